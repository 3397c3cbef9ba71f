"""The physical floor of a recovery: the replay's two unavoidable jobs, timed bare.

    python -m benchmarks._timed read THREADS FILE...
    python -m benchmarks._timed steps LOG_URL COORD_URL RUN_ID SNAPSHOTS_URL REPEATS

Any replay of a snapshot plus a tail must (1) bring the snapshot's state into fresh memory
and (2) run the tail's optimizer steps on it. This times both bare, on the benchmark's own
recorded run: nothing of Rewind's runs in the timed loops but its one-call dispatch to torch's
functional optimizer (``optimstep.run_step``, which the replay uses too):

1. ``read_files``: the newest snapshot's shard files read into fresh buffers with one
   ``readinto`` each (no checksum, no parsing), in a fresh process like the replays and
   ``torch.load`` (on this VM, memory a process has never touched costs most of a read):
   two threads, one shard each, against one thread reading both.
2. ``measure_steps``: the tail's optimizer calls exactly as a batched replay makes them
   (the same tiles, hyperparameters and logged gradients, gathered beforehand by folding
   the log with the optimizer calls captured instead of run), passed straight to torch's
   functional optimizer: two threads, one shard each, torch on one intra-op thread each
   (as a 2-worker replay runs), against one thread running both shards with torch's
   default threads (as a 1-worker replay runs). Every variant starts from the snapshot's
   bits, in memory already touched, with the gradients copied out of the log beforehand.

``read_2 + steps_2`` is what the fastest conceivable 2-worker replay would cost here, and
``read_1 + steps_1`` the same for 1 worker. Their ratios to ``torch.load`` and to each other
are where this machine stops the recovery targets.
"""

from __future__ import annotations

import functools
import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import eventlog.optimstep as optimstep
from eventlog import RunAddress, Target
from eventlog.fold import fold_shard, index_control
from snapshotter.catalog import markers, newest_valid
from snapshotter.store import SnapshotStore

#: One captured optimizer call: (optimizer, hyperparams, params, grads, states, groups).
Call = tuple[str, Any, list[torch.Tensor], list[torch.Tensor], list[dict[str, torch.Tensor]], list[int]]


def measure_steps(address: RunAddress, repeats: int) -> dict[str, Any]:
    """Median seconds of the tail's optimizer steps, bare, with 1 and 2 threads; and the
    snapshot's shard files (for ``read_files``)."""
    store = SnapshotStore(address.snapshots_url or "")
    with address.open_log() as log:
        idx = index_control(log)
        version = idx.resolve(Target())
        start, _ = newest_valid(store, log, idx, version, workers=2)
        if start is None:
            raise SystemExit("the run has no snapshot to start from")
        calls = _capture(log, idx, version, start)
    snapshot_id = next(m.snapshot_id for m in markers(idx).values()
                       if m.end is not None and m.version == start.version)
    files = sorted(store.directory(address.run_id, snapshot_id).glob("shard-*.safetensors"))
    state = [t.bits for s in start.shards for t in s.tensors.values()]
    pristine = [b.copy() for b in state]
    counters = [(s, s.clone()) for c in calls for call in c for st in call[4] for s in st.values()
                if s.numel() == 1]

    def reset() -> None:
        for b, p in zip(state, pristine, strict=True):
            b[:] = p
        for s, first in counters:
            s.copy_(first)

    timings: dict[str, list[float]] = {"steps_1": [], "steps_2": []}
    for i in range(repeats):
        for threads in (1, 2) if i % 2 == 0 else (2, 1):  # neither always meets a warmer cache
            reset()
            timings[f"steps_{threads}"].append(_steps(calls, threads))
    return {"steps_1": statistics.median(timings["steps_1"]),
            "steps_2": statistics.median(timings["steps_2"]),
            "tail_versions": version - start.version, "calls_per_shard": [len(c) for c in calls],
            "files": [str(f) for f in files], "samples": timings}


def _capture(log: Any, idx: Any, version: int, start: Any) -> list[list[Call]]:
    """Each shard's optimizer calls, as a batched replay from ``start`` makes them (the
    calls are recorded, not run: the state stays the snapshot's). Gradients are copied:
    a replay's are views of the log, or of a scratch buffer reused by the next call."""
    calls: list[list[Call]] = []
    mine = threading.local()

    def record(optimizer: str, hyperparams: Any, params: list[torch.Tensor], grads: list[torch.Tensor],
               states: list[dict[str, torch.Tensor]], groups: list[int]) -> None:
        mine.calls.append((optimizer, hyperparams, list(params), [g.clone() for g in grads],
                           [dict(s) for s in states], list(groups)))

    real = optimstep.run_step
    optimstep.run_step = record  # type: ignore[assignment]
    try:
        for shard, state in enumerate(start.shards):
            mine.calls = []
            fold_shard(log, state, idx, version, gt_offset=start.next_offsets[shard + 1] - 1,
                       since_version=start.version, defer_steps=True, grad_digests=False)
            calls.append(mine.calls)
    finally:
        optimstep.run_step = real
    return calls


def read_files(files: list[str], threads: int) -> float:
    """Seconds to read every file into a fresh buffer (torch's allocator, as a replay's):
    one thread per file, or one for all."""
    def one(path: str) -> None:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            buf = torch.empty(size, dtype=torch.uint8).numpy()
            view, got = memoryview(buf.data), 0
            while got < size:
                got += f.readinto(view[got:]) or size

    return _in_threads([functools.partial(one, p) for p in files], threads)


def _steps(calls: list[list[Call]], threads: int) -> float:
    """Seconds to run every captured call through torch: one thread per shard (torch on one
    intra-op thread each), or one thread for all (torch's default threads)."""
    def shard(c: list[Call]) -> None:
        for call in c:
            optimstep.run_step(*call)

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, before // threads))
    try:
        return _in_threads([functools.partial(shard, c) for c in calls], threads)
    finally:
        torch.set_num_threads(before)


def _in_threads(jobs: list[Callable[[], None]], threads: int) -> float:
    """Wall seconds to run ``jobs``: all on this thread, or one thread each."""
    t0 = time.perf_counter()
    if threads == 1:
        for job in jobs:
            job()
    else:
        workers = [threading.Thread(target=job) for job in jobs]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    return time.perf_counter() - t0
