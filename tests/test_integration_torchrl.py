"""TorchRL through ``rewind.integrations.torchrl``: a DQN loop on CartPole (``Collector``,
``ReplayBuffer``, ``DQNLoss`` with a target network, ``HardUpdate`` or ``SoftUpdate``, an
annealed epsilon-greedy policy), and a SAC loop on Pendulum, SIGKILLed at three points of an
iteration and resumed each time end bit-equal to the same loop never interrupted and log the
same losses after every kill, with the buffer on a ``LazyTensorStorage`` or a
``LazyMemmapStorage``; a commit's
replay-buffer bytes follow the rows added, not the buffer's size; what cannot be restored
exactly is refused."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tensordict.nn import NormalParamExtractor, TensorDictModule, TensorDictSequential
from torchrl.collectors import Collector
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    ListStorage,
    ReplayBuffer,
    TensorDictPrioritizedReplayBuffer,
)
from torchrl.envs import GymEnv, SerialEnv, StepCounter, TransformedEnv
from torchrl.modules import MLP, EGreedyModule, ProbabilisticActor, QValueActor, TanhNormal, ValueOperator
from torchrl.objectives import DQNLoss, HardUpdate, LossModule, SACLoss, SoftUpdate
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
    loss: LossModule
    updater: TargetNetUpdater
    optimizers: dict[str, torch.optim.Optimizer]
    collector: Collector
    buffer: ReplayBuffer
    explore: Callable[[int], None]  # after each batch: the exploration's annealing


def _make_env(name: str = "CartPole-v1") -> TransformedEnv:
    env = TransformedEnv(GymEnv(name), StepCounter())
    env.set_seed(0)
    return env


_Parts = tuple[Any, LossModule, TargetNetUpdater, dict[str, torch.optim.Optimizer], Callable[[int], None]]


def _dqn(env: TransformedEnv, frames: int, hard: bool) -> _Parts:
    actor = QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"],
                        spec=env.action_spec)
    greedy = EGreedyModule(env.action_spec, eps_init=1.0, eps_end=0.05, annealing_num_steps=frames * 20)
    loss = DQNLoss(actor, action_space=env.action_spec, delay_value=True)
    updater = HardUpdate(loss, value_network_update_interval=4) if hard else SoftUpdate(loss, eps=0.9)
    return (TensorDictSequential(actor, greedy), loss, updater,
            {"optimizer": torch.optim.Adam(loss.parameters(), lr=1e-3)}, greedy.step)


def _sac(env: TransformedEnv) -> _Parts:
    net = torch.nn.Sequential(MLP(in_features=3, out_features=2, num_cells=[16]), NormalParamExtractor())
    policy = ProbabilisticActor(TensorDictModule(net, in_keys=["observation"], out_keys=["loc", "scale"]),
                                in_keys=["loc", "scale"], spec=env.action_spec, distribution_class=TanhNormal,
                                distribution_kwargs={"low": -2.0, "high": 2.0})
    q = ValueOperator(MLP(in_features=4, out_features=1, num_cells=[16]), in_keys=["observation", "action"])
    loss = SACLoss(policy, q, num_qvalue_nets=2)
    optimizers = {"actor": torch.optim.Adam(loss.actor_network_params.flatten_keys().values(), lr=1e-3),
                  "critic": torch.optim.Adam(loss.qvalue_network_params.flatten_keys().values(), lr=1e-3),
                  "alpha": torch.optim.Adam([loss.log_alpha], lr=1e-3)}
    return policy, loss, SoftUpdate(loss, tau=0.05), optimizers, lambda frames: None


def _loop(algo: str, storage: str, scratch: str | None = None, buffer: int = BUFFER, frames: int = FRAMES,
          iterations: int = ITERATIONS) -> _Loop:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    env = _make_env("CartPole-v1" if algo == "dqn" else "Pendulum-v1")
    policy, loss, updater, optimizers, explore = (_dqn(env, frames, hard=storage == "tensor") if algo == "dqn"
                                                  else _sac(env))
    collector = Collector(env, policy, frames_per_batch=frames, total_frames=frames * iterations,
                          auto_register_policy_transforms=False)
    store = (LazyTensorStorage(buffer) if storage == "tensor"
             else LazyMemmapStorage(buffer, scratch_dir=scratch, existsok=True))
    buffer_ = ReplayBuffer(storage=store, batch_size=8)
    return _Loop(env, loss, updater, optimizers, collector, buffer_, explore)


def _update(loop: _Loop, kill: Callable[[], None]) -> float:
    """One optimizer step of every optimizer on a sampled batch; returns the summed loss."""
    out = loop.loss(loop.buffer.sample())
    value = sum(v for k, v in out.items() if k.startswith("loss"))
    for opt in loop.optimizers.values():
        opt.zero_grad()
    value.backward()
    kill()
    for opt in loop.optimizers.values():
        opt.step()
    loop.updater.step()
    return float(value.item())


def _digests(loop: _Loop) -> dict[str, str]:
    """sha256 of every piece of state whose bits decide the loop's future."""
    items: dict[str, bytes] = {}
    for prefix, module in (("loss", loop.loss), ("policy", loop.collector.policy)):
        for k, t in module.state_dict().items():
            items[f"{prefix}/{k}"] = t.numpy().tobytes()
    for name, opt in loop.optimizers.items():
        sd = opt.state_dict()
        for i, s in sd["state"].items():
            for k, t in s.items():
                items[f"{name}/{i}/{k}"] = t.numpy().tobytes()
        items[f"{name}/groups"] = repr(sd["param_groups"]).encode()
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
        loop = _loop(cfg["algo"], cfg["storage"], cfg.get("scratch"))
        rewind = None
        if cfg["record"]:
            snapshots = every_versions(cfg["snapshot_every"]) if cfg.get("snapshot_every") else None
            rewind = RewindTorchRL(RunAddress(cfg["url"], cfg["url"], cfg["run"]), collector=loop.collector,
                                   loss=loop.loss, optimizers=loop.optimizers, buffer=loop.buffer,
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
            losses = [_update(loop, lambda: kill(i, "backward")) for _ in range(UPDATES)]  # noqa: B023
            loop.explore(data.numel())
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


@pytest.mark.parametrize(("algo", "storage"), [("dqn", "tensor"), ("dqn", "memmap"), ("sac", "tensor")])
def test_a_loop_killed_three_times_ends_bit_equal(
    trainers: multiprocessing.context.ForkServerContext, tmp_path: Path, algo: str, storage: str,
) -> None:
    """DQN on CartPole with HardUpdate (LazyTensorStorage) or SoftUpdate (LazyMemmapStorage),
    SAC on Pendulum with three optimizers and SoftUpdate."""
    # In an update, right after a commit, and as a batch arrives (the buffer has wrapped).
    kills = [[9, "backward"], [17, "committed"], [25, "collected"]]
    base: dict[str, Any] = {"algo": algo, "storage": storage, "scratch": str(tmp_path / "scratch")}
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
        loop = _loop("dqn", "tensor", buffer=size, frames=64, iterations=6)
        with RewindTorchRL(RunAddress(url, url, f"b{size}"), collector=loop.collector, loss=loop.loss,
                           optimizers=loop.optimizers, buffer=loop.buffer, every=1) as rewind:
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
    # A buffer 8x larger: a commit of the whole buffer would cost 8x; of its new rows, about the
    # same (compression of the rows' bits varies with where they fall in the chunks).
    assert max(per_commit[8_000]) < 2 * min(per_commit[1_000])


def test_the_last_iteration_is_committed_and_a_finished_run_trains_nothing(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    torch.set_num_threads(1)
    steps = []
    for _ in range(2):
        loop = _loop("dqn", "tensor", iterations=6)
        with RewindTorchRL(RunAddress(url, url, "done"), collector=loop.collector, loss=loop.loss,
                           optimizers=loop.optimizers, buffer=loop.buffer, every=4) as rewind:
            for i, data in enumerate(loop.collector, rewind.restore()):
                loop.buffer.extend(data)
                if (future := rewind.step(i)) is not None:
                    steps.append(future.result().step)
    assert steps == [4, 6]  # every 4 iterations, and the 6th: the collector's total_frames
    assert rewind.restored is not None and rewind.restored.step == 6 and len(loop.buffer) == 6 * FRAMES


def test_what_cannot_be_restored_exactly_is_refused(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    address = RunAddress(url, url, "refused")
    loop = _loop("dqn", "tensor")
    args: dict[str, Any] = {"collector": loop.collector, "loss": loop.loss, "optimizers": loop.optimizers}
    cases = [
        ({"buffer": ReplayBuffer(storage=ListStorage(10))}, "LazyMemmapStorage, not ListStorage"),
        ({"buffer": ReplayBuffer(storage=LazyTensorStorage(10), batch_size=4, prefetch=2)}, "prefetches"),
        ({"buffer": TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(10))},
         "cannot record the replay buffer's PrioritizedSampler"),
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
