"""Trainer hooks: ``Recorder`` turns each ``commit()`` into one sealed version in the log.

On the training thread, ``commit()`` only copies the state out (tensor bits into staging
buffers, small states into msgpack) and queues it; a bounded queue gives backpressure.
A committer thread hands each staged commit to the commit pipeline
(``eventlog.commit.pipeline``): it encodes the tensors in parallel, allocates gsns, takes the
version CAS and writes the version's events in one log transaction, sealed by
``CommitSealed``. A multi-rank recorder hands it to ``rewind.ranks_commit`` instead, which
uses the same pipeline for the rank's part and rank 0's seal.

Two codecs: when the version is one or two supported optimizer steps after the previous
one, the *predictive* codec (``predictive``) logs the steps' gradients and only the residual
of the replayed step; otherwise tensors are XOR deltas of the previous version's bits.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from eventlog import intraop, statecodec, tensorcodec
from eventlog import predictive as predictive_codec
from eventlog.backends import RunAddress
from eventlog.capture import INLINE_TENSOR_BYTES, TENSOR_ROLES, GlobalRng, Stateful, flatten, load_into
from eventlog.commit.pipeline import SMALL_KINDS, CommitPipeline
from eventlog.digests import shard_digest, tensor_digest
from eventlog.errors import ConfigError, RewindError, RunNotFoundError, StaleVersionError
from eventlog.events import Body, CustomState, EnvironmentFingerprint
from eventlog.fold.apply import ShardState
from eventlog.fold.bits import TensorBits
from eventlog.fold.engine import RebuiltState, SmallStates
from eventlog.layout import assign_shards
from eventlog.optimstep import StepCapture
from eventlog.ports import CONTROL, Coordinator, EventLog
from eventlog.provenance import PROVENANCE, Stamp
from eventlog.settings import Settings, current
from eventlog.waits import warned_wait
from eventlog.weightcodec import WeightsConfig, serving_dtype
from replayer.assemble import full_state
from replayer.replay import ReplayReport, Restorer
from replayer.replay import restorer as restorer_of
from rewind import allocator, distributed, fingerprint, ranks_commit
from rewind.loaders import check_data_position
from rewind.results import CommitResult, RestoreResult
from rewind.snapshots import Snapshots, with_store
from rewind.staged import StagedCommit
from rewind.weights import CommittedWeights
from snapshotter.policies import Trigger
from snapshotter.service import CommittedSnapshots, SnapshotSource, SnapshotterThread

_ROLES = ("model", "optimizer", "scheduler", "sampler")
_logger = logging.getLogger(__name__)


class Recorder:
    """Records a training run's state transitions; restores them after a crash.

    ``objects`` are ``Stateful``. The tensors of ``model``, ``optimizer``, every ``extra``
    object (a target network, a normalizer; but those under 16 KiB, such as RNG states:
    ``eventlog.capture.INLINE_TENSOR_BYTES``) and every ``buffers`` object (a replay buffer)
    go to the tensor shards as XOR deltas: a commit writes only the chunks that changed
    since the previous version. The rest of their states, and ``scheduler``, ``sampler``, the
    global RNGs (``rng=True``) and every ``small`` object (counters, RNG and generator
    states: what changes whole at every commit), are small states (msgpack). Use as a
    context manager, or call ``close()``.

    ``restore()`` loads the newest sealed version: from the newest valid snapshot plus the
    versions after it in the log (through ``replayer.replay``). ``snapshots`` (a trigger such
    as ``every_versions(100)``, or ``Snapshots(...)``) has this recorder take them: when the
    trigger fires, the committer writes the version it has just committed from its own copy
    of it (the base of the next commit: no extra copy of the state), and ``close()`` first
    takes the snapshot that is due (``rewind.snapshots``). ``restorer``
    replaces how ``restore()`` rebuilds the state (an advanced hook; see
    ``replayer.replay.restorer``).

    ``settings`` (default ``eventlog.settings.current()``) gives the defaults of ``shards``,
    ``max_inflight`` and ``chunk_bytes``, and the codec's tuning (``predict_max_steps``,
    ``grad_compression``, ``codec_threads``).

    ``group``: the process group of a ``torch.distributed`` job whose every rank runs a
    ``Recorder`` on the same run (``rewind.distributed``): each rank records its own part
    (``shards`` tensor shards per rank) and rank 0 seals each version once every part is
    durable. ``None``: a single process. A ``DistributedDataParallel`` model is recorded as
    the model it wraps.

    ``weights`` (a serving dtype such as ``torch.bfloat16``, or a ``WeightsConfig``): this
    recorder publishes the run's weights stream for actors (``WeightsFollower``) itself, from
    its copy of each committed version, off the training thread (``rewind.weights``); the
    same stream ``rewind publish`` writes from the log, without replaying the optimizer.
    Single process only.
    """

    def __init__(
        self,
        run: RunAddress | str,
        model: torch.nn.Module | None = None,
        optimizer: Stateful | None = None,
        scheduler: Stateful | None = None,
        sampler: Stateful | None = None,
        rng: bool = True,
        extra: Mapping[str, Stateful] | None = None,
        *,
        buffers: Mapping[str, Stateful] | None = None,
        small: Mapping[str, Stateful] | None = None,
        shards: int | None = None,
        writer_id: str | None = None,
        max_inflight: int | None = None,
        chunk_bytes: int | None = None,
        restorer: Restorer | None = None,
        predictive: bool = True,
        settings: Settings | None = None,
        snapshots: Snapshots | Trigger | None = None,
        group: Any | None = None,
        weights: WeightsConfig | str | torch.dtype | None = None,
    ) -> None:
        address = run if isinstance(run, RunAddress) else RunAddress.from_env(run)
        self._snapshots = None if snapshots is None else Snapshots.of(snapshots)
        self.address = address if self._snapshots is None else with_store(address, self._snapshots)
        self.run_id = self.address.run_id
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            # Its names are the wrapped model's prefixed with "module.": recorded without the
            # wrapper, a run restores, follows and exports into the plain model.
            model = model.module
        check_data_position(sampler, rng)
        weights_config = _weights_config(weights, group)
        self._objects = _stateful_objects((model, optimizer, scheduler, sampler), rng,
                                          {"extra": extra, "buffer": buffers, "small": small})
        # A version recorded with an object's tensors inside its small state (as ``small``
        # objects are) restores all the same: its skeleton holds no references.
        self._tensor_roles = frozenset(TENSOR_ROLES) | frozenset(extra or {}) | frozenset(buffers or {})
        self._inline_roles = frozenset(extra or {})  # their small tensors stay in their small state
        settings = settings or current()
        shards = settings.shards if shards is None else shards
        max_inflight = settings.max_inflight if max_inflight is None else max_inflight
        chunk_bytes = settings.chunk_bytes if chunk_bytes is None else chunk_bytes
        if shards < 1 or chunk_bytes < 16 or max_inflight < 1:
            raise ConfigError("shards and max_inflight must be >= 1 and chunk_bytes >= 16")
        self._restorer = restorer or restorer_of(self.address)
        self._snapshotter: CommittedSnapshots | SnapshotterThread | None = None
        self._group = None if group is None else distributed.RankGroup(group)
        if self._group is not None and self._group.rank != 0:
            self._snapshots = None  # one snapshotter per run: rank 0's
        # The predictive codec watches the optimizer's steps through a pre-hook.
        self._plan: predictive_codec.StepPlan | str = (
            predictive_codec.StepPlan.of(model, optimizer) if predictive else "the predictive codec is off"
        )
        self._steps = (StepCapture(optimizer, settings.predict_max_steps)  # type: ignore[arg-type]
                       if isinstance(self._plan, predictive_codec.StepPlan) else None)
        self.writer_id = writer_id or f"{self.run_id}.trainer"
        if self._group is not None:
            self.writer_id += f".rank{self._group.rank}"
        # Events name the writer and this process's session: a new session after the same
        # writer id marks a recovery in the run's history.
        self.session = uuid.uuid4().hex[:8]
        self._log: EventLog = self.address.open_log()
        self._coord: Coordinator = self.address.open_coordinator()
        # An existing run keeps its shard count, whatever this process asked for.
        self._pipe = CommitPipeline(self._log, self._coord, self.run_id, self.writer_id,
                                    f"{self.writer_id}#{self.session}",
                                    shards=self._log.shard_count() or shards, chunk_bytes=chunk_bytes,
                                    settings=settings)
        self._refuse = ""  # why commit() refuses (a multi-rank run restored without group=)
        # Multi-rank: agrees on the run's shard count now; commits and restores through it.
        self._ranks = None if self._group is None else ranks_commit.RankCommit(
            self._pipe, self._group, shards, restorer, address=self.address, objects=self._objects,
            plan=self._plan, steps=self._steps)
        self._staging_slots = threading.Semaphore(max_inflight + 1)
        self._jobs: queue.Queue[StagedCommit | None] = queue.Queue(maxsize=max_inflight)
        self._failure: BaseException | None = None
        self._closed = False
        #: What the committer thread is doing, for the warning of a commit that waits long.
        self._busy = "idle"
        self._weights = None if weights_config is None else CommittedWeights(self.address, weights_config)
        self._committer = threading.Thread(target=self._run, name="rewind-committer", daemon=True)
        self._committer.start()

    # ------------------------------------------------------------------ training thread
    @property
    def version(self) -> int:
        """The newest version this recorder committed or restored (0: none)."""
        return self._pipe.base.version

    def commit(
        self,
        step: int,
        metrics: Mapping[str, float] | None = None,
        *,
        wait: bool = False,
        base_version: int | None = None,
        consumed: Iterable[Stamp] = (),
    ) -> Future[CommitResult]:
        """Record the current state as the next version; returns a future of its result.

        Blocks only to copy the state out, or while ``max_inflight`` commits are queued.
        ``wait=True`` returns once the version is durable. ``base_version`` makes the commit
        optimistic: it fails with ``StaleVersionError`` unless the run is at that version.
        ``consumed``: the stamps (``Follower.stamp()``) of the rollouts this version's steps
        trained on, recorded as its provenance (``eventlog.provenance``); on a multi-rank run,
        each rank gives the stamps of its own data.
        """
        self._check_usable()
        stamps = tuple(consumed)
        bad = next((s for s in stamps if not isinstance(s, Stamp)), None)
        if bad is not None:
            raise ConfigError(f"commit(consumed=...) takes Stamp objects (Follower.stamp()), got "
                              f"{type(bad).__name__} {bad!r:.60}")
        if self._refuse:
            raise ConfigError(self._refuse)
        if self._snapshots is not None and self._snapshotter is None:
            # Made here, not in __init__: a restore does not share the machine with it. A
            # single process writes each snapshot from its commit base (the version just
            # committed); a multi-rank one holds only its part, so rank 0 folds the log.
            holder = f"{self.writer_id}.snapshotter"
            self._snapshotter = (self._snapshots.committed(self.address, holder) if self._group is None
                                 else self._snapshots.start(self.address, holder))
        tensors, small, replicated = self._capture_part()
        layout = {n: (tensorcodec.dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()}
        with warned_wait(lambda: f"a free slot to stage the commit of step {step} of run {self.run_id!r} "
                         f"(every slot holds a commit in flight); the committer is {self._busy}", _logger):
            self._staging_slots.acquire()  # blocks while max_inflight + 1 commits are in flight
        try:
            staged = self._pipe.staging()
            for name, t in tensors.items():
                bits = tensorcodec.tensor_bits(t)
                buf = staged.get(name)
                if buf is None or buf.shape != bits.shape:
                    # Out of the malloc heap, where the trainer's gradients come and go.
                    buf = staged[name] = tensorcodec.host_buffer(len(bits))
                # torch's copy runs on its intra-op threads (numpy's copy on one core).
                torch.from_numpy(buf).copy_(torch.from_numpy(bits))
            # The copy is done: the log's deferred maintenance (e.g. a WAL checkpoint) may now
            # use the memory bus without slowing it.
            self._pipe.log_writer.maintenance_window()
            for name in list(staged):
                if name not in tensors:
                    del staged[name]
            job = StagedCommit(step, {k: float(v) for k, v in (metrics or {}).items()}, base_version,
                               staged, layout, small, Future(),
                               steps=self._steps.take() if self._steps else [], replicated=replicated,
                               environment=(fingerprint.environment(EnvironmentFingerprint.START)
                                            if self.version == 0 else None), consumed=stamps)
            self._jobs.put(job)
        except BaseException:
            self._staging_slots.release()  # no job will give it back
            raise
        if wait:
            with warned_wait(lambda: f"the commit of step {step} of run {self.run_id!r} to be durable; the "
                             f"committer is {self._busy}", _logger):
                job.future.result()
        return job.future

    def flush(self) -> None:
        """Wait until every queued commit is durable (raises the first failure), and until the
        buffers the last ``restore()`` prepares on a thread of its own are ready."""
        self._pipe.wait_ahead()
        done: Future[CommitResult] = Future()
        marker = StagedCommit(-1, {}, None, {}, {}, {}, done, flush_only=True)
        self._jobs.put(marker)
        with warned_wait(lambda: f"the queued commits of run {self.run_id!r} to be durable; the committer "
                         f"is {self._busy}", _logger):
            done.result()
        self._check_usable()

    def restore(self) -> RestoreResult:
        """Load the newest sealed version into the objects; returns the step to resume after.

        The state is rebuilt from the newest snapshot that verifies plus the log after it, and
        checked against the version's seal before anything is loaded."""
        self._check_usable()
        self.flush()
        if self._group is not None:
            return self._restore_group()
        t0 = time.perf_counter()
        try:
            if self._log.shard_count() is None:
                raise RunNotFoundError(self.run_id)
            state, report = self._restorer(self._log)
        except RunNotFoundError:
            # No sealed version (a crash inside the very first commit leaves none): fresh run,
            # and the coordinator forgets any version the crashed commit had claimed.
            self._coord.reset_version(self.run_id, 0)
            self._stage_ahead(sets=2)  # the first commit's staging becomes the base: the second needs one
            return RestoreResult(step=None, version=0, seconds=time.perf_counter() - t0)
        world = distributed.recorded_world(state)
        load_into(self._objects, full_state(state) if world else state)
        if world:
            self._refuse = (f"run {self.run_id!r} was recorded by {world} ranks: a Recorder without group= "
                            "restores it (full tensors, rank 0's other states) but cannot record into it; "
                            f"continue it with group= at any world size up to its shard count "
                            f"({self._log.shard_count()})")
        if self._steps is not None:
            self._steps.take()  # steps taken before the restore led to another state
        # The rebuilt bits become the XOR base of the next commit themselves: the objects
        # were loaded with copies (``load_into``), so nothing else writes into them. (Bits
        # still in a snapshot file's map, from a restorer that mapped it, are copied on the
        # staging thread started below, as a rank's are.)
        base = self._pipe.base
        if self._weights is not None:
            self._weights.wait_base()  # its thread may still read the base retired here
        self._pipe.retire_base()
        base.bits = {n: t.bits for s in state.shards for n, t in s.tensors.items()}
        base.chunk_digests = {}
        base.specs, base.layout = state.layout.tensors, state.layout
        # Chunk boundaries are part of the digests: keep the run's, whatever this process set.
        self._pipe.chunk_bytes = state.layout.chunk_bytes
        base.small = dict(state.small.states)
        base.version = state.version
        if self._weights is not None:
            self._weights.restored(base.version, base.specs, base.bits)
        base.last_gsn = max([state.seal.gsn, *(e.gsn for _, e in state.index.markers)])
        # The log is the truth: the coordinator's version and gsn counter follow it.
        self._coord.reset_version(self.run_id, state.version)
        self._coord.raise_gsn_floor(self.run_id, base.last_gsn)
        fingerprint.log_resume(self._pipe, state, report)
        result = _restored(state, report, t0)
        # The restored state is the base already: one staging set, faulted in on a thread of
        # its own while training resumes (the first commit waits for it if it must).
        self._stage_ahead(sets=1, background=True)
        return result

    def _stage_ahead(self, sets: int, *, background: bool = False) -> None:
        """Pay here, at restore() (``background``: on a thread of its own, started here), for
        the staging buffers the first commits copy into, so that no commit() faults fresh
        memory in on the training thread: the objects' tensors, and the moments that a first
        Adam step will create."""
        tensors = self._capture_part()[0]
        sizes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
        if isinstance(self._plan, predictive_codec.StepPlan) and self._plan.optimizer in ("Adam", "AdamW"):
            for i, param in enumerate(self._plan.params):
                for key in ("exp_avg", "exp_avg_sq"):
                    if param in sizes:
                        sizes.setdefault(f"{predictive_codec.state_prefix(i)}/{key}", sizes[param])
        self._pipe.add_staging(sizes, sets, background=background)

    def close(self) -> None:
        """Write every queued commit, then release threads and connections."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        with warned_wait(lambda: f"the queued commits of run {self.run_id!r} to be written before the "
                         f"recorder closes; the committer is {self._busy}", _logger):
            self._committer.join()
        if isinstance(self._snapshotter, CommittedSnapshots):
            if self._failure is None:
                self._offer_snapshot()  # the one a time trigger made due since the last commit
            self._snapshotter.close()
        elif self._snapshotter is not None:
            with warned_wait(lambda: f"the snapshotter of run {self.run_id!r} to finish its last snapshot "
                             "before the recorder closes", _logger):
                self._snapshotter.stop(final=self._failure is None)
        try:
            if self._weights is not None:
                self._weights.close()
        finally:
            if self._steps is not None:
                self._steps.close()
            self._pipe.close()
            self._log.close()
            self._coord.close()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise RewindError("recorder is closed")
        if self._failure is not None:
            raise RewindError(
                f"recorder stopped after a failed commit ({type(self._failure).__name__}: "
                f"{self._failure}); create a new Recorder and restore()"
            ) from self._failure

    def _capture_part(self) -> tuple[dict[str, torch.Tensor], dict[str, bytes], frozenset[str]]:
        """What a commit stages: this process's tensors (a rank's local shards), small states,
        and the names of the tensors every rank holds alike (replicated)."""
        if self._group is None:
            return *self._capture(), frozenset()
        part = distributed.capture(self._objects, self._tensor_roles, self._group.rank, self._group.world,
                                   inline=self._inline_roles)
        return part.tensors, part.small, frozenset(part.replicated)

    def _capture(self) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
        tensors: dict[str, torch.Tensor] = {}
        small: dict[str, bytes] = {}
        for name, obj in self._objects.items():
            tree = obj.state_dict()
            if name in self._tensor_roles:
                found, tree = flatten(name, tree, INLINE_TENSOR_BYTES if name in self._inline_roles else 0)
                tensors.update(found)
            small[name] = statecodec.pack(tree)
        return tensors, small

    # ------------------------------------------------------------------ committer thread
    def _run(self) -> None:
        intraop.serial_torch()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.flush_only:
                job.future.set_result(None)  # type: ignore[arg-type]
                continue
            try:
                if self._failure is not None:
                    job.future.set_exception(self._failure)
                else:
                    if self._weights is not None:
                        self._busy = f"waiting for the weights stream to read version {self.version}"
                        self._weights.wait_base()
                    self._busy = f"writing version {self.version + 1} (step {job.step}) to the log"
                    job.future.set_result(self._write(job) if self._group is None else self._write_group(job))
                    # The version's encode buffers go back to the kernel before the trainer's
                    # next step allocates: they are not held while a snapshot is written.
                    allocator.trim()
                    # After the result: training goes on meanwhile, and the next commit is
                    # written once the snapshot no longer reads the base it replaces.
                    self._busy = f"writing the snapshot of version {self.version}, if one is due"
                    self._offer_snapshot()
                    if self._weights is not None:
                        base = self._pipe.base
                        self._weights.offer(base.version, job.step, base.specs, base.bits)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
                self._failure = exc
                if not job.future.done():
                    job.future.set_exception(exc)
            finally:
                self._busy = "idle"
                self._staging_slots.release()
                # Not held while waiting for the next job: its gradients would stay pinned
                # through the trainer's next backward pass.
                job = None

    def _write(self, job: StagedCommit) -> CommitResult:
        t0 = time.perf_counter()
        pipe, prev = self._pipe, self._pipe.base
        version = prev.version + 1
        base = prev.version if job.base_version is None else job.base_version
        if base != prev.version:
            raise StaleVersionError(base, prev.version)
        job.record_consumed(version, PROVENANCE)
        specs = prev.specs
        relayout = {s.name: (s.dtype, tuple(s.shape)) for s in specs} != job.layout
        if relayout:
            owners = (self._plan.owners(list(job.layout))
                      if isinstance(self._plan, predictive_codec.StepPlan) else {})
            specs = assign_shards(job.layout, pipe.shards, specs, owners)
        spec_of = {s.name: s for s in specs}
        t_encode = time.perf_counter()
        prediction, why_not = pipe.predict(self._plan, job.steps, spec_of, prev.bits, relayout, prev.version)
        job.steps = []  # a prediction holds the gradients until it has logged them; then they may be freed
        encode_seconds = time.perf_counter() - t_encode

        # A small state this process no longer records (restored with fewer objects) stays in
        # the version as the fold keeps it: carried forward, so the seal's digest covers it.
        small = {**prev.small, **job.small}
        layout, head = prev.layout, list[Body]()
        if relayout:
            layout = pipe.layout_event(specs, small)
            head.append(layout)
            if version == 1 and job.environment is not None:
                head.append(job.environment)
        control = pipe.control_events(head, small, job.metrics)
        raw = sum(len(b) for b in job.staged.values())
        # Events are written as they are encoded, so their gsns are claimed before it is known
        # which chunks changed: the most the version can have; the rest are never used.
        most = (len(control) + 1 + sum(len(tensorcodec.chunk_ranges(len(b), pipe.chunk_bytes))
                                       for b in job.staged.values())
                + (prediction.event_count(pipe.chunk_bytes) if prediction else 0))

        self._log.create(pipe.shards)
        with pipe.transaction(version, job.step, most, claim_from=base) as emit:
            if prediction:
                for shard, body in pipe.prediction_events(prediction):
                    emit(shard, body)
                encode_seconds += prediction.busy / pipe.settings.resolved_codec_threads()
            chunk_digests, residual, seconds = pipe.encode(
                job.staged, spec_of, prediction.predicted if prediction else set(), emit)
            encode_seconds += seconds
            tensor_digests: list[dict[str, bytes]] = [{} for _ in range(pipe.shards)]
            for s in specs:
                tensor_digests[s.shard][s.name] = tensor_digest(s.name, s.dtype, s.shape,
                                                                chunk_digests[s.name])
            enc = residual + (prediction.grad_bytes if prediction else 0)
            codec = pipe.codec(prediction, why_not)
            control.append(pipe.seal(base, emit.shard_counts, len(control),
                                     [shard_digest(d) for d in tensor_digests], small, codec, raw, enc))
            for event in control:
                emit(CONTROL, event)
        gsn = emit.gsn
        pipe.advance(job.staged, specs, chunk_digests, small, version, gsn - 1)
        prev.layout = layout
        return CommitResult(version, job.step, gsn - emit.first, raw, enc, time.perf_counter() - t0, codec,
                            residual, encode_seconds)

    def _offer_snapshot(self) -> None:
        """Let the snapshots write the base version (just committed), if their trigger says so."""
        base = self._pipe.base
        if isinstance(self._snapshotter, CommittedSnapshots) and base.version and base.bits \
                and self._snapshotter.offer(base.version, self._snapshot_source) is not None:
            allocator.trim()  # what the snapshot's writer threads freed

    def _snapshot_source(self, control_next: int) -> SnapshotSource:
        """The base version's whole state for a snapshot, without copies: its bits are the
        base buffers (untouched until the next commit is written), ``control_next`` the control
        offset after its seal. Every event of this version and of the ones before has a gsn
        at or below the seal's, the applied gsn of every shard."""
        base = self._pipe.base
        sealed = base.last_gsn
        shards = [ShardState(s, applied_gsn=sealed, version=base.version,
                             next_offset=self._log.end_offset(s)) for s in range(self._pipe.shards)]
        for spec in base.specs:
            bits = base.bits[spec.name]
            shards[spec.shard].tensors[spec.name] = TensorBits(spec.dtype, tuple(spec.shape), bits)
        kinds = {name: SMALL_KINDS.get(name, CustomState).__name__ for name in base.small}
        small = SmallStates(dict(base.small), kinds, sealed, next_offset=control_next)
        assert base.layout is not None, "a committed or restored version has a layout"
        return SnapshotSource(base.version, shards, small, base.layout)

    # ------------------------------------------------------------------ multi-rank
    def _write_group(self, job: StagedCommit) -> CommitResult:
        """One rank's side of a multi-rank version (``rewind.ranks_commit``)."""
        assert self._ranks is not None
        return self._ranks.write(job)

    def _restore_group(self) -> RestoreResult:
        """Each rank loads its own part of the newest sealed version (``rewind.ranks_commit``)."""
        assert self._ranks is not None
        t0 = time.perf_counter()
        restored = self._ranks.restore()
        if restored is None:
            return RestoreResult(step=None, version=0, seconds=time.perf_counter() - t0)
        result = _restored(*restored, t0)
        # As in one process: one staging set, faulted in on a thread while training resumes;
        # the same thread first copies base bits still in the snapshot's map (``_load``).
        self._stage_ahead(sets=1, background=True)
        return result


