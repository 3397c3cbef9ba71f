"""TorchRL: ``RewindTorchRL`` records a TorchRL training loop (a ``Collector``, a
``ReplayBuffer``, a loss module with its target networks, optimizers); ``restore`` brings a
killed run back to the iteration it had reached, to continue bit for bit.

What a version holds:

* the collector's policy and the loss module: parameters and buffers, the target networks
  (the loss module's ``target_*_params``) and an exploration module's state (``EGreedyModule``'s
  annealed ``eps``); a tensor the policy and the loss share is recorded once; the env's
  transforms and the collector's ``postproc`` when they are modules;
* every optimizer, and the target-network updater's progress (``HardUpdate``'s counter);
* the replay buffer: its storage's tensors (``LazyTensorStorage``, ``LazyMemmapStorage``: the
  contents, not the files) go to the tensor shards as XOR deltas, so a commit writes only the
  chunks the rows added since the previous version touched; the storage length, the writer's
  cursor and write count, the sampler's state, the buffer's own generator and its transforms
  as small state;
* the collector's place: frames and iterations counted, the trajectory-id counter, and the
  carrier (the observation the next step acts on);
* the environment: each layer of the TorchRL env (``TransformedEnv``, ``GymEnv``) and of the
  gymnasium env under it (``TimeLimit``'s steps, the raw env's physics state and its
  ``np_random``), as plain data;
* every RNG: torch, numpy and ``random``.

What it refuses, with a ``ConfigError``: a collector that runs the env or the policy in
other processes or threads (``MultiSyncCollector``, ``MultiAsyncCollector``,
``AsyncCollector``, a started ``Collector``), batched envs (``ParallelEnv``, ``SerialEnv``) and
gymnasium vector envs, a collector that yields whole trajectories (``trajs_per_batch``), and a
replay buffer whose state is not tensors in one storage dimension (``ListStorage``,
``ndim > 1``), whose sampler's state is not tensors and plain data (``PrioritizedSampler``'s
segment trees), or that prefetches in threads. A ``LazyMemmapStorage`` resumes into its own
``scratch_dir``: give it ``existsok=True`` (or a new directory) to reuse one a killed run left.

Use, in the loop a TorchRL user writes::

    rewind = RewindTorchRL("my-run", collector=collector, loss=loss, optimizers=optim,
                           buffer=rb, updater=updater, every=10)
    start = rewind.restore()                      # 0 for a fresh run
    for i, data in enumerate(collector, start):
        rb.extend(data)
        ...                                       # sample, loss, backward, step, updater.step()
        rewind.step(i)                            # commits when due
    rewind.close()
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase
from torchrl.collectors import Collector
from torchrl.data import ReplayBuffer
from torchrl.data.replay_buffers.storages import TensorStorage
from torchrl.envs import EnvBase, TransformedEnv
from torchrl.envs.batched_envs import BatchedEnvBase
from torchrl.objectives import LossModule
from torchrl.objectives.utils import TargetNetUpdater

from eventlog import statecodec
from eventlog.backends import RunAddress
from eventlog.capture import Stateful, flatten
from eventlog.errors import ConfigError, DecodeError, RewindError
from eventlog.settings import Settings
from rewind.recorder import Recorder
from rewind.results import CommitResult, RestoreResult
from rewind.snapshots import Snapshots
from snapshotter.policies import Trigger

_OWN = ("collector", "updater", "replay_buffer")  # the small states and buffer this adapter names
_KIND = "__rewind_torchrl__"  # marks a recorded value plain msgpack data cannot say on its own
_OMIT = object()  # not plain data: not recorded (specs, callables, sub-envs, spaces)
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")


# ---------------------------------------------------------------------- environments
def _as_plain(value: Any) -> Any:
    """``value`` as data the small-state codec holds exactly, or ``_OMIT``."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return value
    if isinstance(value, np.ndarray | np.generic):
        if value.dtype.kind not in "biufc":
            return _OMIT
        # A numpy scalar stays one: float32 arithmetic is not a Python float's.
        return value.copy() if isinstance(value, np.ndarray) else {_KIND: "scalar", "v": np.array(value)}
    if isinstance(value, np.random.Generator):
        return {_KIND: "generator", "v": value.bit_generator.state}
    if isinstance(value, list | tuple):
        items = [_as_plain(v) for v in value]
        if _OMIT in items:
            return _OMIT
        return tuple(items) if isinstance(value, tuple) else items
    if isinstance(value, Mapping) and all(type(k) in (str, int) for k in value):
        out = {k: _as_plain(v) for k, v in value.items()}
        return _OMIT if _OMIT in out.values() else out
    return _OMIT


