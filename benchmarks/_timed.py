"""One timed recovery in a fresh process, as after a crash: ``python -m benchmarks._timed``.

    python -m benchmarks._timed load CHECKPOINT
    python -m benchmarks._timed replay LOG_URL COORD_URL RUN_ID SNAPSHOTS_URL WORKERS TARGET
    python -m benchmarks._timed read THREADS FILE...
    python -m benchmarks._timed steps LOG_URL COORD_URL RUN_ID SNAPSHOTS_URL REPEATS

Prints one JSON line ``{"seconds": ...}``: the time of ``torch.load(weights_only=True)`` or
``replayer.replay.replay`` alone (imports and interpreter start are not counted). A fresh
process gives both the same memory state (no warm allocator): in the benchmark's own process
the time of ``torch.load`` varied 3x with what was freed before it. ``read`` and ``steps``
time the floor's two bare jobs instead (``benchmarks.floor``).
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    import torch

    if argv[0] == "load":
        t0 = time.perf_counter()
        tree = torch.load(argv[1], weights_only=True)
        seconds = time.perf_counter() - t0
        del tree
        print(json.dumps({"seconds": seconds}))
        return 0
    if argv[0] == "replay":
        from eventlog import RunAddress, Target
        from replayer.replay import replay
        from rewind.allocator import tune_for_replay

        tune_for_replay()  # as the rewind CLI's recovery job does

        log_url, coord_url, run_id, snaps, workers, target = argv[1:7]
        address = RunAddress(log_url, coord_url, run_id, snaps or None)
        t0 = time.perf_counter()
        state, report = replay(address, Target.parse(target), workers=int(workers),
                               share_torch_threads=True)  # as the rewind CLI's replays do
        seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "version": report.version,
                          "snapshot_version": report.snapshot_version,
                          "tail_versions": report.tail_versions,
                          "state_digest": report.state_digest}))
        del state
        return 0
    if argv[0] == "read":
        from benchmarks.floor import read_files

        print(json.dumps({"seconds": read_files(argv[2:], int(argv[1]) > 1)}))
        return 0
    if argv[0] == "steps":
        from benchmarks.floor import measure_steps
        from eventlog import RunAddress

        log_url, coord_url, run_id, snaps, repeats = argv[1:6]
        print(json.dumps(measure_steps(RunAddress(log_url, coord_url, run_id, snaps or None), int(repeats))))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
