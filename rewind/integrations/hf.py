"""Hugging Face ``Trainer``: ``RewindCallback`` records every optimizer step of a run; the
run resumes through the trainer's own ``train()`` and continues bit for bit, mid-epoch
included.

Use::

    rewind = RewindCallback("my-run")
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[rewind])
    trainer.train(resume_from_checkpoint=rewind.checkpoint())

``checkpoint()`` is ``None`` for a run with nothing recorded (training starts afresh).
Otherwise it rebuilds the newest recorded version and writes a small directory in the form
``train()`` resumes from (``trainer_state.json`` and the weights): the trainer then skips
the batches the run already consumed, as its own resume does. When training begins, the
callback loads the whole version into the trainer's objects and removes the directory.

What a version holds (committed at ``on_step_end``, every ``every`` optimizer steps and at
the last one):

* the model and the optimizer state; the optimizer is the torch optimizer inside
  accelerate's ``AcceleratedOptimizer``, whose step pre-hook sees the gradients after
  clipping, so steps are recorded by the predictive codec;
* the learning-rate scheduler;
* the model's config, as it was when training began (``rewind export --format hf`` writes
  it as ``config.json``, so ``from_pretrained`` loads the export);
* this process's RNGs: torch (CPU and every CUDA device), numpy and ``random``;
* the trainer's state (``global_step``, ``epoch``, counters, best metric; not
  ``log_history``, which would make each commit grow with the run);
* the data position: the epoch, the batches consumed in it, the state of every
  ``torch.Generator`` the train dataloader and its samplers hold, and those generators and
  the RNGs as the epoch began;
* every ``extra`` object (its tensors go to the tensor shards like the model's, but for
  those under 16 KiB). One that is the data collator (or the object whose method the
  collator is) is recorded as it was before the next batch was collated (below).

Why the resume is exact. The trainer draws an epoch's batch order when the epoch begins
(from the sampler's generator, or from the global RNG for a sampler without one). On a
mid-epoch resume the callback puts back the RNG states the epoch began with before the
trainer draws that order again and skips the consumed batches, then the RNG states of the
commit just before the first resumed forward pass. No batch is replayed or skipped, and no
RNG draw is made that the uninterrupted run did not make. Evaluation during training leaves
the RNGs and the collator as it found them (the callback puts them back after each
evaluation), so a resumed run, which does not repeat an evaluation, draws the same numbers.

The collator. accelerate's dataloader collates one batch ahead of the one it hands over
(to know which is the last), so when step ``k`` commits, the batch of step ``k + 1`` is
already collated, and a resume, whose trainer skips the consumed batches without collating
them, collates that batch first. The callback therefore runs the train dataloader's
``collate_fn`` through a wrapper that keeps, before each call, the global RNGs and the
recorded collator's state (it draws nothing). A commit records those of the call for the
next batch when it was already made, and the live ones otherwise (at an epoch's end). On a
mid-epoch resume the first collate call starts from the recorded global RNGs, and the RNGs
of the commit follow it, as in the uninterrupted run. So a collator with its own generator
(recorded through ``extra``) and one that draws from the global RNGs both resume exactly.

A finished run started again (``train()`` on a run at ``max_steps``) trains nothing: the
trainer, resumed at a step in the middle of an epoch, would train one more before it
stops, so ``checkpoint()`` tells it the step at the end of that epoch; the callback loads
the recorded version, and puts the recorded step back in ``state.global_step`` at
``on_train_end``. The run's state is then the uninterrupted run's, and no version is added.
(``checkpoint()`` reads ``max_steps`` from the trainer's arguments, which a callback passed
as ``Trainer(callbacks=[...])`` receives; to a callback added later, such a ``train()`` is
refused with an error that says so.)

Limits: one process (``world_size`` 1); a map-style dataset; a dataset that does not draw
from the global RNGs, and, with ``dataloader_num_workers`` above 0, a collator that does
not either (the dataloader fetches batches ahead of the step that uses them; in worker
processes its calls cannot be seen: a collator recorded through ``extra`` is refused
there). The trainer's ``total_flos`` and ``log_history`` are
not part of a version.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import tempfile
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from safetensors.torch import save_file
from transformers import PretrainedConfig, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from eventlog.backends import RunAddress
from eventlog.capture import GlobalRng, Stateful, recorded_trees
from eventlog.errors import ConfigError, RewindError, RunNotFoundError
from eventlog.fold.engine import RebuiltState
from eventlog.settings import Settings
from replayer.export import HF_CONFIG
from replayer.replay import ReplayReport, replay
from rewind.integrations.base import RunRecording
from rewind.results import CommitResult
from rewind.snapshots import Snapshots
from snapshotter.policies import Trigger

#: The files ``Trainer.train(resume_from_checkpoint=...)`` reads the state and weights from.
TRAINER_STATE_FILE = "trainer_state.json"
WEIGHTS_FILE = "model.safetensors"
#: The callback's own small states (beside the recorder's model, optimizer, scheduler, rng).
_OWN_STATES = ("trainer", "data", "epoch_start", HF_CONFIG)
#: The ``TrainerState`` fields a restore loads: the run's progress.
_PROGRESS = ("epoch", "global_step", "num_input_tokens_seen", "total_flos", "best_metric",
             "best_global_step", "best_model_checkpoint")
#: Attributes that lead from a dataloader's ``collate_fn`` to the object it calls (the
#: trainer's column-removing wrapper, a bound method, a ``functools.partial``).
_COLLATOR_LINKS = ("data_collator", "__self__", "func")
#: Attributes that lead from a dataloader to its samplers and generators.
_LOADER_LINKS = ("generator", "synchronized_generator", "sampler", "batch_sampler")


def _generators(loader: object) -> dict[str, torch.Generator]:
    """Every ``torch.Generator`` reachable from ``loader`` through its samplers, by path."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()

    def walk(obj: object, path: str, depth: int) -> None:
        if obj is None or id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Generator):
            found[path] = obj
            return
        for link in _LOADER_LINKS:
            walk(getattr(obj, link, None), f"{path}.{link}" if path else link, depth + 1)

    walk(loader, "", 0)
    return found