def _from_plain(recorded: Any, live: Any) -> Any:
    """The value ``recorded`` (from ``_as_plain``) stands for; a live generator is reseated,
    not replaced (a space or wrapper may hold the same one)."""
    if isinstance(recorded, dict) and _KIND in recorded:
        if recorded[_KIND] == "scalar":
            return recorded["v"][()]
        state = recorded["v"]
        name = state.get("bit_generator")
        if not (isinstance(live, np.random.Generator) and type(live.bit_generator).__name__ == name):
            if name not in _BIT_GENERATORS:
                raise ValueError(f"recorded numpy generator {name!r} is not one of "
                                 f"{', '.join(_BIT_GENERATORS)}")
            live = np.random.Generator(getattr(np.random, name)())
        live.bit_generator.state = state
        return live
    if isinstance(recorded, np.ndarray):
        return recorded.copy()
    if isinstance(recorded, dict):
        return {k: _from_plain(v, None) for k, v in recorded.items()}
    if isinstance(recorded, list | tuple):
        items = [_from_plain(v, None) for v in recorded]
        return tuple(items) if isinstance(recorded, tuple) else items
    return recorded


def _env_layers(env: EnvBase) -> Iterator[Any]:
    """The layers under a TorchRL env whose attributes hold its state, outermost first: the
    gymnasium env's wrappers down to the raw env, and their spaces (their generators are the
    env's too). TorchRL's own layers are modules: their state is in their ``state_dict``."""
    layer: Any = env
    while layer is not None:
        if isinstance(layer, BatchedEnvBase) or hasattr(layer, "num_envs"):
            raise ConfigError(f"RewindTorchRL cannot record a batched env ({type(layer).__name__}): its "
                              "environments run in other processes or hold state it cannot read; use one env")
        if not isinstance(layer, torch.nn.Module):
            yield layer
        for attr in ("action_space", "observation_space"):
            space = vars(layer).get(attr)
            if hasattr(space, "_np_random"):
                yield space
        if isinstance(layer, TransformedEnv):
            layer = layer.base_env
        else:
            layer = vars(layer).get("_env", vars(layer).get("env"))


