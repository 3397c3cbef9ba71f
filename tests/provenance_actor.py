"""An RL actor process for the provenance tests: follows a run with ``Follower`` and answers
each request on stdin with one rollout stamped with ``Follower.stamp()``.

``python -m tests.provenance_actor LOG COORD RUN EVERY``: each stdin line is the newest
version the learner has committed. On every ``EVERY``-th request (the first included) the
actor polls until it holds that version; otherwise it acts with the policy it holds (a
lagging actor). It answers with a JSON line ``{"stamp": hex of Stamp.pack(), "rollout": hex
of the float32 bits of the policy's output on a fixed observation}``.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from eventlog import RunAddress
from replayer.follower import Follower

OBS = torch.linspace(-1.0, 1.0, 4 * 6).reshape(4, 6)


def policy() -> torch.nn.Module:
    """The learner's architecture (its initial values do not matter to a follower)."""
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def main(log: str, coord: str, run: str, every: int) -> None:
    with Follower(RunAddress(log, coord, run), policy(), name=f"actor-every-{every}") as follower:
        for i, line in enumerate(sys.stdin):
            newest = int(line)
            deadline = time.monotonic() + 60
            while i % every == 0 and follower.version < newest:
                if time.monotonic() > deadline:
                    raise SystemExit(f"actor: version {newest} did not arrive in 60 s")
                follower.poll()
            with follower.reading() as model, torch.no_grad():
                stamp = follower.stamp()
                rollout = model(OBS).contiguous()
            bits = rollout.reshape(-1).view(torch.uint8).numpy().tobytes()
            sys.stdout.write(json.dumps({"stamp": stamp.pack().hex(), "rollout": bits.hex()}) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
