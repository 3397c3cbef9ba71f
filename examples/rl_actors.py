"""Asynchronous RL with a weights stream: a learner records, actors follow the bf16 stream.

    python examples/rl_actors.py [--actors 2] [--updates 8] [--dir DIR] [--json OUT]

The learner trains a small CartPole policy (REINFORCE, fp32, Adam) and records every update
with a ``Recorder`` that also publishes each version it commits to the run's weights stream
(``weights=torch.bfloat16``): cast to bfloat16 from its own copy, as a patch. Each actor process holds only
a bfloat16 copy of the policy: a ``WeightsFollower`` keeps it at the newest published
version, exact to the cast, and ``stamp()`` names the run, version and digest of the weights
each rollout was made with. The learner refuses a rollout from a version it never sealed,
records each update with the stamp of the rollout it learned from (``commit(consumed=...)``:
``rewind verify`` checks it, ``rewind history --json`` reports the policy lag), and prints
each rollout's staleness (versions behind the learner). Runs on the embedded log in
``--dir`` (a temporary directory by default), or on Kafka + Redis with ``--log``/``--coord``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rewind import Recorder, RunAddress, Stamp, WeightsFollower

OBS, ACTIONS, HIDDEN = 4, 2, 64
#: The longest an actor or the learner waits for the other side (the example is bounded).
WAIT_S = 60.0
#: How long an actor waits for a version newer than the one it last acted with.
NEWER_WAIT_S = 2.0


def policy() -> torch.nn.Module:
    """The policy's architecture (the learner's in fp32, the actors' in bf16)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(OBS, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, ACTIONS))


def rollout(model: torch.nn.Module, env: Any, seed: int) -> dict[str, list[Any]]:
    """One CartPole episode with ``model`` (actions sampled from its logits)."""
    gen = torch.Generator().manual_seed(seed)
    obs, _ = env.reset(seed=seed)
    out: dict[str, list[Any]] = {"obs": [], "actions": [], "rewards": []}
    done = False
    while not done:
        with torch.no_grad():
            logits = model(torch.as_tensor(obs, dtype=torch.float32).to(torch.bfloat16)).float()
        action = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        out["obs"].append([float(x) for x in obs])
        out["actions"].append(action)
        obs, reward, terminated, truncated, _ = env.step(action)
        out["rewards"].append(float(reward))
        done = terminated or truncated
    return out


def actor(index: int, run: RunAddress, rollouts: int, results: Any) -> None:
    """An actor process: follow the bf16 stream, send ``rollouts`` stamped rollouts."""
    import gymnasium as gym

    env = gym.make("CartPole-v1")
    model = policy().to(torch.bfloat16)
    with WeightsFollower(run, model, dtype=torch.bfloat16, name=f"actor-{index}") as follower:
        version = 0
        for n in range(rollouts):
            # Bounded staleness: wait (a little) for a version newer than the last one used.
            until = time.monotonic() + (WAIT_S if version == 0 else NEWER_WAIT_S)
            while follower.poll().version_after <= version and time.monotonic() < until:
                time.sleep(0.02)
            with follower.reading() as m:  # one whole version while the episode runs
                stamp = follower.stamp()
                episode = rollout(m, env, seed=1000 * index + n)
            version = stamp.version
            results.put({"actor": index, "stamp": stamp.to_wire(), **episode})
    results.put({"actor": index, "done": True})


def reinforce(model: torch.nn.Module, opt: torch.optim.Optimizer, episode: dict[str, Any]) -> float:
    """One REINFORCE update on an episode; returns its return."""
    rewards = torch.tensor(episode["rewards"])
    returns = rewards.flip(0).cumsum(0).flip(0)
    returns = (returns - returns.mean()) / (returns.std() + 1e-6) if len(returns) > 1 else returns
    logits = model(torch.tensor(episode["obs"]))
    logp = torch.log_softmax(logits, -1)[torch.arange(len(rewards)), torch.tensor(episode["actions"])]
    loss = -(logp * returns).sum()
    opt.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return float(rewards.sum())


def learn(run: RunAddress, actors: int, updates: int) -> dict[str, Any]:
    """The learner: record ``updates`` updates from the actors' rollouts, each version
    published in bf16; returns what it saw."""
    model = policy()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    per_actor = -(-updates // actors)  # every update has a rollout to learn from
    procs = [ctx.Process(target=actor, args=(i, run, per_actor, results)) for i in range(actors)]
    seen: list[dict[str, Any]] = []
    with Recorder(run, model, opt, rng=False, weights=torch.bfloat16) as rec:
        sealed = {rec.commit(0, wait=True).result().version}
        for p in procs:
            p.start()
        try:
            finished = 0
            while finished < actors:
                msg = results.get(timeout=WAIT_S)
                if msg.get("done"):
                    finished += 1
                    continue
                stamp = Stamp.from_wire(msg["stamp"], f"rollout of actor {msg['actor']}")
                if stamp.version not in sealed:
                    raise RuntimeError(f"actor {msg['actor']} acted with version {stamp.version}, "
                                       f"which the learner never sealed")
                ret = reinforce(model, opt, msg)
                stale = rec.version - stamp.version
                done = rec.commit(len(seen) + 1, {"return": ret}, wait=True, consumed=[stamp])
                sealed.add(done.result().version)
                seen.append({"actor": msg["actor"], "version": stamp.version, "digest": stamp.digest,
                             "kind": stamp.kind, "return": ret, "staleness": stale})
                print(f"actor {msg['actor']}: return {ret:5.1f} with version {stamp.version} "
                      f"(stale by {stale}); learner at version {rec.version}", flush=True)
        finally:
            for p in procs:
                p.join(timeout=WAIT_S)
                if p.is_alive():
                    p.kill()
        bad = [p.exitcode for p in procs if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"actor processes exited with {bad}")
        return {"sealed": sorted(sealed), "rollouts": seen}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--actors", type=int, default=2, help="actor processes (default 2)")
    ap.add_argument("--updates", type=int, default=8, help="rollouts the learner learns from (default 8)")
    ap.add_argument("--dir", type=Path, help="the embedded log's directory (default: a temporary one)")
    ap.add_argument("--log", help="log URL (kafka://host:port); with --coord")
    ap.add_argument("--coord", help="coordinator URL (redis://host:port/0)")
    ap.add_argument("--run", default="rl-actors", help="run id (default rl-actors)")
    ap.add_argument("--json", type=Path, help="write what the learner saw here")
    a = ap.parse_args(argv)
    if a.actors < 1 or a.updates < 1:
        ap.error("--actors and --updates must be >= 1")
    if a.dir is not None:
        a.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rewind-rl-") as tmp:
        url = f"sqlite://{(a.dir or Path(tmp)) / 'rewind.db'}"
        run = RunAddress(a.log or url, a.coord or url, a.run)
        seen = learn(run, a.actors, a.updates)
    versions = sorted({r["version"] for r in seen["rollouts"]})
    print(f"{len(seen['rollouts'])} rollouts from {a.actors} actors, acting with versions "
          f"{versions[0]}..{versions[-1]}; the learner sealed {len(seen['sealed'])} versions")
    if a.json:
        a.json.write_text(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
