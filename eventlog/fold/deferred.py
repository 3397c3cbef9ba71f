"""Optimizer steps replayed together, tile by tile, instead of one version after another.

Replaying a predictive version runs its optimizer step over the whole shard. Adam reads
the param, its gradient and both moments, and writes three of them back: about seven
passes over the state's memory per version. A tail of K versions run one by one streams
the state through memory K times, and two replay workers share one memory bus, so a second
core barely helps. Run tile by tile instead: for each cache-sized tile (one gradient
chunk, or a part of one when workers share the cache), the K steps run back to back while
the tile's param, moments and gradient stay in cache. The state then crosses the memory
bus once for the whole tail, and the work is bound by arithmetic more than by the bus.

This is exact because every optimizer the replayer supports (Adam, AdamW, SGD) updates each
element from that element alone: a step run on a slice computes the bits the whole step
computes there, as long as the slice keeps each element in the same loop of torch's kernel
(``TILE_ALIGN``). The one state that is not per element, Adam's ``step`` counter, is
counted by each tile on its own copy, and the param's counter takes the final count. A
state of any other shape makes its param one whole-tensor tile.

Two checks wait for the seal on this path. Each version's predicted-tensor digests are not
checked: hashing every tensor after every version would stream the state through memory
again. Nor are the digests of the gradient chunks: hashing them streamed every gradient
byte through memory a second time, before the step read it (gigabytes for a tail of a
large model). The shard digest is still checked against the target's seal, and it covers
both: a damaged gradient or a step that predicts differently leaves bits the seal does not
vouch for, before anyone sees them. On a mismatch, replaying with
``REWIND_REPLAY_DEFER_STEPS=0`` (what ``replayer.replay`` does by itself) checks each
chunk and each step, and names the record, the version and the tensor. The gradient
digests are skipped only when the fold's caller asks for it (``check_grads``):
``replayer.replay``, which folds again with every check on a mismatch. Others (the
snapshotter, a follower's incremental step, ``rewind verify``) report the damaged record
itself.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from eventlog import filemaps, optimstep, tensorcodec
from eventlog.errors import IntegrityError, RewindError
from eventlog.events import OptimizerStep, TensorDelta
from eventlog.fold.bits import TensorBits
from eventlog.fold.sharing import WorkBoard
from eventlog.tiles import TILE_ALIGN, units_of

#: Optimizers whose step only reads its gradients (torch's Adam and AdamW write one only to
#: unscale it by ``grad_scale``, which ``optimstep`` never passes). Their raw gradients are
#: handed over as read-only views of the message. SGD gets a copy in the tile buffer: its
#: foreach nesterov path adds the momentum into the gradient. (The recorder logs such a
#: step as XOR deltas, as it sees the gradients change, but the replaying torch may differ.)
READS_GRADS_ONLY = frozenset({"Adam", "AdamW"})


_warning_consumed = False
_warning_lock = threading.Lock()


def _consume_readonly_warning() -> None:
    """torch warns once per process, from one place, that it cannot make a tensor over
    read-only memory read-only. The gradient views above are only read, so that warning
    is consumed here, before the first batch of steps runs (under a lock: one thread), where
    a ``-W error`` setting cannot turn a replay into a failure. The cost: a later
    ``torch.from_numpy`` of a read-only array in the same process does not warn either."""
    global _warning_consumed
    with _warning_lock:
        if _warning_consumed:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.from_numpy(np.frombuffer(b"\0" * 4, dtype=np.uint8))
        _warning_consumed = True


@dataclass
class GradChunks:
    """The gradient chunks of one param, as logged, kept until its step runs."""

    dtype: str
    shape: tuple[int, ...]
    count: int
    chunks: dict[int, tuple[TensorDelta, str]] = field(default_factory=dict)  # index -> (chunk, where)

    def cut(self) -> tuple[int, int]:
        """How the tensor is cut: chunk count and first chunk's length (``check_chunk``
        has pinned every chunk to the grid these two define)."""
        return self.count, self.chunks[0][0].byte_length

    def grid(self) -> list[tuple[int, int]]:
        """``(byte offset, length)`` of each chunk, in order."""
        return [(self.chunks[i][0].byte_offset, self.chunks[i][0].byte_length) for i in range(self.count)]


@dataclass
class PendingStep:
    """One logged optimizer step whose math has not run yet."""

    body: OptimizerStep
    version: int
    where: str
    hyperparams: list[dict[str, Any]]
    grads: dict[str, GradChunks]


@dataclass(frozen=True)
class _Tile:
    """Elements ``[start, stop)`` of one param, fed by gradient chunks ``chunks`` (or by
    ``nbytes`` of one chunk's bits from byte ``skip`` on: a part of a chunk)."""

    param: str
    start: int
    stop: int
    chunks: tuple[int, ...]
    whole: bool  # the param's states are not all per element: the tile is the whole tensor
    nbytes: int  # of gradient
    skip: int = 0


class DeferredSteps:
    """Optimizer steps and their logged gradients, waiting to be replayed as one batch."""

    def __init__(self) -> None:
        self._grads: dict[str, GradChunks] = {}  # gradients of the step not logged yet
        self.steps: list[PendingStep] = []
        #: Compressed bytes held in memory (gradients of pending steps and of the next one;
        #: see ``_held``), and bytes of views of mapped files among them.
        self.nbytes = 0
        self.mapped = 0
        #: Versions whose steps ran here, their predicted digests unchecked (until a seal
        #: check of the shard vouches for them: ``apply.verify_shard`` clears it).
        self.unchecked: list[int] = []
        #: Whether each gradient chunk's digest is checked as its tile reads it (``False``:
        #: left to the seal, see the module's doc; set by ``fold.fold_shard``), and whether
        #: some batch since the last seal check ran without (``apply.verify_shard`` clears it).
        self.check_grads = True
        self.grads_unchecked = False
        #: Where the batch's units are posted for other replay workers to share
        #: (``eventlog.fold.sharing``; set by ``fold.fold_shard`` for the fold's duration).
        self.board: WorkBoard | None = None

    def __bool__(self) -> bool:
        return bool(self.steps)

    def add_grad(self, delta: TensorDelta, where: str) -> None:
        """Keep one ``GRAD`` chunk (validated now, decoded when its step runs)."""
        shape = tuple(delta.shape)
        total = tensorcodec.nbytes_of(delta.dtype, shape, where)
        tensorcodec.torch_dtype(delta.dtype, where)
        tensorcodec.check_chunk(delta, total, where)
        grad = self._grads.get(delta.name)
        if grad is None or grad.dtype != delta.dtype or grad.shape != shape:
            grad = self._grads[delta.name] = GradChunks(delta.dtype, shape, delta.chunk_count)
        if grad.count != delta.chunk_count:
            raise IntegrityError(f"{where}: gradient chunks of {delta.name!r} disagree on their count")
        old = grad.chunks.get(delta.chunk_index)
        self.nbytes += _held(delta) - (_held(old[0]) if old else 0)
        self.mapped += _mapped(delta) - (_mapped(old[0]) if old else 0)
        grad.chunks[delta.chunk_index] = (delta, where)

    def fits(self) -> bool:
        """Whether the gradients gathered for the next step cut their params into the same
        tiles as the pending steps do (always, unless the chunk size changed)."""
        for step in self.steps:
            for name, grad in self._grads.items():
                other = step.grads.get(name)
                if other is not None and len(grad.chunks) == grad.count and other.cut() != grad.cut():
                    return False
        return True

    def add_step(self, body: OptimizerStep, version: int, where: str,
                 tensors: Mapping[str, TensorBits]) -> None:
        """Queue a step after checking that the shard holds its params and whole gradients."""
        optimstep.check_lists(body, where)
        grads: dict[str, GradChunks] = {}
        for name in body.params:
            param, grad = tensors.get(name), self._grads.get(name)
            if (param is None or grad is None or grad.dtype != param.dtype
                    or grad.shape != param.shape or len(grad.chunks) != grad.count):
                raise IntegrityError(f"{where}: optimizer step of version {version} updates {name!r}, "
                                     "but the shard holds no such param or not its whole gradient")
            grads[name] = grad
        hyperparams = optimstep.unpack_hyperparams(body.hyperparams, where)
        self.steps.append(PendingStep(body, version, where, hyperparams, grads))
        self._grads = {}

    def run(self, tensors: Mapping[str, TensorBits], unit_bytes: int) -> None:
        """Run every pending step on ``tensors`` in place, tile by tile, then forget them.

        Tiles are gathered into units of about ``unit_bytes`` of gradient (small params
        share one), and each unit runs all steps before the next unit starts.
        """
        _consume_readonly_warning()
        steps, self.steps = self.steps, []
        kept = [d for g in self._grads.values() for d, _ in g.chunks.values()]
        self.nbytes, self.mapped = sum(map(_held, kept)), sum(map(_mapped, kept))
        if not steps:
            return
        owned = optimstep.states_by_owner(tensors)
        # Per step, each param's states by key; the shapes decide how a param is tiled.
        states = [{n: owned.get(prefix, {}) for n, prefix in zip(s.body.params, s.body.states, strict=True)}
                  for s in steps]
        check = self.check_grads
        # Workers running units at once share the last-level cache: each unit's working
        # set (its tiles' params, moments and gradients) gets that share, so that a tile
        # stays cached through all of its steps; two workers on whole tiles overflow it
        # (figures: docs/performance.md).
        unit_bytes = max(1, unit_bytes // (self.board.threads if self.board is not None else 1))
        tiles = _tiles(steps, states, tensors, None if check else unit_bytes)
        # Scalar states (Adam's step counter): each unit counts on a copy; these keep the
        # copies' final values, written back once every unit has run.
        finals: dict[str, torch.Tensor] = {}
        views = _Views(tensors)

        def work(unit: list[_Tile]) -> None:
            _run_unit(unit, steps, states, views, finals, check)

        units = units_of(tiles, unit_bytes)
        if self.board is not None:
            self.board.run(units, work)  # units are disjoint slices: any thread may run one
        else:
            for unit in units:
                work(unit)
        for name, value in finals.items():
            t = tensors[name]
            optimstep.tensor_view(t.bits, t.dtype, t.shape).copy_(value)
        self.unchecked.extend(dict.fromkeys(s.version for s in steps))
        self.grads_unchecked = self.grads_unchecked or not self.check_grads


def _tiles(steps: list[PendingStep], states: list[dict[str, dict[str, str]]],
           tensors: Mapping[str, TensorBits], part_bytes: int | None) -> list[_Tile]:
    """Every param's tiles: one per gradient chunk, or one whole-tensor tile for a param
    with a state that is neither per element nor a single value, or whose chunks do not
    start on multiples of ``TILE_ALIGN`` (a log recorded with an odd ``chunk_bytes``: a
    tile starting there would move elements between torch's vector and scalar loops).
    With ``part_bytes``, a chunk that every step reads in place (see ``_in_place``) is cut
    into parts of about that many bytes, a multiple of ``TILE_ALIGN``."""
    out: list[_Tile] = []
    seen: set[str] = set()
    for step, _owned in zip(steps, states, strict=True):
        for name, grad in step.grads.items():
            if name in seen:
                continue
            seen.add(name)
            param = tensors[name]
            numel = _numel(param)
            size = tensorcodec.itemsize(param.dtype)
            per_element = all(_numel(tensors[n]) in (numel, 1)
                              for o in states for n in o.get(name, {}).values())
            on_grid = all(off % TILE_ALIGN == 0 for off, _ in grad.grid())
            if not per_element or numel == 0 or not on_grid:
                out.append(_Tile(name, 0, numel, tuple(range(grad.count)), True, numel * size))
                continue
            part = part_bytes if part_bytes is not None and _in_place(steps, name) else None
            for i, (off, n) in enumerate(grad.grid()):
                for skip, m in part_cuts(n, part) if part is not None else [(0, n)]:
                    first = (off + skip) // size
                    out.append(_Tile(name, first, first + m // size, (i,), False, m, skip))
    return out


def part_cuts(nbytes: int, part_bytes: int) -> list[tuple[int, int]]:
    """``(skip, length)`` of each part of an ``nbytes``-long gradient chunk cut into parts
    of about ``part_bytes``, rounded to a multiple of ``TILE_ALIGN``; one part if the chunk
    is no longer. (``benchmarks.floor`` cuts its captured calls by the same rule.)"""
    width = max(TILE_ALIGN, part_bytes // TILE_ALIGN * TILE_ALIGN)
    if nbytes <= width:
        return [(0, nbytes)]
    return [(at, min(width, nbytes - at)) for at in range(0, nbytes, width)]


def _in_place(steps: list[PendingStep], name: str) -> bool:
    """Whether every step that updates param ``name`` reads its gradient chunks in place
    (``_decode``'s view): only a part of such a chunk can be a tile of its own."""
    return all(step.body.optimizer in READS_GRADS_ONLY
               and all(tensorcodec.is_raw(delta) for delta, _ in step.grads[name].chunks.values())
               for step in steps if name in step.grads)


def _held(delta: TensorDelta) -> int:
    """The memory a kept chunk holds: its payload's length, unless the payload is a view
    (a segment file's map, ``eventlog.embedded.segments``), which holds only page cache the kernel
    can drop and read again. So a replay of an embedded log batches its whole tail: each
    tile then crosses the memory bus once, not once per 256 MiB of gradients."""
    return 0 if isinstance(delta.payload, memoryview) else len(delta.payload)


def _mapped(delta: TensorDelta) -> int:
    """The bytes of a kept chunk that are a view of a mapped file (they hold no memory, but
    keep the file mapped, and open, until the batch runs)."""
    return len(delta.payload) - _held(delta)


def _numel(t: TensorBits) -> int:
    return math.prod(t.shape)


class Scratch:
    """A byte buffer per thread, grown as needed and reused (it stays in cache across
    steps); ``scratch(n)`` is this thread's first ``n`` bytes. Each user has its own, so a
    thread that holds one user's view never sees it overwritten by another's."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self, nbytes: int) -> np.ndarray:
        buf: np.ndarray | None = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._local.buf = np.empty(max(nbytes, 1), dtype=np.uint8)
        return buf[:nbytes]


_scratch = Scratch()


def _run_unit(unit: list[_Tile], steps: list[PendingStep], states: list[dict[str, dict[str, str]]],
              views: _Views, finals: dict[str, torch.Tensor], check_grads: bool) -> None:
    """Run every step, in order, on one unit's tiles."""
    # Each tile's param and states as tensors over the shard's bits, made once for the unit
    # rather than once per step: making views holds the GIL the other replay worker waits
    # for.
    tile_params: dict[_Tile, torch.Tensor] = {}
    copies: dict[tuple[str, int], torch.Tensor] = {}
    tile_states: dict[tuple[_Tile, tuple[tuple[str, str], ...]], dict[str, torch.Tensor]] = {}
    for step, owned in zip(steps, states, strict=True):
        members = [t for t in unit if t.param in step.grads]
        if not members:
            continue
        scratch = _scratch(sum(t.nbytes for t in members))
        index = {n: i for i, n in enumerate(step.body.params)}
        view_ok = step.body.optimizer in READS_GRADS_ONLY
        params, grads, step_states, groups = [], [], [], []
        at = 0
        for tile in members:
            buf = _decode(step.grads[tile.param], tile, scratch[at:at + tile.nbytes], view_ok, check_grads)
            at += tile.nbytes
            if tile not in tile_params:
                tile_params[tile] = views.slice(tile.param, tile)
            params.append(tile_params[tile])
            param = views.tensors[tile.param]
            shape = param.shape if tile.whole else (tile.stop - tile.start,)
            grads.append(optimstep.tensor_view(buf, param.dtype, shape))
            mine = owned.get(tile.param, {})
            key = (tile, tuple(mine.items()))
            if key not in tile_states:
                tile_states[key] = views.states(tile, mine, copies)
            step_states.append(tile_states[key])
            groups.append(step.body.groups[index[tile.param]])
        try:
            optimstep.run_step(step.body.optimizer, step.hyperparams, params, grads, step_states, groups)
        except RewindError:
            raise
        except Exception as exc:  # recorded (untrusted) values drive torch's optimizer code
            raise optimstep.describe_failure(step.body, step.version, step.where, exc) from exc
        for tile in members:  # no other step or unit reads these gradient bytes
            _release(step.grads[tile.param], tile)
    for (name, _), value in copies.items():
        finals[name] = value  # every tile of a param counts the same steps


def _release(grad: GradChunks, tile: _Tile) -> None:
    """Give back the mapped pages of the tile's gradient (``eventlog.filemaps``): its part of
    one uncompressed chunk, or the whole payloads of its chunks."""
    for i in tile.chunks:
        delta = grad.chunks[i][0]
        part = tile.nbytes < delta.byte_length  # (only an uncompressed chunk is cut in parts)
        filemaps.release(memoryview(delta.payload)[tile.skip:tile.skip + tile.nbytes] if part
                         else delta.payload)


class _Views:
    """Tensors over a shard's bits, for the tiles of one batch of steps: each tensor's whole
    view is made once, and tiles slice it. Units on other threads share it: a view made
    twice by a race is the same view."""

    def __init__(self, tensors: Mapping[str, TensorBits]) -> None:
        self.tensors = tensors
        self._whole: dict[str, torch.Tensor] = {}

    def whole(self, name: str) -> torch.Tensor:
        """Tensor ``name`` in its shape, over its bits."""
        view = self._whole.get(name)
        if view is None:
            t = self.tensors[name]
            view = self._whole[name] = optimstep.tensor_view(t.bits, t.dtype, t.shape)
        return view

    def slice(self, name: str, tile: _Tile) -> torch.Tensor:
        """The tile's part of tensor ``name`` (all of it, in its shape, for a whole-tensor tile)."""
        view = self.whole(name)
        return view if tile.whole else view.reshape(-1)[tile.start:tile.stop]

    def states(self, tile: _Tile, owned: Mapping[str, str],
               copies: dict[tuple[str, int], torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tile's slice of each per-element state; for a single-value state (Adam's
        step counter), the tile's own copy, kept in its unit's ``copies`` by (state, tile
        start) and advanced by each step."""
        out: dict[str, torch.Tensor] = {}
        for key, name in owned.items():
            if not tile.whole and _numel(self.tensors[name]) == 1:
                if (name, tile.start) not in copies:
                    copies[(name, tile.start)] = self.whole(name).clone()
                out[key] = copies[(name, tile.start)]
            else:
                out[key] = self.slice(name, tile)
        return out


def _decode(grad: GradChunks, tile: _Tile, out: np.ndarray, view_ok: bool, verify: bool) -> np.ndarray:
    """The tile's gradient bits, digests checked if ``verify``: with ``view_ok``, the
    payload itself (or the tile's part of it) for one uncompressed chunk; else its chunks
    copied or decompressed into ``out``."""
    if view_ok and len(tile.chunks) == 1:
        delta, where = grad.chunks[tile.chunks[0]]
        raw = tensorcodec.raw_bits(delta, where, verify=verify)
        if raw is not None:
            return raw[tile.skip:tile.skip + tile.nbytes]
    if tile.skip or (len(tile.chunks) == 1 and tile.nbytes != grad.chunks[tile.chunks[0]][0].byte_length):
        raise RewindError(f"internal error: a part of gradient chunk {tile.chunks[0]} of "
                          f"{tile.param!r} must be read in place")  # ``_tiles`` cuts no other
    at = 0
    for i in tile.chunks:
        delta, where = grad.chunks[i]
        tensorcodec.decode_bits_into(delta, out[at:at + delta.byte_length], where, verify=verify)
        at += delta.byte_length
    return out
