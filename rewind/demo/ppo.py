"""PPO on CartPole-v1 for ``rewind demo``: the config, the model, the sampler, the updates.

Everything a resumed run needs is a ``Stateful`` object (:meth:`PPOTrainer.state_objects`)
plus the process-wide RNGs, which the recorder captures itself (``rng=True``, the library's
``GlobalRng``): torch's (action sampling), Python's ``random`` (per-episode reset seeds)
and numpy's (the sticky-action coin). Continuing from a restored copy of all of these gives
the same bits as never having stopped; :meth:`PPOTrainer.state_digest` shows it.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical

from eventlog.capture import GlobalRng, Stateful
from eventlog.errors import ConfigError
from rewind.demo.digest import digest_of
from rewind.demo.env import N_ACTIONS, OBS_DIM, CartPoleState, check_format, require

__all__ = ["ActorCritic", "MinibatchSampler", "PPOConfig", "PPOTrainer"]

_SAMPLER_STATE_FORMAT = 2


@dataclass(frozen=True)
class PPOConfig:
    """Hyperparameters of one PPO run. Frozen: a run's config never changes mid-run.

    ``updates`` is the length of the learning-rate schedule (LinearLR decays from ``lr`` to
    ``lr * lr_end_factor`` over ``updates`` scheduler steps); a resumed run must use the
    same config to be bit-exact.
    """

    seed: int = 0
    updates: int = 60
    rollout_steps: int = 256
    epochs: int = 4
    minibatch_size: int = 64
    hidden: int = 64
    lr: float = 3e-3
    lr_end_factor: float = 0.1
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    # Sticky actions (Machado et al., 2018): with this probability the env repeats the
    # previously executed action instead of the policy's. The coin comes from numpy's
    # global RNG and is drawn on every step, even when the probability is 0, so the RNG
    # stream does not depend on this value.
    sticky_action_prob: float = 0.05
    # Intra-op threads for torch. 1 makes results independent of the host's core count
    # (see PPOTrainer.__init__) and is also the fastest choice for a model this small.
    num_threads: int = 1

    def __post_init__(self) -> None:
        # Fail at construction with a message naming the field, not deep inside an update.
        for name in ("updates", "rollout_steps", "epochs", "minibatch_size", "hidden", "num_threads"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"PPOConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.minibatch_size > self.rollout_steps:
            raise ConfigError(f"PPOConfig.minibatch_size ({self.minibatch_size}) exceeds "
                              f"rollout_steps ({self.rollout_steps})")
        if not 0.0 <= self.sticky_action_prob < 1.0:
            raise ConfigError(f"PPOConfig.sticky_action_prob must be in [0, 1), "
                              f"got {self.sticky_action_prob}")

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON data."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "PPO config") -> PPOConfig:
        """Rebuild a config; unknown keys are an error so a config mismatch is never silent."""
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"{where}: unknown PPOConfig field(s): {', '.join(unknown)}")
        return cls(**dict(data))


class ActorCritic(nn.Module):
    """Separate policy and value MLPs (tanh) for CartPole: obs 4 -> logits 2, value 1.

    Separate trunks because a shared trunk lets the value loss disturb the policy features,
    which hurts PPO on CartPole at this size. Orthogonal init as in the PPO reference
    implementations; it draws from torch's global RNG, which the trainer seeds first.
    """

    def __init__(self, hidden: int = 64, obs_dim: int = OBS_DIM, n_actions: int = N_ACTIONS) -> None:
        super().__init__()
        self.actor = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
            nn.Linear(hidden, n_actions),
        )
        self.critic = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
            nn.Linear(hidden, 1),
        )
        for seq, last_gain in ((self.actor, 0.01), (self.critic, 1.0)):
            linears = [m for m in seq if isinstance(m, nn.Linear)]
            for i, layer in enumerate(linears):
                gain = last_gain if i == len(linears) - 1 else math.sqrt(2.0)
                nn.init.orthogonal_(layer.weight, gain=gain)
                nn.init.zeros_(layer.bias)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(logits [B, n_actions], value [B])`` for a batch of observations."""
        return self.actor(obs), self.critic(obs).squeeze(-1)


