"""The recorder's host memory: resident memory above the trainer's baseline, per state size.

    python -m benchmarks.memory [--size 25M] [--codec predictive|xor] [--snapshots]
                                [--commits 12] [--json out.json]

Each measurement runs in a fresh process (no allocator state carried over): it builds the
benchmark's model and Adam, runs one training step, takes the baseline (``VmRSS`` then),
starts a ``Recorder(model, optimizer, rng=True)`` on an embedded log and commits once per
training step with ``wait=True``. It reports ``VmRSS`` after 2 commits and after the last,
and ``VmHWM`` (the peak, including ``close()`` and, with ``--snapshots``, the final
snapshot), each above the baseline as a multiple of the state's tensor bytes. A ``clone()``
of the state per step (DCP-style staging) is measured the same way beside it. Not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: The recorder's extra resident memory target, as a multiple of the state.
TARGET = 2.2
#: A restarted trainer's ``restore()``: its peak above the trainer's footprint before it.
RESTORE_TARGET = 1.5
#: Versions between the snapshots of a ``--snapshots`` run (several snapshots per run).
SNAPSHOT_EVERY = 5


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure (``VmRSS``, ``VmHWM``) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0); False if the kernel refuses, and
    then the peak includes what came before (an overestimate, never an underestimate)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure(size: str, codec: str, snapshots: bool, commits: int, root: Path) -> dict[str, Any]:
    """Run in this process: the figures of one recorder run (or ``codec="clone"``)."""
    import torch

    from benchmarks.model import Workload, parse_size
    from eventlog import RunAddress
    from rewind import Snapshots, every_versions, keep_last
    from rewind.recorder import Recorder

    work = Workload.build(parse_size(size))
    if codec != "restore-fresh":
        work.step()
    state = work.raw_bytes()
    url = f"sqlite://{root / 'rewind.db'}"
    address = RunAddress(url, url, "memory", f"file://{root / 'snapshots'}")
    baseline = status_kib("VmRSS")  # after every import: the peak counts memory, not code
    peak_reset = reset_peak()
    rss: dict[int, int] = {}
    if codec.startswith("restore"):
        # A trainer restarted: its objects built (``restore``: the optimizer stepped once,
        # so its moments exist, as DCP's in-place load needs; ``restore-fresh``: not yet),
        # then ``restore()`` of the run ``record`` left in ``root``.
        with Recorder(address, model=work.model, optimizer=work.optimizer, rng=True) as rec:
            restored = rec.restore()
            rss[min(2, commits)] = rss[commits] = status_kib("VmRSS")
            peak = status_kib("VmHWM")  # restore() alone: not its staging thread, not close()
        state = work.raw_bytes()  # with the moments a fresh optimizer got from the restore
        if restored.version != commits:
            raise RuntimeError(f"restored version {restored.version}, recorded {commits}")
    elif codec == "clone":
        staged: dict[str, torch.Tensor] = {}
        for i in range(commits):
            work.step()
            staged = {}  # the previous stage is released first, as an async save's would be
            staged = {n: t.clone() for n, t in work.tensors().items()}
            rss[i + 1] = status_kib("VmRSS")
        del staged
    else:
        snaps = Snapshots(every_versions(SNAPSHOT_EVERY), keep=keep_last(2)) if snapshots else None
        with Recorder(address, model=work.model, optimizer=work.optimizer, rng=True,
                      predictive=codec == "predictive", snapshots=snaps) as rec:
            for i in range(commits):
                work.step()
                rec.commit(work.steps_done, wait=True)
                rss[i + 1] = status_kib("VmRSS")
    if not codec.startswith("restore"):
        peak = status_kib("VmHWM")
    kib = 1024 / state

    def above(v: int) -> float:
        return round((v - baseline) * kib, 3)

    return {
        "size": size, "codec": codec, "snapshots": snapshots, "commits": commits,
        "state_bytes": state, "baseline_rss_bytes": baseline * 1024, "peak_reset": peak_reset,
        "rss_after_2": above(rss[min(2, commits)]), "rss_after_last": above(rss[commits]),
        "peak": above(peak),
    }


def run_child(size: str, codec: str, snapshots: bool, commits: int) -> dict[str, Any]:
    """``measure`` in a fresh Python process; its figures. A ``restore`` run first records
    the run it restores (predictive, snapshots on) in a fresh process of its own."""
    with tempfile.TemporaryDirectory(prefix="rewind-memory-") as tmp:
        def child(codec: str, snapshots: bool) -> dict[str, Any]:
            args = [sys.executable, "-m", "benchmarks.memory", "--child", "--size", size, "--codec", codec,
                    "--commits", str(commits), "--root", tmp] + (["--snapshots"] if snapshots else [])
            out = subprocess.run(args, check=True, capture_output=True, text=True)
            result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
            return result

        if codec.startswith("restore"):
            child("predictive", True)
        return child(codec, snapshots)


#: The recorder runs of each size's table (``python -m benchmarks --sizes``): key ->
#: (codec, snapshots). ``clone`` is DCP-style staging, the comparison; ``restore`` is a
#: restarted trainer's ``restore()`` of a predictive run with snapshots (``restore-fresh``:
#: its optimizer not stepped yet, so the moments are allocated by the restore).
RECORDER_RUNS = {"predictive": ("predictive", True), "xor": ("xor", True), "clone": ("clone", False),
                 "restore": ("restore", False), "restore-fresh": ("restore-fresh", False)}


def recorder_runs(size: str, commits: int) -> dict[str, dict[str, Any]]:
    """``RECORDER_RUNS``, each in a fresh process; a run that fails (e.g. killed for memory)
    gives ``{"error": ...}`` and the others still run."""
    out: dict[str, dict[str, Any]] = {}
    for key, (codec, snapshots) in RECORDER_RUNS.items():
        try:
            out[key] = run_child(size, codec, snapshots, commits)
        except subprocess.CalledProcessError as exc:
            out[key] = {"error": f"exit status {exc.returncode}: {(exc.stderr or '')[-500:]}"}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="25M")
    p.add_argument("--codec", choices=["predictive", "xor", "clone", "restore", "restore-fresh"],
                   default="predictive")
    p.add_argument("--snapshots", action="store_true",
                   help=f"take a snapshot every {SNAPSHOT_EVERY} versions")
    p.add_argument("--commits", type=int, default=12)
    p.add_argument("--no-clone", action="store_true", help="skip the clone() baseline")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.commits < 1:
        p.error("--commits must be >= 1")
    if a.child:
        print(json.dumps(measure(a.size, a.codec, a.snapshots, a.commits, a.root)))
        return 0
    rows = [run_child(a.size, a.codec, a.snapshots, a.commits)]
    if not a.no_clone and a.codec != "clone":
        rows.append(run_child(a.size, "clone", False, a.commits))
    state_mb = rows[0]["state_bytes"] / 1e6
    print(f"size {a.size}: state {state_mb:.0f} MB; resident memory above the baseline, x the state")
    print(f"{'run':<28}{'after 2':>10}{f'after {a.commits}':>10}{'peak':>10}  target")
    for r in rows:
        label = r["codec"] + (" + snapshots" if r["snapshots"] else "")
        limit = {"clone": None, "restore-fresh": None, "restore": RESTORE_TARGET}.get(r["codec"], TARGET)
        verdict = "" if limit is None else f"peak <= {limit}: " + ("PASS" if r["peak"] <= limit else "MISS")
        figures = f"{r['rss_after_2']:>10.2f}{r['rss_after_last']:>10.2f}{r['peak']:>10.2f}"
        print(f"{label:<28}{figures}  {verdict}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