def _generator_states(loader: object) -> dict[str, torch.Tensor]:
    return {path: g.get_state() for path, g in _generators(loader).items()}


def _load_generators(loader: object, states: Mapping[str, torch.Tensor]) -> None:
    """Set the live generators recorded under the same path (a sampler that creates its
    generator when it is first iterated, and seeds it then, has none yet: nothing to set)."""
    for path, g in _generators(loader).items():
        if path in states:
            g.set_state(states[path])


def _collator_objects(collate: object) -> list[object]:
    """The objects a dataloader's ``collate_fn`` calls through (itself first)."""
    found: list[object] = []
    obj: object = collate
    for _ in range(4):
        found.append(obj)
        links = (getattr(obj, link, None) for link in _COLLATOR_LINKS)
        nxt = next((o for o in links if o is not None), None)
        if nxt is None or any(nxt is o for o in found):
            break
        obj = nxt
    return found


@dataclasses.dataclass
class _Fetched:
    """The state just before one collate call: the global RNGs and the data-side objects."""

    rng: dict[str, Any]
    objects: dict[str, Any]


class _Fetches:
    """The train dataloader's collate calls in the current epoch, each with the state just
    before it (``_Fetched``).

    The loader fetches ahead of the step that trains a batch (accelerate keeps one batch in
    hand to know the last one), so at a commit the batch after the consumed ones has
    already been collated. A commit records the state as it was just before that collate
    call, which is the state a resume, whose first collate call is that batch's, starts from.
    """

    def __init__(self, objects: Mapping[str, Stateful]) -> None:
        #: The recorded objects the collator is or calls through (``extra`` entries).
        self.objects = dict(objects)
        self.calls = 0
        self._before: dict[int, _Fetched] = {}
        #: A mid-epoch resume: the RNGs to load before its first collate call, and after it.
        self._resume: tuple[dict[str, Any], dict[str, Any]] | None = None
        self._mark: dict[str, Any] = {}

    def begin_epoch(self, batches: int) -> None:
        """An epoch begins after ``batches`` batches (skipped by the trainer on a resume)."""
        self.calls, self._before = batches, {}

    def resume(self, before: dict[str, Any], after: dict[str, Any]) -> None:
        self._resume = (before, after)

    def collate(self, inner: Callable[[Any], Any], features: Any) -> Any:
        resume, self._resume = self._resume, None
        if resume is not None:
            GlobalRng().load_state_dict(resume[0])
        self._before[self.calls] = _Fetched(
            GlobalRng().state_dict(), {n: copy.deepcopy(o.state_dict()) for n, o in self.objects.items()})
        self.calls += 1
        batch = inner(features)
        if resume is not None:
            # The uninterrupted run collated the next batches after the commit.
            GlobalRng().load_state_dict(resume[1])
        return batch

    def at(self, batches: int) -> _Fetched | None:
        """The state before the collate call of batch ``batches`` of the epoch, when that
        call was already made (``None``: the live state is the one to record)."""
        return self._before.get(batches)

    def consumed(self, batches: int) -> None:
        """Forget the states of batches training has consumed."""
        for index in [i for i in self._before if i < batches]:
            del self._before[index]

    def mark(self) -> None:
        """Keep the data-side objects' live states (an evaluation puts them back)."""
        self._mark = {n: copy.deepcopy(o.state_dict()) for n, o in self.objects.items()}

    def put_back(self) -> None:
        for name, state in self._mark.items():
            self.objects[name].load_state_dict(state)


