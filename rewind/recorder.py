"""Trainer hooks: ``Recorder`` turns each ``commit()`` into one sealed version in the log.

On the training thread, ``commit()`` only copies the state out (tensor bits into staging
buffers, small states into msgpack) and queues it; a bounded queue gives backpressure.
A committer thread encodes the tensors in parallel, allocates gsns, takes the version CAS
and writes the version's events in one log transaction, sealed by ``CommitSealed``.

Two codecs: when the version is one or two supported optimizer steps after the previous
one, the *predictive* codec (``predictive``) logs the steps' gradients and only the residual
of the replayed step; otherwise tensors are XOR deltas of the previous version's bits.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from eventlog import crypto, knobs, serde, statecodec, tensorcodec
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
    Metrics,
    RngAdvance,
    RunStarted,
    SamplerCursor,
    SchedulerStep,
    TensorDelta,
    TensorSpec,
)
from eventlog.fold.engine import RebuiltState, Target, index_control, rebuild
from eventlog.layout import assign_shards, config_digest
from eventlog.optimstep import CapturedStep, StepCapture
from eventlog.ports import CONTROL, Coordinator, EventLog

REWIND_VERSION = "0.1.0"
_KINDS: dict[str, type[Any]] = {
    "scheduler": SchedulerStep, "sampler": SamplerCursor, "rng": RngAdvance,
}

#: How a restore obtains the recorded state (the replayer passes its parallel,
#: snapshot-aware one; the default folds the whole log).
Restorer = Callable[[EventLog], RebuiltState]


@dataclass(frozen=True)
class CommitResult:
    """A version that is durable in the log."""

    version: int
    step: int
    events: int
    raw_bytes: int
    encoded_bytes: int
    seconds: float
    #: The codec of the version, and why (``CommitSealed.encoding``).
    encoding: str = ""
    #: Bytes of residual (predictive) or delta chunks, without gradients.
    residual_bytes: int = 0
    #: Seconds the committer spent encoding (predicting, compressing, hashing), not writing.
    encode_seconds: float = 0.0


@dataclass(frozen=True)
class RestoreResult:
    """What ``restore()`` found: the step to resume after, or a fresh run."""

    step: int | None
    version: int
    applied: int = 0
    skipped: int = 0
    seconds: float = 0.0
    source: str = ""
    detail: RebuiltState | None = field(default=None, repr=False)

    @property
    def fresh(self) -> bool:
        """True when the log held no version and nothing was restored."""
        return self.step is None


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


class Recorder:
    """Records a training run's state transitions; restores them after a crash.

    ``objects`` are ``Stateful``: ``model`` and ``optimizer`` go to the tensor shards,
    ``scheduler``, ``sampler``, the global RNGs (``rng=True``) and every ``extra`` object
    are small states. Use as a context manager, or call ``close()``.
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
        shards: int = knobs.SHARDS,
        writer_id: str | None = None,
        max_inflight: int = knobs.MAX_INFLIGHT,
        chunk_bytes: int = knobs.CHUNK_BYTES,
        restorer: Restorer | None = None,
        predictive: bool = True,
    ) -> None:
        self.address = run if isinstance(run, RunAddress) else RunAddress.from_env(run)
        self.run_id = self.address.run_id
        objects: dict[str, Stateful] = {}
        for name, obj in (("model", model), ("optimizer", optimizer), ("scheduler", scheduler),
                          ("sampler", sampler)):
            if obj is not None:
                objects[name] = obj
        if rng:
            objects["rng"] = GlobalRng()
        for name, obj in (extra or {}).items():
            if name in objects or name in ("model", "optimizer", "scheduler", "sampler", "rng"):
                raise ConfigError(f"extra state name {name!r} is reserved or used twice")
            if not isinstance(obj, Stateful):
                raise ConfigError(f"extra state {name!r} has no state_dict/load_state_dict")
            objects[name] = obj
        if shards < 1 or chunk_bytes < 16 or max_inflight < 1:
            raise ConfigError("shards and max_inflight must be >= 1 and chunk_bytes >= 16")
        self._objects = objects
        self._shards = shards
        self._chunk_bytes = chunk_bytes
        self._restorer = restorer
        # The predictive codec watches the optimizer's steps through a pre-hook.
        self._plan: predictive_codec.StepPlan | str = (
            predictive_codec.StepPlan.of(model, optimizer) if predictive else "the predictive codec is off"
        )
        self._steps = (StepCapture(optimizer, knobs.PREDICT_MAX_STEPS)  # type: ignore[arg-type]
                       if isinstance(self._plan, predictive_codec.StepPlan) else None)
        self.writer_id = writer_id or f"{self.run_id}.trainer"
        # Events name the writer and this process's session: a new session after the same
        # writer id marks a recovery in the run's history.
        self.session = uuid.uuid4().hex[:8]
        self._log: EventLog = self.address.open_log()
        self._coord: Coordinator = self.address.open_coordinator()
        # An existing run keeps its shard count, whatever this process asked for.
        self._shards = self._log.shard_count() or shards
        # Becoming the writer fences any older process with the same writer id (a zombie).
        self._writer = self._log.writer(self.writer_id)
        self._serialize = serde.EnvelopeSerializer()
        # Last committed state: the XOR base, its chunk digests, its layout, its small states.
        self._version = 0
        self._last_gsn = 0
        self._prev: dict[str, np.ndarray] = {}
        self._prev_chunks: dict[str, list[bytes]] = {}
        self._specs: tuple[TensorSpec, ...] = ()
        self._small: dict[str, bytes] = {}
        self._grad_buffers: dict[tuple[int, int], np.ndarray] = {}  # reused across versions
        self._spare: queue.Queue[dict[str, np.ndarray]] = queue.Queue()
        for _ in range(max_inflight + 1):
            self._spare.put({})
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=max_inflight)
        self._pool = ThreadPoolExecutor(knobs.codec_threads(), thread_name_prefix="rewind-codec")
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
        tensors, small = self._capture()
        layout = {n: (tensorcodec.dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()}
        staged = self._spare.get()  # blocks while every buffer set is in flight
        for name, t in tensors.items():
            bits = tensorcodec.tensor_bits(t)
            buf = staged.get(name)
            if buf is None or buf.shape != bits.shape:
                # torch's allocator backs large buffers with huge pages: first-touch page
                # faults of a fresh numpy buffer cost more than the copy itself.
                buf = staged[name] = torch.empty(len(bits), dtype=torch.uint8).numpy()
            # torch's copy runs on its intra-op threads (numpy's copy on one core).
            torch.from_numpy(buf).copy_(torch.from_numpy(bits))
        # The copy is done: the log's deferred maintenance (e.g. a WAL checkpoint) may now
        # use the memory bus without slowing it.
        self._writer.maintenance_window()
        for name in list(staged):
            if name not in tensors:
                del staged[name]
        job = _Job(step, {k: float(v) for k, v in (metrics or {}).items()}, base_version,
                   staged, layout, small, Future(), steps=self._steps.take() if self._steps else [])
        self._jobs.put(job)
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
        """Load the newest sealed version into the objects; returns the step to resume after."""
        self._check_usable()
        self.flush()
        t0 = time.perf_counter()
        try:
            if self._log.shard_count() is None:
                raise RunNotFoundError(self.run_id)
            state = (self._restorer or (lambda log: rebuild(log, Target())))(self._log)
        except RunNotFoundError:
            # No sealed version (a crash inside the very first commit leaves none): fresh run,
            # and the coordinator forgets any version the crashed commit had claimed.
            self._coord.reset_version(self.run_id, 0)
            return RestoreResult(step=None, version=0, seconds=time.perf_counter() - t0)
        load_into(self._objects, state)
        if self._steps is not None:
            self._steps.take()  # steps taken before the restore led to another state
        # The restored state becomes the XOR base of the next commit.
        self._prev = {n: t.bits.copy() for s in state.shards for n, t in s.tensors.items()}
        self._prev_chunks = {}
        self._specs = state.layout.tensors
        # Chunk boundaries are part of the digests: keep the run's, whatever this process set.
        self._chunk_bytes = state.layout.chunk_bytes
        self._small = dict(state.small.states)
        self._version = state.version
        self._last_gsn = max([state.seal.gsn, *(e.gsn for _, e in state.index.markers)])
        # The log is the truth: the coordinator's version and gsn counter follow it.
        self._coord.reset_version(self.run_id, state.version)
        self._coord.raise_gsn_floor(self.run_id, self._last_gsn)
        c = state.counts
        return RestoreResult(
            step=state.step, version=state.version, applied=c.applied,
            skipped=c.skipped_by_snapshot + c.skipped_duplicate + c.skipped_unsealed,
            seconds=time.perf_counter() - t0, source=state.source, detail=state,
        )

    def close(self) -> None:
        """Write every queued commit, then release threads and connections."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._committer.join()
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
            if name in TENSOR_ROLES:
                found, tree = flatten(name, tree)
                tensors.update(found)
            small[name] = statecodec.pack(tree)
        return tensors, small

    # ------------------------------------------------------------------ committer thread
    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.flush_only:
                job.future.set_result(None)  # type: ignore[arg-type]
                continue
            if self._failure is not None:
                job.future.set_exception(self._failure)
                continue
            try:
                job.future.set_result(self._write(job))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's future
                self._failure = exc
                job.future.set_exception(exc)

    def _write(self, job: _Job) -> CommitResult:
        t0 = time.perf_counter()
        version = self._version + 1
        base = self._version if job.base_version is None else job.base_version
        if base != self._version:
            raise StaleVersionError(base, self._version)
        specs = self._specs
        relayout = {s.name: (s.dtype, tuple(s.shape)) for s in specs} != job.layout
        if relayout:
            owners = self._plan.owners(list(job.layout)) if isinstance(self._plan, predictive_codec.StepPlan) else {}
            specs = assign_shards(job.layout, self._shards, specs, owners)
        spec_of = {s.name: s for s in specs}
        t_encode = time.perf_counter()
        prediction, why_not = self._predict(job, spec_of, relayout)
        encoded, chunk_digests = self._encode(job, spec_of, prediction.predicted if prediction else set())
        encode_seconds = time.perf_counter() - t_encode

        tensor_digests: list[dict[str, bytes]] = [{} for _ in range(self._shards)]
        for s in specs:
            tensor_digests[s.shard][s.name] = tensor_digest(s.name, s.dtype, s.shape, chunk_digests[s.name])
        shard_digests = tuple(shard_digest(d) for d in tensor_digests)
        small_dig = small_digest(job.small)

        bodies: list[tuple[int, Body]] = list(prediction.bodies) if prediction else []
        for name, chunks in encoded.items():
            s = spec_of[name]
            bodies.extend((s.shard, c.to_delta(name, s.dtype, s.shape)) for c in chunks)
        shard_counts = [0] * self._shards
        for shard, _ in bodies:
            shard_counts[shard] += 1
        bodies.sort(key=lambda b: b[0])  # stable: a shard's gradients and steps stay first
        control: list[Body] = []
        if relayout:
            control.append(RunStarted(
                self._shards, specs, tuple(sorted(job.small)), config_digest(specs, list(job.small)),
                torch.__version__, "cuda" if torch.cuda.is_available() else "cpu",
                REWIND_VERSION, serde.schemas.SCHEMA_VERSION, self._chunk_bytes))
        for name, state in sorted(job.small.items()):
            if self._small.get(name) != state:
                control.append(_KINDS.get(name, CustomState)(name, state))
        if job.metrics:
            control.append(Metrics(job.metrics))
        raw = sum(len(b) for b in job.staged.values())
        residual = sum(len(c.payload) for cs in encoded.values() for c in cs)
        enc = residual + (prediction.grad_bytes if prediction else 0)
        if prediction:
            codec = (f"predictive/{self._plan.optimizer} x{prediction.steps} "  # type: ignore[union-attr]
                     f"+ gradients/{knobs.GRAD_COMPRESSION} + residual/blosc2-zstd")
        else:
            codec = f"xor-delta/blosc2-zstd (not predictive: {why_not})"
        control.append(CommitSealed(
            base, tuple(shard_counts), len(control), shard_digests, small_dig,
            state_digest(shard_digests, small_dig), codec, raw, enc))

        self._log.create(self._shards)
        self._claim_version(base, version)
        try:
            count = len(bodies) + len(control)
            first = self._coord.allocate_gsns(self.run_id, count)
            if first <= self._last_gsn:
                # The coordinator lost its counter (e.g. Redis flushed): rebuild it from ours.
                self._coord.raise_gsn_floor(self.run_id, self._last_gsn)
                first = self._coord.allocate_gsns(self.run_id, count)
            now = int(time.time() * 1000)
            keys = crypto.keyring()
            with self._writer.transaction() as txn:
                gsn = first
                for i, (shard, body) in enumerate(bodies + [(CONTROL, b) for b in control]):
                    knobs.fault_point("commit", version, i)
                    env = Envelope(self.run_id, gsn, version, job.step,
                                   CONTROL_SHARD if shard == CONTROL else shard,
                                   f"{self.writer_id}#{self.session}", now, body)
                    if keys is not None:
                        env = crypto.encrypt_event(env, keys)
                    data, bulk_at = self._serialize.with_bulk(env)
                    txn.append(shard, data, bulk_at=bulk_at)
                    gsn += 1
        except BaseException:
            try:  # give the version back, so a retry after restore() is not stale
                self._coord.compare_and_set_version(self.run_id, version, base)
            except RewindError:
                pass
            raise
        # The committed bits become the next XOR base; the old base's buffers are reused.
        old = self._prev
        self._prev = job.staged
        self._prev_chunks = chunk_digests
        self._spare.put(old)
        self._specs, self._small = specs, dict(job.small)
        self._version, self._last_gsn = version, first + count - 1
        return CommitResult(version, job.step, count, raw, enc, time.perf_counter() - t0, codec, residual,
                            encode_seconds)

    def _predict(
        self, job: _Job, spec_of: Mapping[str, TensorSpec], relayout: bool
    ) -> tuple[predictive_codec.Prediction | None, str | None]:
        """The version's predictive part, or ``None`` and why this version is XOR deltas."""
        why_not = predictive_codec.check(self._plan, job.steps, spec_of, self._prev, relayout,
                                         self._version)
        if why_not is not None:
            return None, why_not
        assert isinstance(self._plan, predictive_codec.StepPlan)
        try:
            return predictive_codec.predict(self._plan, job.steps, spec_of, self._prev, self._pool,
                                            self._chunk_bytes, self._grad_buffers), None
        except Exception as exc:  # noqa: BLE001 - a step torch refuses must not stop training
            # It may have run part way on the previous bits: no delta against them, FULL.
            self._prev, self._prev_chunks = {}, {}
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
        self, job: _Job, spec_of: Mapping[str, TensorSpec], predicted: set[str]
    ) -> tuple[dict[str, list[tensorcodec.EncodedChunk]], dict[str, list[bytes]]]:
        """Encode every chunk of every tensor in parallel; returns chunks and chunk digests.

        Tensors in ``predicted`` are encoded against the prediction (now in ``self._prev``):
        their chunks are residuals, and an unchanged chunk is one the prediction got right."""
        tasks = []
        old_specs = {s.name: (s.dtype, tuple(s.shape)) for s in self._specs}
        for name, new in job.staged.items():
            spec = spec_of[name]
            same = old_specs.get(name) == (spec.dtype, tuple(spec.shape))
            prev = self._prev.get(name) if same else None
            size = tensorcodec.itemsize(spec.dtype)
            ranges = tensorcodec.chunk_ranges(len(new), self._chunk_bytes)
            for i, (off, n) in enumerate(ranges):
                tasks.append((name, i, self._pool.submit(
                    tensorcodec.encode_chunk, new[off:off + n],
                    None if prev is None else prev[off:off + n], typesize=size,
                    base_version=self._version, index=i, count=len(ranges), offset=off)))
        encoded: dict[str, list[tensorcodec.EncodedChunk]] = {n: [] for n in job.staged}
        digests: dict[str, list[bytes]] = {n: [] for n in job.staged}
        for name, i, fut in tasks:
            chunk = fut.result()
            if chunk is None:
                old = None if name in predicted else self._prev_chunks.get(name)
                digests[name].append(
                    old[i] if old else tensorcodec.digest(self._chunk_of(job.staged[name], i))
                )
            else:
                if name in predicted and chunk.encoding == TensorDelta.XOR:
                    chunk = dataclasses.replace(chunk, encoding=TensorDelta.RESIDUAL)
                encoded[name].append(chunk)
                digests[name].append(chunk.digest)
        return encoded, digests

    def _chunk_of(self, bits: np.ndarray, index: int) -> np.ndarray:
        off, n = tensorcodec.chunk_ranges(len(bits), self._chunk_bytes)[index]
        return bits[off:off + n]