class MinibatchSampler:
    """Shuffled minibatch indices from a private ``torch.Generator``.

    A private generator (instead of torch's global RNG) keeps the minibatch order
    independent of how many actions were sampled, and gives the log a separate, small
    "sampler cursor" state. The sampler is resumable mid-epoch: its state holds the
    generator, the permutation being consumed and the cursor into it.
    """

    def __init__(self, seed: int, batch_size: int, minibatch_size: int) -> None:
        if not 0 < minibatch_size <= batch_size:
            raise ConfigError(f"minibatch_size {minibatch_size} not in (0, {batch_size}]")
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        self.minibatch_size = int(minibatch_size)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(self.seed)
        self.epochs_drawn = 0  # permutations drawn so far (a monotone cursor)
        self.cursor = 0  # position inside the current permutation
        self._perm: torch.Tensor | None = None  # the permutation being consumed, if any

    def minibatches(self) -> Iterator[torch.Tensor]:
        """Yield one epoch of minibatch index tensors (int64), continuing a started epoch.

        A trailing partial minibatch is dropped (rollout_steps is a multiple of the
        minibatch size in the default config, so normally nothing is dropped).
        """
        if self._perm is None:
            self._perm = torch.randperm(self.batch_size, generator=self.generator)
            self.epochs_drawn += 1
            self.cursor = 0
        while self.cursor + self.minibatch_size <= self.batch_size:
            idx = self._perm[self.cursor : self.cursor + self.minibatch_size]
            self.cursor += self.minibatch_size
            yield idx
        self._perm = None
        self.cursor = 0

    def state_dict(self) -> dict[str, Any]:
        """Generator state, cursor and the permutation being consumed."""
        return {
            "format": _SAMPLER_STATE_FORMAT,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "minibatch_size": self.minibatch_size,
            "generator": self.generator.get_state(),
            "epochs_drawn": self.epochs_drawn,
            "cursor": self.cursor,
            "permutation": None if self._perm is None else self._perm.clone(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict` output (also after the codec's round trip)."""
        owner = "MinibatchSampler"
        check_format(state, _SAMPLER_STATE_FORMAT, owner)
        for key in ("batch_size", "minibatch_size"):
            if int(require(state, key, owner)) != getattr(self, key):
                raise ValueError(f"{owner}: {key} mismatch: state has {state[key]}, "
                                 f"sampler has {getattr(self, key)}")
        self.seed = int(require(state, "seed", owner))
        generator = require(state, "generator", owner)
        self.generator.set_state(torch.as_tensor(generator, dtype=torch.uint8).clone())
        self.epochs_drawn = int(require(state, "epochs_drawn", owner))
        self.cursor = int(require(state, "cursor", owner))
        perm = require(state, "permutation", owner)
        self._perm = None if perm is None else torch.as_tensor(perm, dtype=torch.int64).clone()


def _seed_global_rngs(seed: int) -> None:
    """Put all three global RNGs in a defined state derived from ``seed``."""
    torch.manual_seed(seed)
    random.seed(seed)
    # numpy's legacy seeding only accepts 32-bit seeds.
    np.random.seed(seed % 2**32)


class PPOTrainer:
    """PPO on CartPole-v1, built from a :class:`PPOConfig`; all state is restorable.

    Construction seeds the three global RNGs, so building a trainer and then loading a
    saved state (objects from :meth:`state_objects` plus the global RNG states) gives
    exactly the trainer that was saved. Training is bit-exact across processes only with
    the same torch intra-op thread count (``config.num_threads``); the process that trains
    pins it, as the demo's trainer process does.
    """

    def __init__(self, config: PPOConfig | None = None) -> None:
        self.config = config or PPOConfig()
        cfg = self.config
        _seed_global_rngs(cfg.seed)
        self.model = ActorCritic(cfg.hidden)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr, eps=1e-5)
        # LinearLR, not LambdaLR: its state_dict is plain numbers (lambdas can't be stored).
        self.scheduler = torch.optim.lr_scheduler.LinearLR(
            self.optimizer, start_factor=1.0, end_factor=cfg.lr_end_factor, total_iters=cfg.updates
        )
        # Distinct derived seeds so the sampler and env streams don't mirror each other
        # or the global torch stream.
        self.sampler = MinibatchSampler(cfg.seed + 1_000_003, cfg.rollout_steps, cfg.minibatch_size)
        self.env = CartPoleState(seed=cfg.seed + 2_000_003)

    def state_objects(self) -> dict[str, Stateful]:
        """The Stateful pieces of the trainer (global RNGs are separate: rng=True)."""
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "sampler": self.sampler,
            "env": self.env,
        }

    def state_digest(self) -> str:
        """Digest of the whole training state: :meth:`state_objects` and the global RNGs.

        Consumes no randomness, so calling it never perturbs the run.
        """
        return digest_of({**self.state_objects(), "rng": GlobalRng()})

    @torch.no_grad()
    def _collect(self) -> dict[str, Any]:
        """Roll the policy out for ``rollout_steps`` env steps (actions from torch's RNG)."""
        cfg = self.config
        n = cfg.rollout_steps
        obs_buf = torch.zeros((n, OBS_DIM), dtype=torch.float32)
        act_buf = torch.zeros(n, dtype=torch.int64)
        logp_buf = torch.zeros(n, dtype=torch.float32)
        val_buf = np.zeros(n, dtype=np.float64)
        rew_buf = np.zeros(n, dtype=np.float64)
        done_buf = np.zeros(n, dtype=np.float64)
        finished: list[tuple[float, int]] = []
        for t in range(n):
            obs_t = torch.from_numpy(self.env.obs.copy()).unsqueeze(0)
            logits, value = self.model(obs_t)
            dist: Any = Categorical(logits=logits)  # torch leaves it untyped
            action = dist.sample()  # torch's global RNG
            obs_buf[t] = obs_t[0]
            act_buf[t] = action[0]
            logp_buf[t] = dist.log_prob(action)[0]
            val_buf[t] = float(value[0])
            # Drawn unconditionally so the numpy stream is independent of the probability.
            sticky = bool(np.random.random() < cfg.sticky_action_prob)
            res = self.env.step(int(action[0]), sticky=sticky)
            reward = res.reward
            if res.truncated and not res.terminated:
                # Time-limit truncation is not a real terminal: bootstrap from the value of
                # the final observation instead of treating it as worth 0.
                _, v_final = self.model(torch.from_numpy(res.obs.copy()).unsqueeze(0))
                reward += cfg.gamma * float(v_final[0])
            rew_buf[t] = reward
            if res.terminated or res.truncated:
                done_buf[t] = 1.0
                assert res.episode_return is not None and res.episode_length is not None
                finished.append((res.episode_return, res.episode_length))
                # Per-episode seeds from Python's RNG: every episode can be reproduced on
                # its own from one logged integer.
                self.env.reset(seed=random.getrandbits(32))
        _, last_value = self.model(torch.from_numpy(self.env.obs.copy()).unsqueeze(0))
        return {
            "obs": obs_buf,
            "actions": act_buf,
            "logp": logp_buf,
            "values": val_buf,
            "rewards": rew_buf,
            "dones": done_buf,
            "last_value": float(last_value[0]),
            "finished": finished,
        }

    def _gae(self, roll: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Generalized advantage estimation in float64, returned as float32 tensors."""
        cfg = self.config
        values, rewards, dones = roll["values"], roll["rewards"], roll["dones"]
        n = len(rewards)
        adv = np.zeros(n, dtype=np.float64)
        last = 0.0
        for t in reversed(range(n)):
            next_value = roll["last_value"] if t == n - 1 else values[t + 1]
            nonterminal = 1.0 - dones[t]
            delta = rewards[t] + cfg.gamma * next_value * nonterminal - values[t]
            last = delta + cfg.gamma * cfg.gae_lambda * nonterminal * last
            adv[t] = last
        returns = adv + values
        return (
            torch.from_numpy(adv.astype(np.float32)),
            torch.from_numpy(returns.astype(np.float32)),
        )

    def run_update(self, update_index: int) -> dict[str, float]:
        """Run one PPO update: rollout, GAE, epochs x minibatches of clipped PPO, LR step.

        ``update_index`` is only reported back (all state lives in the state objects), so
        a resumed run calls this with the next index. Returns float-only metrics that are
        deterministic (no wall-clock values), so a replayed run reproduces them exactly.
        """
        cfg = self.config
        lr_used = float(self.optimizer.param_groups[0]["lr"])
        roll = self._collect()
        advantages, returns = self._gae(roll)
        obs, actions, old_logp = roll["obs"], roll["actions"], roll["logp"]

        sums = {"loss": 0.0, "policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0,
                "approx_kl": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0}
        n_mb = 0
        for _ in range(cfg.epochs):
            for idx in self.sampler.minibatches():
                logits, value = self.model(obs[idx])
                dist: Any = Categorical(logits=logits)  # torch leaves it untyped
                logp = dist.log_prob(actions[idx])
                entropy = dist.entropy().mean()
                log_ratio = logp - old_logp[idx]
                ratio = log_ratio.exp()
                mb_adv = advantages[idx]
                # Per-minibatch normalization, as in the reference PPO implementations.
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(
                    -mb_adv * ratio, -mb_adv * ratio.clamp(1.0 - cfg.clip, 1.0 + cfg.clip)
                ).mean()
                v_loss = 0.5 * (value - returns[idx]).pow(2).mean()
                loss = pg_loss + cfg.vf_coef * v_loss - cfg.ent_coef * entropy

                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.optimizer.step()

                with torch.no_grad():
                    sums["loss"] += float(loss)
                    sums["policy_loss"] += float(pg_loss)
                    sums["value_loss"] += float(v_loss)
                    sums["entropy"] += float(entropy)
                    # k3 estimator of KL(old || new): unbiased, low variance, >= 0.
                    sums["approx_kl"] += float(((ratio - 1.0) - log_ratio).mean())
                    sums["clip_fraction"] += float(((ratio - 1.0).abs() > cfg.clip).float().mean())
                    sums["grad_norm"] += float(grad_norm)
                n_mb += 1
        self.scheduler.step()

        finished = roll["finished"]
        if finished:
            ep_return = sum(r for r, _ in finished) / len(finished)
            ep_length = sum(n for _, n in finished) / len(finished)
        elif self.env.last_episode_return is not None and self.env.last_episode_length is not None:
            # No episode ended in this rollout (a good policy outlives it): report the most
            # recent finished episode rather than NaN.
            ep_return = float(self.env.last_episode_return)
            ep_length = float(self.env.last_episode_length)
        else:
            ep_return = float(self.env.episode_return)
            ep_length = float(self.env.episode_length)
        metrics = {k: v / max(n_mb, 1) for k, v in sums.items()}
        metrics.update(
            update=float(update_index),
            lr=lr_used,
            episode_return_mean=float(ep_return),
            episode_length_mean=float(ep_length),
            episodes_finished=float(len(finished)),
            env_steps=float((update_index + 1) * cfg.rollout_steps),
        )
        return metrics

    def close(self) -> None:
        """Release the environment."""
        self.env.close()
