"""Stable-Baselines3 through ``rewind.integrations.sb3``: a run SIGKILLed five times and
resumed each time ends bit-equal to the same run never interrupted (PPO on CartPole, SAC on
Pendulum with a replay buffer that wraps), logs the same losses after every kill, and a
commit's replay-buffer bytes follow the transitions added, not the buffer's size."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import signal
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from stable_baselines3 import PPO, SAC
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback, CallbackList
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.save_util import recursive_getattr

from eventlog import RunAddress
from rewind import every_versions
from rewind.integrations.sb3 import RewindCallback
from tests.killchain import buffer_bytes, kill_chain, run_child

# Its module-scoped fixture is built once: every test of the file on one xdist worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_integration_sb3")]

PPO_TOTAL = 32 * 20  # timesteps: 20 rollouts of 32 steps
SAC_TOTAL = 320
SAC_BUFFER = 100  # wraps at timestep 100
SAC_EVERY = 16  # SAC commits every 16 rollouts (env steps)


# ---------------------------------------------------------------------- the child trainer
def _model(cfg: dict[str, Any]) -> BaseAlgorithm:
    if cfg["algo"] == "ppo":
        env = make_vec_env("CartPole-v1", n_envs=1, seed=0)
        return PPO("MlpPolicy", env, n_steps=32, batch_size=16, n_epochs=2, seed=0, device="cpu",
                   policy_kwargs={"net_arch": [16]})
    env = make_vec_env("Pendulum-v1", n_envs=1, seed=0)
    return SAC("MlpPolicy", env, buffer_size=cfg["buffer"], learning_starts=cfg["learning_starts"],
               batch_size=16, seed=0, device="cpu", policy_kwargs={"net_arch": [16]})


def _digests(model: BaseAlgorithm) -> dict[str, str]:
    """sha256 of every piece of state whose bits decide the run's future."""
    items: dict[str, bytes] = {}
    for k, t in model.policy.state_dict().items():
        items[f"policy/{k}"] = t.numpy().tobytes()
    names, variables = model._get_torch_save_params()
    for name in names[1:]:
        sd = recursive_getattr(model, name).state_dict()
        for i, s in sd["state"].items():
            for k, t in s.items():
                items[f"{name}/{i}/{k}"] = t.numpy().tobytes()
        items[f"{name}/groups"] = repr(sd["param_groups"]).encode()
    for name in variables:
        items[name] = recursive_getattr(model, name).detach().numpy().tobytes()
    items["rng/torch"] = torch.get_rng_state().numpy().tobytes()
    items["rng/numpy"] = repr(np.random.get_state()).encode()
    items["rng/python"] = repr(random.getstate()).encode()
    items["rng/action_space"] = repr(model.action_space.np_random.bit_generator.state).encode()
    raw = model.get_env().envs[0].unwrapped  # type: ignore[union-attr]
    items["env/np_random"] = repr(raw.np_random.bit_generator.state).encode()
    items["env/state"] = np.asarray(raw.state).tobytes()
    items["last_obs"] = np.asarray(model._last_obs).tobytes()
    items["counters"] = repr((model.num_timesteps, model._n_updates, model._episode_num)).encode()
    buffer = getattr(model, "replay_buffer", None)
    if buffer is not None:
        for k in ("observations", "next_observations", "actions", "rewards", "dones", "timeouts"):
            items[f"replay_buffer/{k}"] = getattr(buffer, k).tobytes()
        items["replay_buffer/pos"] = repr((buffer.pos, buffer.full)).encode()
    return {k: hashlib.sha256(v).hexdigest() for k, v in items.items()}


