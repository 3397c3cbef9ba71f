"""TorchRL through ``rewind.integrations.torchrl``: a DQN loop on CartPole (``Collector``,
``ReplayBuffer``, ``DQNLoss`` with a target network, ``HardUpdate`` or ``SoftUpdate``, an
annealed epsilon-greedy policy) SIGKILLed at three points of an iteration and resumed each
time ends bit-equal to the same loop never interrupted and logs the same losses after every
kill, with its buffer on a ``LazyTensorStorage`` or a ``LazyMemmapStorage``; a commit's
replay-buffer bytes follow the rows added, not the buffer's size; what cannot be restored
exactly is refused."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict.nn import TensorDictSequential
from torchrl.collectors import Collector
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, ListStorage, ReplayBuffer
from torchrl.envs import GymEnv, SerialEnv, StepCounter, TransformedEnv
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, HardUpdate, SoftUpdate
from torchrl.objectives.utils import TargetNetUpdater

from eventlog import RunAddress
from eventlog.errors import ConfigError
from rewind import every_versions
from rewind.integrations.torchrl import RewindTorchRL
from tests.killchain import buffer_bytes, forkserver, kill_chain, reporting

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_integration_torchrl")]

FRAMES = 16  # frames per collector iteration
ITERATIONS = 30
BUFFER = 200  # rows: wraps at iteration 12
EVERY = 3  # iterations per commit
UPDATES = 2  # optimizer steps per iteration


# ---------------------------------------------------------------------- the training loop
@dataclass
class _Loop:
    env: TransformedEnv
    greedy: EGreedyModule
    loss: DQNLoss
    updater: TargetNetUpdater
    optimizer: torch.optim.Optimizer
    collector: Collector
    buffer: ReplayBuffer


def _make_env() -> TransformedEnv:
    env = TransformedEnv(GymEnv("CartPole-v1"), StepCounter())
    env.set_seed(0)
    return env


def _loop(storage: str, scratch: str | None = None, buffer: int = BUFFER, frames: int = FRAMES,
          iterations: int = ITERATIONS) -> _Loop:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    env = _make_env()
    actor = QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"],
                        spec=env.action_spec)
    greedy = EGreedyModule(env.action_spec, eps_init=1.0, eps_end=0.05, annealing_num_steps=frames * 20)
    loss = DQNLoss(actor, action_space=env.action_spec, delay_value=True)
    updater: TargetNetUpdater = (HardUpdate(loss, value_network_update_interval=4) if storage == "tensor"
                                 else SoftUpdate(loss, eps=0.9))
    optimizer = torch.optim.Adam(loss.parameters(), lr=1e-3)
    collector = Collector(env, TensorDictSequential(actor, greedy), frames_per_batch=frames,
                          total_frames=frames * iterations, auto_register_policy_transforms=False)
    store = (LazyTensorStorage(buffer) if storage == "tensor"
             else LazyMemmapStorage(buffer, scratch_dir=scratch, existsok=True))
    return _Loop(env, greedy, loss, updater, optimizer, collector, ReplayBuffer(storage=store, batch_size=8))


def _digests(loop: _Loop) -> dict[str, str]:
    """sha256 of every piece of state whose bits decide the loop's future."""
    items: dict[str, bytes] = {}
    for prefix, module in (("loss", loop.loss), ("policy", loop.collector.policy)):
        for k, t in module.state_dict().items():
            items[f"{prefix}/{k}"] = t.numpy().tobytes()
    sd = loop.optimizer.state_dict()
    for i, s in sd["state"].items():
        for k, t in s.items():
            items[f"adam/{i}/{k}"] = t.numpy().tobytes()
    items["adam/groups"] = repr(sd["param_groups"]).encode()
    items["updater"] = repr(loop.updater.state_dict()).encode()
    items["rng/torch"] = torch.get_rng_state().numpy().tobytes()
    items["rng/numpy"] = repr(np.random.get_state()).encode()
    items["rng/python"] = repr(random.getstate()).encode()
    raw = loop.env.base_env._env.unwrapped
    items["env/np_random"] = repr(raw.np_random.bit_generator.state).encode()
    items["env/state"] = np.asarray(raw.state).tobytes()
    items["env/elapsed"] = repr(loop.env.base_env._env._elapsed_steps).encode()
    c = loop.collector
    for k, t in c._carrier.items(include_nested=True, leaves_only=True):
        items[f"carrier/{k}"] = t.numpy().tobytes()
    items["collector"] = repr((c._frames, c._iter, c._traj_pool.state_dict())).encode()
    rows = len(loop.buffer)
    for k, t in loop.buffer[:rows].items(include_nested=True, leaves_only=True):
        items[f"replay_buffer/{k}"] = t.numpy().tobytes()
    items["replay_buffer/writer"] = repr(loop.buffer._writer.state_dict()).encode()
    return {k: hashlib.sha256(v).hexdigest() for k, v in items.items()}


