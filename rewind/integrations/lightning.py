"""Lightning adapter: a killed ``Trainer.fit`` resumes bit-exactly, mid-epoch included.

Usage (``pip install "rewind[lightning]"``)::

    from rewind.integrations.lightning import ResumableLoader, RewindCallback

    trainer = L.Trainer(max_epochs=10, callbacks=[RewindCallback("run-1", every=50)])
    trainer.fit(model, ResumableLoader(DataLoader(dataset, batch_size=32, shuffle=True)))

The same two lines start a new run and resume a killed one: there is no ``ckpt_path``. In
``on_fit_start`` the callback restores the newest sealed version, if the run has one, before
the fit loop starts; a ``CheckpointIO`` is not needed, because Lightning's own hooks for a
resumable loader (``state_dict`` / ``load_state_dict``) carry the data position.

What a commit records, at ``on_train_batch_end`` every ``every`` optimizer steps:

* the LightningModule's parameters and buffers, every optimizer's state, every LR scheduler;
* the torch (CPU and CUDA), numpy and Python RNGs, and every ``extra`` object (its tensors
  of 16 KiB and more in the tensor shards, as XOR deltas);
* the fit loop's progress (epoch, global step, batch index, the counters Lightning's own
  mid-epoch restart reads), the state of the other callbacks (``Callback.state_dict``) and
  of the precision plugin (an AMP grad scaler);
* through ``ResumableLoader``, the epoch's data position: the RNG state the epoch's
  iterator was created from (so the shuffle is the same permutation) and how many batches
  training consumed. A resume creates the iterator from that state again (the same
  shuffle) and loads the consumed batches again (workers and their RNGs stay in step), then
  puts the RNGs back as they were at the commit and continues on the exact next batch.
  Recording changes nothing: a recorded fit is bit-equal to the same fit with the bare
  ``DataLoader`` and no callback (``ResumableLoader`` takes back the seed drawn by the
  iterator Lightning creates only to check the loader is iterable).

A batch is not a commit point when the state after its ``on_train_batch_end`` is not all
the state: while gradients accumulate (they live in ``.grad``), when validation or the end
of the epoch follows it (Lightning does not rerun those on a restart), or when the trainer
is stopping. The commit moves to the next batch that is one: with 8 batches an epoch and
``every=4``, the commit due at step 8 (the epoch's last batch) is made at step 9, the
first batch of the next epoch, and the next ones at 12, 16, ... ``on_train_end`` commits the
final state: fitting a finished run again restores it and trains no more.

Why not commit at the epoch boundary itself (``on_train_epoch_end``): after this callback's
hook Lightning still runs the module's and the monitoring callbacks' (``ModelCheckpoint``)
``on_train_epoch_end`` and steps the epoch-interval LR schedulers, and a restart from a state
saved there runs none of them again, so the resumed fit would not be the uninterrupted one.

Not covered: ``ReduceLROnPlateau`` stepped per batch (Lightning steps it after the commit
point; refused with ``ConfigError``), several training dataloaders, a loader without a
length (Lightning then loads a batch ahead of training), time-based validation intervals,
and hooks that run after this callback's ``on_train_start`` on a resume (the module's
``on_train_start``, callbacks listed after this one) drawing random numbers. Epoch-level
aggregates of ``self.log`` cover only the batches since the resume, as in any Lightning
restart.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any

import lightning.pytorch as pl
import torch

from eventlog import statecodec
from eventlog.backends import RunAddress
from eventlog.capture import GlobalRng, Stateful
from eventlog.errors import ConfigError, StateMismatchError
from eventlog.settings import Settings
from rewind.integrations.base import RunRecording
from rewind.snapshots import Snapshots
from snapshotter.policies import Trigger

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Unused:
    """An iterator created and not yet advanced: the random state before and after it."""

    before: dict[str, Any]
    after: bytes


class ResumableLoader:
    """A training dataloader whose position survives a crash: wraps a ``DataLoader`` (or any
    sized iterable) so that Lightning records and restores where its epoch stands.

    Each epoch's iterator is created from a recorded RNG state, so a resume draws the same
    shuffle and loads the batches training had consumed again before yielding the next one.
    Attributes it does not define (``sampler``, ``batch_size``, ``dataset``) are the wrapped
    loader's.

    It changes nothing in the fit: Lightning calls ``iter()`` once on a loader that is not a
    ``DataLoader`` (to check it is iterable) and drops the iterator, while creating a
    ``DataLoader`` iterator draws a seed from the RNGs. The draws of an iterator that was
    never advanced are taken back when the next one is created, if no random number was
    drawn in between, so the fit draws what it draws with the bare ``DataLoader``.
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        if not isinstance(loader, Sized):
            raise ConfigError(f"ResumableLoader needs a loader with a length, got {type(loader).__name__}")
        self.loader = loader
        self._rng = GlobalRng()
        self._epoch_rng: dict[str, Any] | None = None
        self._sampler_epoch: int | None = None
        self._fetched = 0
        self._pending: dict[str, Any] | None = None
        self._unused: _Unused | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (e.g. during copy): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        self._take_back_unused()
        state, self._pending = self._pending, None
        if state is not None:
            # Lightning sets the sampler's epoch after this iter() on a resume: set it first.
            _set_sampler_epoch(self.loader, state["sampler_epoch"])
            self._rng.load_state_dict(state["epoch_rng"])
        self._epoch_rng = self._rng.state_dict()
        self._sampler_epoch = _sampler_epoch(self.loader)
        before = self._random_state()
        inner = iter(self.loader)
        self._fetched = 0
        if state is not None:
            # Loaded, not skipped in the sampler: workers and their RNGs stay in step.
            for _ in range(state["fetched"]):
                next(inner)
            self._fetched = state["fetched"]
        unused = self._unused = _Unused(before, statecodec.pack(self._random_state()))
        return self._batches(inner, unused)

    def _batches(self, inner: Iterator[Any], unused: _Unused) -> Iterator[Any]:
        if self._unused is unused:
            self._unused = None  # advanced: its draws are the fit's
        for batch in inner:
            self._fetched += 1
            yield batch

    def _random_state(self) -> dict[str, Any]:
        """The global RNGs, and the wrapped loader's own generator (its iterator's seed)."""
        state: dict[str, Any] = {"global": self._rng.state_dict()}
        generator = getattr(self.loader, "generator", None)
        if isinstance(generator, torch.Generator):
            state["loader"] = generator.get_state()
        return state

    def _take_back_unused(self) -> None:
        """Undo the draws of the previous iterator if it was never advanced (module docs)."""
        unused, self._unused = self._unused, None
        if unused is None:
            return
        if statecodec.pack(self._random_state()) != unused.after:
            _log.warning("ResumableLoader: an iterator that was never used drew random numbers that "
                         "cannot be taken back (more were drawn since): this fit draws one more seed "
                         "than the same fit with the bare loader")
            return
        self._rng.load_state_dict(unused.before["global"])
        if "loader" in unused.before:
            self.loader.generator.set_state(unused.before["loader"])  # type: ignore[attr-defined]

    def check_consumed(self, batches: int) -> None:
        """Refuse to record a position when batches were loaded ahead of training (their
        loading drew from RNGs whose state at the time is not kept)."""
        if batches != self._fetched:
            raise StateMismatchError(f"ResumableLoader: training consumed {batches} batches of the epoch but "
                                     f"{self._fetched} were loaded; prefetching loaders are not supported")

    def state_dict(self) -> dict[str, Any]:
        """The epoch's position: its iterator's RNG state and the batches loaded from it."""
        return {"epoch_rng": self._epoch_rng, "sampler_epoch": self._sampler_epoch, "fetched": self._fetched}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Make the next ``iter()`` continue the recorded epoch where training left it."""
        self._pending = dict(state) if state.get("epoch_rng") is not None else None


class RewindCallback(pl.Callback, RunRecording):
    r"""Record a ``Trainer.fit`` to a Rewind run and resume it when the fit starts again.

    A commit is due every ``every`` optimizer steps, and made at the first batch at or after
    that is a commit point (module docs); ``on_train_end`` commits the final state.

    Args:
        run: The run's ``RunAddress``, or its id (``REWIND_LOG`` names the backend, as for
            ``Recorder``).
        every: Commit every ``every`` optimizer steps (``rewind.integrations.base.Cadence``).
        extra: More ``Stateful`` objects to record; their tensors are recorded like the
            module's (the name ``trainer`` is the callback's).
        snapshots: A snapshot trigger or ``Snapshots``, passed to the ``Recorder``.
        settings: The ``Settings`` passed to the ``Recorder``.
        predictive: The ``Recorder``'s predictive codec (one optimizer's steps replayed).
        every_n_steps: Deprecated spelling of ``every`` (also the second positional argument):
            it warns and means the same.

    After ``on_fit_start``, ``restored`` holds what the restore found (``restored.fresh``
    for a new run) and ``recorder`` the recorder.
    """

    owner, unit = "RewindCallback", "optimizer steps"

    def __init__(
        self,
        run: RunAddress | str,
        every_n_steps: int | None = None,
        *,
        every: int | None = None,
        extra: Mapping[str, Stateful] | None = None,
        snapshots: Snapshots | Trigger | None = None,
        settings: Settings | None = None,
        predictive: bool = True,
    ) -> None:
        if every_n_steps is not None:
            if every is not None:
                raise ConfigError("RewindCallback: pass every=, not every_n_steps= as well")
            warnings.warn("RewindCallback(every_n_steps=...) is deprecated: use every=, the name all "
                          "Rewind adapters share", DeprecationWarning, stacklevel=2)
            every = every_n_steps
        every = 1 if every is None else every
        self._init_recording(run, every, extra, snapshots, settings, predictive, own=("trainer",))
        self.snapshots = snapshots
        self.settings = settings
        self._resume_rng: dict[str, Any] | None = None

    @property
    def every_n_steps(self) -> int:
        """Deprecated: ``every``."""
        return self.every

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the recorder and restore the newest sealed version, before the fit loop runs."""
        if trainer.ckpt_path is not None:
            raise ConfigError("RewindCallback restores the run itself: fit without ckpt_path")
        for config in trainer.lr_scheduler_configs:
            if config.reduce_on_plateau and config.interval == "step":
                raise ConfigError("RewindCallback: a ReduceLROnPlateau scheduler with interval='step' "
                                  "steps after the commit point; use interval='epoch'")
        optimizers, schedulers = trainer.optimizers, [c.scheduler for c in trainer.lr_scheduler_configs]
        # One optimizer is passed as it is, so the predictive codec can hook its steps.
        optimizer: Stateful | None = (optimizers[0] if len(optimizers) == 1
                                      else _Group(optimizers) if optimizers else None)
        scheduler: Stateful | None = (schedulers[0] if len(schedulers) == 1
                                      else _Group(schedulers) if schedulers else None)
        self._open({"trainer": _TrainerState(trainer, self)}, model=pl_module, optimizer=optimizer,
                   scheduler=scheduler)
        if not self._restore().fresh:
            # The fit loop creates the data iterator before on_train_start, moving the RNGs:
            # they are set back to the commit's there.
            self._resume_rng = GlobalRng().state_dict()
            self.cadence.reset(trainer.global_step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check the training dataloader is resumable; on a resume, put the RNGs back."""
        _train_loader(trainer)
        if self._resume_rng is not None:
            GlobalRng().load_state_dict(self._resume_rng)
            self._resume_rng = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int,
    ) -> None:
        """Commit when a commit is due and this batch is a commit point."""
        step = trainer.global_step
        if not self.cadence.due(step) or not _commit_point(trainer):
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        metrics = {"loss": float(loss)} if isinstance(loss, torch.Tensor) and loss.numel() == 1 else {}
        self._commit_at(trainer, step, metrics)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Commit the final state and wait until every commit is durable."""
        self._commit_at(trainer, trainer.global_step, {})
        assert self.recorder is not None
        self.recorder.flush()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A finished run fitted again trains no more: its RNGs end as the run's did."""
        if self._resume_rng is not None:
            GlobalRng().load_state_dict(self._resume_rng)
            self._resume_rng = None

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException,
    ) -> None:
        """Close the recorder: the commits already queued are whole states and are kept."""
        self.close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Close the recorder (writing the queued commits)."""
        self.close()

    def _commit_at(self, trainer: pl.Trainer, step: int, metrics: dict[str, float]) -> None:
        _train_loader(trainer).check_consumed(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        self._commit(step, metrics)
        self.cadence.committed(step)


class _TrainerState:
    """The trainer's own state as one ``Stateful``: loops, the other callbacks, precision."""

    def __init__(self, trainer: pl.Trainer, owner: pl.Callback) -> None:
        self.trainer = trainer
        self.owner = owner

    def _callbacks(self) -> dict[str, pl.Callback]:
        return {cb.state_key: cb for cb in self.trainer.callbacks  # type: ignore[attr-defined]
                if cb is not self.owner}

    def state_dict(self) -> dict[str, Any]:
        states = {key: cb.state_dict() for key, cb in self._callbacks().items()}
        return {"loops": self.trainer.fit_loop.state_dict(),
                "callbacks": {key: s for key, s in states.items() if s},
                "precision": self.trainer.precision_plugin.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        callbacks = self._callbacks()
        unknown = sorted(state["callbacks"].keys() - callbacks.keys())
        if unknown:
            raise StateMismatchError(f"the recorded run had callbacks this trainer lacks: "
                                     f"{', '.join(unknown)}")
        # Lightning's own checkpoint restore: the loop's counters select its restart path,
        # and its ``combined_loader`` entry goes to the ResumableLoader before iter().
        self.trainer.fit_loop.load_state_dict(state["loops"])
        for key, cb_state in state["callbacks"].items():
            callbacks[key].load_state_dict(cb_state)
        if state["precision"]:
            self.trainer.precision_plugin.load_state_dict(state["precision"])


class _Group:
    """Several optimizers or schedulers as one ``Stateful``."""

    def __init__(self, members: list[Any]) -> None:
        self.members = members

    def state_dict(self) -> dict[str, Any]:
        return {str(i): m.state_dict() for i, m in enumerate(self.members)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if len(state) != len(self.members):
            raise StateMismatchError(f"recorded {len(state)} optimizers or schedulers, the trainer has "
                                     f"{len(self.members)}")
        for i, m in enumerate(self.members):
            m.load_state_dict(state[str(i)])


def _commit_point(trainer: pl.Trainer) -> bool:
    """True when the state at ``on_train_batch_end`` is all of the state: Lightning's restart
    resumes after this batch without rerunning anything that follows it."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    if trainer.should_stop or epoch_loop.batch_progress.is_last_batch:
        return False
    if trainer.lightning_module.automatic_optimization and fit_loop._should_accumulate():
        return False
    fetcher = fit_loop._data_fetcher
    return fetcher is None or not epoch_loop._should_check_val_fx(fetcher)


def _train_loader(trainer: pl.Trainer) -> ResumableLoader:
    """The one training dataloader, which must be a ``ResumableLoader``."""
    loaders = _leaves(trainer.train_dataloader)
    if len(loaders) != 1:
        raise ConfigError(f"RewindCallback supports one training dataloader, the trainer has {len(loaders)}")
    if not isinstance(loaders[0], ResumableLoader):
        raise ConfigError(f"RewindCallback: the training dataloader is a {type(loaders[0]).__name__}; "
                          "wrap it as ResumableLoader(loader) so a resume continues on the exact next batch")
    return loaders[0]


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, Mapping):
        return [leaf for v in tree.values() for leaf in _leaves(v)]
    if isinstance(tree, list | tuple):
        return [leaf for v in tree for leaf in _leaves(v)]
    return [] if tree is None else [tree]


def _samplers(loader: Any) -> list[Any]:
    return [s for s in (getattr(loader, "sampler", None),
                        getattr(getattr(loader, "batch_sampler", None), "sampler", None)) if s is not None]


def _sampler_epoch(loader: Any) -> int | None:
    """The epoch a ``set_epoch`` sampler (``DistributedSampler``) is at, if it has one."""
    for sampler in _samplers(loader):
        epoch = getattr(sampler, "epoch", None)
        if callable(getattr(sampler, "set_epoch", None)) and isinstance(epoch, int):
            return epoch
    return None


def _set_sampler_epoch(loader: Any, epoch: int | None) -> None:
    if epoch is None:
        return
    for sampler in _samplers(loader):
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)