class _RecordedCollate:
    """The train dataloader's ``collate_fn`` with ``_Fetches`` taking the state before each
    call; it draws no random number itself."""

    def __init__(self, inner: Callable[[Any], Any], fetches: _Fetches) -> None:
        self.inner, self.fetches = inner, fetches

    def __call__(self, features: Any) -> Any:
        return self.fetches.collate(self.inner, features)


class _AtFetch:
    """A data-side ``extra`` object as the recorder sees it: its state at the data position."""

    def __init__(self, name: str, obj: Stateful, fetches: _Fetches, position: _Position) -> None:
        self.name, self.obj, self.fetches, self.position = name, obj, fetches, position

    def state_dict(self) -> Any:
        fetched = self.fetches.at(self.position.batches)
        return self.obj.state_dict() if fetched is None else fetched.objects[self.name]

    def load_state_dict(self, state: Any) -> None:
        self.obj.load_state_dict(state)


class _TrainerState:
    """The trainer's ``TrainerState`` as a ``Stateful``: recorded whole but ``log_history``
    (``checkpoint()`` writes it as ``trainer_state.json``); a restore loads only the
    progress, not what the trainer sets from its arguments (``max_steps``, ...)."""

    def __init__(self) -> None:
        self.state: TrainerState | None = None

    def state_dict(self) -> dict[str, Any]:
        assert self.state is not None
        return {f.name: getattr(self.state, f.name) for f in dataclasses.fields(self.state)
                if f.name != "log_history"}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        assert self.state is not None
        for name in _PROGRESS:
            setattr(self.state, name, state[name])


@dataclasses.dataclass
class _Position:
    """Where the run is in its data: the epoch (-1: none begun), the batches consumed in it
    out of ``batches_in_epoch``, the live state of the dataloader's generators, and the
    global RNGs just before the next batch was collated (``fetch_rng``; ``None`` when it was
    not collated yet)."""

    epoch: int = -1
    batches: int = 0
    batches_in_epoch: int = 0
    loader: object = None
    fetches: _Fetches | None = None
    fetch_rng: dict[str, Any] | None = None

    @property
    def mid_epoch(self) -> bool:
        return 0 < self.batches < self.batches_in_epoch

    def state_dict(self) -> dict[str, Any]:
        fetched = None if self.fetches is None else self.fetches.at(self.batches)
        return {"epoch": self.epoch, "batches": self.batches, "batches_in_epoch": self.batches_in_epoch,
                "generators": _generator_states(self.loader),
                "fetch_rng": None if fetched is None else fetched.rng}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.batches = int(state["epoch"]), int(state["batches"])
        self.batches_in_epoch = int(state["batches_in_epoch"])
        _load_generators(self.loader, state["generators"])
        self.fetch_rng = state.get("fetch_rng")  # absent in versions recorded before it was kept


