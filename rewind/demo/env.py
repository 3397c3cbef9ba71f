"""CartPole-v1 as a ``Stateful`` whose ``state_dict`` is the complete environment state.

The state is plain data plus numpy arrays and big integers, all of which the recorder's
small-state codec (``eventlog.statecodec``) stores exactly, so no pickle is involved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

ENV_ID = "CartPole-v1"
OBS_DIM = 4
N_ACTIONS = 2

# A version tag inside the state, so a future layout change fails loudly instead of
# silently loading the wrong thing.
_STATE_FORMAT = 2


def require(state: Mapping[str, Any], key: str, owner: str) -> Any:
    """``state[key]``, or a ``KeyError`` naming the state and the missing key."""
    try:
        return state[key]
    except KeyError:
        raise KeyError(f"{owner} state is missing key {key!r}") from None


def check_format(state: Mapping[str, Any], expected: int, owner: str) -> None:
    """Refuse a state written in another layout than this code reads."""
    fmt = require(state, "format", owner)
    if fmt != expected:
        raise ValueError(f"{owner} state has format {fmt!r}; this code reads format {expected}")


def _optional(value: Any, kind: type) -> Any:
    return None if value is None else kind(value)


@dataclass(frozen=True)
class StepResult:
    """What one env step produced. ``obs`` is the observation *after* the step (for a
    finished episode: the final observation, before any reset)."""

    obs: np.ndarray
    reward: float
    terminated: bool
    truncated: bool
    episode_return: float | None  # set when this step finished an episode
    episode_length: int | None


class CartPoleState:
    """``gymnasium.make("CartPole-v1")`` whose ``state_dict`` captures every future influence.

    That is the physics state, ``steps_beyond_terminated``, the TimeLimit wrapper's elapsed
    steps, the OrderEnforcing "has reset" flag, the env's ``np_random`` bit-generator state
    (and the seed it reports), the current observation, the previously executed action (for
    sticky actions) and the episode counters. The action and observation spaces' own RNGs
    are not captured: the trainer never calls ``space.sample()``.
    """

    def __init__(self, seed: int, env_id: str = ENV_ID) -> None:
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

    def _chain(self) -> list[Any]:
        """The wrappers from the outermost one down to the raw env."""
        chain: list[Any] = [self.env]
        while hasattr(chain[-1], "env"):
            chain.append(chain[-1].env)
        return chain

    def _find_wrappers(self) -> tuple[Any, Any]:
        chain = self._chain()
        time_limit = next((w for w in chain if hasattr(w, "_elapsed_steps")), None)
        order = next((w for w in chain if hasattr(w, "_has_reset")), None)
        if time_limit is None:
            raise RuntimeError(f"{self.env_id}: no TimeLimit wrapper found (gymnasium changed?)")
        return time_limit, order

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
        ep_ret: float | None = None
        ep_len: int | None = None
        if terminated or truncated:
            ep_ret, ep_len = self.episode_return, self.episode_length
            self.episodes_completed += 1
            self.last_episode_return, self.last_episode_length = ep_ret, ep_len
        return StepResult(self.obs, float(reward), bool(terminated), bool(truncated), ep_ret, ep_len)

    def state_dict(self) -> dict[str, Any]:
        """The complete env state (see the class docstring)."""
        u: Any = self.env.unwrapped  # CartPoleEnv; gymnasium types it as a plain Env
        return {
            "format": _STATE_FORMAT,
            "env_id": self.env_id,
            "wrappers": [type(w).__name__ for w in self._chain()],
            "physics": None if u.state is None else np.array(u.state),
            "steps_beyond_terminated": _optional(u.steps_beyond_terminated, int),
            "elapsed_steps": _optional(self._time_limit._elapsed_steps, int),
            "has_reset": None if self._order_enforcing is None else bool(self._order_enforcing._has_reset),
            "np_random": u.np_random.bit_generator.state,
            "np_random_seed": _optional(getattr(u, "_np_random_seed", None), int),
            "obs": self.obs.copy(),
            "prev_action": self.prev_action,
            "episode_return": float(self.episode_return),
            "episode_length": int(self.episode_length),
            "episodes_completed": int(self.episodes_completed),
            "last_episode_return": _optional(self.last_episode_return, float),
            "last_episode_length": _optional(self.last_episode_length, int),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict` output (also after the codec's round trip)."""
        owner = "CartPoleState"
        check_format(state, _STATE_FORMAT, owner)
        env_id = require(state, "env_id", owner)
        if env_id != self.env_id:
            raise ValueError(f"{owner}: state is for env {env_id!r}, this adapter is {self.env_id!r}")
        wrappers = list(require(state, "wrappers", owner))
        mine = [type(w).__name__ for w in self._chain()]
        if wrappers != mine:
            raise ValueError(f"{owner}: wrapper chain mismatch: state has {wrappers}, this env has "
                             f"{mine} (gymnasium version or make() flags differ)")
        u: Any = self.env.unwrapped  # CartPoleEnv; gymnasium types it as a plain Env
        physics = require(state, "physics", owner)
        u.state = None if physics is None else np.array(physics)
        u.steps_beyond_terminated = _optional(require(state, "steps_beyond_terminated", owner), int)
        self._time_limit._elapsed_steps = _optional(require(state, "elapsed_steps", owner), int)
        has_reset = require(state, "has_reset", owner)
        if self._order_enforcing is not None and has_reset is not None:
            self._order_enforcing._has_reset = bool(has_reset)
        bg_state = dict(require(state, "np_random", owner))
        bg_name = str(bg_state.get("bit_generator"))
        if type(u.np_random.bit_generator).__name__ != bg_name:
            # Another generator type than the one seeded at construction: build one.
            u.np_random = np.random.Generator(getattr(np.random, bg_name)())
        u.np_random.bit_generator.state = bg_state
        if hasattr(u, "_np_random_seed"):
            u._np_random_seed = _optional(require(state, "np_random_seed", owner), int)
        self.obs = np.array(require(state, "obs", owner), dtype=np.float32)
        self.prev_action = _optional(require(state, "prev_action", owner), int)
        self.episode_return = float(require(state, "episode_return", owner))
        self.episode_length = int(require(state, "episode_length", owner))
        self.episodes_completed = int(require(state, "episodes_completed", owner))
        self.last_episode_return = _optional(require(state, "last_episode_return", owner), float)
        self.last_episode_length = _optional(require(state, "last_episode_length", owner), int)

    def close(self) -> None:
        """Release the gymnasium env."""
        self.env.close()
