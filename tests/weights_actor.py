"""An actor process for the weights-stream tests: follows a run's weights stream in bf16 until
it holds a given version, while a reader thread hashes the model inside ``reading()``.

``python -m tests.weights_actor LOG COORD RUN VERSION OUT``: writes OUT as JSON,
``{"version": V, "hash": H, "seen": [hashes the reader saw]}``."""

from __future__ import annotations

import json
import sys
import threading
import time

import torch
import xxhash

from eventlog import RunAddress
from replayer.weights_follower import WeightsFollower


def net() -> torch.nn.Module:
    """The actor's model: the trainer's architecture (tests.test_follower._net), in bf16."""
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                               torch.nn.Linear(32, 3)).to(torch.bfloat16)


def model_hash(state: dict[str, torch.Tensor]) -> str:
    """xxh3 of every tensor's bits, in key order."""
    h = xxhash.xxh3_64()
    for name, t in state.items():
        h.update(name.encode())
        h.update(t.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(log: str, coord: str, run: str, version: int, out: str) -> None:
    model, seen, stop = net(), set(), threading.Event()
    with WeightsFollower(RunAddress(log, coord, run), model, max_lag=2, name="actor-proc") as follower:

        def read() -> None:
            while not stop.is_set():
                with follower.reading() as m:
                    if follower.version:
                        seen.add(model_hash(m.state_dict()))
                time.sleep(0.001)

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 120
        while follower.version < version and time.monotonic() < deadline:
            follower.poll()
            time.sleep(0.05)
        stop.set()
        reader.join()
        result = {"version": follower.version, "hash": model_hash(model.state_dict()), "seen": sorted(seen)}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
