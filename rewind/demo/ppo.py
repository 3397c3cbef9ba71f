"""The PPO trainer behind ``rewind demo``: CartPole-v1, CPU, bit-exactly resumable.

This module is deliberately self-contained (torch, numpy and gymnasium only) so the demo
and the crash/recovery tests have a real RL workload to record and replay. Everything
that a resumed run needs is exposed as ``Stateful`` objects (``state_dict()`` /
``load_state_dict()``) plus the three global RNGs:

* ``model`` (:class:`ActorCritic`), ``optimizer`` (``torch.optim.Adam``) and
  ``scheduler`` (``torch.optim.lr_scheduler.LinearLR``, whose state is plain data);
* ``sampler`` (:class:`MinibatchSampler`), the minibatch order, driven by its own
  ``torch.Generator``;
* ``env`` (:class:`CartPoleState`), the complete environment state, as plain data;
* the global RNGs: torch (action sampling), Python ``random`` (per-episode reset seeds)
  and numpy (the sticky-action coin).

Continuing from a restored copy of all of the above gives the same bits as never having
stopped; :meth:`PPOTrainer.state_digest` proves it. No pickle is used anywhere: every
state that is not a tensor is made of dict/list/str/int/float/bool/None/bytes, so it
survives msgpack.

CLI::

    python -m rewind.demo.ppo --run-dir DIR --updates N --seed S [--digest-file F]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import random
import signal
import struct
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import gymnasium as gym
import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical

from eventlog import RunAddress
from replayer.replay import restorer
from rewind.recorder import Recorder
from snapshotter.policies import every_versions, keep_last
from snapshotter.service import Snapshotter, SnapshotterConfig, start_background
from snapshotter.store import SnapshotStore

__all__ = [
    "ENV_ID",
    "ActorCritic",
    "CartPoleState",
    "MinibatchSampler",
    "PPOConfig",
    "PPOTrainer",
    "RunResult",
    "Stateful",
    "get_global_rng_state",
    "main",
    "make_recorder",
    "run",
    "set_global_rng_state",
]

ENV_ID = "CartPole-v1"
OBS_DIM = 4
N_ACTIONS = 2

# Version tags inside the plain-data states, so a future layout change fails loudly
# instead of silently loading the wrong thing.
_ENV_STATE_FORMAT = 1
_SAMPLER_STATE_FORMAT = 1
_RNG_STATE_FORMAT = 1

# msgpack integers are limited to [-2**63, 2**64); numpy's PCG64 state holds 128-bit ints.
_MSGPACK_INT_MIN = -(2**63)
_MSGPACK_INT_MAX = 2**64 - 1


@runtime_checkable
class Stateful(Protocol):
    """Anything whose complete state round-trips through ``state_dict``/``load_state_dict``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PPOConfig:
    """Hyperparameters of one PPO run. Frozen: a run's config never changes mid-run.

    ``updates`` is the length of the learning-rate schedule (LinearLR decays from ``lr`` to
    ``lr * lr_end_factor`` over ``updates`` scheduler steps). A driver may run fewer
    updates than that, but a resumed run must use the same config to be bit-exact.
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
        positive = ("updates", "rollout_steps", "epochs", "minibatch_size", "hidden")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"PPOConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.minibatch_size > self.rollout_steps:
            raise ValueError(
                f"PPOConfig.minibatch_size ({self.minibatch_size}) exceeds "
                f"rollout_steps ({self.rollout_steps})"
            )
        if not 0.0 <= self.sticky_action_prob < 1.0:
            raise ValueError(
                f"PPOConfig.sticky_action_prob must be in [0, 1), got {self.sticky_action_prob}"
            )
        if self.num_threads < 1:
            raise ValueError(f"PPOConfig.num_threads must be >= 1, got {self.num_threads}")

    def to_dict(self) -> dict[str, Any]:
        """The config as plain JSON/msgpack-able data."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PPOConfig:
        """Rebuild a config; unknown keys are an error so a config mismatch is never silent."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown PPOConfig field(s): {', '.join(unknown)}")
        return cls(**dict(data))


# --------------------------------------------------------------------------------------
# Plain-data helpers (no pickle: everything becomes msgpack-able Python data)
# --------------------------------------------------------------------------------------


def _array_to_plain(a: np.ndarray) -> dict[str, Any]:
    """Exact encoding of a numpy array: dtype string, shape and the raw little-endian bytes."""
    a = np.ascontiguousarray(a)
    le = a.astype(a.dtype.newbyteorder("<"), copy=False)
    return {"dtype": le.dtype.str, "shape": list(a.shape), "data": le.tobytes()}


def _array_from_plain(d: Mapping[str, Any]) -> np.ndarray:
    """Inverse of :func:`_array_to_plain`; returns a fresh, writable, native-order array."""
    dtype = np.dtype(d["dtype"])
    arr = np.frombuffer(bytes(d["data"]), dtype=dtype).reshape([int(s) for s in d["shape"]])
    return arr.astype(dtype.newbyteorder("="), copy=True)


def _bitgen_to_plain(obj: Any) -> Any:
    """Make a numpy bit-generator state msgpack-able.

    PCG64 states contain 128-bit integers (msgpack stops at 64 bits) and MT19937 states
    contain arrays, so both get an explicit tagged encoding; everything else passes through.
    """
    if isinstance(obj, dict):
        return {str(k): _bitgen_to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_bitgen_to_plain(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return {"$ndarray": _array_to_plain(obj)}
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        v = int(obj)
        if _MSGPACK_INT_MIN <= v <= _MSGPACK_INT_MAX:
            return v
        return {"$bigint": str(v)}
    if isinstance(obj, (float, np.floating)):
        return float(obj)
    if obj is None or isinstance(obj, (str, bytes)):
        return obj
    raise TypeError(f"cannot encode {type(obj).__name__} in a bit-generator state")


def _bitgen_from_plain(obj: Any) -> Any:
    """Inverse of :func:`_bitgen_to_plain`."""
    if isinstance(obj, dict):
        if set(obj) == {"$bigint"}:
            return int(obj["$bigint"])
        if set(obj) == {"$ndarray"}:
            return _array_from_plain(obj["$ndarray"])
        return {k: _bitgen_from_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_bitgen_from_plain(v) for v in obj]
    return obj


def _require(state: Mapping[str, Any], key: str, owner: str) -> Any:
    """Fetch a required key, with an error that says which state lacks what."""
    try:
        return state[key]
    except KeyError:
        raise KeyError(f"{owner} state is missing key {key!r}") from None


def _check_format(state: Mapping[str, Any], expected: int, owner: str) -> None:
    fmt = _require(state, "format", owner)
    if fmt != expected:
        raise ValueError(f"{owner} state has format {fmt!r}; this code reads format {expected}")


# --------------------------------------------------------------------------------------
# Global RNGs
# --------------------------------------------------------------------------------------


def get_global_rng_state() -> dict[str, Any]:
    """Capture torch's, numpy's and Python's global RNG states as plain msgpack-able data."""
    np_state = np.random.get_state(legacy=True)
    assert isinstance(np_state, tuple)  # legacy=True always yields the MT19937 tuple
    name, key, pos, has_gauss, cached_gaussian = np_state
    py_version, py_internal, py_gauss_next = random.getstate()
    return {
        "format": _RNG_STATE_FORMAT,
        "torch": torch.get_rng_state().numpy().tobytes(),
        "numpy": {
            "bit_generator": str(name),
            "key": _array_to_plain(np.asarray(key, dtype=np.uint32)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": {
            "version": int(py_version),
            "internal": [int(x) for x in py_internal],
            "gauss_next": py_gauss_next,
        },
    }


def set_global_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the three global RNGs from :func:`get_global_rng_state` output (lists OK)."""
    _check_format(state, _RNG_STATE_FORMAT, "global RNG")
    torch_bytes = bytes(_require(state, "torch", "global RNG"))
    # bytearray: torch.frombuffer needs a writable buffer to avoid a warning; clone detaches.
    torch.set_rng_state(torch.frombuffer(bytearray(torch_bytes), dtype=torch.uint8).clone())
    nps = _require(state, "numpy", "global RNG")
    np.random.set_state(
        (
            str(nps["bit_generator"]),
            _array_from_plain(nps["key"]),
            int(nps["pos"]),
            int(nps["has_gauss"]),
            float(nps["cached_gaussian"]),
        )
    )
    pys = _require(state, "python", "global RNG")
    internal = tuple(int(x) for x in pys["internal"])  # msgpack gives a list back
    random.setstate((int(pys["version"]), internal, pys["gauss_next"]))


def _seed_global_rngs(seed: int) -> None:
    """Put all three global RNGs in a defined state derived from ``seed``."""
    torch.manual_seed(seed)
    random.seed(seed)
    # numpy's legacy seeding only accepts 32-bit seeds.
    np.random.seed(seed % 2**32)


# --------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------


class ActorCritic(nn.Module):
    """Separate policy and value MLPs (tanh) for CartPole: obs 4 -> logits 2, value 1.

    Separate trunks because a shared trunk lets the value loss disturb the policy features,
    which hurts PPO on CartPole at this size. Orthogonal init as in the PPO reference
    implementations; it draws from torch's global RNG, which the trainer seeds first.
    """

    def __init__(self, hidden: int = 64, obs_dim: int = OBS_DIM, n_actions: int = N_ACTIONS):
        super().__init__()
        self.actor = nn.Sequential(
            nn.Linear(obs_dim, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, n_actions),
        )
        self.critic = nn.Sequential(
            nn.Linear(obs_dim, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
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


# --------------------------------------------------------------------------------------
# Environment adapter
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepResult:
    """What one env step produced. ``obs`` is the observation *after* the step (for a
    finished episode: the final observation, before any reset)."""

    obs: np.ndarray
    reward: float
    terminated: bool
    truncated: bool
    executed_action: int
    episode_return: float | None  # set when this step finished an episode
    episode_length: int | None


class CartPoleState:
    """Stateful wrapper of ``gymnasium.make("CartPole-v1")`` whose state is complete.

    ``state_dict()`` captures everything that influences future steps, as plain data:
    the physics state (float64, exact bytes), ``steps_beyond_terminated``, the TimeLimit
    wrapper's elapsed steps, the OrderEnforcing "has reset" flag, the env's ``np_random``
    bit-generator state (and the seed it reports), the current observation (float32
    bytes), the previously executed action (for sticky actions) and the episode counters.

    Not captured: the action/observation spaces' own RNGs. This trainer never calls
    ``space.sample()``, so they never influence a run.
    """

    def __init__(self, seed: int, env_id: str = ENV_ID):
        # The passive env checker only adds one-shot "has it been checked" flags that would
        # be more state to carry; the env is a stock one, so the checker buys nothing.
        self.env_id = env_id
        self.env = gym.make(env_id, disable_env_checker=True)
        self._time_limit, self._order_enforcing = self._find_wrappers()
        obs, _ = self.env.reset(seed=seed)
        self.obs: np.ndarray = np.asarray(obs, dtype=np.float32)
        self.prev_action: int | None = None
        self.episode_return = 0.0
        self.episode_length = 0
        self.episodes_completed = 0
        self.last_episode_return: float | None = None
        self.last_episode_length: int | None = None

    def _find_wrappers(self) -> tuple[Any, Any]:
        """Walk ``.env`` from the outermost wrapper to find the stateful wrappers."""
        time_limit = order = None
        w: Any = self.env
        while True:
            if hasattr(w, "_elapsed_steps") and time_limit is None:
                time_limit = w
            if hasattr(w, "_has_reset") and order is None:
                order = w
            if not hasattr(w, "env"):
                break
            w = w.env
        if time_limit is None:
            raise RuntimeError(f"{self.env_id}: no TimeLimit wrapper found (gymnasium changed?)")
        return time_limit, order

    def _wrapper_chain(self) -> list[str]:
        names: list[str] = []
        w: Any = self.env
        while True:
            names.append(type(w).__name__)
            if not hasattr(w, "env"):
                return names
            w = w.env

    @property
    def unwrapped(self) -> Any:
        """The raw ``CartPoleEnv`` under the wrappers."""
        return self.env.unwrapped

    def reset(self, seed: int | None = None) -> np.ndarray:
        """Start a new episode (``seed=None`` continues the env's own RNG stream)."""
        obs, _ = self.env.reset(seed=seed)
        self.obs = np.asarray(obs, dtype=np.float32)
        self.prev_action = None
        self.episode_return = 0.0
        self.episode_length = 0
        return self.obs

    def step(self, action: int, sticky: bool = False) -> StepResult:
        """Step the env. With ``sticky`` the previously executed action is repeated.

        Does not reset at episode end: the caller needs the final observation first (to
        bootstrap a truncated episode) and decides how to seed the next episode.
        """
        executed = self.prev_action if (sticky and self.prev_action is not None) else action
        obs, reward, terminated, truncated, _ = self.env.step(executed)
        self.obs = np.asarray(obs, dtype=np.float32)
        self.prev_action = int(executed)
        self.episode_return += float(reward)
        self.episode_length += 1
        done = bool(terminated) or bool(truncated)
        ep_ret: float | None = None
        ep_len: int | None = None
        if done:
            ep_ret, ep_len = self.episode_return, self.episode_length
            self.episodes_completed += 1
            self.last_episode_return = ep_ret
            self.last_episode_length = ep_len
        return StepResult(
            obs=self.obs,
            reward=float(reward),
            terminated=bool(terminated),
            truncated=bool(truncated),
            executed_action=int(executed),
            episode_return=ep_ret,
            episode_length=ep_len,
        )

    def state_dict(self) -> dict[str, Any]:
        """The complete env state as plain msgpack-able data (see the class docstring)."""
        u = self.unwrapped
        physics = None if u.state is None else _array_to_plain(np.asarray(u.state))
        seed_attr = getattr(u, "_np_random_seed", None)  # gymnasium >= 1.0 only
        return {
            "format": _ENV_STATE_FORMAT,
            "env_id": self.env_id,
            "gymnasium": gym.__version__,
            "wrappers": self._wrapper_chain(),
            "physics": physics,
            "steps_beyond_terminated": (
                None if u.steps_beyond_terminated is None else int(u.steps_beyond_terminated)
            ),
            "elapsed_steps": (
                None
                if self._time_limit._elapsed_steps is None
                else int(self._time_limit._elapsed_steps)
            ),
            "has_reset": (
                None if self._order_enforcing is None else bool(self._order_enforcing._has_reset)
            ),
            "np_random": _bitgen_to_plain(u.np_random.bit_generator.state),
            "np_random_seed": None if seed_attr is None else int(seed_attr),
            "obs": _array_to_plain(self.obs),
            "prev_action": self.prev_action,
            "episode_return": float(self.episode_return),
            "episode_length": int(self.episode_length),
            "episodes_completed": int(self.episodes_completed),
            "last_episode_return": (
                None if self.last_episode_return is None else float(self.last_episode_return)
            ),
            "last_episode_length": (
                None if self.last_episode_length is None else int(self.last_episode_length)
            ),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict` output (also after a msgpack round trip)."""
        owner = "CartPoleState"
        _check_format(state, _ENV_STATE_FORMAT, owner)
        env_id = _require(state, "env_id", owner)
        if env_id != self.env_id:
            raise ValueError(
                f"{owner}: state is for env {env_id!r}, this adapter is {self.env_id!r}"
            )
        wrappers = list(_require(state, "wrappers", owner))
        if wrappers != self._wrapper_chain():
            raise ValueError(
                f"{owner}: wrapper chain mismatch: state has {wrappers}, "
                f"this env has {self._wrapper_chain()} (gymnasium version or make() flags differ)"
            )
        u = self.unwrapped
        physics = _require(state, "physics", owner)
        u.state = None if physics is None else _array_from_plain(physics)
        sbt = _require(state, "steps_beyond_terminated", owner)
        u.steps_beyond_terminated = None if sbt is None else int(sbt)
        elapsed = _require(state, "elapsed_steps", owner)
        self._time_limit._elapsed_steps = None if elapsed is None else int(elapsed)
        has_reset = _require(state, "has_reset", owner)
        if self._order_enforcing is not None and has_reset is not None:
            self._order_enforcing._has_reset = bool(has_reset)
        bg_state = _bitgen_from_plain(_require(state, "np_random", owner))
        bg_name = bg_state.get("bit_generator")
        if type(u.np_random.bit_generator).__name__ != bg_name:
            # Different generator type than the one seeded at construction: build one.
            bit_gen_cls = getattr(np.random, str(bg_name))
            u.np_random = np.random.Generator(bit_gen_cls())
        u.np_random.bit_generator.state = bg_state
        seed = _require(state, "np_random_seed", owner)
        if hasattr(u, "_np_random_seed"):
            u._np_random_seed = None if seed is None else int(seed)
        self.obs = _array_from_plain(_require(state, "obs", owner)).astype(np.float32, copy=False)
        prev = _require(state, "prev_action", owner)
        self.prev_action = None if prev is None else int(prev)
        self.episode_return = float(_require(state, "episode_return", owner))
        self.episode_length = int(_require(state, "episode_length", owner))
        self.episodes_completed = int(_require(state, "episodes_completed", owner))
        last = _require(state, "last_episode_return", owner)
        self.last_episode_return = None if last is None else float(last)
        last_len = _require(state, "last_episode_length", owner)
        self.last_episode_length = None if last_len is None else int(last_len)

    def close(self) -> None:
        self.env.close()


# --------------------------------------------------------------------------------------
# Minibatch sampler
# --------------------------------------------------------------------------------------


class MinibatchSampler:
    """Shuffled minibatch indices from a private ``torch.Generator``.

    A private generator (instead of torch's global RNG) keeps the minibatch order
    independent of how many actions were sampled, and gives the log a separate, small
    "sampler cursor" state. The sampler is resumable mid-epoch: its state holds the
    generator, the permutation being consumed and the cursor into it.
    """

    def __init__(self, seed: int, batch_size: int, minibatch_size: int):
        if not 0 < minibatch_size <= batch_size:
            raise ValueError(f"minibatch_size {minibatch_size} not in (0, {batch_size}]")
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
        """Generator bytes, cursor and in-flight permutation, as plain data."""
        return {
            "format": _SAMPLER_STATE_FORMAT,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "minibatch_size": self.minibatch_size,
            "generator": self.generator.get_state().numpy().tobytes(),
            "epochs_drawn": self.epochs_drawn,
            "cursor": self.cursor,
            "permutation": (
                None if self._perm is None else self._perm.numpy().astype("<i8").tobytes()
            ),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict` output (also after a msgpack round trip)."""
        owner = "MinibatchSampler"
        _check_format(state, _SAMPLER_STATE_FORMAT, owner)
        for key in ("batch_size", "minibatch_size"):
            if int(_require(state, key, owner)) != getattr(self, key):
                raise ValueError(
                    f"{owner}: {key} mismatch: state has {state[key]}, "
                    f"sampler has {getattr(self, key)}"
                )
        self.seed = int(_require(state, "seed", owner))
        gen_bytes = bytes(_require(state, "generator", owner))
        self.generator.set_state(torch.frombuffer(bytearray(gen_bytes), dtype=torch.uint8).clone())
        self.epochs_drawn = int(_require(state, "epochs_drawn", owner))
        self.cursor = int(_require(state, "cursor", owner))
        perm = _require(state, "permutation", owner)
        self._perm = (
            None
            if perm is None
            else torch.from_numpy(np.frombuffer(bytes(perm), dtype="<i8").astype(np.int64))
        )


# --------------------------------------------------------------------------------------
# Deterministic digest
# --------------------------------------------------------------------------------------


def _feed(h: Any, obj: Any) -> None:
    """Feed ``obj`` into hash ``h`` with an unambiguous, type-tagged, key-sorted encoding.

    Floats are hashed by their bit pattern (``float.hex``) and tensors/arrays by their raw
    bytes plus dtype and shape, so the digest changes iff some bit of the state changes.
    """
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        # reshape(-1) first: view(dtype) refuses 0-dim tensors whose element size differs.
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        h.update(b"T" + f"{t.dtype}|{tuple(t.shape)}|{len(raw)}|".encode())
        h.update(raw)
    elif isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        raw = a.tobytes()
        h.update(b"A" + f"{a.dtype.str}|{a.shape}|{len(raw)}|".encode())
        h.update(raw)
    elif isinstance(obj, Mapping):
        items = sorted(obj.items(), key=lambda kv: (type(kv[0]).__name__, str(kv[0])))
        h.update(b"D" + struct.pack("<q", len(items)))
        for k, v in items:
            _feed(h, k)
            _feed(h, v)
    elif isinstance(obj, (list, tuple)):
        h.update(b"L" + struct.pack("<q", len(obj)))
        for v in obj:
            _feed(h, v)
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        b = bytes(obj)
        h.update(b"B" + struct.pack("<q", len(b)) + b)
    elif isinstance(obj, str):
        b = obj.encode("utf-8")
        h.update(b"S" + struct.pack("<q", len(b)) + b)
    elif obj is None:
        h.update(b"N")
    elif isinstance(obj, (bool, np.bool_)):
        h.update(b"?1" if obj else b"?0")
    elif isinstance(obj, (int, np.integer)):
        h.update(b"I" + str(int(obj)).encode() + b"|")
    elif isinstance(obj, (float, np.floating)):
        h.update(b"F" + float(obj).hex().encode() + b"|")
    else:
        raise TypeError(f"state_digest: cannot hash {type(obj).__name__}")


def _digest(obj: Any) -> str:
    h = hashlib.sha256()
    _feed(h, obj)
    return h.hexdigest()


# --------------------------------------------------------------------------------------
# Trainer
# --------------------------------------------------------------------------------------


class PPOTrainer:
    """PPO on CartPole-v1, built from a :class:`PPOConfig`; all state is restorable.

    Construction seeds the three global RNGs, so building a trainer and then loading a
    saved state (objects from :meth:`state_objects` plus the global RNG states) gives
    exactly the trainer that was saved.
    """

    def __init__(self, config: PPOConfig | None = None):
        self.config = config or PPOConfig()
        cfg = self.config
        # Why one thread: CPU kernels split reductions and GEMMs by thread count, so the
        # float summation order (hence the result bits) may depend on it. Pinning it makes
        # a resumed run on a host with a different core count produce the same bits. For a
        # 64-unit MLP on 2 cores it is also faster (no fork/join overhead). This is a
        # process-wide setting; it is set here so every entry point gets it.
        torch.set_num_threads(cfg.num_threads)
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

    # -- state --------------------------------------------------------------------------

    def state_objects(self) -> dict[str, Any]:
        """The Stateful pieces of the trainer (global RNGs are separate: rng=True)."""
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "sampler": self.sampler,
            "env": self.env,
        }

    def component_digests(self) -> dict[str, str]:
        """sha256 per component; tells you *which* part diverged when digests differ."""
        return {
            "config": _digest(self.config.to_dict()),
            "model": _digest(self.model.state_dict()),  # params and buffers, by name
            "optimizer": _digest(self.optimizer.state_dict()),  # tensors + param_groups
            "scheduler": _digest(self.scheduler.state_dict()),
            "sampler": _digest(self.sampler.state_dict()),
            "env": _digest(self.env.state_dict()),
            "rng.torch": _digest(torch.get_rng_state()),
            "rng.numpy": _digest(np.random.get_state(legacy=True)),
            "rng.python": _digest(random.getstate()),
        }

    def state_digest(self) -> str:
        """One sha256 over the bit patterns of the whole training state.

        Covers model params/buffers, optimizer state tensors and param_groups, scheduler,
        sampler, env, the config, and torch/numpy/Python global RNG states. Consumes no
        randomness, so calling it never perturbs the run.
        """
        return _digest(self.component_digests())

    # -- training -------------------------------------------------------------------------

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
            dist = Categorical(logits=logits)
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
                dist = Categorical(logits=logits)
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
        self.env.close()


# --------------------------------------------------------------------------------------
# Driver and CLI
# --------------------------------------------------------------------------------------


def make_recorder(trainer: PPOTrainer, address: RunAddress) -> Recorder:
    """Plug Rewind's recorder into the trainer: every piece of state it owns is recorded,
    and a restore starts from the newest good snapshot plus the log tail."""
    return Recorder(
        address,
        model=trainer.model,
        optimizer=trainer.optimizer,
        scheduler=trainer.scheduler,
        sampler=trainer.sampler,
        rng=True,
        extra={"env": trainer.env},
        restorer=restorer(address),
    )


RecorderFactory = Callable[[PPOTrainer, Path], Any]


@dataclass
class RunResult:
    """Outcome of :func:`run`."""

    start_update: int  # first update run in this process (0 for a fresh run)
    end_update: int  # last update run (start_update - 1 if none ran)
    final_digest: str
    metrics: list[dict[str, float]]
    seconds: float


def _append_digest(path: Path, step: int, digest: str) -> None:
    # Open/append/close per line: the line is in the OS page cache before a simulated
    # SIGKILL, so the crash tests can trust the file.
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "digest": digest}) + "\n")


def _hard_kill() -> None:
    """Die like a crashed trainer: no finally blocks, no atexit, no flushing."""
    sys.stdout.flush()
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(137)


def run(
    config: PPOConfig,
    updates: int | None = None,
    recorder_factory: RecorderFactory | None = None,
    kill_at: int | None = None,
    digest_file: str | os.PathLike[str] | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    log: Callable[[str], None] | None = None,
) -> RunResult:
    """Train ``updates`` updates (default ``config.updates``), resuming if the recorder can.

    * ``recorder_factory(trainer, run_dir)`` returns a recorder or ``None`` (unrecorded).
      With a recorder, ``restore()`` decides the first update and every update is
      committed durably (``wait=True``) before the next starts.
    * ``kill_at=k``: SIGKILL this process during update ``k``, after computing it but
      before committing it or writing its digest line, i.e. the worst moment: the work is
      lost and a resumed run must redo update ``k`` and land on the same bits.
    * ``digest_file``: append ``{"step": u, "digest": ...}`` per completed update
      (append-only: a killed-then-resumed run leaves one line per update it completed).
    """
    total = config.updates if updates is None else int(updates)
    rdir = Path(run_dir) if run_dir is not None else Path(".")
    dpath = Path(digest_file) if digest_file is not None else None
    emit = log or (lambda _msg: None)

    # The trainer is built (and the global RNGs seeded) *before* restore(), so a restore
    # overwrites the seeded state instead of being overwritten by it.
    trainer = PPOTrainer(config)
    rec: Any = recorder_factory(trainer, rdir) if recorder_factory is not None else None
    start = 0
    if rec is not None:
        resume = rec.restore()
        start = 0 if resume.step is None else int(resume.step) + 1
        _write_json(rdir / "restore.json", {
            "step": resume.step, "version": resume.version, "applied": resume.applied,
            "skipped": resume.skipped, "seconds": resume.seconds, "source": resume.source,
        })
        emit(f"resuming after update {resume.step}" if resume.step is not None else "fresh run")

    all_metrics: list[dict[str, float]] = []
    t_start = time.perf_counter()
    for u in range(start, total):
        t0 = time.perf_counter()
        metrics = trainer.run_update(u)
        if kill_at is not None and u == kill_at:
            emit(f"kill_at={kill_at}: SIGKILL before committing update {u}")
            _hard_kill()
        if rec is not None:
            rec.commit(step=u, metrics=metrics, wait=True)
        if dpath is not None:
            _append_digest(dpath, u, trainer.state_digest())
        all_metrics.append(metrics)
        emit(
            f"update {u:4d}  return {metrics['episode_return_mean']:7.1f}  "
            f"loss {metrics['loss']:8.4f}  kl {metrics['approx_kl']:.4f}  "
            f"lr {metrics['lr']:.2e}  {time.perf_counter() - t0:5.3f}s"
        )
    if rec is not None:
        rec.close()
    result = RunResult(
        start_update=start,
        end_update=total - 1 if start < total else start - 1,
        final_digest=trainer.state_digest(),
        metrics=all_metrics,
        seconds=time.perf_counter() - t_start,
    )
    trainer.close()
    return result


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def _check_run_dir_config(run_dir: Path, config: PPOConfig) -> None:
    """Record the config in the run dir; refuse to continue a run with a different one."""
    path = run_dir / "ppo_config.json"
    if path.exists():
        saved = PPOConfig.from_dict(json.loads(path.read_text(encoding="utf-8")))
        if saved != config:
            diff = {
                f.name: (getattr(saved, f.name), getattr(config, f.name))
                for f in dataclasses.fields(PPOConfig)
                if getattr(saved, f.name) != getattr(config, f.name)
            }
            details = ", ".join(f"{k}: run has {a!r}, asked {b!r}" for k, (a, b) in diff.items())
            raise SystemExit(f"error: {path} belongs to a different config ({details})")
        return
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # atomic: never a half-written config


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rewind.demo.ppo",
        description="PPO on CartPole-v1 (the `rewind demo` trainer).",
    )
    p.add_argument("--run-dir", required=True, type=Path, help="directory of this run")
    p.add_argument("--updates", type=int, default=PPOConfig.updates,
                   help="PPO updates (also the LR schedule length)")
    p.add_argument("--seed", type=int, default=PPOConfig.seed)
    p.add_argument("--digest-file", type=Path, default=None,
                   help='append {"step": u, "digest": sha256} per update (JSON lines)')
    p.add_argument("--record", action=argparse.BooleanOptionalAction, default=False,
                   help="record with Rewind (default: --no-record)")
    p.add_argument("--log", default=None, help="log URL (default: the run dir's sqlite file)")
    p.add_argument("--coord", default=None, help="coordinator URL (default: same as --log)")
    p.add_argument("--run", default="ppo", help="run id")
    p.add_argument("--snapshots", default=None, help="snapshot store URL (default: RUN_DIR/snapshots)")
    p.add_argument("--snapshot-every", type=int, default=0,
                   help="snapshot every N versions from a background thread (0: off)")
    p.add_argument("--kill-at", type=int, default=None,
                   help="SIGKILL during update K, before it is committed (crash testing)")
    p.add_argument("--rollout-steps", type=int, default=PPOConfig.rollout_steps)
    p.add_argument("--epochs", type=int, default=PPOConfig.epochs)
    p.add_argument("--minibatch-size", type=int, default=PPOConfig.minibatch_size)
    p.add_argument("--quiet", action="store_true", help="no per-update lines")
    p.add_argument("--quiet-progress", action="store_true",
                   help="print only 'update N' per finished update (for a parent's progress bar)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the process exit code."""
    args = _build_parser().parse_args(argv)
    try:
        config = PPOConfig(
            seed=args.seed,
            updates=args.updates,
            rollout_steps=args.rollout_steps,
            epochs=args.epochs,
            minibatch_size=args.minibatch_size,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir: Path = args.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    _check_run_dir_config(run_dir, config)

    factory: RecorderFactory | None = None
    background = None
    if args.record:
        log_url = args.log or f"sqlite://{(run_dir / 'rewind.db').resolve()}"
        snapshots = args.snapshots or f"file://{(run_dir / 'snapshots').resolve()}"
        address = RunAddress(log_url, args.coord or log_url, args.run, snapshots)
        if args.snapshot_every:
            # The embedded case: the snapshotter runs as a thread inside the trainer.
            snap_config = SnapshotterConfig(trigger=every_versions(args.snapshot_every),
                                            retention=keep_last(3), poll_interval_s=0.2)
            background = start_background(Snapshotter(
                address, SnapshotStore(snapshots), snap_config,
                holder=f"{args.run}.trainer-snapshotter"))

        def factory(trainer: PPOTrainer, rdir: Path) -> Recorder:
            return make_recorder(trainer, address)

    log = None if args.quiet else (lambda msg: print(msg, flush=True))
    if args.quiet_progress:
        def log(msg: str) -> None:
            if msg.startswith("update "):
                print(" ".join(msg.split()[:2]), flush=True)
    result = run(
        config,
        updates=args.updates,
        recorder_factory=factory,
        kill_at=args.kill_at,
        digest_file=args.digest_file,
        run_dir=run_dir,
        log=log,
    )
    if background is not None:
        thread, stop = background
        stop.set()
        thread.join(timeout=60)
    n = len(result.metrics)
    per = result.seconds / n if n else 0.0
    print(
        f"done: updates {result.start_update}..{result.end_update} in {result.seconds:.2f}s "
        f"({per:.3f}s/update)  digest {result.final_digest[:16]}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