class _ModelConfig:
    """The model's config as ``save_pretrained`` writes it (``{}`` for a model without one),
    taken as training begins: ``rewind export --format hf`` writes it as ``config.json``.
    A restore leaves the live model's config as it is."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = getattr(model, "config", None)
        self._state: dict[str, Any] = {}
        if isinstance(config, PretrainedConfig):
            tree = json.loads(config.to_json_string(use_diff=False))
            tree["architectures"] = [type(model).__name__]  # as save_pretrained sets it
            self._state = {"json": json.dumps(tree, sort_keys=True)}

    def state_dict(self) -> dict[str, Any]:
        return self._state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


@dataclasses.dataclass
class _EpochStart:
    """The global RNGs and the dataloader's generators as the current epoch began."""

    rng: dict[str, Any] = dataclasses.field(default_factory=dict)
    generators: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng, "generators": self.generators}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rng, self.generators = dict(state["rng"]), dict(state["generators"])


class RewindCallback(TrainerCallback, RunRecording):
    """A [`TrainerCallback`] that records a [`Trainer`] run with a Rewind `Recorder` and
    resumes it exactly (module docs).

    Args:
        run (`RunAddress` or `str`):
            The run's address, or its id (the backends from the environment, as for `Recorder`).
        every (`int`, *optional*, defaults to 1):
            Commit every that many optimizer steps, and at the last one
            (`rewind.integrations.base.Cadence`).
        extra (`Mapping[str, Stateful]`, *optional*):
            More objects to record; their tensors are recorded like the model's. Their names
            must differ from `model`, `optimizer`, `scheduler`, `sampler`, `rng`, `trainer`,
            `data`, `epoch_start` and `hf_config`. One that is the trainer's data collator, or
            the object whose method it is, is recorded at the data position (module docs).
        snapshots (`Snapshots` or `Trigger`, *optional*):
            Snapshots the recorder takes, passed to the `Recorder`.
        settings (`Settings`, *optional*):
            Passed to the `Recorder`.
        predictive (`bool`, *optional*, defaults to `True`):
            The `Recorder`'s predictive codec (each step's gradients instead of its result).
    """

    owner, unit = "RewindCallback", "optimizer steps"

    def __init__(
        self,
        run: RunAddress | str,
        *,
        every: int = 1,
        extra: Mapping[str, Stateful] | None = None,
        snapshots: Snapshots | Trigger | None = None,
        settings: Settings | None = None,
        predictive: bool = True,
    ) -> None:
        self._init_recording(run, every, extra, snapshots, settings, predictive, own=_OWN_STATES)
        self.address = self._address()
        self._trainer = _TrainerState()
        self._position = _Position()
        self._epoch_start = _EpochStart()
        #: The trainer's arguments (``on_init_end``): ``checkpoint()`` reads where the run ends.
        self._args: TrainingArguments | None = None
        #: The train dataloader's collate calls (``None``: its collator runs in workers).
        self._fetches: _Fetches | None = None
        #: The newest version rebuilt by ``checkpoint()``, and the directory written from it.
        self._rebuilt: tuple[RebuiltState, ReplayReport] | None = None
        self._resume_dir: Path | None = None
        #: A finished run started again: its recorded step, and the step ``train()`` is told
        #: (the end of its last epoch, so the trainer enters no epoch).
        self._finished: tuple[int, int] | None = None
        #: A mid-epoch resume: the epoch's starting RNGs go back when it begins again, then
        #: the commit's RNGs (these) before its first resumed step.
        self._resume_epoch = False
        self._commit_rng: dict[str, Any] | None = None
        #: The RNGs at the newest step end: an evaluation puts them back when it is done.
        self._mark: dict[str, Any] | None = None
        self._last: Future[CommitResult] | None = None
        self._last_step = -1

    @property
    def last_commit(self) -> Future[CommitResult] | None:
        """The newest commit's future (``None`` before the first)."""
        return self._last

    def checkpoint(self) -> str | None:
        """The directory to pass as ``train(resume_from_checkpoint=...)``: ``None`` when the
        run has recorded nothing yet. Rebuilds the newest version (the one training will
        continue from) and writes its trainer state and weights there. For a run that has
        reached its last step, ``train()`` then trains nothing."""
        try:
            rebuilt, report = replay(self.address)
        except RunNotFoundError:
            return None
        trees = recorded_trees(rebuilt, ["trainer", "model", "data"])
        self._remove_resume_dir()
        path = Path(tempfile.mkdtemp(prefix="rewind-resume-"))
        trainer = {**trees["trainer"], "log_history": []}
        self._finished = self._finish(trainer, int(trees["data"]["batches_in_epoch"]))
        if self._finished is not None:
            trainer["global_step"] = self._finished[1]
        TrainerState(**trainer).save_to_json(str(path / TRAINER_STATE_FILE))
        # A tied weight is one tensor under two names, which safetensors refuses to store:
        # the second name gets a copy, so the Trainer finds every key it expects.
        weights: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for key, tensor in trees["model"].items():
            weights[key] = tensor.clone() if id(tensor) in seen else tensor.contiguous()
            seen.add(id(tensor))
        save_file(weights, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
        self._rebuilt, self._resume_dir = (rebuilt, report), path
        return str(path)

    def _finish(self, trainer: Mapping[str, Any], batches_in_epoch: int) -> tuple[int, int] | None:
        """For a run at or past its last step: its step, and the step at the end of the epoch
        it ended in (the trainer resumes at an epoch's end without training: resumed at the
        step itself, mid-epoch, it would train one more step before it stops)."""
        step, args = int(trainer["global_step"]), self._args
        if args is None or batches_in_epoch < 1:
            return None
        last = args.max_steps if args.max_steps > 0 else int(trainer["max_steps"])
        if step < last:
            return None
        # The trainer's own count of optimizer steps in an epoch.
        per_epoch = max(math.ceil(batches_in_epoch / args.gradient_accumulation_steps), 1)
        return step, math.ceil(step / per_epoch) * per_epoch

    # ------------------------------------------------------------------ trainer events
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._args = args

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if args.world_size > 1:
            raise ConfigError(f"RewindCallback records one process; this run has {args.world_size}")
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        loader = kwargs.get("train_dataloader")
        if not isinstance(model, torch.nn.Module) or optimizer is None or loader is None:
            raise RewindError("RewindCallback.on_train_begin: the trainer passed no model, optimizer "
                              "or train dataloader")
        try:
            batches_in_epoch = len(loader)
        except TypeError:
            raise ConfigError("RewindCallback needs a map-style train dataset (one with a length): "
                              "an iterable dataset's position cannot be restored") from None
        if isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer  # the torch optimizer: its step is the one replayed
        self._trainer.state = state
        self._fetches = _record_collate(loader, self._extra)
        self._position = _Position(batches_in_epoch=batches_in_epoch, loader=loader, fetches=self._fetches)
        self._epoch_start = _EpochStart()
        rebuilt, self._rebuilt = self._rebuilt, None
        finished, self._finished = (self._finished, None) if rebuilt is not None else (None, None)
        begins_at = state.global_step  # where train() resumes (the restore sets the recorded one)
        own: dict[str, Stateful] = {"trainer": self._trainer, "data": self._position,
                                    "epoch_start": self._epoch_start}
        # A run whose versions hold no config (recorded before the callback kept one) resumes.
        if rebuilt is None or HF_CONFIG in rebuilt[0].small.states:
            own[HF_CONFIG] = _ModelConfig(model)
        extra = dict(self._extra)
        if self._fetches is not None:
            extra.update({n: _AtFetch(n, o, self._fetches, self._position)
                          for n, o in self._fetches.objects.items()})
        self._open(own, extra, model=model, optimizer=optimizer, scheduler=kwargs.get("lr_scheduler"),
                   restorer=None if rebuilt is None else (lambda _log: rebuilt))
        result = self._restore()
        self._remove_resume_dir()
        self._check_resume(result.step, result.fresh, begins_at, finished)
        self._last_step = state.global_step
        self.cadence.reset(state.global_step)
        if finished is not None:
            # The trainer counts the steps this train() made from the step it was told.
            state.global_step = finished[1]
            self._finished = finished
        self._resume_epoch = self._position.mid_epoch and finished is None
        if self._resume_epoch and args.ignore_data_skip:
            self.close()
            raise ConfigError("RewindCallback: ignore_data_skip=True would train the batches of the "
                              f"resumed epoch again (run {self.address.run_id!r} stopped mid-epoch)")
        self._mark = GlobalRng().state_dict()
        self._commit_rng = self._mark if self._resume_epoch else None
        if self._resume_epoch and self._fetches is not None and self._position.fetch_rng is not None:
            # The first collate call of the resumed epoch is the batch collated before the
            # commit: it starts from the RNGs recorded then, and the commit's follow it.
            self._fetches.resume(self._position.fetch_rng, self._mark)
            self._commit_rng = None
        if self._fetches is not None:
            self._fetches.mark()

    def _check_resume(self, restored: int | None, fresh: bool, begins_at: int,
                      finished: tuple[int, int] | None) -> None:
        """Refuse a ``train()`` that does not begin where the run is."""
        expected = (restored or 0) if finished is None else finished[1]
        if begins_at == expected and (finished is None or restored == finished[0]):
            return
        self.close()
        if fresh:
            raise RewindError(f"run {self.address.run_id!r} has recorded nothing, but train() resumes "
                              f"at step {begins_at}: a Rewind run starts at step 0")
        raise RewindError(f"run {self.address.run_id!r} is at step {restored}, but train() begins at "
                          f"step {begins_at}: resume with "
                          "trainer.train(resume_from_checkpoint=callback.checkpoint())")

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        pos = self._position
        if self._recorder is not None and state.global_step >= state.max_steps:
            # A finished run the trainer would train further (checkpoint() did not see the
            # trainer's arguments): refused, not one more step.
            self.close()
            raise RewindError(f"run {self.address.run_id!r} is finished (step {state.global_step} of "
                              f"{state.max_steps}) but the trainer is about to train another epoch: pass "
                              "the callback as Trainer(callbacks=[...]) so checkpoint() sees its arguments")
        if self._resume_epoch:
            # The epoch the run was killed in begins again: the same order is drawn from the
            # same states, and the trainer skips the batches consumed.
            self._resume_epoch = False
            GlobalRng().load_state_dict(self._epoch_start.rng)
            _load_generators(pos.loader, self._epoch_start.generators)
            if self._fetches is not None:
                self._fetches.begin_epoch(pos.batches)
            return
        pos.epoch, pos.batches = pos.epoch + 1, 0
        if self._fetches is not None:
            self._fetches.begin_epoch(0)
        self._epoch_start.rng = GlobalRng().state_dict()
        self._epoch_start.generators = _generator_states(pos.loader)

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        if self._commit_rng is not None:
            GlobalRng().load_state_dict(self._commit_rng)
            self._commit_rng = None

    def on_substep_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._position.batches += 1

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._position.batches += 1
        if self.cadence.due(state.global_step) or state.global_step >= state.max_steps:
            self._commit_step(state.global_step)
        self._mark = GlobalRng().state_dict()
        if self._fetches is not None:
            self._fetches.consumed(self._position.batches)
            self._fetches.mark()

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self._recorder is not None and self._mark is not None:
            GlobalRng().load_state_dict(self._mark)
            if self._fetches is not None:
                self._fetches.put_back()  # the evaluation's dataloader calls the same collator

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self._recorder is None:
            return
        if self._finished is not None:
            state.global_step, self._finished = self._finished[0], None
        if state.global_step != self._last_step:
            self._commit_step(state.global_step)
        self.close()

    # ------------------------------------------------------------------ helpers
    def _commit_step(self, step: int) -> None:
        self._last = self._commit(step)
        self._last_step = step
        self.cadence.committed(step)

    def _remove_resume_dir(self) -> None:
        if self._resume_dir is not None:
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._resume_dir = None


def _record_collate(loader: Any, extra: Mapping[str, Stateful]) -> _Fetches | None:
    """Make the train dataloader's collate calls go through ``_Fetches`` (``None`` when its
    collator runs in worker processes, where the calls cannot be seen)."""
    # accelerate's DataLoaderShard iterates the torch DataLoader it holds.
    base = getattr(loader, "base_dataloader", loader)
    collate = getattr(base, "collate_fn", None)
    if not callable(collate):
        return None
    if isinstance(collate, _RecordedCollate):
        collate = collate.inner
    chain = _collator_objects(collate)
    objects = {n: o for n, o in extra.items() if any(o is c for c in chain)}
    workers = getattr(base, "num_workers", 0)
    if workers and objects:
        raise ConfigError(f"RewindCallback(extra=...): {next(iter(objects))!r} is the data collator, which "
                          f"runs in {workers} dataloader worker processes, where its state cannot be "
                          "recorded: train with dataloader_num_workers=0")
    if workers:
        return None
    fetches = _Fetches(objects)
    base.collate_fn = _RecordedCollate(collate, fetches)
    return fetches