class _CollectorState:
    """The collector's counters and carrier, and every env layer's plain state."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.layers = list(_env_layers(collector.env))

    def state_dict(self) -> dict[str, Any]:
        c = self.collector
        if c.is_running():
            raise RewindError("RewindTorchRL cannot commit while the collector runs in its own thread "
                              "(collector.start()): iterate it in the training loop")
        layers = []
        for layer in self.layers:
            attrs = {k: plain for k, v in vars(layer).items() if (plain := _as_plain(v)) is not _OMIT}
            layers.append({"type": type(layer).__name__, "attrs": attrs})
        carrier = c._carrier
        return {"frames": int(c._frames), "iter": int(c._iter),
                "traj_pool": c._traj_pool.state_dict() if c.track_traj_ids else None,
                "carrier": carrier.to_dict(), "carrier_batch": list(carrier.batch_size),
                "layers": layers}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        c = self.collector
        types = [r["type"] for r in state["layers"]]
        if types != [type(layer).__name__ for layer in self.layers]:
            raise ValueError(f"the recorded env layers are {types}; this collector's env has "
                             f"{[type(layer).__name__ for layer in self.layers]}")
        for layer, rec in zip(self.layers, state["layers"], strict=True):
            for k, v in rec["attrs"].items():
                setattr(layer, k, _from_plain(v, getattr(layer, k, None)))
        c._frames, c._iter = state["frames"], state["iter"]
        if state["traj_pool"] is not None:
            c._traj_pool.load_state_dict(state["traj_pool"])
        c._carrier = TensorDict(state["carrier"], batch_size=state["carrier_batch"],
                                device=None if c._carrier_has_no_device else c.env_device)


# ---------------------------------------------------------------------- replay buffer
class _ReplayBufferState:
    """A replay buffer's storage tensors (the log keeps only their changed chunks), its
    length, writer, sampler, transforms, batch size and generator."""

    def __init__(self, buffer: ReplayBuffer) -> None:
        storage = buffer._storage
        if not isinstance(storage, TensorStorage):
            raise ConfigError("RewindTorchRL records a replay buffer on a LazyTensorStorage or "
                              f"LazyMemmapStorage, not {type(storage).__name__}")
        if storage.ndim != 1:
            raise ConfigError(f"RewindTorchRL records storages of one dimension, not ndim={storage.ndim}")
        if buffer._prefetch:
            raise ConfigError("RewindTorchRL cannot record a replay buffer that prefetches (prefetch=...): "
                              "its queued samples are drawn ahead in threads")
        for part in (buffer._sampler, buffer._writer):
            try:
                statecodec.pack(flatten(type(part).__name__, part.state_dict())[1])
            except DecodeError as exc:
                raise ConfigError(f"RewindTorchRL cannot record the replay buffer's {type(part).__name__}: "
                                  f"its state_dict is not tensors and plain data ({exc})") from exc
        self.buffer, self.storage = buffer, storage

    def state_dict(self) -> dict[str, Any]:
        b, store = self.buffer, self.storage._storage
        rng = b._rng
        if store is None:
            tensors: Any = None
        elif isinstance(store, TensorDictBase):
            tensors = store.to_dict()  # nested dicts of the storage's own tensors (no copy)
        else:
            tensors = store
        return {"tensors": tensors, "len": int(self.storage._len), "sampler": b._sampler.state_dict(),
                "writer": b._writer.state_dict(), "transforms": b._transform.state_dict(),
                "batch_size": b._batch_size,
                "rng": None if rng is None else (rng.get_state(), str(rng.device))}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        b, recorded = self.buffer, state["tensors"]
        if recorded is not None:
            if isinstance(recorded, Mapping):
                recorded = TensorDict(dict(recorded), batch_size=[self.storage.max_size])
            if not self.storage.initialized:
                # Allocated as a first extend() would (a memmap storage in its scratch_dir).
                self.storage._init(recorded[0])
            self._fill(recorded)
        self.storage._len = state["len"]
        bump = getattr(self.storage, "_bump_mutation_revision", None)
        if bump is not None:
            bump()  # as the storage's own load_state_dict: what was derived from its rows is stale
        b._sampler.load_state_dict(state["sampler"])
        b._writer.load_state_dict(state["writer"])
        b._transform.load_state_dict(state["transforms"])
        b._batch_size = state["batch_size"]
        if state["rng"] is not None:
            rng = torch.Generator(device=state["rng"][1])
            rng.set_state(state["rng"][0])
            b.set_rng(rng)

    def _fill(self, recorded: torch.Tensor | TensorDictBase) -> None:
        """Copy the recorded rows into the storage's own tensors (its files, for memmap)."""
        live = self.storage._storage
        if isinstance(recorded, TensorDictBase) and isinstance(live, TensorDictBase):
            keys = sorted(map(str, live.keys(True, True)))
            if keys != sorted(map(str, recorded.keys(True, True))):
                raise ValueError(f"the replay buffer's fields differ: recorded "
                                 f"{sorted(map(str, recorded.keys(True, True)))}, live {keys}")
            live.update_(recorded)
        elif isinstance(recorded, torch.Tensor) and isinstance(live, torch.Tensor):
            live.copy_(recorded)
        else:
            raise ValueError(f"the replay buffer's storage holds a {type(live).__name__}; "
                             f"the recording has a {type(recorded).__name__}")