def _stateful_objects(roles: tuple[Stateful | None, ...], rng: bool,
                      named: Mapping[str, Mapping[str, Stateful] | None]) -> dict[str, Stateful]:
    """The recorded objects by name: the model, optimizer, scheduler and sampler given (in
    ``roles``), the global RNGs, then each named object (``named``: by kind, e.g. ``extra``)."""
    objects: dict[str, Stateful] = {}
    for name, obj in zip(_ROLES, roles, strict=True):
        if obj is None:
            continue
        if not isinstance(obj, Stateful):
            # Checked here: the first commit() would fail far from the mistake.
            raise ConfigError(f"{name}={type(obj).__name__} has no state_dict/load_state_dict; "
                              "pass an object with both (wrap it if needed)")
        objects[name] = obj
    if rng:
        objects["rng"] = GlobalRng()
    for kind, given in named.items():
        for name, obj in (given or {}).items():
            if name in objects or name in (*_ROLES, "rng", PROVENANCE):
                raise ConfigError(f"{kind} state name {name!r} is reserved or used twice")
            if not isinstance(obj, Stateful):
                raise ConfigError(f"{kind} state {name!r} has no state_dict/load_state_dict")
            objects[name] = obj
    return objects


def _weights_config(weights: WeightsConfig | str | torch.dtype | None, group: object) -> WeightsConfig | None:
    """``Recorder(weights=...)`` as a config, checked before anything is opened."""
    if weights is None:
        return None
    if group is not None:
        raise ConfigError("weights=: a multi-rank run's weights stream is published by `rewind publish "
                          "--follow` (each rank holds only its part of the model)")
    return weights if isinstance(weights, WeightsConfig) else WeightsConfig(dtype=serving_dtype(weights))


def _restored(state: RebuiltState, report: ReplayReport, t0: float) -> RestoreResult:
    """What a restore that loaded ``state`` reports (``t0``: when it began)."""
    c = state.counts
    return RestoreResult(
        step=state.step, version=state.version, applied=c.applied,
        skipped=c.skipped_by_snapshot + c.skipped_duplicate + c.skipped_unsealed,
        seconds=time.perf_counter() - t0, source=state.source, snapshot=report.snapshot_id,
        snapshot_version=report.snapshot_version, tail=report.tail_versions,
        passed_over=tuple(report.passed_over), state_digest=report.state_digest,
    )
