"""Stable-Baselines3: ``RewindCallback`` records an algorithm's whole training state; its
``restore`` gives back a killed run's model, ready to continue ``learn()`` bit for bit.

What a version holds:

* the policy (with any target networks: they are part of its ``state_dict``), every optimizer
  and the tensors SB3 saves beside them (SAC's ``log_ent_coef``);
* SB3's counters (``num_timesteps``, ``_n_updates``, the schedules' progress, episode count,
  DQN's exploration rate), the last observations and episode starts, the episode-info
  buffers and the action noise;
* every RNG: torch, numpy and ``random`` (the recorder's), and each space's and env's own;
* the environments: every ``VecEnvWrapper`` layer (``VecNormalize`` statistics included), the
  ``DummyVecEnv`` buffers, and each env's wrapper chain down to the raw env (physics state,
  ``TimeLimit`` steps, ``Monitor`` episode stats), as plain data;
* for off-policy algorithms, the replay buffer: its arrays go to the tensor shards as XOR
  deltas, so a commit writes only the chunks the transitions added since the previous one
  touched (a wrap is the same: the rows overwritten), and ``pos`` / ``full`` as small state;
* every ``extra`` object, its tensors (16 KiB and more) as XOR deltas too.

Use::

    callback = RewindCallback("my-run", every=1)
    model = callback.restore(PPO("MlpPolicy", env, seed=0))   # a fresh run: unchanged
    model.learn(total - model.num_timesteps, callback=callback, reset_num_timesteps=False)

``model.learn(total, callback=callback)`` (SB3's default ``reset_num_timesteps=True``) resumes
the same way: the state ``learn()`` resets is loaded again when training starts.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping
from typing import Any, TypeVar

import numpy as np
import torch
from gymnasium import spaces
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.running_mean_std import RunningMeanStd
from stable_baselines3.common.save_util import recursive_getattr
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv, VecEnvWrapper

from eventlog.backends import RunAddress
from eventlog.capture import GlobalRng, Stateful
from eventlog.errors import ConfigError, RewindError, StateMismatchError
from eventlog.settings import Settings
from rewind.integrations.base import RunRecording
from rewind.recorder import Recorder
from rewind.snapshots import Snapshots
from snapshotter.policies import Trigger

AlgorithmT = TypeVar("AlgorithmT", bound=BaseAlgorithm)

#: SB3's counters that decide what comes next (those an algorithm has).
_COUNTERS = ("num_timesteps", "_n_updates", "_current_progress_remaining", "_episode_num",
             "_n_calls", "exploration_rate")
#: numpy bit generators a recorded env or space may hold.
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")
_TAG = "__rewind_sb3__"  # marks a value that plain msgpack data cannot say on its own
_SKIP = object()  # not plain data: not recorded (objects, callables, spaces, sub-envs)


# ---------------------------------------------------------------------- plain state
def _encode(value: Any) -> Any:
    """``value`` as plain data the small-state codec stores exactly, or ``_SKIP``."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if isinstance(value, np.ndarray):
        return value.copy() if value.dtype.kind in "biufc" else _SKIP
    if isinstance(value, np.generic):
        # Kept a numpy scalar: float32 arithmetic differs from a Python float's.
        return {_TAG: "scalar", "v": np.array(value)} if value.dtype.kind in "biufc" else _SKIP
    if isinstance(value, np.random.Generator):
        return {_TAG: "generator", "v": value.bit_generator.state}
    if isinstance(value, RunningMeanStd):
        return {_TAG: "rms", "v": {"mean": np.array(value.mean), "var": np.array(value.var),
                                   "count": float(value.count)}}
    if isinstance(value, list | tuple):
        items = [_encode(v) for v in value]
        if any(v is _SKIP for v in items):
            return _SKIP
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            enc = _encode(v)
            if enc is _SKIP or not (k is None or type(k) in (str, int, bool)):
                return _SKIP
            out[k] = enc
        return out
    return _SKIP


def _generator(state: Mapping[str, Any], current: Any) -> np.random.Generator:
    name = state.get("bit_generator")
    if isinstance(current, np.random.Generator) and type(current.bit_generator).__name__ == name:
        current.bit_generator.state = state
        return current
    if name not in _BIT_GENERATORS:
        raise ValueError(f"recorded numpy generator {name!r} is not one of {', '.join(_BIT_GENERATORS)}")
    made = np.random.Generator(getattr(np.random, name)())
    made.bit_generator.state = state
    return made