def _files(loop: _Loop) -> list[str]:
    """The files of a memmap storage's tensors (none for a storage in memory)."""
    store = loop.buffer._storage._storage
    if not isinstance(loop.buffer._storage, LazyMemmapStorage) or store is None:
        return []
    return sorted(str(t.filename) for t in store.values(True, True))


def _child(cfg: dict[str, Any]) -> None:
    """One trainer process: the loop a TorchRL user writes, with ``RewindTorchRL`` in it when
    ``cfg["record"]``; SIGKILLs itself at ``cfg["kill_at"]`` (``[iteration, where]``)."""
    with reporting(cfg):
        torch.set_num_threads(1)
        loop = _loop(cfg["storage"], cfg.get("scratch"))
        rewind = None
        if cfg["record"]:
            snapshots = every_versions(cfg["snapshot_every"]) if cfg.get("snapshot_every") else None
            rewind = RewindTorchRL(RunAddress(cfg["url"], cfg["url"], cfg["run"]), collector=loop.collector,
                                   loss=loop.loss, optimizers=loop.optimizer, buffer=loop.buffer,
                                   updater=loop.updater, every=EVERY, snapshots=snapshots)
        start = rewind.restore() if rewind is not None else 0
        found = rewind.restored if rewind is not None else None
        Path(cfg["out"] + ".restored").write_text(json.dumps({
            "fresh": found is None or found.fresh, "t": start, "full": len(loop.buffer) == BUFFER,
            "snapshot": found is not None and found.snapshot is not None, "files": _files(loop)}))

        def kill(i: int, where: str) -> None:
            if cfg["kill_at"] == [i, where]:
                os.kill(os.getpid(), signal.SIGKILL)

        for i, data in enumerate(loop.collector, start):
            kill(i, "collected")
            loop.buffer.extend(data)
            losses = []
            for _ in range(UPDATES):
                value = loop.loss(loop.buffer.sample())["loss"]
                loop.optimizer.zero_grad()
                value.backward()
                kill(i, "backward")
                loop.optimizer.step()
                loop.updater.step()
                losses.append(value.item())
            loop.greedy.step(data.numel())
            with open(cfg["losses"], "a") as f:
                f.write(json.dumps({"seg": cfg["seg"], "t": i, "train": losses}) + "\n")
            if rewind is not None:
                rewind.step(i)
            kill(i, "committed")
        if rewind is not None:
            rewind.close()
        Path(cfg["out"]).write_text(json.dumps(_digests(loop)))


# ---------------------------------------------------------------------- the parent's side
@pytest.fixture(scope="module")
def trainers() -> multiprocessing.context.ForkServerContext:
    """Trainer processes forked from a server that imported torch and TorchRL once."""
    return forkserver(__name__)


def _check(restored: list[dict[str, Any]], kills: list[list[Any]]) -> None:
    assert restored[0]["fresh"]
    for (kill_at, _), found in zip(kills, restored[1:], strict=True):
        # Commits are asynchronous: a kill may cut the newest one short.
        assert not found["fresh"] and kill_at - 3 * EVERY <= found["t"] <= kill_at + 1


@pytest.mark.parametrize("storage", ["tensor", "memmap"])
def test_dqn_on_cartpole_killed_three_times_ends_bit_equal(
    trainers: multiprocessing.context.ForkServerContext, tmp_path: Path, storage: str,
) -> None:
    # In an update, right after a commit, and as a batch arrives (the buffer has wrapped).
    kills = [[9, "backward"], [17, "committed"], [25, "collected"]]
    base: dict[str, Any] = {"storage": storage, "scratch": str(tmp_path / "scratch")}
    if storage == "memmap":
        base["snapshot_every"] = 3
    restored, expected = kill_chain(trainers, _child, tmp_path, base, kills)
    _check(restored, kills)
    assert len(expected) == ITERATIONS
    assert restored[-1]["full"]  # resumed with a buffer that had wrapped
    if storage == "memmap":
        assert any(r["snapshot"] for r in restored)  # the buffer came back from a snapshot + the log tail
        # Each resume refilled the storage's own files, in its scratch_dir (the contents were recorded).
        scratch = base["scratch"] + os.sep
        for found in restored[1:]:
            assert found["files"] and all(f.startswith(scratch) for f in found["files"]), found["files"]


