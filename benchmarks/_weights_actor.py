"""One actor process of ``python -m benchmarks --only weights`` (not run by hand).

    python -m benchmarks._weights_actor sync LOG COORD RUN PARAMS KIND
    python -m benchmarks._weights_actor follow LOG COORD RUN PARAMS VERSION
    python -m benchmarks._weights_actor load PATH

``sync``: build the benchmark's model (bf16 for ``KIND=weights``, fp32 for ``KIND=full``, the
full-state follower), take the bare process's ``VmRSS``, sync once and print the peak above
it (``VmHWM``) and the sync's seconds. ``follow``: sync, print ``ready``, then poll until the
follower holds ``VERSION``, and print when each version was applied (wall clock) and what
applying it took. ``load``: time ``torch.load`` of a state dict. Each prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from benchmarks.memory import reset_peak, status_kib
from benchmarks.model import linear_stack, shape_for
from eventlog import RunAddress

#: Seconds between a follower's polls while it waits for the next version.
POLL_S = 0.005


def actor_model(params: int, dtype: torch.dtype) -> torch.nn.Module:
    """The benchmark's architecture at ``params`` parameters, in ``dtype``."""
    torch.manual_seed(1)
    return linear_stack(*shape_for(params)).to(dtype)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's tensors."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def sync(address: RunAddress, params: int, kind: str) -> dict[str, Any]:
    """One first sync, with the process's peak memory above the bare model."""
    from replayer.follower import Follower
    from replayer.weights_follower import WeightsFollower

    model = actor_model(params, torch.bfloat16 if kind == "weights" else torch.float32)
    baseline = status_kib("VmRSS")
    reset = reset_peak()
    t0 = time.perf_counter()
    with (WeightsFollower(address, model, dtype=torch.bfloat16) if kind == "weights"
          else Follower(address, model)) as follower:
        result = follower.poll()
        seconds = time.perf_counter() - t0
    return {"model_bytes": model_bytes(model), "peak_bytes": (status_kib("VmHWM") - baseline) * 1024,
            "peak_reset": reset, "seconds": seconds, "mode": result.mode, "version": result.version_after}


def follow(address: RunAddress, params: int, until: int) -> dict[str, Any]:
    """Sync, say ``ready``, then note when each version up to ``until`` was applied."""
    from replayer.weights_follower import WeightsFollower

    applied: list[dict[str, float]] = []
    with WeightsFollower(address, actor_model(params, torch.bfloat16), dtype=torch.bfloat16,
                         max_lag=1 << 20) as follower:
        follower.poll()
        print("ready", flush=True)
        deadline = time.monotonic() + 600
        while follower.version < until and time.monotonic() < deadline:
            result = follower.poll()
            if result.version_after > result.version_before:
                applied.append({"version": result.version_after, "at": time.time(),
                                "seconds": result.seconds, "versions": result.versions_applied})
            else:
                time.sleep(POLL_S)
    return {"applied": applied}


def load(path: str) -> dict[str, Any]:
    """``torch.load`` of a state dict, timed."""
    t0 = time.perf_counter()
    state = torch.load(path, weights_only=True)
    return {"seconds": time.perf_counter() - t0, "tensors": len(state)}


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "load":
        out = load(argv[1])
    else:
        address = RunAddress(argv[1], argv[2], argv[3])
        out = sync(address, int(argv[4]), argv[5]) if mode == "sync" else follow(address, int(argv[4]),
                                                                                 int(argv[5]))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