def _decode_into(current: Any, rec: Any) -> Any:
    """The value ``rec`` (from ``_encode``) stands for, written into ``current`` where the
    types allow: arrays and dicts others may hold a reference to stay the same objects."""
    if isinstance(rec, dict) and _TAG in rec:
        kind, v = rec[_TAG], rec["v"]
        if kind == "scalar":
            return v[()]
        if kind == "generator":
            return _generator(v, current)
        if kind == "rms":
            rms = current if isinstance(current, RunningMeanStd) else RunningMeanStd(shape=v["mean"].shape)
            rms.mean, rms.var, rms.count = v["mean"].copy(), v["var"].copy(), v["count"]
            return rms
        raise ValueError(f"unknown recorded value kind {kind!r}")
    if isinstance(rec, np.ndarray):
        if (isinstance(current, np.ndarray) and current.shape == rec.shape and current.dtype == rec.dtype
                and current.flags.writeable):
            current[...] = rec
            return current
        return rec.copy()
    if isinstance(rec, dict):
        if not isinstance(current, dict):
            return {k: _decode_into(None, v) for k, v in rec.items()}
        for k in [k for k in current if k not in rec]:
            del current[k]
        for k, v in rec.items():
            current[k] = _decode_into(current.get(k), v)
        return current
    if isinstance(rec, list):
        olds = current if isinstance(current, list) else []
        items = [_decode_into(c, r) for c, r in itertools.zip_longest(olds[:len(rec)], rec)]
        if isinstance(current, list):
            current[:] = items
            return current
        return items
    if isinstance(rec, tuple):
        return tuple(_decode_into(None, r) for r in rec)
    return rec


def _layer_state(obj: Any) -> dict[str, Any]:
    """An object's plain attributes (what ``_encode`` can store), by name, and its type."""
    plain = {k: enc for k, v in vars(obj).items() if (enc := _encode(v)) is not _SKIP}
    return {"type": type(obj).__name__, "attrs": plain}


def _load_layer(obj: Any, state: Mapping[str, Any], where: str) -> None:
    if state["type"] != type(obj).__name__:
        raise ValueError(f"{where} is a {type(obj).__name__}; the recording has a {state['type']}")
    for k, rec in state["attrs"].items():
        setattr(obj, k, _decode_into(getattr(obj, k, None), rec))


# ---------------------------------------------------------------------- Statefuls
def _env_chain(env: Any) -> list[Any]:
    """A gymnasium env's wrappers, outermost first, down to the raw env."""
    chain = [env]
    while hasattr(chain[-1], "env"):
        chain.append(chain[-1].env)
    return chain


def _vec_chain(venv: VecEnv) -> list[VecEnv]:
    """A VecEnv's wrappers, outermost first, down to the ``DummyVecEnv``."""
    chain = [venv]
    while isinstance(chain[-1], VecEnvWrapper):
        chain.append(chain[-1].venv)
    if not isinstance(chain[-1], DummyVecEnv):
        raise ConfigError(f"RewindCallback needs a DummyVecEnv; the model's env is a "
                          f"{type(chain[-1]).__name__}, whose environments' state cannot be recorded")
    return chain


