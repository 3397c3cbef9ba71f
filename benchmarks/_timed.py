"""One timed job in a fresh process, as after a crash: ``python -m benchmarks._timed``.

    python -m benchmarks._timed load CHECKPOINT
    python -m benchmarks._timed replay LOG_URL COORD_URL RUN_ID SNAPSHOTS_URL WORKERS TARGET
    python -m benchmarks._timed check LOG_URL COORD_URL RUN_ID SNAPSHOTS_URL CHECKPOINT
    python -m benchmarks._timed recover LOG_URL COORD_URL RUN_ID SNAPSHOTS_URL OUT_DIR
    python -m benchmarks._timed snapshot LOG_URL COORD_URL RUN_ID SNAPSHOTS_URL
    python -m benchmarks._timed read THREADS FILE...
    python -m benchmarks._timed steps LOG_URL COORD_URL RUN_ID SNAPSHOTS_URL REPEATS

Prints one JSON line ``{"seconds": ..., "peak_extra_bytes": ...}``: the time of
``torch.load(weights_only=True)``, ``replayer.replay.replay`` or a snapshotter's
``snapshot(force=True)`` alone (imports and interpreter start are not counted), and the
process's peak resident memory (``VmHWM``) above its resident memory once the imports are
done. A fresh process gives each job the same memory state (no warm allocator): in the
benchmark's own process the time of ``torch.load`` varied 3x with what was freed before it.
``recover`` is ``rewind recover``'s job: the replay (2 workers), then the checkpoint
written to ``OUT_DIR``. ``check`` replays the newest version and compares it bit for bit with the checkpoint
(``torch.save`` of the live state at that version), so the benchmark's own process need not
hold a second copy of the state. ``read`` and ``steps`` time the floor's two bare jobs
(``benchmarks.floor``).
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.memory import reset_peak, status_kib

#: The module of each URL scheme's backend. ``eventlog.backends`` imports it on first use,
#: which would put its import inside the timed job: it is imported with the job's others.
_BACKENDS = {"sqlite": "eventlog.embedded", "kafka": "eventlog.kafka", "redis": "eventlog.redis",
             "rediss": "eventlog.redis"}


def _address(args: list[str]) -> Any:
    from eventlog import RunAddress

    log_url, coord_url, run_id, snaps = args[:4]
    for url in (log_url, coord_url):
        importlib.import_module(_BACKENDS[url.partition("://")[0]])
    return RunAddress(log_url, coord_url, run_id, snaps or None)


def _replay(args: list[str], workers: int, target: str) -> tuple[Any, Any, float]:
    """``replay`` as the rewind CLI's recovery job runs it: (state, report, seconds)."""
    from eventlog import Target
    from replayer.replay import replay
    from rewind.allocator import tune_for_replay

    tune_for_replay()
    address = _address(args)
    t0 = time.perf_counter()
    state, report = replay(address, Target.parse(target), workers=workers,
                           share_torch_threads=True)  # as the rewind CLI's replays do
    return state, report, time.perf_counter() - t0


def _report(report: Any) -> dict[str, Any]:
    return {"version": report.version, "snapshot_version": report.snapshot_version,
            "tail_versions": report.tail_versions, "state_digest": report.state_digest}


def _load(argv: list[str]) -> dict[str, Any]:
    import torch

    t0 = time.perf_counter()
    tree = torch.load(argv[0], weights_only=True)
    seconds = time.perf_counter() - t0
    del tree
    return {"seconds": seconds}


def _replay_job(argv: list[str]) -> dict[str, Any]:
    state, report, seconds = _replay(argv, int(argv[4]), argv[5])
    del state
    return {"seconds": seconds, **_report(report)}


def _recover(argv: list[str]) -> dict[str, Any]:
    from pathlib import Path

    from replayer.replay import write_checkpoint

    t0 = time.perf_counter()
    state, report, _ = _replay(argv, 2, "latest")
    write_checkpoint(state, report, Path(argv[4]))
    return {"seconds": time.perf_counter() - t0, **_report(report)}


def _check(argv: list[str]) -> dict[str, Any]:
    """Replay the newest version (2 workers) and compare every tensor with the checkpoint's."""
    import torch

    from eventlog.capture import flatten

    state, report, seconds = _replay(argv, 2, "latest")
    tree = torch.load(argv[4], weights_only=True)
    live, _ = flatten("model", tree["model"])
    optimizer, _ = flatten("optimizer", tree["optimizer"])
    live.update(optimizer)
    compared = 0
    for shard in state.shards:
        for name, t in shard.tensors.items():
            if name not in live:
                raise SystemExit(f"the replay holds tensor {name}, the checkpoint does not")
            mine = live[name].detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            if not (mine == t.bits).all():
                raise SystemExit(f"replayed tensor {name} differs from the live state")
            compared += 1
    if compared != len(live):
        raise SystemExit(f"the replay rebuilt {compared} of the checkpoint's {len(live)} tensors")
    return {"seconds": seconds, "tensors": compared, **_report(report)}


def _snapshot(argv: list[str]) -> dict[str, Any]:
    """A snapshotter process's ``snapshot(force=True)`` of the run's newest version."""
    from snapshotter.service import Snapshotter, SnapshotterConfig
    from snapshotter.store import SnapshotStore

    address = _address(argv)
    t0 = time.perf_counter()
    with Snapshotter(address, SnapshotStore(address.snapshots_url or ""),
                     SnapshotterConfig(workers=2)) as snap:
        result = snap.snapshot(force=True)
    return {"seconds": time.perf_counter() - t0, "version": result.version if result else None}


def _read(argv: list[str]) -> dict[str, Any]:
    from benchmarks.floor import read_files

    return {"seconds": read_files(argv[1:], int(argv[0]) > 1)}


def _steps(argv: list[str]) -> dict[str, Any]:
    from benchmarks.floor import measure_steps

    return measure_steps(_address(argv), int(argv[4]))


JOBS: dict[str, Callable[[list[str]], dict[str, Any]]] = {
    "load": _load, "replay": _replay_job, "recover": _recover, "check": _check, "snapshot": _snapshot,
    "read": _read, "steps": _steps,
}


def main(argv: list[str]) -> int:
    job = JOBS.get(argv[0]) if argv else None
    if job is None:
        print(__doc__, file=sys.stderr)
        return 2
    # Every job's modules are imported before the baseline: the peak counts the job's
    # memory, not the code's.
    import benchmarks.floor  # noqa: F401
    import eventlog.embedded  # noqa: F401  (``open_log`` imports its backend on first use)
    import replayer.replay  # noqa: F401
    import rewind.allocator  # noqa: F401
    import snapshotter.service  # noqa: F401

    if any(arg.startswith("kafka:") for arg in argv):
        import eventlog.kafka  # noqa: F401

    baseline = status_kib("VmRSS")
    reset_peak()
    out = job(argv[1:])
    out["peak_extra_bytes"] = (status_kib("VmHWM") - baseline) * 1024
    out["baseline_rss_bytes"] = baseline * 1024
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
