"""The recorder's side of the predictive codec: log the optimizer step, not its result.

For a version that is a few ``optimizer.step()`` calls after the previous one, the recorder
logs each step's gradients (``GRAD`` chunks) and hyperparameters (``OptimizerStep``), runs
the same step (``optimstep.run_step``) on the previous version's bits to predict the new
ones, and leaves the caller to log only ``actual XOR predicted`` (``RESIDUAL`` chunks),
which is almost always all zeros and then costs nothing. Anything the prediction cannot
cover falls back to XOR deltas, and the seal says why.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import torch

from eventlog import optimstep, tensorcodec
from eventlog.events import OptimizerStep, TensorDelta, TensorSpec
from eventlog.optimstep import CapturedStep, tensor_view
from eventlog.tiles import TILE_ALIGN, units_of

STATE_PREFIX = "optimizer/state"
#: Elements per param that ``predict`` runs each step on first (copies), to find a step
#: that torch refuses before the log or the previous bits see any of it.
_PROBE_ELEMENTS = 64


@dataclass(frozen=True)
class StepPlan:
    """How a recorder's optimizer maps onto its log tensors (fixed for the recorder's life)."""

    optimizer: str  # the replayable class name
    params: tuple[str, ...]  # log name of each optimizer param, by state_dict index

    @staticmethod
    def of(model: torch.nn.Module | None, optimizer: object) -> StepPlan | str:
        """The plan for this model and optimizer, or the reason there is none."""
        if optimizer is None or model is None:
            return "no model and optimizer to predict"
        name = optimstep.supported(optimizer)
        if name is None:
            return f"optimizer {type(optimizer).__name__} is not replayable (supported: Adam, AdamW, SGD)"
        names = optimstep.param_names(model, optimizer)  # type: ignore[arg-type]
        if isinstance(names, str):
            return names
        return StepPlan(name, tuple(names))

    def owners(self, tensors: Sequence[str]) -> dict[str, str]:
        """Each optimizer state tensor's param: the layout keeps them on one shard."""
        out = {}
        for name in tensors:
            index = _state_index(name)
            if index is not None and index < len(self.params):
                out[name] = self.params[index]
        return out


def _state_index(name: str) -> int | None:
    parts = name.split("/")
    if len(parts) == 4 and f"{parts[0]}/{parts[1]}" == STATE_PREFIX and parts[2].isdigit():
        return int(parts[2])
    return None


def state_prefix(index: int) -> str:
    """The log name prefix of optimizer param ``index``'s state tensors."""
    return f"{STATE_PREFIX}/{index}"


@dataclass(frozen=True)
class _Tile:
    """Elements ``[start, stop)`` of param ``index``'s tensor, fed by gradient chunks
    ``chunks`` (``whole``: the whole tensor, in its shape)."""

    index: int  # optimizer param index
    start: int
    stop: int
    chunks: tuple[int, ...]
    whole: bool
    nbytes: int


