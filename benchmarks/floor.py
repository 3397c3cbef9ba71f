"""The floor of a recovery with this replay design: its unavoidable jobs, each timed bare.

    python -m benchmarks._timed read THREADS FILE...
    python -m benchmarks._timed steps LOG_URL COORD_URL RUN_ID SNAPSHOTS_URL REPEATS

A replay of a snapshot plus a tail must bring the snapshot's state into fresh memory, run
the tail's optimizer steps on it, and (to be verified) hash the state once, for the
target's seal digest (the seal covers the snapshot's bits too: with batched steps, the
default, ``replayer.replay`` checks the snapshot's files and digests only after a failure).
This times each of those jobs
bare, on the benchmark's own recorded run, with 1 thread and with one thread per shard:

1. ``read_files``: the newest snapshot's shard files read into fresh buffers with one
   ``readinto`` each (no checksum, no parsing), in a fresh process like the replays and
   ``torch.load`` (on this VM, memory a process has never touched costs most of a read).
2. ``measure_steps``, steps: the tail's optimizer calls exactly as a batched replay makes
   them (the same tiles, hyperparameters and logged gradients, gathered beforehand by
   folding the log with the calls recorded instead of run), passed to torch through the
   replay's own one-call dispatch (``optimstep.run_step``). One thread runs every shard
   with torch's default threads (as a 1-worker replay does); one thread per shard runs
   with torch's threads shared out among them, on the tiles such a replay cuts (each
   chunk's tile in parts of ``REPLAY_TILE_BYTES / threads``: ``_parts``). Every
   variant starts from the snapshot's bits, in memory already touched, with the gradients
   copied out of the log beforehand.
3. ``measure_steps``, checks: one xxh3 pass over each shard's state, the shard digest
   against the target's seal, with ``ShardState.digest`` as the replay calls it.

Left out, so the floor stays below any real replay: reading the records, mapping the
gradients out of the log (the copies are in memory already), the Python around the calls,
and the wait for the slower shard. ``read + steps`` is the floor of an unverified replay;
``read + steps + checks`` that of a verified one. Their ratios to ``torch.load`` and to each
other are where this machine stops the recovery targets, for this design (4 KiB pages,
torch's fused Adam once per tile and step).
"""

from __future__ import annotations

import functools
import os
import statistics
from typing import Any

import numpy as np
import torch

from eventlog import RunAddress, Target, optimstep
from eventlog.fold.apply import ShardState
from eventlog.fold.deferred import READS_GRADS_ONLY, DeferredSteps, part_cuts
from eventlog.fold.engine import ControlIndex, FoldStart, fold_shard, index_control
from eventlog.ports import EventLog
from eventlog.settings import current
from snapshotter.catalog import markers, newest_valid
from snapshotter.store import SnapshotStore

from .model import timed_in_threads

#: One captured optimizer call: (optimizer, hyperparams, params, grads, states, groups).
Call = tuple[str, Any, list[torch.Tensor], list[torch.Tensor], list[dict[str, torch.Tensor]], list[int]]


