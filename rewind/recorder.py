"""Trainer hooks: ``Recorder`` turns each ``commit()`` into one sealed version in the log.

On the training thread, ``commit()`` only copies the state out (tensor bits into staging
buffers, small states into msgpack) and queues it; a bounded queue gives backpressure.
A committer thread encodes the tensors in parallel, allocates gsns, takes the version CAS
and writes the version's events in one log transaction, sealed by ``CommitSealed``.

Two codecs: when the version is one or two supported optimizer steps after the previous
one, the *predictive* codec (``predictive``) logs the steps' gradients and only the residual
of the replayed step; otherwise tensors are XOR deltas of the previous version's bits.

The module is longer than most because the training-thread side and the committer thread
share one set of state (staging buffers, the base version, the in-flight queue) whose
hand-offs are easiest to check when they sit in one class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from eventlog import crypto, intraop, serde, statecodec, tensorcodec
from eventlog import predictive as predictive_codec
from eventlog.backends import RunAddress
from eventlog.capture import TENSOR_ROLES, GlobalRng, Stateful, flatten, load_into
from eventlog.digests import shard_digest, small_digest, state_digest, tensor_digest
from eventlog.errors import (
    ConfigError,
    RewindError,
    RunNotFoundError,
    StaleVersionError,
)
from eventlog.events import (
    CONTROL_SHARD,
    Body,
    CommitSealed,
    CustomState,
    Envelope,
    EnvironmentFingerprint,
    Metrics,
    RngAdvance,
    RunStarted,
    SamplerCursor,
    SchedulerStep,
    TensorDelta,
    TensorSpec,
)
from eventlog.fold.apply import ShardState, TensorBits
from eventlog.fold.engine import RebuiltState, SmallStates, index_control
from eventlog.layout import assign_shards, config_digest
from eventlog.optimstep import CapturedStep, StepCapture
from eventlog.ports import CONTROL, Coordinator, EventLog, LogTransaction
from eventlog.settings import Settings, current
from replayer.assemble import full_state
from replayer.replay import ReplayReport, Restorer
from replayer.replay import restorer as restorer_of
from rewind import allocator, distributed, fingerprint, ranks_commit
from rewind.results import CommitResult, RestoreResult
from rewind.snapshots import Snapshots, with_store
from schemas import SCHEMA_VERSION
from snapshotter.policies import Trigger
from snapshotter.service import CommittedSnapshots, SnapshotSource, SnapshotterThread

REWIND_VERSION = "0.1.0"
T = TypeVar("T")
_KINDS: dict[str, type[Any]] = {
    "scheduler": SchedulerStep, "sampler": SamplerCursor, "rng": RngAdvance,
}


@dataclass
class _Job:
    step: int
    metrics: dict[str, float]
    base_version: int | None
    staged: dict[str, np.ndarray]
    layout: dict[str, tuple[str, tuple[int, ...]]]
    small: dict[str, bytes]
    future: Future[CommitResult]
    flush_only: bool = False
    steps: list[CapturedStep] = field(default_factory=list)
    #: Multi-rank: replicated tensors in ``staged`` (rank 0 writes them; the others hash them).
    replicated: frozenset[str] = frozenset()
    #: The training thread's environment (its thread count is the training thread's, not
    #: the committer's), taken while the run has no version: version 1 logs it.
    environment: EnvironmentFingerprint | None = None


class Recorder:
    """Records a training run's state transitions; restores them after a crash.

    ``objects`` are ``Stateful``: ``model`` and ``optimizer`` go to the tensor shards,
    ``scheduler``, ``sampler``, the global RNGs (``rng=True``) and every ``extra`` object
    are small states. The tensors in each ``buffers`` object's state (a replay buffer, say)
    go to the tensor shards too, as XOR deltas: a commit writes only the chunks that
    changed since the previous version. Use as a context manager, or call ``close()``.

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
        shards: int | None = None,
        writer_id: str | None = None,
        max_inflight: int | None = None,
        chunk_bytes: int | None = None,
        restorer: Restorer | None = None,
        predictive: bool = True,
        settings: Settings | None = None,
        snapshots: Snapshots | Trigger | None = None,
        group: Any | None = None,
    ) -> None:
        address = run if isinstance(run, RunAddress) else RunAddress.from_env(run)
        self._snapshots = None if snapshots is None else Snapshots.of(snapshots)
        self.address = address if self._snapshots is None else with_store(address, self._snapshots)
        self.run_id = self.address.run_id
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            # Its names are the wrapped model's prefixed with "module.": recorded without the
            # wrapper, a run restores, follows and exports into the plain model.
            model = model.module
        objects: dict[str, Stateful] = {}
        for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler),
                          ("sampler", sampler)):
            if obj is None:
                continue
            if not isinstance(obj, Stateful):
                # Checked here: the first commit() would fail far from the mistake.
                raise ConfigError(f"{name}={type(obj).__name__} has no state_dict/load_state_dict; "
                                  "pass an object with both (wrap it if needed)")
            objects[name] = obj
        if rng:
            objects["rng"] = GlobalRng()
        for kind, given in (("extra", extra), ("buffer", buffers)):
            for name, obj in (given or {}).items():
                if name in objects or name in ("model", "optimizer", "scheduler", "sampler", "rng"):
                    raise ConfigError(f"{kind} state name {name!r} is reserved or used twice")
                if not isinstance(obj, Stateful):
                    raise ConfigError(f"{kind} state {name!r} has no state_dict/load_state_dict")
                objects[name] = obj
        self._tensor_roles = frozenset(TENSOR_ROLES) | frozenset(buffers or {})
        settings = settings or current()
        shards = settings.shards if shards is None else shards
        max_inflight = settings.max_inflight if max_inflight is None else max_inflight
        chunk_bytes = settings.chunk_bytes if chunk_bytes is None else chunk_bytes
        self._settings = settings
        if shards < 1 or chunk_bytes < 16 or max_inflight < 1:
            raise ConfigError("shards and max_inflight must be >= 1 and chunk_bytes >= 16")
        self._objects = objects
        self._shards = shards
        self._chunk_bytes = chunk_bytes
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
        self._shards = self._log.shard_count() or shards
        # Becoming the writer fences any older process with the same writer id (a zombie).
        self._writer = self._log.writer(self.writer_id)
        self._refuse = ""  # why commit() refuses (a multi-rank run restored without group=)
        # Multi-rank: agrees on the run's shard count now; commits and restores through it.
        self._ranks = None if self._group is None else ranks_commit.RankCommit(
            self, self._group, shards, restorer, _Emitter, _KINDS, REWIND_VERSION)
        self._serialize = serde.EnvelopeSerializer()
        # Last committed state: the XOR base, its chunk digests, its layout, its small states.
        self._version = 0
        self._last_gsn = 0
        self._prev: dict[str, np.ndarray] = {}
        self._prev_chunks: dict[str, list[bytes]] = {}
        self._specs: tuple[TensorSpec, ...] = ()
        self._small: dict[str, bytes] = {}
        self._layout: RunStarted | None = None  # the base version's (a snapshot records it)
        # Staging buffer sets freed by a commit (the base it replaced), newest last: reused
        # newest first, so a trainer that waits for each commit only ever has two sets (this
        # base and one staging); a new set is made only when every freed one is in flight.
        self._spare: list[dict[str, np.ndarray]] = []
        self._spare_lock = threading.Lock()
        self._staging_slots = threading.Semaphore(max_inflight + 1)
        self._window = 2 * settings.resolved_codec_threads()  # encoded chunks held ahead of the writer
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=max_inflight)
        self._pool = ThreadPoolExecutor(settings.resolved_codec_threads(), thread_name_prefix="rewind-codec",
                                        initializer=intraop.serial_torch)
        self._failure: BaseException | None = None
        self._closed = False
        self._committer = threading.Thread(target=self._run, name="rewind-committer", daemon=True)
        self._committer.start()

    # ------------------------------------------------------------------ training thread
    @property
    def version(self) -> int:
        """The newest version this recorder committed or restored (0: none)."""
        return self._version

    def commit(
        self,
        step: int,
        metrics: Mapping[str, float] | None = None,
        *,
        wait: bool = False,
        base_version: int | None = None,
    ) -> Future[CommitResult]:
        """Record the current state as the next version; returns a future of its result.

        Blocks only to copy the state out, or while ``max_inflight`` commits are queued.
        ``wait=True`` returns once the version is durable. ``base_version`` makes the commit
        optimistic: it fails with ``StaleVersionError`` unless the run is at that version.
        """
        self._check_usable()
        if self._refuse:
            raise ConfigError(self._refuse)
        if self._snapshots is not None and self._snapshotter is None:
            # Made here, not in __init__: a restore does not share the machine with it. A
            # single process writes each snapshot from its commit base (the version just
            # committed); a multi-rank one holds only its part, so rank 0 folds the log.
            holder = f"{self.writer_id}.snapshotter"
            self._snapshotter = (self._snapshots.committed(self.address, holder) if self._group is None
                                 else self._snapshots.start(self.address, holder))
        replicated: frozenset[str] = frozenset()
        if self._group is None:
            tensors, small = self._capture()
        else:
            part = distributed.capture(self._objects, self._tensor_roles, self._group.rank, self._group.world)
            tensors, small, replicated = part.tensors, part.small, frozenset(part.replicated)
        layout = {n: (tensorcodec.dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()}
        self._staging_slots.acquire()  # blocks while max_inflight + 1 commits are in flight
        try:
            with self._spare_lock:
                staged = self._spare.pop() if self._spare else {}
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
            self._writer.maintenance_window()
            for name in list(staged):
                if name not in tensors:
                    del staged[name]
            job = _Job(step, {k: float(v) for k, v in (metrics or {}).items()}, base_version,
                       staged, layout, small, Future(), steps=self._steps.take() if self._steps else [],
                       replicated=replicated,
                       environment=(fingerprint.environment(EnvironmentFingerprint.START)
                                    if self._version == 0 else None))
            self._jobs.put(job)
        except BaseException:
            self._staging_slots.release()  # no job will give it back
            raise
        if wait:
            job.future.result()
        return job.future

    def flush(self) -> None:
        """Wait until every queued commit is durable (raises the first failure)."""
        done: Future[CommitResult] = Future()
        marker = _Job(-1, {}, None, {}, {}, {}, done, flush_only=True)
        self._jobs.put(marker)
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
        # The restored state becomes the XOR base of the next commit (in host buffers, as
        # the bases commits keep: not in the heap below the trainer's allocations).
        self._prev = {n: _host_copy(t.bits) for s in state.shards for n, t in s.tensors.items()}
        self._prev_chunks = {}
        self._specs, self._layout = state.layout.tensors, state.layout
        # Chunk boundaries are part of the digests: keep the run's, whatever this process set.
        self._chunk_bytes = state.layout.chunk_bytes
        self._small = dict(state.small.states)
        self._version = state.version
        self._last_gsn = max([state.seal.gsn, *(e.gsn for _, e in state.index.markers)])
        # The log is the truth: the coordinator's version and gsn counter follow it.
        self._coord.reset_version(self.run_id, state.version)
        self._coord.raise_gsn_floor(self.run_id, self._last_gsn)
        self._last_gsn = fingerprint.log_resume(self._writer, self._coord, self.run_id,
                                                f"{self.writer_id}#{self.session}", state, report)
        return _restored(state, report, t0)

    def close(self) -> None:
        """Write every queued commit, then release threads and connections."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._committer.join()
        if isinstance(self._snapshotter, CommittedSnapshots):
            if self._failure is None:
                self._offer_snapshot()  # the one a time trigger made due since the last commit
            self._snapshotter.close()
        elif self._snapshotter is not None:
            self._snapshotter.stop(final=self._failure is None)
        if self._steps is not None:
            self._steps.close()
        self._pool.shutdown()
        self._writer.close()
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

    def _capture(self) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
        tensors: dict[str, torch.Tensor] = {}
        small: dict[str, bytes] = {}
        for name, obj in self._objects.items():
            tree = obj.state_dict()
            if name in self._tensor_roles:
                found, tree = flatten(name, tree)
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
                    job.future.set_result(self._write(job) if self._group is None else self._write_group(job))
                    # The version's encode buffers go back to the kernel before the trainer's
                    # next step allocates: they are not held while a snapshot is written.
                    allocator.trim()
                    # After the result: training goes on meanwhile, and the next commit is
                    # written once the snapshot no longer reads the base it replaces.
                    self._offer_snapshot()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
                self._failure = exc
                if not job.future.done():
                    job.future.set_exception(exc)
            finally:
                self._staging_slots.release()
                # Not held while waiting for the next job: its gradients would stay pinned
                # through the trainer's next backward pass.
                job = None

    def _write(self, job: _Job) -> CommitResult:
        t0 = time.perf_counter()
        version = self._version + 1
        base = self._version if job.base_version is None else job.base_version
        if base != self._version:
            raise StaleVersionError(base, self._version)
        specs = self._specs
        relayout = {s.name: (s.dtype, tuple(s.shape)) for s in specs} != job.layout
        if relayout:
            owners = (self._plan.owners(list(job.layout))
                      if isinstance(self._plan, predictive_codec.StepPlan) else {})
            specs = assign_shards(job.layout, self._shards, specs, owners)
        spec_of = {s.name: s for s in specs}
        t_encode = time.perf_counter()
        prediction, why_not = self._predict(job, spec_of, relayout)
        job.steps = []  # a prediction holds the gradients until it has logged them; then they may be freed
        encode_seconds = time.perf_counter() - t_encode

        control: list[Body] = []
        layout = self._layout
        if relayout:
            layout = RunStarted(
                self._shards, specs, tuple(sorted(job.small)), config_digest(specs, list(job.small)),
                torch.__version__, "cuda" if torch.cuda.is_available() else "cpu",
                REWIND_VERSION, SCHEMA_VERSION, self._chunk_bytes)
            control.append(layout)
            if version == 1 and job.environment is not None:
                control.append(job.environment)
        for name, state in sorted(job.small.items()):
            if self._small.get(name) != state:
                control.append(_KINDS.get(name, CustomState)(name, state))
        if job.metrics:
            control.append(Metrics(job.metrics))
        raw = sum(len(b) for b in job.staged.values())
        # Events are written as they are encoded, so their gsns are claimed before it is known
        # which chunks changed: the most the version can have; the rest are never used.
        most = (len(control) + 1 + sum(len(tensorcodec.chunk_ranges(len(b), self._chunk_bytes))
                                       for b in job.staged.values())
                + (prediction.event_count(self._chunk_bytes) if prediction else 0))

        self._log.create(self._shards)
        self._claim_version(base, version)
        try:
            first = self._allocate_gsns(most)
            with self._writer.transaction() as txn:
                emit = _Emitter(self, txn, version, job.step, first)
                if prediction:
                    # Each shard's gradients and steps come before its residuals.
                    for shard, body in prediction.events(self._pool, self._chunk_bytes,
                                                         self._settings.grad_compression, self._window):
                        emit(shard, body)
                    encode_seconds += prediction.busy / self._settings.resolved_codec_threads()
                chunk_digests, residual, seconds = self._encode(
                    job, spec_of, prediction.predicted if prediction else set(), emit)
                encode_seconds += seconds

                tensor_digests: list[dict[str, bytes]] = [{} for _ in range(self._shards)]
                for s in specs:
                    tensor_digests[s.shard][s.name] = tensor_digest(s.name, s.dtype, s.shape,
                                                                    chunk_digests[s.name])
                shard_digests = tuple(shard_digest(d) for d in tensor_digests)
                small_dig = small_digest(job.small)
                enc = residual + (prediction.grad_bytes if prediction else 0)
                if prediction:
                    codec = (f"predictive/{self._plan.optimizer} x{prediction.steps} "  # type: ignore[union-attr]
                             f"+ gradients/{self._settings.grad_compression} + residual/blosc2-zstd")
                else:
                    codec = f"xor-delta/blosc2-zstd (not predictive: {why_not})"
                control.append(CommitSealed(
                    base, tuple(emit.shard_counts), len(control), shard_digests, small_dig,
                    state_digest(shard_digests, small_dig), codec, raw, enc))
                for event in control:
                    emit(CONTROL, event)
            gsn = emit.gsn
        except BaseException:
            # Give the version back, so a retry after restore() is not stale.
            with contextlib.suppress(RewindError):
                self._coord.compare_and_set_version(self.run_id, version, base)
            raise
        self._advance(job, specs, chunk_digests, dict(job.small), version, gsn - 1)
        self._layout = layout
        return CommitResult(version, job.step, gsn - first, raw, enc, time.perf_counter() - t0, codec,
                            residual, encode_seconds)

    def _offer_snapshot(self) -> None:
        """Let the snapshots write the base version (just committed), if their trigger says so."""
        if isinstance(self._snapshotter, CommittedSnapshots) and self._version and self._prev \
                and self._snapshotter.offer(self._version, self._snapshot_source) is not None:
            allocator.trim()  # what the snapshot's writer threads freed

    def _snapshot_source(self, control_next: int) -> SnapshotSource:
        """The base version's whole state for a snapshot, without copies: its bits are the
        base buffers (untouched until the next commit is written), ``control_next`` the control
        offset after its seal. Every event of this version and of the ones before has a gsn
        at or below the seal's, the applied gsn of every shard."""
        sealed = self._last_gsn
        shards = [ShardState(s, applied_gsn=sealed, version=self._version,
                             next_offset=self._log.end_offset(s)) for s in range(self._shards)]
        for spec in self._specs:
            bits = self._prev[spec.name]
            shards[spec.shard].tensors[spec.name] = TensorBits(spec.dtype, tuple(spec.shape), bits)
        kinds = {name: _KINDS.get(name, CustomState).__name__ for name in self._small}
        small = SmallStates(dict(self._small), kinds, sealed, next_offset=control_next)
        assert self._layout is not None, "a committed or restored version has a layout"
        return SnapshotSource(self._version, shards, small, self._layout)

    def _advance(self, job: _Job, specs: tuple[TensorSpec, ...], chunk_digests: dict[str, list[bytes]],
                 small: dict[str, bytes], version: int, last_gsn: int) -> None:
        """Make a sealed version the recorder's base: its bits the next XOR base (the old
        base's buffers are reused), its layout and small states the ones to compare with."""
        old = self._prev
        self._prev = job.staged
        self._prev_chunks = chunk_digests
        if old:
            with self._spare_lock:
                self._spare.append(old)
        self._specs, self._small = specs, small
        self._version, self._last_gsn = version, last_gsn

    # ------------------------------------------------------------------ multi-rank
    def _write_group(self, job: _Job) -> CommitResult:
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
        return _restored(*restored, t0)

    def _allocate_gsns(self, count: int) -> int:
        """The first of ``count`` fresh gsns, all above every gsn this recorder has seen."""
        first = self._coord.allocate_gsns(self.run_id, count)
        if first <= self._last_gsn:
            # The coordinator lost its counter (e.g. Redis flushed): rebuild it from ours.
            self._coord.raise_gsn_floor(self.run_id, self._last_gsn)
            first = self._coord.allocate_gsns(self.run_id, count)
        return first

    def _predict(
        self, job: _Job, spec_of: Mapping[str, TensorSpec], relayout: bool
    ) -> tuple[predictive_codec.Prediction | None, str | None]:
        """The version's predictive part, or ``None`` and why this version is XOR deltas."""
        why_not = predictive_codec.check(self._plan, job.steps, spec_of, self._prev, relayout,
                                         self._version, self._settings.predict_max_steps)
        if why_not is not None:
            return None, why_not
        assert isinstance(self._plan, predictive_codec.StepPlan)
        try:
            return predictive_codec.predict(self._plan, job.steps, spec_of, self._prev), None
        except Exception as exc:  # noqa: BLE001 - a step torch refuses must not stop training
            # Refused on copies: the previous bits are untouched, and deltas against them stand.
            return None, f"the {self._plan.optimizer} step could not be replayed ({exc})"

    def _claim_version(self, base: int, version: int) -> None:
        """The version CAS; if the coordinator lost its state (Redis flushed or restarted
        empty), rebuild it from the log, the truth, and claim again once."""
        try:
            self._coord.compare_and_set_version(self.run_id, base, version)
        except StaleVersionError as exc:
            if exc.actual != 0 or base == 0:
                raise
            if index_control(self._log).latest_version() != base:
                raise
            self._coord.reset_version(self.run_id, base)
            self._coord.compare_and_set_version(self.run_id, base, version)

    def _encode(
        self, job: _Job, spec_of: Mapping[str, TensorSpec], predicted: set[str],
        emit: Callable[[int, Body], None],
    ) -> tuple[dict[str, list[bytes]], int, float]:
        """Encode every chunk of every tensor in parallel and ``emit`` each changed one as it
        comes; returns the chunk digests, the payload bytes, and the encoding's seconds on
        the pool (its work over the pool's threads: what it adds to a commit not overlapped
        with writing).

        Tensors in ``predicted`` are encoded against the prediction (now in ``self._prev``):
        their chunks are residuals, and an unchanged chunk is one the prediction got right."""
        keys: list[tuple[str, int]] = []
        calls: list[Callable[[], tuple[tensorcodec.EncodedChunk | None, float]]] = []
        old_specs = {s.name: (s.dtype, tuple(s.shape)) for s in self._specs}
        for name, new in job.staged.items():
            spec = spec_of[name]
            same = old_specs.get(name) == (spec.dtype, tuple(spec.shape))
            prev = self._prev.get(name) if same else None
            size = tensorcodec.itemsize(spec.dtype)
            ranges = tensorcodec.chunk_ranges(len(new), self._chunk_bytes)
            for i, (off, n) in enumerate(ranges):
                keys.append((name, i))
                calls.append(functools.partial(
                    _timed, tensorcodec.encode_chunk, new[off:off + n],
                    None if prev is None else prev[off:off + n], typesize=size,
                    base_version=self._version, index=i, count=len(ranges), offset=off))
        digests: dict[str, list[bytes]] = {n: [] for n in job.staged}
        payload_bytes, busy = 0, 0.0
        for (name, i), (chunk, seconds) in zip(keys, tensorcodec.map_ordered(self._pool, calls, self._window),
                                              strict=True):
            busy += seconds
            if chunk is None:
                old = None if name in predicted else self._prev_chunks.get(name)
                digests[name].append(
                    old[i] if old else tensorcodec.digest(self._chunk_of(job.staged[name], i))
                )
                continue
            if name in predicted and chunk.encoding == TensorDelta.XOR:
                chunk = dataclasses.replace(chunk, encoding=TensorDelta.RESIDUAL)
            s = spec_of[name]
            emit(s.shard, chunk.to_delta(name, s.dtype, s.shape))
            payload_bytes += len(chunk.payload)
            digests[name].append(chunk.digest)
        return digests, payload_bytes, busy / self._settings.resolved_codec_threads()

    def _chunk_of(self, bits: np.ndarray, index: int) -> np.ndarray:
        off, n = tensorcodec.chunk_ranges(len(bits), self._chunk_bytes)[index]
        return bits[off:off + n]


class _Emitter:
    """Appends one version's events to an open log transaction, with consecutive gsns from
    ``first``, counting each tensor shard's events."""

    def __init__(self, rec: Recorder, txn: LogTransaction, version: int, step: int, first: int) -> None:
        self._rec, self._txn, self._version, self._step = rec, txn, version, step
        self.gsn = first
        self.shard_counts = [0] * rec._shards
        self._now = int(time.time() * 1000)
        self._keys = crypto.keyring()

    def __call__(self, shard: int, body: Body) -> None:
        rec = self._rec
        env = Envelope(rec.run_id, self.gsn, self._version, self._step,
                       CONTROL_SHARD if shard == CONTROL else shard,
                       f"{rec.writer_id}#{rec.session}", self._now, body)
        if self._keys is not None:
            env = crypto.encrypt_event(env, self._keys)
        data, bulk_at = rec._serialize.in_parts(env)
        self._txn.append(shard, data, bulk_at=bulk_at)
        if shard != CONTROL:
            self.shard_counts[shard] += 1
        self.gsn += 1


def _host_copy(bits: np.ndarray) -> np.ndarray:
    """``bits`` copied into a ``tensorcodec.host_buffer``."""
    out = tensorcodec.host_buffer(len(bits))
    out[:] = bits
    return out


def _timed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, float]:
    """``fn(*args, **kwargs)`` and the seconds it took."""
    t0 = time.perf_counter()
    return fn(*args, **kwargs), time.perf_counter() - t0


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
