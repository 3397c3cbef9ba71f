"""One writer's commit pipeline: from a staged state to a sealed version in the log.

``CommitPipeline`` holds what every commit needs and nothing about where the state came
from: the log writer (becoming it fences a zombie with the same writer id), the gsn blocks
and the version CAS on the coordinator, the codec pool that encodes tensor chunks (XOR deltas
or the predictive codec's residuals), and the base: the newest version this writer committed
or restored, against which the next one is encoded. ``transaction`` opens one log transaction
of a version, with its gsns claimed and, for a writer that seals, the version taken by the CAS
and given back if the transaction fails.

A single process (``rewind.recorder``) and each rank of a multi-rank job
(``rewind.ranks_commit``) are two users of it; ``append.append_control`` writes the control
events that are not part of a version's commit (the environment fingerprint, a resume's proof,
the snapshotter's markers) through the same ``EventAppender``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

from eventlog import filemaps, intraop, serde, tensorcodec
from eventlog import predictive as predictive_codec
from eventlog.commit.append import EventAppender, append_control
from eventlog.digests import small_digest, state_digest
from eventlog.errors import RewindError, StaleVersionError
from eventlog.events import (
    Body,
    CommitSealed,
    CustomState,
    Metrics,
    OptimizerStep,
    RngAdvance,
    RunStarted,
    SamplerCursor,
    SchedulerStep,
    TensorDelta,
    TensorSpec,
)
from eventlog.fold.engine import index_control
from eventlog.layout import config_digest
from eventlog.optimstep import CapturedStep
from eventlog.ports import Coordinator, EventLog
from eventlog.settings import Settings
from eventlog.version import REWIND_VERSION
from eventlog.waits import warned_wait
from schemas import SCHEMA_VERSION

_log = logging.getLogger(__name__)

T = TypeVar("T")
#: The event type of each small state, by its role; every other small state is ``CustomState``.
SMALL_KINDS: dict[str, type[SchedulerStep | SamplerCursor | RngAdvance | CustomState]] = {
    "scheduler": SchedulerStep, "sampler": SamplerCursor, "rng": RngAdvance,
}
#: ``(chunk digests by tensor, payload bytes, seconds)`` of one ``encode``.
Encoded = tuple[dict[str, list[bytes]], int, float]


def small_state_event(name: str, state: bytes, role: str | None = None) -> Body:
    """The event that records small state ``name`` (its kind chosen by ``role``, default ``name``)."""
    return SMALL_KINDS.get(name if role is None else role, CustomState)(name, state)


_PAGE = 4096


@dataclass
class CommitBase:
    """The newest version a writer committed or restored: what the next commit is encoded
    against (its tensors' bits and chunk digests) and compared with (layout, small states)."""

    version: int = 0
    #: Every gsn this writer has seen is at or below it.
    last_gsn: int = 0
    bits: dict[str, np.ndarray] = field(default_factory=dict)
    chunk_digests: dict[str, list[bytes]] = field(default_factory=dict)
    specs: tuple[TensorSpec, ...] = ()
    small: dict[str, bytes] = field(default_factory=dict)
    #: The ``RunStarted`` of the base version (a snapshot of it records the layout).
    layout: RunStarted | None = None


class CommitPipeline:
    """Writes versions of run ``run_id`` as writer ``writer_id`` (events name ``writer``:
    the writer id and this process's session); ``shards`` tensor shards, chunks of
    ``chunk_bytes``. ``settings`` gives the codec's threads and tuning."""

    def __init__(self, log: EventLog, coord: Coordinator, run_id: str, writer_id: str, writer: str,
                 *, shards: int, chunk_bytes: int, settings: Settings) -> None:
        self.log, self.coord, self.run_id, self.writer = log, coord, run_id, writer
        self.shards, self.chunk_bytes, self.settings = shards, chunk_bytes, settings
        # Becoming the writer fences any older process with the same writer id (a zombie).
        self.log_writer = log.writer(writer_id)
        self.base = CommitBase()
        threads = settings.resolved_codec_threads()
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="rewind-codec",
                                       initializer=intraop.serial_torch)
        self._window = 2 * threads  # encoded chunks held ahead of the writer
        self._serialize = serde.EnvelopeSerializer()
        # Bases a commit replaced, newest last: the next commits stage into them (newest
        # first), so a trainer that waits for each commit only ever has two sets of buffers.
        self._spare: list[dict[str, np.ndarray]] = []
        self._spare_lock = threading.Lock()
        self._ahead: threading.Thread | None = None  # allocating staging sets (``add_staging``)
        self._retired: list[dict[str, np.ndarray]] = []  # a replaced base's buffers (``retire_base``)

    # ------------------------------------------------------------------ versions and gsns
    def allocate_gsns(self, count: int) -> int:
        """The first of ``count`` fresh gsns, all above every gsn this writer has seen."""
        first = self.coord.allocate_gsns(self.run_id, count)
        if first <= self.base.last_gsn:
            # The coordinator lost its counter (e.g. Redis flushed): rebuild it from ours.
            self.coord.raise_gsn_floor(self.run_id, self.base.last_gsn)
            first = self.coord.allocate_gsns(self.run_id, count)
        return first

    def claim_version(self, base: int, version: int) -> None:
        """The version CAS; if the coordinator lost its state (Redis flushed or restarted
        empty), rebuild it from the log, the truth, and claim again once."""
        try:
            self.coord.compare_and_set_version(self.run_id, base, version)
        except StaleVersionError as exc:
            if exc.actual != 0 or base == 0:
                raise
            if index_control(self.log).latest_version() != base:
                raise
            self.coord.reset_version(self.run_id, base)
            self.coord.compare_and_set_version(self.run_id, base, version)

    @contextlib.contextmanager
    def transaction(self, version: int, step: int, most: int, *,
                    claim_from: int | None = None) -> Iterator[EventAppender]:
        """One log transaction of ``version``'s events, with gsns for at most ``most`` of them.
        ``claim_from``: the writer seals the version, so it first takes it from that base by
        the CAS, and gives it back if the transaction fails (a retry after a restore is then
        not stale)."""
        if claim_from is not None:
            self.claim_version(claim_from, version)
        try:
            first = self.allocate_gsns(most)
            with self.log_writer.transaction() as txn:
                yield EventAppender(txn, self.run_id, self.writer, version, step, first, self.shards,
                                    self._serialize)
        except BaseException:
            if claim_from is not None:
                with contextlib.suppress(RewindError):
                    self.coord.compare_and_set_version(self.run_id, version, claim_from)
            raise

    def append_control(self, version: int, step: int, bodies: Sequence[Body]) -> int:
        """Write control events outside a version's commit (a fingerprint, a resume's proof);
        returns their last gsn, which the base now covers."""
        last = append_control(self.log_writer, self.coord, self.run_id, self.writer, version, step, bodies)
        self.base.last_gsn = max(self.base.last_gsn, last)
        return last

    # ------------------------------------------------------------------ the base
    def staging(self) -> dict[str, np.ndarray]:
        """Buffers to stage the next commit into: a replaced base's, or a new empty set
        (after the sets ``add_staging`` is still allocating are ready)."""
        self.wait_ahead()
        with self._spare_lock:
            return self._spare.pop() if self._spare else {}

    def wait_ahead(self) -> None:
        """Wait for the thread of ``add_staging`` (staging sets, the base's own bits), if any."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            with warned_wait("the staging buffers allocated at restore() to be ready", _log):
                ahead.join()

    def add_staging(self, sizes: Mapping[str, int], sets: int, *, background: bool = False) -> None:
        """Allocate ``sets`` staging sets of buffers sized ``sizes`` (bytes by tensor name)
        and touch every page, so that the first commits copy into memory that is already
        there instead of faulting it in on the training thread (``background``: on a thread
        started here, which the next ``staging()`` waits for). Sets already spare count: a
        second call adds none."""
        self.wait_ahead()  # (a second call counts the sets the first one allocated)
        if background:
            self._ahead = threading.Thread(target=self._add_staging_or_warn, args=(sizes, sets),
                                           name="rewind-stage-ahead", daemon=True)
            self._ahead.start()
        else:
            self._add_staging(sizes, sets)

    def _add_staging_or_warn(self, sizes: Mapping[str, int], sets: int) -> None:
        try:
            self._add_staging(sizes, sets)
        except Exception as exc:  # noqa: BLE001 - the commits allocate what is missing
            _log.warning("staging buffers could not be allocated ahead (%s: %s); the first commits "
                         "allocate their own", type(exc).__name__, exc)

    def _add_staging(self, sizes: Mapping[str, int], sets: int) -> None:
        retired, self._retired = self._retired, []
        # A restore may leave base bits in a snapshot file's map (a rank maps its snapshot):
        # they become bits of the base's own here, off the training thread, before any
        # commit reads the base (it waits for this thread), in the retired base's buffers
        # where they fit (memory already touched).
        bits = self.base.bits
        for name, view in list(bits.items()):
            if filemaps.of_file(view):
                fits = (r for r in retired if name in r and r[name].nbytes == view.nbytes)
                into = next((r.pop(name) for r in fits), None)
                bits[name] = filemaps.owned(view, into)
        with self._spare_lock:
            missing = max(0, sets - len(self._spare))
        for _ in range(missing):
            staged = retired.pop() if retired else {}
            for name, n in sizes.items():
                if name not in staged or staged[name].nbytes != n:
                    staged[name] = _touched(tensorcodec.host_buffer(n))
            with self._spare_lock:
                self._spare.append(staged)
        retired.clear()  # what is left is freed here, not on the training thread

    def retire_base(self) -> None:
        """Empty the base (a restore is about to set another). Its buffers are not freed
        here: the next ``add_staging`` stages into them or copies a mapped base into them,
        and frees the rest on its own thread."""
        old, self.base.bits = self.base.bits, {}
        if _reusable(old):
            self._retired.append(old)

    def advance(self, bits: dict[str, np.ndarray], specs: tuple[TensorSpec, ...],
                chunk_digests: dict[str, list[bytes]], small: dict[str, bytes], version: int,
                last_gsn: int) -> None:
        """Make a sealed version the base: its bits the next XOR base (the old base's buffers
        are staged into again), its layout and small states the ones to compare with."""
        old, base = self.base.bits, self.base
        base.bits, base.chunk_digests, base.specs, base.small = bits, chunk_digests, specs, small
        base.version, base.last_gsn = version, last_gsn
        if _reusable(old):
            with self._spare_lock:
                self._spare.append(old)

    def control_events(self, first: Sequence[Body], small: Mapping[str, bytes], metrics: Mapping[str, float],
                       *, ranked: bool = False) -> list[Body]:
        """A version's control events before its seal: ``first`` (a layout, a fingerprint), each
        small state that differs from the base's, and the metrics. ``ranked``: small states are
        named ``rank<r>/<role>`` (a multi-rank run)."""
        events = list(first)
        for name, state in sorted(small.items()):
            if self.base.small.get(name) != state:
                events.append(small_state_event(name, state, name.rpartition("/")[2] if ranked else None))
        if metrics:
            events.append(Metrics(dict(metrics)))
        return events

    def seal(self, base: int, counts: Sequence[int], control: int, shard_digests: Sequence[bytes],
             small: Mapping[str, bytes], codec: str, raw_bytes: int, encoded_bytes: int) -> CommitSealed:
        """The ``CommitSealed`` of a version built on ``base``: each tensor shard's event count and
        digest, the number of ``control`` events before it, the digest of the whole state."""
        small_dig = small_digest(small)
        return CommitSealed(base, tuple(counts), control, tuple(shard_digests), small_dig,
                            state_digest(shard_digests, small_dig), codec, raw_bytes, encoded_bytes)

    def layout_event(self, specs: tuple[TensorSpec, ...], small: Iterable[str]) -> RunStarted:
        """The ``RunStarted`` of a version whose tensors are ``specs`` and small states ``small``."""
        names = sorted(small)
        return RunStarted(self.shards, specs, tuple(names), config_digest(specs, names), torch.__version__,
                          "cuda" if torch.cuda.is_available() else "cpu", REWIND_VERSION, SCHEMA_VERSION,
                          self.chunk_bytes)

    # ------------------------------------------------------------------ encoding
    def predict(self, plan: predictive_codec.StepPlan | str, steps: list[CapturedStep],
                specs: Mapping[str, TensorSpec], prev: Mapping[str, np.ndarray], relayout: bool,
                base: int) -> tuple[predictive_codec.Prediction | None, str]:
        """The version's predictive part (over ``specs``, from the previous bits ``prev``), or
        ``None`` and why the version is XOR deltas."""
        why_not = predictive_codec.check(plan, steps, specs, prev, relayout, base,
                                         self.settings.predict_max_steps)
        if why_not is not None:
            return None, why_not
        assert isinstance(plan, predictive_codec.StepPlan)
        try:
            return predictive_codec.predict(plan, steps, specs, prev), ""
        except Exception as exc:  # noqa: BLE001 - a step torch refuses must not stop training
            # Refused on copies: the previous bits are untouched, and deltas against them stand.
            return None, f"the {plan.optimizer} step could not be replayed ({exc})"

    def prediction_events(
        self, prediction: predictive_codec.Prediction,
    ) -> Iterator[tuple[int, TensorDelta | OptimizerStep]]:
        """The prediction's events: each shard's gradients and steps before its residuals."""
        yield from prediction.events(self.pool, self.chunk_bytes, self.settings.grad_compression,
                                     self._window)

    def codec(self, prediction: predictive_codec.Prediction | None, why_not: str) -> str:
        """What a seal says of how its version (or a rank's part) is encoded."""
        if prediction is None:
            return f"xor-delta/blosc2-zstd (not predictive: {why_not})"
        return (f"predictive/{prediction.plan.optimizer} x{prediction.steps} "
                f"+ gradients/{self.settings.grad_compression} + residual/blosc2-zstd")

    def encode(self, staged: Mapping[str, np.ndarray], spec_of: Mapping[str, TensorSpec],
               predicted: set[str], emit: Callable[[int, Body], None]) -> Encoded:
        """Encode every chunk of every staged tensor against the base in parallel and ``emit``
        each changed one as it comes; returns the chunk digests, the payload bytes, and the
        encoding's seconds on the pool (its work over the pool's threads: what it adds to a
        commit not overlapped with writing).

        Tensors in ``predicted`` are encoded against the prediction (now in the base's bits):
        their chunks are residuals, and an unchanged chunk is one the prediction got right."""
        keys: list[tuple[str, int]] = []
        calls: list[Callable[[], tuple[tensorcodec.EncodedChunk | None, float]]] = []
        old_specs = {s.name: (s.dtype, tuple(s.shape)) for s in self.base.specs}
        for name, new in staged.items():
            spec = spec_of[name]
            same = old_specs.get(name) == (spec.dtype, tuple(spec.shape))
            prev = self.base.bits.get(name) if same else None
            size = tensorcodec.itemsize(spec.dtype)
            ranges = tensorcodec.chunk_ranges(len(new), self.chunk_bytes)
            for i, (off, n) in enumerate(ranges):
                keys.append((name, i))
                calls.append(functools.partial(
                    _timed, tensorcodec.encode_chunk, new[off:off + n],
                    None if prev is None else prev[off:off + n], typesize=size,
                    base_version=self.base.version, index=i, count=len(ranges), offset=off))
        digests: dict[str, list[bytes]] = {n: [] for n in staged}
        payload_bytes, busy = 0, 0.0
        for (name, i), (chunk, seconds) in zip(keys, tensorcodec.map_ordered(self.pool, calls, self._window),
                                              strict=True):
            busy += seconds
            if chunk is None:
                old = None if name in predicted else self.base.chunk_digests.get(name)
                digests[name].append(old[i] if old else tensorcodec.digest(self._chunk_of(staged[name], i)))
                continue
            if name in predicted and chunk.encoding == TensorDelta.XOR:
                chunk = dataclasses.replace(chunk, encoding=TensorDelta.RESIDUAL)
            s = spec_of[name]
            emit(s.shard, chunk.to_delta(name, s.dtype, s.shape))
            payload_bytes += len(chunk.payload)
            digests[name].append(chunk.digest)
        return digests, payload_bytes, busy / self.settings.resolved_codec_threads()

    def _chunk_of(self, bits: np.ndarray, index: int) -> np.ndarray:
        off, n = tensorcodec.chunk_ranges(len(bits), self.chunk_bytes)[index]
        return bits[off:off + n]

    def close(self) -> None:
        """Stop the codec pool and release the log writer."""
        self.pool.shutdown()
        self.log_writer.close()


def _reusable(bits: Mapping[str, np.ndarray]) -> bool:
    """Whether a replaced base's buffers may be staged into: it has some, and none is a view
    of a file's map (a write there would copy the file's pages one fault at a time)."""
    return bool(bits) and not any(filemaps.of_file(b) for b in bits.values())


def _touched(buf: np.ndarray) -> np.ndarray:
    """``buf`` with every page mapped (one write per page)."""
    buf[::_PAGE] = 0
    return buf


def _timed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, float]:
    """``fn(*args, **kwargs)`` and the seconds it took."""
    t0 = time.perf_counter()
    return fn(*args, **kwargs), time.perf_counter() - t0
