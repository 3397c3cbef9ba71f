"""Predictive codec against XOR deltas, side by side on the same real training.

Each codec records the same seeded Adam run (one version per step) with the embedded
backend; the figures are medians over the versions after the optimizer state exists:
log bytes per version / raw state bytes, encode throughput (raw state MB per second of the
committer's encode work: predicting, compressing, hashing; not the log write), and decode
throughput (raw state MB per second of replaying the first ``DECODE_VERSIONS`` versions).
The replayed state is checked bit for bit against the live one.

    python -m benchmarks.codecs --size 25M --steps 100
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from eventlog import RunAddress, Target
from eventlog.fold.engine import rebuild
from rewind.recorder import Recorder

from .model import Workload, parse_size

MB = 1e6
#: Versions replayed to measure decode throughput (from the first, FULL, version).
DECODE_VERSIONS = 11
CODECS = ("xor", "predictive")


def run_codec(codec: str, params: int, steps: int, root: Path, log: Any = print) -> dict[str, Any]:
    """Record ``steps`` one-step versions with ``codec``; returns its figures."""
    work = Workload.build(params)
    url = f"sqlite://{root / codec / 'rewind.db'}"
    (root / codec).mkdir(parents=True, exist_ok=True)
    address = RunAddress(url, url, f"codec-{codec}")
    ratios, encode_mb_s, encodings = [], [], []
    with Recorder(address, work.model, work.optimizer, work.scheduler, rng=True,
                  predictive=codec == "predictive") as rec:
        for i in range(steps + 1):
            if i:
                work.step()
            res = rec.commit(work.steps_done, wait=True).result()
            encodings.append(res.encoding)
            if res.version >= 3:  # version 1 is FULL, version 2 gains the Adam state
                ratios.append(res.encoded_bytes / res.raw_bytes)
                encode_mb_s.append(res.raw_bytes / MB / res.encode_seconds)
            if res.version % 10 == 0:
                log(f"  {codec} v{res.version}: {res.encoded_bytes / res.raw_bytes:.3f} of "
                    f"{res.raw_bytes / MB:.0f} MB, encode {res.encode_seconds:.3f} s "
                    f"({res.encoding.split(' (')[0]})")
        raw = res.raw_bytes
    gc.collect()
    t0 = time.perf_counter()
    state = rebuild(address.open_log(), Target("version", DECODE_VERSIONS), workers=2,
                    share_torch_threads=True)
    decode_s = time.perf_counter() - t0
    del state
    gc.collect()
    latest = rebuild(address.open_log(), Target(), workers=2, share_torch_threads=True)
    _check(latest, work)
    predictive = sum(e.startswith("predictive/") for e in encodings)
    return {
        "params": work.params,
        "raw_state_mb": raw / MB,
        "versions": len(encodings),
        "predictive_versions": predictive,
        "bytes_per_commit_ratio": statistics.median(ratios),
        "encode_mb_s": statistics.median(encode_mb_s),
        "decode_mb_s": DECODE_VERSIONS * raw / MB / decode_s,
        "bit_exact": True,
    }


def _check(state: Any, work: Workload) -> None:
    live = {n: t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            for n, t in work.tensors().items()}
    for shard in state.shards:
        for name, t in shard.tensors.items():
            if not (live[name] == t.bits).all():
                raise AssertionError(f"replayed tensor {name} differs from the live state")


def compare(params: int, steps: int, root: Path, log: Any = print) -> dict[str, Any]:
    """Both codecs on the same training; ratios predictive / xor."""
    out: dict[str, Any] = {}
    for codec in CODECS:
        log(f"codec {codec}: {params / 1e6:.0f}M params, {steps} Adam steps")
        out[codec] = run_codec(codec, params, steps, root, log)
    x, p = out["xor"], out["predictive"]
    out["encode_speedup"] = p["encode_mb_s"] / x["encode_mb_s"]
    out["decode_speedup"] = p["decode_mb_s"] / x["decode_mb_s"]
    out["bytes_vs_xor"] = p["bytes_per_commit_ratio"] / x["bytes_per_commit_ratio"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.codecs", description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="25M", help="parameters of the model (default 25M)")
    ap.add_argument("--steps", type=int, default=100, help="Adam steps, one version each")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rewind-codecs-") as tmp:
        res = compare(parse_size(args.size), args.steps, Path(tmp))
    for codec in CODECS:
        r = res[codec]
        print(f"{codec:>10}: bytes/commit {r['bytes_per_commit_ratio']:.3f}, encode "
              f"{r['encode_mb_s']:.0f} MB/s, decode {r['decode_mb_s']:.0f} MB/s, "
              f"{r['predictive_versions']}/{r['versions']} versions predictive")
    print(f"predictive / xor: encode {res['encode_speedup']:.2f}x, decode "
          f"{res['decode_speedup']:.2f}x, bytes {res['bytes_vs_xor']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