# ---------------------------------------------------------------------- the rest
class _Optimizers:
    """Every optimizer by name, as one ``Stateful``."""

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
        self.optimizers = dict(optimizers)

    def state_dict(self) -> dict[str, Any]:
        return {n: o.state_dict() for n, o in self.optimizers.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if sorted(state) != sorted(self.optimizers):
            raise ValueError(f"optimizers differ: recorded {sorted(state)}, given {sorted(self.optimizers)}")
        for n, opt in self.optimizers.items():
            opt.load_state_dict(state[n])


def _modules(collector: Collector, loss: torch.nn.Module) -> torch.nn.ModuleDict:
    """The policy, the loss module (target networks included), and the env's transforms and
    the collector's ``postproc`` when they are modules, under one module."""
    if isinstance(loss, LossModule):
        # A loss module builds its default value estimator (and its buffers) on first use:
        # built now, every version holds the same tensors, the first one included.
        loss.value_estimator  # noqa: B018
    found: dict[str, torch.nn.Module] = {"loss": loss}
    for name, obj in (("policy", collector.policy), ("postproc", collector.postproc),
                      ("transform", getattr(collector.env, "transform", None))):
        if isinstance(obj, torch.nn.Module):
            found[name] = obj
    return torch.nn.ModuleDict(found)


def _check_collector(collector: Any) -> Collector:
    if not isinstance(collector, Collector):
        raise ConfigError(f"RewindTorchRL records a single-process Collector, not "
                          f"{type(collector).__name__}: its env and policy state live in other processes")
    if collector.trajs_per_batch is not None:
        raise ConfigError("RewindTorchRL cannot record a collector with trajs_per_batch: it holds "
                          "unfinished trajectories between the batches it yields")
    return collector


class RewindTorchRL:
    """Records a TorchRL training loop's state to ``run``; ``restore`` resumes it (module docs).

    ``collector``: a single-process ``Collector``; ``loss``: the loss module (its target
    networks are recorded with it); ``optimizers``: one optimizer or a mapping of them;
    ``buffer``: the replay buffer, or ``None``; ``updater``: a ``SoftUpdate`` / ``HardUpdate``,
    or ``None``; ``extra``: more ``Stateful`` objects, their tensors recorded as deltas like
    the buffer's.

    ``step(i)`` goes at the end of collector iteration ``i`` (counted from 0, as
    ``enumerate(collector, start)`` counts): a version is committed once every ``every``
    iterations, and after the iteration that reaches the collector's ``total_frames``.
    ``commit(i)`` commits now. ``snapshots``, ``settings`` and ``predictive`` are passed to the
    ``Recorder`` (the predictive codec is off by default: a version holds several updates).
    """

    def __init__(
        self,
        run: RunAddress | str,
        *,
        collector: Collector,
        loss: torch.nn.Module,
        optimizers: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer],
        buffer: ReplayBuffer | None = None,
        updater: TargetNetUpdater | None = None,
        every: int = 1,
        extra: Mapping[str, Stateful] | None = None,
        snapshots: Snapshots | Trigger | None = None,
        settings: Settings | None = None,
        predictive: bool = False,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ConfigError(f"RewindTorchRL(every={every!r}): commit every 1 or more iterations")
        clash = sorted(set(extra or {}) & set(_OWN))
        if clash:
            raise ConfigError(f"RewindTorchRL(extra=...): state name {clash[0]!r} is the adapter's own")
        self.collector = _check_collector(collector)
        self.every = every
        opts = {"optimizer": optimizers} if isinstance(optimizers, torch.optim.Optimizer) else optimizers
        small: dict[str, Stateful] = {"collector": _CollectorState(collector)}
        if updater is not None:
            small["updater"] = updater
        tensors: dict[str, Stateful] = dict(extra or {})
        if buffer is not None:
            tensors["replay_buffer"] = _ReplayBufferState(buffer)
        self.recorder = Recorder(run, model=_modules(collector, loss), optimizer=_Optimizers(opts), rng=True,
                                 extra=small, buffers=tensors, predictive=predictive, settings=settings,
                                 snapshots=snapshots)
        #: What ``restore`` found (``None`` until it ran).
        self.restored: RestoreResult | None = None
        self._done = 0  # iterations the state holds

    def restore(self) -> int:
        """Load the run's newest version into the objects; returns the iteration to run next
        (0 for a fresh run). The objects must be built as the recorded ones were."""
        if self.restored is not None:
            raise RewindError("RewindTorchRL.restore: this adapter already restored its run")
        self.restored = self.recorder.restore()
        self._done = 0 if self.restored.fresh else int(self.restored.step or 0)
        return self._done

    def step(self, iteration: int, metrics: Mapping[str, float] | None = None) -> Future[CommitResult] | None:
        """Iteration ``iteration`` is done: commit when due (see the class docs)."""
        done = iteration + 1
        finished = self.collector._frames >= self.collector.total_frames
        if done // self.every > self._done // self.every or (finished and done > self._done):
            return self.commit(iteration, metrics)
        return None

    def commit(self, iteration: int, metrics: Mapping[str, float] | None = None, *,
               wait: bool = False) -> Future[CommitResult]:
        """Commit the state after iteration ``iteration`` now."""
        self._done = iteration + 1
        return self.recorder.commit(self._done, metrics, wait=wait)

    def close(self) -> None:
        """Write every queued version and release the recorder."""
        self.recorder.close()

    def __enter__(self) -> RewindTorchRL:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