@dataclass
class Prediction:
    """A version's predictive part: per shard, each step's gradients then its ``OptimizerStep``,
    all before the shard's residuals.

    Nothing is computed up front. ``events`` reads each gradient chunk once from the
    trainer's gradient into a chunk-sized buffer, logs that copy, and runs the step on the
    matching tile of the previous bits (``prev``, in place) with the same copy: the bits
    logged and the bits predicted with are the same, and no whole copy of the gradients
    is ever held. Once ``events`` is done, ``prev`` holds the prediction."""

    plan: StepPlan
    captured: list[CapturedStep]  # released once ``events`` has read them
    spec_of: Mapping[str, TensorSpec]
    prev: Mapping[str, np.ndarray]
    shards: list[int]
    predicted: set[str]  # tensors whose previous bits hold the prediction after ``events``
    steps: int  # optimizer steps
    #: Bytes of gradient payloads ``events`` yielded so far.
    grad_bytes: int = 0
    #: Seconds the pool's threads spent on ``events``' work (copies, steps, encodes, digests).
    busy: float = 0.0

    def event_count(self, chunk_bytes: int) -> int:
        """How many events ``events`` yields."""
        chunks = sum(len(tensorcodec.chunk_ranges(len(tensorcodec.tensor_bits(g)), chunk_bytes))
                     for step in self.captured for g in step.grads.values())
        return chunks + len(self.shards) * self.steps

    def events(self, pool: Executor, chunk_bytes: int, compression: str,
               window: int) -> Iterator[tuple[int, TensorDelta | OptimizerStep]]:
        """``(shard, body)`` of every gradient chunk and step, in log order, running each
        step on ``prev`` as its gradient chunks are encoded: on ``pool``, at most ``window``
        units of work ahead of the caller (``compression``: ``Settings.grad_compression``)."""
        device = "cuda" if torch.cuda.is_available() else "cpu"
        owned = optimstep.states_by_owner(self.spec_of)
        try:
            for shard in self.shards:
                for k, step in enumerate(self.captured):
                    members = [i for i in sorted(step.grads)
                               if self.spec_of[self.plan.params[i]].shard == shard]
                    states = {i: owned.get(state_prefix(i), {}) for i in members}
                    bits = {i: tensorcodec.tensor_bits(step.grads[i]) for i in members}
                    tiles = [t for i in members for t in self._tiles(i, len(bits[i]), states[i], chunk_bytes)]
                    counters: dict[str, torch.Tensor] = {}
                    units = units_of(tiles, chunk_bytes)
                    calls = [functools.partial(self._run_unit, unit, step, bits, states, chunk_bytes,
                                               compression) for unit in units]
                    for unit, (chunks, finals, seconds) in zip(
                            units, tensorcodec.map_ordered(pool, calls, window), strict=True):
                        self.busy += seconds
                        counters.update(finals)
                        for tile, tile_chunks in zip(unit, chunks, strict=True):
                            spec = self.spec_of[self.plan.params[tile.index]]
                            for chunk in tile_chunks:
                                self.grad_bytes += len(chunk.payload)
                                yield shard, chunk.to_delta(spec.name, spec.dtype, tuple(spec.shape))
                    for name, value in counters.items():  # every tile counted the same steps
                        self._view(name).copy_(value)
                    yield shard, self._step_body(k, step, members, states, pool, device)
        finally:
            self.captured = []  # the trainer's gradients are no longer read: they may be freed

    def _tiles(self, index: int, nbytes: int, states: Mapping[str, str], chunk_bytes: int) -> list[_Tile]:
        """Param ``index``'s tiles: one per gradient chunk, or the whole tensor when a state
        is neither per element nor a single value, or chunks are off ``TILE_ALIGN`` (as the
        replayer's tiles, ``eventlog.fold.deferred``: a step on a tile computes the bits the
        whole step computes there)."""
        spec = self.spec_of[self.plan.params[index]]
        numel = math.prod(spec.shape)
        size = tensorcodec.itemsize(spec.dtype)
        ranges = tensorcodec.chunk_ranges(nbytes, chunk_bytes)
        per_element = all(math.prod(self.spec_of[n].shape) in (numel, 1) for n in states.values())
        if not per_element or numel == 0 or any(off % TILE_ALIGN for off, _ in ranges):
            return [_Tile(index, 0, numel, tuple(range(len(ranges))), True, nbytes)]
        return [_Tile(index, off // size, (off + n) // size, (j,), False, n)
                for j, (off, n) in enumerate(ranges)]

    def _view(self, name: str) -> torch.Tensor:
        spec = self.spec_of[name]
        return tensor_view(self.prev[name], spec.dtype, tuple(spec.shape))

    def _run_unit(
        self, unit: list[_Tile], step: CapturedStep, bits: Mapping[int, np.ndarray],
        states: Mapping[int, Mapping[str, str]], chunk_bytes: int, compression: str,
    ) -> tuple[list[list[tensorcodec.EncodedChunk]], dict[str, torch.Tensor], float]:
        """Copy the unit's gradient tiles once, encode their chunks, and run the step on the
        unit's tiles of ``prev`` with those copies; returns each tile's encoded chunks, the
        single-value states (Adam's ``step``) as the step left them, and the seconds taken."""
        t0 = time.perf_counter()
        total = sum(t.nbytes for t in unit)
        # The codec thread's one chunk buffer: encoding a gradient chunk (no base) leaves it alone.
        scratch = tensorcodec.chunk_scratch(total) if total <= chunk_bytes else np.empty(total, np.uint8)
        out: list[list[tensorcodec.EncodedChunk]] = []
        params, grads, tile_states, groups = [], [], [], []
        finals: dict[str, torch.Tensor] = {}
        at = 0
        for tile in unit:
            spec = self.spec_of[self.plan.params[tile.index]]
            size = tensorcodec.itemsize(spec.dtype)
            copy = scratch[at:at + tile.nbytes]
            at += tile.nbytes
            lo = tile.start * size
            copy[:] = bits[tile.index][lo:lo + tile.nbytes]  # the one read of the trainer's bits
            ranges = tensorcodec.chunk_ranges(len(bits[tile.index]), chunk_bytes)
            chunks = []
            for j in tile.chunks:
                off, n = ranges[j]
                chunk = tensorcodec.encode_chunk(
                    copy[off - lo:off - lo + n], None, typesize=size, base_version=-1, index=j,
                    count=len(ranges), offset=off, compression=compression)
                assert chunk is not None  # a chunk without a base is always written
                chunks.append(dataclasses.replace(chunk, encoding=TensorDelta.GRAD))
            out.append(chunks)
            shape = tuple(spec.shape) if tile.whole else (tile.stop - tile.start,)
            params.append(self._tile_of(spec.name, tile))
            grads.append(tensor_view(copy, spec.dtype, shape))
            mine: dict[str, torch.Tensor] = {}
            for key, name in states[tile.index].items():
                if not tile.whole and math.prod(self.spec_of[name].shape) == 1:
                    # Each tile counts the step on its own copy; the state takes the count.
                    mine[key] = finals[name] = self._view(name).clone()
                else:
                    mine[key] = self._tile_of(name, tile)
            tile_states.append(mine)
            groups.append(step.groups[tile.index])
        optimstep.run_step(self.plan.optimizer, step.hyperparams, params, grads, tile_states, groups)
        return out, finals, time.perf_counter() - t0

    def _tile_of(self, name: str, tile: _Tile) -> torch.Tensor:
        view = self._view(name)
        return view if tile.whole else view.reshape(-1)[tile.start:tile.stop]

    def _step_body(self, k: int, step: CapturedStep, members: list[int],
                   states: Mapping[int, Mapping[str, str]], pool: Executor, device: str) -> OptimizerStep:
        """Step ``k``'s ``OptimizerStep`` for one shard, with the digests of what it predicted."""
        t0 = time.perf_counter()
        names = [self.plan.params[i] for i in members]
        written = [n for i in members for n in (self.plan.params[i], *sorted(states[i].values()))]
        digests = tuple(pool.map(tensorcodec.digest, [self.prev[n] for n in written]))
        self.busy += time.perf_counter() - t0
        return OptimizerStep(
            self.plan.optimizer, k, self.steps, torch.__version__, device,
            optimstep.pack_hyperparams(step.hyperparams), tuple(names),
            tuple(step.groups[i] for i in members), tuple(state_prefix(i) for i in members),
            tuple(written), digests)


def check(
    plan: StepPlan | str,
    steps: Sequence[CapturedStep],
    spec_of: Mapping[str, TensorSpec],
    prev: Mapping[str, np.ndarray],
    relayout: bool,
    version: int,
    max_steps: int,
) -> str | None:
    """Why this version cannot be encoded predictively, or ``None`` if it can (``max_steps``:
    ``Settings.predict_max_steps``)."""
    if isinstance(plan, str):
        return plan
    if not steps:
        return "no optimizer step since the last commit"
    if len(steps) > max_steps:
        # Each step's gradients cost ~0.28 of an Adam state; past two, a delta is smaller.
        return f"{len(steps)} optimizer steps since the last commit, over {max_steps}"
    if version == 0 or relayout:
        return "the layout changed (first commit, or new optimizer state)"
    owned = optimstep.states_by_owner(spec_of)
    for step in steps:
        for i, g in step.grads.items():
            if step.versions[i] < 0 or optimstep.version_of(g) != step.versions[i]:
                return "a gradient was changed in place after optimizer.step() (or keeps no version)"
            if i >= len(plan.params):
                return "the optimizer gained params after the recorder started"
            name = plan.params[i]
            spec = spec_of.get(name)
            if spec is None or name not in prev:
                return f"param {name} has no previous bits"
            if (tensorcodec.dtype_name(g.dtype), tuple(g.shape)) != (spec.dtype, tuple(spec.shape)):
                return f"the gradient of {name} does not match the param's dtype and shape"
            states = owned.get(state_prefix(i), {})
            if not states and plan.optimizer != "SGD":  # plain SGD keeps no state
                return f"param {name} has no optimizer state yet"
            for key, sname in states.items():
                if spec_of[sname].shard != spec.shard or sname not in prev:
                    return f"param {name} and its optimizer state {key} are on different shards"
    return None


def predict(
    plan: StepPlan,
    steps: Sequence[CapturedStep],
    spec_of: Mapping[str, TensorSpec],
    prev: Mapping[str, np.ndarray],
) -> Prediction:
    """The version's predictive part (``Prediction``: its ``events`` run the steps on
    ``prev``). Each step first runs on copies of a few elements of every param and state,
    so that a step torch refuses fails here, before anything is logged or ``prev`` changes."""
    owned = optimstep.states_by_owner(spec_of)
    for step in steps:
        params, grads, states, groups = [], [], [], []
        for i in sorted(step.grads):
            spec = spec_of[plan.params[i]]
            numel = math.prod(spec.shape)
            mine = owned.get(state_prefix(i), {})
            whole = not all(math.prod(spec_of[n].shape) in (numel, 1) for n in mine.values())

            def probe(t: torch.Tensor, numel: int = numel, whole: bool = whole) -> torch.Tensor:
                return (t if whole or t.numel() != numel else t.reshape(-1)[:_PROBE_ELEMENTS]).clone()

            params.append(probe(tensor_view(prev[spec.name], spec.dtype, tuple(spec.shape))))
            grads.append(probe(step.grads[i].detach()))
            states.append({key: probe(tensor_view(prev[n], spec_of[n].dtype, tuple(spec_of[n].shape)))
                           for key, n in mine.items()})
            groups.append(step.groups[i])
        optimstep.run_step(plan.optimizer, step.hyperparams, params, grads, states, groups)
    shards = sorted({spec_of[plan.params[i]].shard for step in steps for i in step.grads})
    predicted = {n for step in steps for i in step.grads
                 for n in (plan.params[i], *owned.get(state_prefix(i), {}).values())}
    return Prediction(plan, list(steps), spec_of, prev, shards, predicted, len(steps))