class _Environments:
    """Every env layer's plain state and every space's RNG, as one ``Stateful``."""

    def __init__(self, model: BaseAlgorithm) -> None:
        self.model = model
        venv = model.get_env()
        if venv is None:
            raise ConfigError("RewindCallback needs a model with an environment (model.get_env() is None)")
        self.vec = _vec_chain(venv)
        base = self.vec[-1]
        assert isinstance(base, DummyVecEnv)  # _vec_chain checked it
        self.envs = [_env_chain(e) for e in base.envs]

    def _spaces(self) -> list[tuple[str, spaces.Space[Any]]]:
        found: list[tuple[str, spaces.Space[Any]]] = []
        seen: set[int] = set()

        def add(path: str, space: Any) -> None:
            if not isinstance(space, spaces.Space) or id(space) in seen:
                return
            seen.add(id(space))
            found.append((path, space))
            subs = getattr(space, "spaces", None)
            if isinstance(subs, Mapping):
                for k, s in subs.items():
                    add(f"{path}.{k}", s)
            elif isinstance(subs, tuple | list):
                for i, s in enumerate(subs):
                    add(f"{path}.{i}", s)

        add("model.action_space", self.model.action_space)
        add("model.observation_space", self.model.observation_space)
        for i, layer in enumerate(self.vec):
            for attr in ("action_space", "observation_space"):
                add(f"vec{i}.{attr}", vars(layer).get(attr))
        for e, chain in enumerate(self.envs):
            for i, layer in enumerate(chain):
                for attr, value in vars(layer).items():
                    add(f"env{e}.{i}.{attr}", value)
        return found

    def state_dict(self) -> dict[str, Any]:
        # The spaces' ``_np_random``, not ``np_random``: reading the property would seed one.
        return {
            "vec": [_layer_state(layer) for layer in self.vec],
            "envs": [[_layer_state(layer) for layer in chain] for chain in self.envs],
            "spaces": {path: _encode(s._np_random) for path, s in self._spaces()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if len(state["vec"]) != len(self.vec) or len(state["envs"]) != len(self.envs):
            raise ValueError(f"the recording has {len(state['envs'])} envs under {len(state['vec'])} VecEnv "
                             f"layers; this model has {len(self.envs)} under {len(self.vec)}")
        for i, (layer, rec) in enumerate(zip(self.vec, state["vec"], strict=True)):
            _load_layer(layer, rec, f"VecEnv layer {i}")
        for e, (chain, recs) in enumerate(zip(self.envs, state["envs"], strict=True)):
            if len(chain) != len(recs):
                raise ValueError(f"env {e} has {len(chain)} wrapper layers; the recording has {len(recs)}")
            for i, (layer, rec) in enumerate(zip(chain, recs, strict=True)):
                _load_layer(layer, rec, f"env {e} layer {i}")
        live = self._spaces()
        paths = sorted(p for p, _ in live)
        if paths != sorted(state["spaces"]):
            raise ValueError(f"spaces differ: recorded {sorted(state['spaces'])}, live {paths}")
        for path, space in live:
            rec = state["spaces"][path]
            space._np_random = None if rec is None else _decode_into(space._np_random, rec)  # type: ignore[assignment]


class _Progress:
    """SB3's counters, last observations, episode-info buffers and action noise."""

    def __init__(self, model: BaseAlgorithm) -> None:
        self.model = model
        self.noise_loaded = True

    def _noises(self) -> list[Any]:
        noise = getattr(self.model, "action_noise", None)
        return [] if noise is None else [noise, *getattr(noise, "noises", [])]

    def state_dict(self) -> dict[str, Any]:
        m = self.model
        return {
            "algorithm": type(m).__name__,
            "counters": {k: _encode(getattr(m, k)) for k in _COUNTERS if hasattr(m, k)},
            "last_obs": _encode(m._last_obs),
            "last_episode_starts": _encode(m._last_episode_starts),
            "last_original_obs": _encode(m._last_original_obs),
            "ep_info_buffer": None if m.ep_info_buffer is None else _encode(list(m.ep_info_buffer)),
            "ep_success_buffer": None if m.ep_success_buffer is None else _encode(list(m.ep_success_buffer)),
            "action_noise": [_layer_state(n) for n in self._noises()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        m = self.model
        if state["algorithm"] != type(m).__name__:
            raise ValueError(f"the run was recorded with {state['algorithm']}; this model is a "
                             f"{type(m).__name__}")
        for k, v in state["counters"].items():
            setattr(m, k, _decode_into(None, v))
        m._last_obs = _decode_into(None, state["last_obs"])
        m._last_episode_starts = _decode_into(None, state["last_episode_starts"])
        m._last_original_obs = _decode_into(None, state["last_original_obs"])
        for name in ("ep_info_buffer", "ep_success_buffer"):
            rec = state[name]
            setattr(m, name, None if rec is None else
                    collections.deque(_decode_into(None, rec), maxlen=m._stats_window_size))
        noises, recs = self._noises(), state["action_noise"]
        # learn() may wrap the noise per env (VectorizedActionNoise) only once it starts:
        # then the noise is loaded when training starts, from the state kept for it.
        self.noise_loaded = [type(n).__name__ for n in noises] == [r["type"] for r in recs]
        if self.noise_loaded:
            for i, (noise, rec) in enumerate(zip(noises, recs, strict=True)):
                _load_layer(noise, rec, f"action noise {i}")


class _Optimizers:
    """Every optimizer SB3 saves for the algorithm, and its extra tensors, as one ``Stateful``."""

    def __init__(self, model: BaseAlgorithm) -> None:
        names, variables = model._get_torch_save_params()
        self.optimizers = {n: recursive_getattr(model, n) for n in names if n != "policy"}
        self.variables: dict[str, torch.Tensor] = {n: recursive_getattr(model, n) for n in variables}

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": {n: o.state_dict() for n, o in self.optimizers.items()},
                "variables": {n: v.detach() for n, v in self.variables.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if sorted(state["optimizers"]) != sorted(self.optimizers):
            raise ValueError(f"optimizers differ: recorded {sorted(state['optimizers'])}, "
                             f"model has {sorted(self.optimizers)}")
        for n, opt in self.optimizers.items():
            opt.load_state_dict(state["optimizers"][n])
        with torch.no_grad():
            for n, var in self.variables.items():
                var.copy_(state["variables"][n])  # in place: the optimizer holds this tensor


class _ReplayArrays:
    """A replay buffer's arrays as torch views of the same memory (no copy), plus ``pos`` and
    ``full``: the recorder logs each array's changed chunks only."""

    def __init__(self, buffer: ReplayBuffer) -> None:
        self.buffer = buffer

    def _arrays(self) -> dict[str, np.ndarray]:
        lead = (self.buffer.buffer_size, self.buffer.n_envs)
        out: dict[str, np.ndarray] = {}
        for name, value in vars(self.buffer).items():
            items = value.items() if isinstance(value, Mapping) else [(None, value)]
            for key, arr in items:
                if isinstance(arr, np.ndarray) and arr.shape[:2] == lead:
                    out[name if key is None else f"{name}.{key}"] = arr
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"arrays": {n: torch.from_numpy(a) for n, a in self._arrays().items()},
                "pos": int(self.buffer.pos), "full": bool(self.buffer.full)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        arrays = self._arrays()
        if sorted(arrays) != sorted(state["arrays"]):
            raise ValueError(f"replay buffer arrays differ: recorded {sorted(state['arrays'])}, "
                             f"live {sorted(arrays)}")
        for n, arr in arrays.items():
            rec = state["arrays"][n].numpy()
            if rec.shape != arr.shape or rec.dtype != arr.dtype:
                raise ValueError(f"replay buffer {n}: recorded {rec.dtype}{list(rec.shape)}, "
                                 f"live {arr.dtype}{list(arr.shape)} (another buffer_size?)")
            np.copyto(arr, rec)
        self.buffer.pos, self.buffer.full = int(state["pos"]), bool(state["full"])


# ---------------------------------------------------------------------- the callback
class RewindCallback(BaseCallback, RunRecording):
    """Record an SB3 algorithm's whole training state to a Rewind run, and resume it.

    A version is committed when a rollout starts, every ``every`` rollouts (for SAC/TD3/DQN
    with ``train_freq=1`` a rollout is one env step), and when training ends. Only there is
    the whole state in the objects recorded: ``train()`` has consumed the previous rollout,
    the rollout buffer was just reset, and no step is half taken. (At a rollout's end the
    pending update would need the rollout buffer, and ``learn()`` would not run it first.)
    Each ``learn()`` also commits the state it starts from (if not already recorded). A
    version's metrics are the ``train/`` values SB3's logger holds from the last update.
    gSDE (``use_sde``) is not supported: it draws fresh noise before the rollout-start hook.

    :param run: the run's ``RunAddress``, or its id (``REWIND_LOG`` names the backend).
    :param every: commit every ``every`` rollouts (see ``rewind.integrations.base.Cadence``).
    :param extra: more ``Stateful`` objects to record; their tensors are recorded like the
        policy's (names ``progress``, ``environments`` and ``replay_buffer`` are the callback's).
    :param snapshots: a snapshot trigger or ``Snapshots``, passed to the ``Recorder``.
    :param settings: the ``Settings`` passed to the ``Recorder``.
    :param predictive: the ``Recorder``'s predictive codec; off by default, because it replays
        one torch optimizer and SB3's optimizers are recorded as one group.
    :param verbose: SB3's verbosity level.
    """

    owner, unit = "RewindCallback", "rollouts"

    def __init__(
        self,
        run: RunAddress | str,
        *,
        every: int = 1,
        extra: Mapping[str, Stateful] | None = None,
        snapshots: Snapshots | Trigger | None = None,
        settings: Settings | None = None,
        predictive: bool = False,
        verbose: int = 0,
    ) -> None:
        BaseCallback.__init__(self, verbose)
        self._init_recording(run, every, extra, snapshots, settings, predictive,
                              own=("progress", "environments", "replay_buffer"))
        self._progress: _Progress | None = None
        self._objects: dict[str, Stateful] = {}
        self._bound: BaseAlgorithm | None = None
        self._rollouts = 0
        self._committed_at: int | None = None
        self._reload: dict[str, Any] = {}
        self._last_done_row: np.ndarray | None = None

    def restore(self, model: AlgorithmT) -> AlgorithmT:
        """Load the run's newest recorded version into ``model`` and return it.

        ``model`` must be built as the recorded one was (algorithm, policy, env, buffer
        size). A run with nothing recorded leaves it unchanged. Pass this callback to the
        next ``learn()``, with the timesteps still to go and ``reset_num_timesteps=False``
        (or the run's total, with SB3's default ``reset_num_timesteps=True``).
        """
        self._bind(model)
        if self.restored is not None:
            raise RewindError("RewindCallback.restore: this callback already restored its run; "
                              "make a new callback for another model")
        if not self._restore().fresh:
            self._committed_at = model.num_timesteps
            # learn() resets these (counters, the env, episode buffers, action noise) unless
            # reset_num_timesteps=False: kept to load again when training starts.
            self._reload = {n: self._objects[n].state_dict() for n in ("progress", "environments", "rng")}
            buffer = getattr(model, "replay_buffer", None)
            if isinstance(buffer, ReplayBuffer):
                # optimize_memory_usage: learn() marks the newest transition done on a reset.
                self._last_done_row = buffer.dones[(buffer.pos - 1) % buffer.buffer_size].copy()
        return model

    def _bind(self, model: BaseAlgorithm) -> Recorder:
        if self._bound is not None:
            if model is not self._bound:
                raise ConfigError("RewindCallback records one model; make a new callback for another")
            if self.recorder is None:
                raise RewindError("RewindCallback is closed; make a new callback to record further")
            return self.recorder
        if getattr(model, "use_sde", False):
            raise ConfigError("RewindCallback does not support use_sde=True: gSDE draws its noise "
                              "before a rollout starts, where a version is committed")
        self._progress = _Progress(model)
        self._objects = {"progress": self._progress, "environments": _Environments(model)}
        optimizers = _Optimizers(model)
        buffers: dict[str, Stateful] = {}
        if isinstance(model, OffPolicyAlgorithm):
            buffer = model.replay_buffer
            kind = type(buffer).__name__
            if buffer is None or kind not in ("ReplayBuffer", "DictReplayBuffer"):
                raise ConfigError(f"RewindCallback records ReplayBuffer and DictReplayBuffer, not {kind}")
            buffers["replay_buffer"] = _ReplayArrays(buffer)
        recorder = self._open(self._objects, model=model.policy, optimizer=optimizers, rng=True,
                              buffers=buffers)
        self._objects = {**self._objects, "rng": GlobalRng()}  # the recorder's own reads the same RNGs
        self._bound = model
        return recorder

    def _init_callback(self) -> None:
        if self._bound is None:
            # Not restored by hand: resume here, inside learn(), which already set its target.
            self.restore(self.model)
        else:
            self._bind(self.model)

    def _on_training_start(self) -> None:
        for name, tree in self._reload.items():
            self._objects[name].load_state_dict(tree)
        if self._progress is not None and not self._progress.noise_loaded:
            raise StateMismatchError("the recorded action noise does not match the model's "
                                     f"({type(self.model.action_noise).__name__})")
        if self._last_done_row is not None:
            buffer = self.model.replay_buffer  # type: ignore[attr-defined]
            buffer.dones[(buffer.pos - 1) % buffer.buffer_size] = self._last_done_row
        self._reload, self._last_done_row = {}, None
        # Rollouts are counted from this learn(); its first rollout start is due too.
        self._rollouts = 0
        self.cadence.reset(-1)

    def _on_rollout_start(self) -> None:
        if self.cadence.due(self._rollouts):
            self._commit_state()
            self.cadence.committed(self._rollouts)
        self._rollouts += 1

    def _on_step(self) -> bool:
        return True

    def _on_training_end(self) -> None:
        self._commit_state()
        assert self.recorder is not None
        self.recorder.flush()

    def _commit_state(self) -> None:
        step = self.model.num_timesteps
        if step == self._committed_at:
            return  # the state of the version restored or committed last
        metrics = {k: float(v) for k, v in self.model.logger.name_to_value.items()
                   if k.startswith("train/") and isinstance(v, int | float | np.number)}
        self._commit(step, metrics)
        self._committed_at = step