def measure_steps(address: RunAddress, repeats: int) -> dict[str, Any]:
    """Median seconds of the tail's optimizer steps and of the state's checks, bare, with
    1 thread and with one thread per shard; and the snapshot's shard files (for
    ``read_files``)."""
    store = SnapshotStore(address.snapshots_url or "")
    with address.open_log() as log:
        idx = index_control(log)
        version = idx.resolve(Target())
        start, _ = newest_valid(store, log, idx, version, workers=2)
        if start is None:
            raise SystemExit("the run has no snapshot to start from")
        state = [t.bits for s in start.shards for t in s.tensors.values()]
        pristine = [b.copy() for b in state]
        calls = _capture(log, idx, version, start)
    if any(not np.array_equal(b, p) for b, p in zip(state, pristine, strict=True)):
        raise SystemExit("the tail holds chunks besides gradients and optimizer steps: the floor "
                         "times optimizer steps only")
    snapshot_id = next((m.snapshot_id for m in markers(idx).values()
                        if start.source == f"snapshot {m.snapshot_id} (version {m.version})"), None)
    if snapshot_id is None:
        raise SystemExit(f"cannot tell which snapshot {start.source!r} is")
    files = sorted(store.directory(address.run_id, snapshot_id).glob("shard-*.safetensors"))
    parted = [_parts(c, current().replay_tile_bytes // len(calls)) for c in calls]
    counters = [(s, s.clone()) for plan in (calls, parted) for c in plan for call in c
                for st in call[4] for s in st.values() if s.numel() == 1]

    def reset() -> None:
        for b, p in zip(state, pristine, strict=True):
            b[:] = p
        for s, first in counters:
            s.copy_(first)

    layout = idx.layout_at(version, start.layout)
    timings: dict[str, list[float]] = {f"{job}_{n}": [] for job in ("steps", "checks") for n in (1, 2)}
    for i in range(repeats):
        for threads in (1, 2) if i % 2 == 0 else (2, 1):  # neither always meets a warmer cache
            reset()
            timings[f"steps_{threads}"].append(_steps(parted if threads == 2 else calls, threads == 2))
            timings[f"checks_{threads}"].append(_checks(start.shards, layout, threads == 2))
    out: dict[str, Any] = {k: statistics.median(v) for k, v in timings.items()}
    out.update({"tail_versions": version - start.version, "calls_per_shard": [len(c) for c in calls],
                "files": [str(f) for f in files], "samples": timings})
    return out


def _capture(log: EventLog, idx: ControlIndex, version: int, start: FoldStart) -> list[list[Call]]:
    """Each shard's optimizer calls, as a batched replay from ``start`` makes them (the
    calls are recorded, not run: the state stays the snapshot's). Gradients are copied:
    a replay's are views of the log, or of a scratch buffer reused by the next call.

    Refuses a tail a shard replays in more than one batch (a log that cuts batches, or a
    chunk size that changes): each batch's step counters start from where the one before
    left them, which a capture that runs nothing cannot reproduce."""
    calls: list[list[Call]] = []
    batches = 0

    def record(optimizer: str, hyperparams: Any, params: list[torch.Tensor], grads: list[torch.Tensor],
               states: list[dict[str, torch.Tensor]], groups: list[int]) -> None:
        calls[-1].append((optimizer, hyperparams, list(params), [g.clone() for g in grads],
                          [dict(s) for s in states], list(groups)))

    def counted(steps: DeferredSteps, *args: Any, **kwargs: Any) -> None:
        nonlocal batches
        batches += bool(steps.steps)
        run(steps, *args, **kwargs)

    real, run = optimstep.run_step, DeferredSteps.run
    optimstep.run_step = record  # type: ignore[assignment]
    DeferredSteps.run = counted  # type: ignore[method-assign, assignment]
    try:
        for shard, state in enumerate(start.shards):
            calls.append([])
            batches = 0
            fold_shard(log, state, idx, version, gt_offset=start.next_offsets[shard + 1] - 1,
                       since_version=start.version, defer_steps=True, grad_digests=False)
            if batches != 1:
                raise SystemExit(f"shard {shard}'s tail replays in {batches} batches; the floor "
                                 "needs one (an embedded log, one chunk size)")
    finally:
        optimstep.run_step = real
        DeferredSteps.run = run  # type: ignore[method-assign]
    return calls


def _parts(calls: list[Call], part_bytes: int) -> list[Call]:
    """One shard's calls as workers sharing the cache make them (``eventlog.fold.deferred``):
    each single-tile call whose gradient exceeds ``part_bytes`` cut into parts
    (``eventlog.fold.deferred.part_cuts``, the replay's own rule), every part
    running the tile's steps in order before the next part starts, on its own copy of the
    step counter. Views of the same tensors: no memory is copied. (It assumes what the
    benchmark's log holds: uncompressed gradients, which the replay reads in place.)"""
    out: list[Call] = []
    group: list[Call] = []

    def flush() -> None:
        if not group:
            return
        first = group[0]
        g = first[3][0] if len(first[2]) == 1 else None
        cuts: list[tuple[int, int]] = []
        size = 1
        if g is not None and first[0] in READS_GRADS_ONLY and g.dim() == 1:
            size = g.element_size()
            cuts = part_cuts(g.numel() * size, part_bytes)
        if len(cuts) <= 1:
            out.extend(group)
        else:
            for at, n in ((skip // size, m // size) for skip, m in cuts):
                counters: dict[int, torch.Tensor] = {}
                out.extend((o, h, [_cut(p, at, n, counters) for p in ps],
                            [_cut(x, at, n, counters) for x in gs],
                            [{k: _cut(v, at, n, counters) for k, v in st.items()} for st in sts], gr)
                           for o, h, ps, gs, sts, gr in group)
        group.clear()

    for call in calls:  # a tile's calls are consecutive, on the same param view
        if group and call[2] and group[0][2] and call[2][0] is not group[0][2][0]:
            flush()
        group.append(call)
    flush()
    return out


def _cut(t: torch.Tensor, at: int, n: int, counters: dict[int, torch.Tensor]) -> torch.Tensor:
    """Elements ``[at, at + n)`` of a tile's tensor; for its step counter, the part's own copy."""
    if t.numel() == 1:
        if id(t) not in counters:
            counters[id(t)] = t.clone()
        return counters[id(t)]
    return t[at:at + n]


def read_files(files: list[str], per_file: bool) -> float:
    """Seconds to read every file into a fresh buffer (torch's allocator, as a replay's):
    one thread for all, or one thread per file."""
    def one(path: str) -> None:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            buf = torch.empty(size, dtype=torch.uint8).numpy()
            view, got = memoryview(buf.data), 0
            while got < size:
                got += f.readinto(view[got:]) or size

    return timed_in_threads([functools.partial(one, p) for p in files], per_file)


def _steps(calls: list[list[Call]], per_shard: bool) -> float:
    """Seconds to run every captured call through torch: one thread for all (torch's
    threads as they are), or one thread per shard (torch's threads shared out, as
    ``eventlog.fold.engine`` shares them among replay workers)."""
    def shard(c: list[Call]) -> None:
        for call in c:
            optimstep.run_step(*call)

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, before // len(calls)) if per_shard else before)
    try:
        return timed_in_threads([functools.partial(shard, c) for c in calls], per_shard)
    finally:
        torch.set_num_threads(before)


def _checks(shards: list[ShardState], layout: Any, per_shard: bool) -> float:
    """Seconds to hash each shard's state as a verified replay does: its shard digest,
    checked against the target's seal."""
    def shard(state: ShardState) -> None:
        state.digest(layout.tensors, layout.chunk_bytes)

    return timed_in_threads([functools.partial(shard, s) for s in shards], per_shard)