class _LossTap(BaseCallback):
    """Appends SB3's ``train/`` values after each update, tagged with the process's segment;
    writes what the resume found when training starts; SIGKILLs the process at ``kill_at``."""

    def __init__(self, cfg: dict[str, Any], rewind: RewindCallback | None) -> None:
        super().__init__()
        self.cfg, self.rewind, self.last = cfg, rewind, -1

    def _on_training_start(self) -> None:
        if self.rewind is not None:
            assert self.rewind.restored is not None
            buffer = getattr(self.model, "replay_buffer", None)
            with open(self.cfg["out"] + ".restored", "w") as f:
                json.dump({"fresh": self.rewind.restored.fresh, "t": self.model.num_timesteps,
                           "full": bool(buffer is not None and buffer.full),
                           "snapshot": self.rewind.restored.snapshot is not None}, f)

    def _tap(self) -> None:
        values = {k: float(v) for k, v in self.model.logger.name_to_value.items() if k.startswith("train/")}
        if values and self.model.num_timesteps != self.last:
            self.last = self.model.num_timesteps
            with open(self.cfg["losses"], "a") as f:
                f.write(json.dumps({"seg": self.cfg["seg"], "t": self.last, "train": values}) + "\n")

    def _on_rollout_start(self) -> None:
        self._tap()

    def _on_training_end(self) -> None:
        self._tap()

    def _on_step(self) -> bool:
        if self.num_timesteps == self.cfg["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)
        return True


def _child(cfg: dict[str, Any]) -> None:
    """One trainer process: PPO resumes by ``restore`` + ``learn(rest, reset_num_timesteps=
    False)``, SAC by ``learn(total)`` alone (the callback restores inside ``learn``)."""
    try:
        torch.set_num_threads(1)
        os.environ["SB3_LOGDIR"] = str(Path(cfg["out"]).parent / "sb3")  # not a folder in /tmp
        model = _model(cfg)
        rewind = None
        if cfg["record"]:
            snapshots = every_versions(cfg["snapshot_every"]) if cfg.get("snapshot_every") else None
            rewind = RewindCallback(RunAddress(cfg["url"], cfg["url"], cfg["run"]), every=cfg["every"],
                                    snapshots=snapshots)
        tap = _LossTap(cfg, rewind)
        callbacks = CallbackList([c for c in (rewind, tap) if c is not None])
        total = PPO_TOTAL if cfg["algo"] == "ppo" else SAC_TOTAL
        if cfg["algo"] == "ppo" and rewind is not None:
            model = rewind.restore(model)
            model.learn(total - model.num_timesteps, callback=callbacks, reset_num_timesteps=False)
        else:
            model.learn(total, callback=callbacks)
        if rewind is not None:
            rewind.close()
        Path(cfg["out"]).write_text(json.dumps(_digests(model)))
    except BaseException:
        Path(cfg["out"] + ".error").write_text(traceback.format_exc())
        raise


# ---------------------------------------------------------------------- the parent's side
@pytest.fixture(scope="module")
def trainers() -> Iterator[multiprocessing.context.ForkServerContext]:
    """Children forked from one server that imported torch and SB3 once (no torch work
    before the fork), each a fresh process that can be SIGKILLed."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    yield ctx


def _run(ctx: multiprocessing.context.ForkServerContext, cfg: dict[str, Any]) -> int | None:
    return run_child(ctx, _child, cfg)


def _kill_chain(ctx: multiprocessing.context.ForkServerContext, tmp_path: Path, base: dict[str, Any],
                kills: list[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return kill_chain(ctx, _child, tmp_path, base, kills)


def _check_resumes(restored: list[dict[str, Any]], kills: list[int], every: int) -> None:
    assert restored[0]["fresh"]
    for kill_at, found in zip(kills, restored[1:], strict=True):
        # Commits are asynchronous: a kill may cut the newest one or two short.
        assert not found["fresh"] and kill_at - 3 * every <= found["t"] <= kill_at


def test_ppo_on_cartpole_killed_five_times_ends_bit_equal(
    trainers: multiprocessing.context.ForkServerContext, tmp_path: Path,
) -> None:
    rng = random.Random(24)
    kills = sorted(rng.sample(range(40, PPO_TOTAL - 8), 5))
    restored, expected = _kill_chain(trainers, tmp_path, {"algo": "ppo", "every": 1}, kills)
    _check_resumes(restored, kills, 32)
    assert len(expected) == PPO_TOTAL // 32  # one train() per rollout, each logged once


def test_sac_on_pendulum_with_a_wrapping_buffer_killed_five_times_ends_bit_equal(
    trainers: multiprocessing.context.ForkServerContext, tmp_path: Path,
) -> None:
    rng = random.Random(25)
    before_wrap = rng.sample(range(40, SAC_BUFFER), 3)
    kills = sorted(before_wrap + rng.sample(range(SAC_BUFFER + 40, SAC_TOTAL - 10), 2))
    base = {"algo": "sac", "every": SAC_EVERY, "buffer": SAC_BUFFER, "learning_starts": 30,
            "snapshot_every": 4}
    restored, _ = _kill_chain(trainers, tmp_path, base, kills)
    _check_resumes(restored, kills, SAC_EVERY)
    assert sum(r["full"] for r in restored) >= 2  # resumed with a buffer that had wrapped
    assert any(r["snapshot"] for r in restored)  # the buffer came back from a snapshot + the log tail


def test_a_commit_logs_the_transitions_added_not_the_buffer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """50 transitions into an 8x larger buffer cost the same bytes per commit: about their
    raw size (Pendulum's floats barely compress), whatever the buffer's."""
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    monkeypatch.setenv("SB3_LOGDIR", str(tmp_path / "sb3"))
    per_commit = {}
    torch.set_num_threads(1)
    for size in (2_000, 16_000):
        # Learning never starts: the buffer is all that changes between commits.
        model = _model({"algo": "sac", "buffer": size, "learning_starts": 10_000})
        with RewindCallback(RunAddress(url, url, f"b{size}"), every=50) as rewind:
            model.learn(300, callback=rewind)
        sizes = buffer_bytes(url, f"b{size}")
        assert sorted(sizes) == list(range(1, 8))  # timesteps 0, 50, ..., 300
        per_commit[size] = [sizes[v] for v in range(2, 8)]  # each added 50 transitions
    assert isinstance(model, SAC) and model.replay_buffer is not None
    buffer = model.replay_buffer
    row = sum(getattr(buffer, k)[0].nbytes for k in ("observations", "next_observations", "actions",
                                                      "rewards", "dones", "timeouts"))
    assert all(0.5 * 50 * row < b < 1.5 * 50 * row for b in per_commit[2_000] + per_commit[16_000])
    assert max(per_commit[16_000]) < 1.25 * min(per_commit[2_000])
