"""Replaying a run to a target and turning the rebuilt state into things users keep.

``replay`` rebuilds and verifies the state (shards in parallel); ``state_dicts`` turns it
back into torch ``state_dict`` trees; ``write_checkpoint`` writes a restorable checkpoint
(``torch.load(weights_only=True)``-safe tensors, msgpack small states, a JSON report).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eventlog import ConfigError, RunAddress, Target
from eventlog.capture import TENSOR_ROLES, rebuilt_tensors, recorded_trees
from eventlog.errors import BatchedStepsMismatchError, DecodeError, IntegrityError
from eventlog.events import RunStarted
from eventlog.fold.bits import TensorBits
from eventlog.fold.engine import FoldStart, RebuiltState, SmallStates, index_control, rebuild
from eventlog.ports import EventLog
from eventlog.settings import Settings, current
from eventlog.target import LATEST
from snapshotter.catalog import newest_valid, run_store

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayReport:
    """What a replay did, in the counts the design promises."""

    run_id: str
    target: str
    version: int
    step: int
    applied: int
    skipped_by_snapshot: int
    skipped_duplicate: int
    skipped_unsealed: int
    bytes: int
    seconds: float
    per_shard: dict[int, dict[str, float]]
    state_digest: str
    #: The snapshot the replay started from (``None``: the start of the log).
    snapshot: str | None = None
    snapshot_version: int = 0
    #: Newer snapshots that were passed over, and why: what is damaged, or, for one that
    #: retention deleted on purpose, a reason that begins with "deleted by retention".
    passed_over: list[tuple[str, str]] = field(default_factory=list)
    #: Versions folded from the log after the start (the snapshot, or the start of the log).
    tail_versions: int = 0
    #: The id of the snapshot the replay started from (``None``: the start of the log).
    snapshot_id: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return asdict(self)


def replay(
    address: RunAddress,
    target: Target = LATEST,
    *,
    workers: int = 2,
    on_bytes: Callable[[int], None] | None = None,
    use_snapshots: bool = True,
    settings: Settings | None = None,
    share_torch_threads: bool = False,
    shards: Callable[[RunStarted, SmallStates], Collection[int]] | None = None,
    written: bool = False,
) -> tuple[RebuiltState, ReplayReport]:
    """Rebuild the run's state at ``target`` from the newest good snapshot at or before it
    plus the log tail, verified against the target's seal.

    ``settings``: whether to batch optimizer steps (``replay_defer_steps``; default
    ``current()``, whose limits the fold's internals use). ``share_torch_threads``: divide
    torch's intra-op threads among the workers while they fold; it changes a process-wide
    setting (restored after), so only a process that owns torch turns it on (the ``rewind``
    CLI does). ``shards``: fold and verify only the shards it chooses (see
    ``eventlog.fold.engine.rebuild``). ``written``: the caller will write into the state's
    bits (a recorder keeps them as its base), so no snapshot file is mapped under them."""
    settings = settings or current()
    t0 = time.perf_counter()
    with address.open_log() as log:
        idx = index_control(log)
        version = idx.resolve(target)
        # Without a store address, the run's own end markers say where its snapshots live.
        store = run_store(address.snapshots_url, idx, log.run_id) if use_snapshots else None

        def start_at(checked: bool) -> tuple[FoldStart | None, list[tuple[str, str]]]:
            if store is None:
                return None, []
            return newest_valid(store, log, idx, version, workers=workers, checked=checked,
                                written=written)

        def fold(start: FoldStart | None, batched: bool) -> RebuiltState:
            return rebuild(log, target, workers=workers, on_bytes=on_bytes, idx=idx, start=start,
                           defer_steps=batched, grad_digests=not batched,
                           share_torch_threads=share_torch_threads, shards=shards)

        # A batched fold leaves to the target's seal what the seal covers: each gradient
        # chunk's digest (hashing them streamed 4 GB through memory a second time in a
        # 10-version tail of a 100M model), and the snapshot files' checksums and shard
        # digests (two passes over the whole state).
        batched = settings.replay_defer_steps
        start, passed = start_at(checked=not batched)
        miss: tuple[str, str] | None = None  # only the batched fold missed the seal: what, where
        try:
            state = fold(start, batched)
        except (IntegrityError, DecodeError) as exc:
            if not batched:
                raise
            # Unchecked bits can fail in many ways before the seal: a renamed tensor in a
            # damaged snapshot header, a garbage step counter torch refuses, a digest that
            # differs. Fold again with every check, so a damaged snapshot is named and
            # passed over for an older one, and a damaged record is named; or the version,
            # the tensor and both torch builds of a step that predicts differently.
            first = _source(start)
            start, passed = start_at(checked=True)
            state = fold(start, False)
            if _source(start) == first:
                # The checked fold passed the seal: its state stands, but say what the
                # first one met (a file that changed between the reads, or a bug).
                if isinstance(exc, BatchedStepsMismatchError):
                    miss = exc.mismatch, differing(exc.rebuilt, state.tensors())
                    exc.rebuilt = {}
                else:
                    _log.warning("run %r: a batched replay of %s failed (%s), a fold with every "
                                 "check from the same start matched the seal", log.run_id,
                                 _source(start), exc)
        if miss is not None:  # past the except block, which kept the batched fold's state alive
            _warn_batched(log.run_id, *miss, lambda: fold(start_at(checked=True)[0], True))
    c = state.counts
    digest = state.state_digest()
    if digest != state.seal.seal.state_digest:
        _log.warning("run %r: the seal of version %d records state digest %s, but the shard and "
                     "small-state digests the state verified against make %s: the seal is damaged "
                     "there (rewind verify names it)", state.run_id, state.version,
                     state.seal.seal.state_digest.hex(), digest.hex())
    report = ReplayReport(
        run_id=state.run_id, target=str(target), version=state.version, step=state.step,
        applied=c.applied, skipped_by_snapshot=c.skipped_by_snapshot,
        skipped_duplicate=c.skipped_duplicate, skipped_unsealed=c.skipped_unsealed,
        bytes=c.bytes, seconds=time.perf_counter() - t0,
        per_shard={s: asdict(v) for s, v in state.per_shard.items()},
        state_digest=digest.hex(),
        snapshot=start.source if start else None,
        snapshot_version=start.version if start else 0,
        passed_over=passed,
        tail_versions=_sealed_between(state, start.version if start else 0),
        snapshot_id=start.snapshot_id if start else None,
    )
    return state, report


def _warn_batched(run_id: str, mismatch: str, differs: str, again: Callable[[], object]) -> None:
    """Warn that only the batched fold missed the seal (``mismatch``), rebuilding ``differs``
    differently, and whether ``again`` (a batched fold from the snapshot read with its
    checksums) misses it too (the batched steps compute differently) or not (the first fold
    read other bits). Whatever ``again`` meets only changes the warning: the state stands."""
    try:
        again()
        verdict = ("a second batched fold, from the snapshot read with its checksums, matched the "
                   "seal: the first one read other bits (the snapshot's files, or the log's mapped "
                   "gradients, changed under it)")
    except BatchedStepsMismatchError:
        verdict = ("a second batched fold, from the snapshot read with its checksums, missed it too: "
                   "the batched optimizer steps compute differently")
    except Exception as second:  # noqa: BLE001 - a diagnostic; the verified state is returned
        verdict = f"a second batched fold failed otherwise ({type(second).__name__}: {second})"
    _log.warning("run %r: %s; a fold from the same start that checked every step and gradient chunk "
                 "(and the snapshot's files) matched the seal, and its state is the one returned. "
                 "The batched fold rebuilt %s differently, and %s. A bug: please report it "
                 "(REWIND_REPLAY_DEFER_STEPS=0 replays without batching)", run_id, mismatch, differs,
                 verdict)


def differing(batched: Mapping[str, TensorBits], checked: Mapping[str, object], most: int = 4) -> str:
    """Which tensors two folds of one shard rebuilt differently, and in how many bytes
    (the first ``most`` of them by name)."""
    found = []
    for name in sorted(batched):
        other = checked.get(name)
        if not isinstance(other, TensorBits) or other.bits.shape != batched[name].bits.shape:
            found.append(f"{name!r} (absent or resized)")
        elif (n := int(np.count_nonzero(batched[name].bits != other.bits))):
            found.append(f"{name!r} ({n} of {batched[name].bits.size} bytes)")
    if not found:
        return "no tensor (the digest differs, the bits do not)"
    more = f" and {len(found) - most} more" if len(found) > most else ""
    return ", ".join(found[:most]) + more


def _sealed_between(state: RebuiltState, since: int) -> int:
    """The sealed versions after ``since`` up to the state's (a multi-rank run may skip numbers)."""
    return sum(1 for v in state.index.seals if since < v <= state.version)


def _source(start: FoldStart | None) -> str:
    return start.source if start else "the start of the log"


#: How a ``Recorder`` obtains the state it restores, with the report of how it was rebuilt.
Restorer = Callable[[EventLog], tuple[RebuiltState, ReplayReport]]


def restorer(address: RunAddress, workers: int = 2) -> Restorer:
    """The ``Recorder``'s restore: the newest sealed version, from the newest good snapshot
    plus the log tail (``workers``: shards folded in parallel), in bits the recorder keeps
    and writes into as its base."""

    def restore(_log: EventLog) -> tuple[RebuiltState, ReplayReport]:
        return replay(address, LATEST, workers=workers, written=True)

    return restore


#: Every rebuilt tensor by log name, and the recorded state_dict trees by role.
tensors_of = rebuilt_tensors
state_dicts = recorded_trees


def write_checkpoint(state: RebuiltState, report: ReplayReport, out: Path) -> list[Path]:
    """Write ``state`` to ``out``: ``<role>.pt`` for tensor roles, ``<name>.msgpack`` for the
    rest, and ``recovery.json``. Files are written to a temp name and renamed."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, tree in state_dicts(state, copy=False).items():  # (views: written, not kept)
        if name in TENSOR_ROLES or any(t.name.startswith(f"{name}/") for t in state.layout.tensors):
            path = out / f"{name}.pt"
            _atomic(path, functools.partial(_save_tree, tree))
        else:
            path = out / f"{name.replace('/', '_')}.msgpack"
            _atomic(path, functools.partial(_write_bytes, state.small.states[name]))
        written.append(path)
    path = out / "recovery.json"
    _atomic(path, lambda p: Path(p).write_text(json.dumps(report.to_json(), indent=2) + "\n"))
    written.append(path)
    return written


def read_checkpoint(out: Path) -> dict[str, Any]:
    """The states a checkpoint directory holds (``write_checkpoint``, ``rewind recover``), by
    file name without its suffix: tensor trees loaded with ``torch.load(weights_only=True)``,
    the other states decoded from msgpack, ready for each object's ``load_state_dict``."""
    from eventlog.statecodec import unpack

    out = Path(out)
    if not (out / "recovery.json").is_file():
        raise ConfigError(f"no Rewind checkpoint in {out}: it holds no recovery.json")
    states: dict[str, Any] = {}
    for path in sorted(out.glob("*.pt")):
        states[path.stem] = torch.load(path, map_location="cpu", weights_only=True)
    for path in sorted(out.glob("*.msgpack")):
        states[path.stem] = unpack(path.read_bytes(), str(path))
    return states


def _save_tree(tree: Any, path: str) -> None:
    torch.save(tree, path)


def _write_bytes(data: bytes, path: str) -> None:
    Path(path).write_bytes(data)


def _atomic(path: Path, write: Callable[[str], object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(str(tmp))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
