"""Measure candidate compressors on real Adam updates: ratio and single-core throughput.

Run: ``python -m benchmarks.codec_choice`` (after ``pip install -e ".[bench]"``: zstandard
and lz4 are not dependencies of the package). ``docs/performance.md`` records its output;
the tensor codec's default compressor comes from it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import blosc2
import numpy as np
import torch

try:
    import lz4.frame
    import zstandard
except ImportError as exc:
    raise ImportError(f"benchmarks.codec_choice needs {exc.name}, which the package does not "
                      "install: pip install -e \".[bench]\"") from exc


def _adam_versions(params: int = 4_000_000, steps: int = 12) -> list[dict[str, np.ndarray]]:
    """Raw state (params + Adam moments) after each of ``steps`` real Adam updates."""
    torch.manual_seed(0)
    width = int((params / 3) ** 0.5)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
        torch.nn.ReLU(), torch.nn.Linear(width, width),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    out = []
    for _ in range(steps):
        x = torch.randn(64, width)
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state: dict[str, np.ndarray] = {}
        for i, p in enumerate(model.parameters()):
            state[f"p{i}"] = p.detach().numpy().copy()
            st = opt.state[p]
            state[f"m{i}"] = st["exp_avg"].numpy().copy()
            state[f"v{i}"] = st["exp_avg_sq"].numpy().copy()
        out.append(state)
    return out


def _np_shuffle(raw: np.ndarray, itemsize: int) -> bytes:
    return raw.view(np.uint8).reshape(-1, itemsize).T.tobytes()


def _candidates() -> dict[str, Callable[[np.ndarray], bytes]]:
    z1 = zstandard.ZstdCompressor(level=1)
    z3 = zstandard.ZstdCompressor(level=3)
    def b2(codec: blosc2.Codec, level: int) -> Callable[[np.ndarray], bytes]:
        def run(a: np.ndarray) -> bytes:
            return bytes(blosc2.compress2(a.tobytes(), typesize=a.itemsize, clevel=level, codec=codec,
                                          filters=[blosc2.Filter.SHUFFLE], nthreads=1))
        return run
    return {
        "numpy-shuffle+zstd-1": lambda a: z1.compress(_np_shuffle(a, a.itemsize)),
        "numpy-shuffle+zstd-3": lambda a: z3.compress(_np_shuffle(a, a.itemsize)),
        "numpy-shuffle+lz4": lambda a: lz4.frame.compress(_np_shuffle(a, a.itemsize)),
        "blosc2-shuffle+zstd-1": b2(blosc2.Codec.ZSTD, 1),
        "blosc2-shuffle+zstd-3": b2(blosc2.Codec.ZSTD, 3),
        "blosc2-shuffle+lz4-5": b2(blosc2.Codec.LZ4, 5),
        "blosc2-shuffle+blosclz-5": b2(blosc2.Codec.BLOSCLZ, 5),
    }


def main() -> None:
    versions = _adam_versions()
    deltas = []
    for prev, new in zip(versions[1:], versions[2:], strict=False):
        deltas.append({k: (new[k].view(np.uint32) ^ prev[k].view(np.uint32)) for k in new})
    raw = sum(a.nbytes for d in deltas for a in d.values())
    print(f"{len(deltas)} XOR deltas of real Adam steps, {raw / 1e6:.0f} MB raw (params+moments)")
    print(f"{'candidate':28s} {'ratio':>7s} {'MB/s/core':>10s}")
    for name, fn in _candidates().items():
        times, sizes = [], 0
        for d in deltas:
            t0 = time.perf_counter()
            sizes += sum(len(fn(a)) for a in d.values())
            times.append(time.perf_counter() - t0)
        per = raw / len(deltas) / statistics.median(times) / 1e6
        print(f"{name:28s} {sizes / raw:7.3f} {per:10.0f}")


if __name__ == "__main__":
    main()