def test_a_commit_logs_the_rows_added_not_the_buffer(tmp_path: Path) -> None:
    """64 rows added cost the same bytes per commit in a buffer of 1,000 rows or of 8,000."""
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    torch.set_num_threads(1)
    per_commit = {}
    for size in (1_000, 8_000):
        loop = _loop("tensor", buffer=size, frames=64, iterations=6)
        with RewindTorchRL(RunAddress(url, url, f"b{size}"), collector=loop.collector, loss=loop.loss,
                           optimizers=loop.optimizer, buffer=loop.buffer, every=1) as rewind:
            for i, data in enumerate(loop.collector):
                loop.buffer.extend(data)
                rewind.step(i)
        sizes = buffer_bytes(url, f"b{size}")
        assert sorted(sizes) == list(range(1, 7))
        per_commit[size] = [sizes[v] for v in range(2, 7)]  # each added 64 rows
    storage = loop.buffer._storage._storage
    row = sum(t[0].nbytes for t in storage.values(include_nested=True, leaves_only=True))
    # About the raw size of the rows added (new floats XORed with what the rows held barely
    # compress), a small part of even the smaller buffer.
    assert all(0.25 * 64 * row < b < 1.5 * 64 * row for b in per_commit[1_000] + per_commit[8_000])
    assert max(per_commit[8_000]) < 1.25 * min(per_commit[1_000])


def test_the_last_iteration_is_committed_and_a_finished_run_trains_nothing(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    torch.set_num_threads(1)
    steps = []
    for _ in range(2):
        loop = _loop("tensor", iterations=6)
        with RewindTorchRL(RunAddress(url, url, "done"), collector=loop.collector, loss=loop.loss,
                           optimizers=loop.optimizer, buffer=loop.buffer, every=4) as rewind:
            for i, data in enumerate(loop.collector, rewind.restore()):
                loop.buffer.extend(data)
                if (future := rewind.step(i)) is not None:
                    steps.append(future.result().step)
    assert steps == [4, 6]  # every 4 iterations, and the 6th: the collector's total_frames
    assert rewind.restored is not None and rewind.restored.step == 6 and len(loop.buffer) == 6 * FRAMES


def test_what_cannot_be_restored_exactly_is_refused(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    address = RunAddress(url, url, "refused")
    loop = _loop("tensor")
    args: dict[str, Any] = {"collector": loop.collector, "loss": loop.loss, "optimizers": loop.optimizer}
    cases = [
        ({"buffer": ReplayBuffer(storage=ListStorage(10))}, "LazyMemmapStorage, not ListStorage"),
        ({"buffer": ReplayBuffer(storage=LazyTensorStorage(10), batch_size=4, prefetch=2)}, "prefetches"),
        ({"every": 0}, "every=0"),
        ({"extra": {"collector": loop.updater}}, "'collector' is the adapter's own"),
    ]
    for given, message in cases:
        with pytest.raises(ConfigError, match=message):
            RewindTorchRL(address, **{**args, **given})
    serial = Collector(SerialEnv(1, _make_env), loop.collector.policy, frames_per_batch=4, total_frames=8,
                       auto_register_policy_transforms=False)
    with pytest.raises(ConfigError, match="cannot record a batched env \\(SerialEnv\\)"):
        RewindTorchRL(address, **{**args, "collector": serial})
    serial.shutdown()
    by_trajectory = Collector(_make_env(), loop.collector.policy, frames_per_batch=4, total_frames=8,
                              trajs_per_batch=2, auto_register_policy_transforms=False)
    with pytest.raises(ConfigError, match="trajs_per_batch"):
        RewindTorchRL(address, **{**args, "collector": by_trajectory})
    with pytest.raises(ConfigError, match="single-process Collector, not list"):
        RewindTorchRL(address, **{**args, "collector": []})
