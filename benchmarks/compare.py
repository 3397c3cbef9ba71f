"""Two versions of the package side by side on one recorded run: ``python -m benchmarks.compare``.

    python -m benchmarks --size 25M --only recovery_s --keep --workdir DIR   # records a run
    git worktree add --detach /tmp/before <commit>
    python -m benchmarks.compare DIR/rewind-bench-XXXX --before /tmp/before [--repeats 5]

``--before-run`` gives the old version its own copy of the run, for a change of the stored
format: e.g. ``python -m benchmarks.inline_copy RUN COPY`` writes the same log with every
message in SQLite, as versions before segment files wrote it.

Every measurement is ``benchmarks._timed`` in a fresh process (as in ``recovery_s``), run
from each source tree in turn, interleaved (before, after, before, after...), so both see
the same machine load; the table shows medians. The rows: replay of the newest version with
1 and 2 workers, replay to the newest snapshot's own version (2 workers), and
``torch.load(weights_only=True)`` of the run's checkpoint. Both trees must rebuild the same
state digest, or the comparison stops.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent


def timed(tree: Path, args: list[str]) -> dict[str, Any]:
    """One ``benchmarks._timed`` run from the source tree ``tree``."""
    out = subprocess.run([sys.executable, "-m", "benchmarks._timed", *args], cwd=str(tree),
                         capture_output=True, text=True, check=False, timeout=1800,
                         env={"PYTHONPATH": str(tree), **_env()})
    if out.returncode:
        raise RuntimeError(f"{tree}: benchmarks._timed {args[0]} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _replay_args(run: Path, run_id: str) -> list[str]:
    """``benchmarks._timed replay``'s log, coordinator, run and snapshot arguments."""
    db = f"sqlite://{run / 'embedded' / 'rewind.db'}"
    return [db, db, run_id, f"file://{run / 'embedded' / 'snapshots'}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="a run kept by python -m benchmarks --keep")
    ap.add_argument("--before", required=True, help="source tree of the old version")
    ap.add_argument("--after", default=str(HERE), help="source tree of the new version (this one)")
    ap.add_argument("--before-run", help="the run the old version reads (default: run_dir), "
                    "the same log in the old version's format")
    ap.add_argument("--run", default="bench", help="run id (the benchmark's is 'bench')")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    run = Path(args.run_dir).resolve()
    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    runs = {"before": Path(args.before_run).resolve() if args.before_run else run, "after": run}
    base = {side: _replay_args(r, args.run) for side, r in runs.items()}
    probe = timed(trees["after"], ["replay", *base["after"], "2", "latest"])
    rows = {"replay, 1 worker": ["1", "latest"], "replay, 2 workers": ["2", "latest"],
            "snapshot alone, 2 workers": ["2", f"version={probe['snapshot_version']}"]}
    times: dict[tuple[str, str], list[float]] = {}
    digests: dict[tuple[str, str], set[str]] = {}
    for _ in range(args.repeats):
        for row, extra in rows.items():
            for side, tree in trees.items():
                got = timed(tree, ["replay", *base[side], *extra])
                times.setdefault((row, side), []).append(got["seconds"])
                digests.setdefault((row, ""), set()).add(got["state_digest"])
    checkpoint = run / "checkpoint.pt"
    loads = [timed(trees["after"], ["load", str(checkpoint)])["seconds"]
             for _ in range(args.repeats)] if checkpoint.exists() else []
    bad = [row for (row, _), ds in digests.items() if len(ds) != 1]
    if bad:
        raise SystemExit(f"the two trees rebuild different states: {bad}")

    def med(row: str, side: str) -> float:
        return statistics.median(times[(row, side)])

    load = statistics.median(loads) if loads else None
    print(f"run {run} (v{probe['version']}: snapshot v{probe['snapshot_version']} + "
          f"{probe['tail_versions']} versions), medians of {args.repeats}, fresh processes")
    print(f"{'':28} {'before':>9} {'after':>9} {'speedup':>8}" +
          (f" {'before/load':>12} {'after/load':>11}" if load else ""))
    for row in rows:
        b, a = med(row, "before"), med(row, "after")
        line = f"{row:28} {b:8.3f}s {a:8.3f}s {b / a:7.2f}x"
        if load:
            line += f" {b / load:11.1f}x {a / load:10.1f}x"
        print(line)
    for side in trees:
        w1, w2 = med("replay, 1 worker", side), med("replay, 2 workers", side)
        print(f"speedup 2 vs 1 workers, {side}: {w1 / w2:.2f}x")
    if load:
        print(f"torch.load(weights_only=True): {load:.3f} s")
    print(json.dumps({"times": {f"{r}|{s}": v for (r, s), v in times.items()},
                      "torch_load": loads}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
