"""``python -m benchmarks.bisect_speed``: ``rewind bisect`` on two long runs against a full
replay of both.

    python -m benchmarks.bisect_speed [--versions 2000] [--diverge-at 1000] [--width 64]
                                      [--snapshot-every 200] [--workdir DIR] [--json out.json]

Records two runs of one seeded trainer (a stack of ``Linear(width, width)`` layers, Adam,
one version per step), the second with one weight element nudged at ``--diverge-at``, each
with a snapshot every ``--snapshot-every`` versions (0: none). Then times, in this process:
``bisect`` (reads both runs' seals, replays two versions per run from the newest snapshot
before the divergence), and a full replay of each run from the start of its log (without
snapshots), the least a comparison by replaying would cost. Not a test.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from eventlog import RunAddress
from eventlog.target import LATEST
from replayer.bisect import bisect
from replayer.replay import replay
from rewind import Snapshots, every_versions, keep_all
from rewind.recorder import Recorder


def record(root: Path, run: str, versions: int, width: int, snapshot_every: int,
           nudge_at: int | None) -> tuple[RunAddress, float]:
    """Record one run; returns its read-only address and the seconds it took."""
    url = f"sqlite://{root / run}.db"
    address = RunAddress(url, url, run, f"file://{root / run}-snapshots")
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(2):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    first = layers[0]
    assert isinstance(first, torch.nn.Linear)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    # Every snapshot is kept: bisect starts its replays from the newest one before the divergence.
    snapshots = Snapshots(every_versions(snapshot_every), keep=keep_all()) if snapshot_every else None
    with Recorder(address, model, opt, snapshots=snapshots) as rec:
        for step in range(1, versions + 1):
            opt.zero_grad()
            model(torch.randn(8, width)).pow(2).mean().backward()
            opt.step()
            if step == nudge_at:
                with torch.no_grad():
                    first.weight[0, 0] += 1e-3
            rec.commit(step)
        rec.flush()
    seconds = time.perf_counter() - t0
    return RunAddress(url, url, run, address.snapshots_url, read_only=True), seconds


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--versions", type=int, default=2000)
    parser.add_argument("--diverge-at", type=int, default=None, help="default: half way")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--snapshot-every", type=int, default=200)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    at = args.diverge_at or args.versions // 2
    with tempfile.TemporaryDirectory(prefix="rewind-bisect-", dir=args.workdir) as tmp:
        root = Path(tmp)
        a, rec_a = record(root, "a", args.versions, args.width, args.snapshot_every, None)
        b, rec_b = record(root, "b", args.versions, args.width, args.snapshot_every, at)
        t0 = time.perf_counter()
        report = bisect(a, b)
        bisect_s = time.perf_counter() - t0
        assert report.step == at, report.step
        t0 = time.perf_counter()
        for address in (a, b):
            replay(address, LATEST, use_snapshots=False)
        full_s = time.perf_counter() - t0
    params = sum(p.numel() for p in torch.nn.Linear(args.width, args.width).parameters()) * 2
    result = {
        "versions": args.versions, "diverge_at": at, "params": params,
        "snapshot_every": args.snapshot_every, "record_s": [rec_a, rec_b],
        "bisect_s": bisect_s, "bisect_seals_s": report.seconds.get("seals"),
        "bisect_replay_s": report.seconds.get("replay"), "seals_compared": report.seals_compared,
        "replayed_versions": report.replayed, "full_replay_both_s": full_s,
        "speedup": full_s / bisect_s if bisect_s else None,
    }
    print(f"{args.versions} versions per run, {params} params, diverging at version {at}, "
          f"a snapshot every {args.snapshot_every or 'never'}")
    print(f"bisect: {bisect_s:.2f} s (seals {result['bisect_seals_s']:.2f} s, {report.seals_compared} "
          f"compared; replayed {report.replayed} in {result['bisect_replay_s']:.2f} s)")
    print(f"full replay of both runs (no snapshots): {full_s:.2f} s; bisect is "
          f"{result['speedup']:.1f}x faster")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
