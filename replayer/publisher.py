"""The weights-stream publisher: follows a run's log and publishes each sealed version's model,
cast to the serving dtype, as a patch against the previous published version (``eventlog.
weightstream``), with a keyframe every ``keyframe_every`` versions and retention after it.

It folds the log with the full-state follower's machinery (the shared exactly-once fold,
verified against every seal), one version at a time, so it costs the trainer nothing. It is
restartable and idempotent: each version is one transaction; on start it reads the stream's
seals, replays the log to the last published version, and checks that version's cast digest
before going on, so a publisher killed at any point and started again publishes each version
exactly once. A second publisher of the same run fences the first (one writer id).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from eventlog import IntegrityError, RunAddress, RunNotFoundError, TruncatedHistoryError
from eventlog.errors import ConfigError
from eventlog.ports import LogWriter
from eventlog.waits import IDLE_REPEAT_S, Idle
from eventlog.weightcodec import (
    CastTensor,
    WeightsConfig,
    cast_digest,
    cast_weights,
    encode_version,
    same_layout,
)
from eventlog.weightstream import KEYFRAME, PATCH, PublishedVersion, WeightsStream
from replayer.follower import MODEL, Follower

WRITER_ID = "weights-publisher"
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PublishReport:
    """What one ``publish()`` call did."""

    published: int
    keyframes: int
    last_version: int
    payload_bytes: int
    seconds: float


class _LogFold(Follower):
    """The full-state follower, stopped at a chosen version and keeping the model's tensors
    instead of loading them into a module; it reports no version (it is no actor)."""

    def __init__(self, address: RunAddress, workers: int) -> None:
        super().__init__(address, torch.nn.Module(), max_lag=1 << 30, name=WRITER_ID, workers=workers)
        self.ceiling = 0
        self.tensors: dict[str, torch.Tensor] = {}
        self.newest = 0

    def _latest(self) -> int:
        self.newest = super()._latest()
        return min(self.newest, self.ceiling)

    def _publish(self, version: int) -> None:
        prefix = f"{MODEL}/"
        self.tensors = {n.removeprefix(prefix): t for n, t in self._model_tensors().items()}
        self._version = version

    def _report(self) -> None:
        return None

    def oldest_sealed(self) -> int | None:
        """The oldest sealed version the control index holds (``None``: none)."""
        return min(self._idx.seals, default=None) if self._idx is not None else None

    def step_of(self, version: int) -> int:
        """The trainer step of a sealed version (0 if unknown)."""
        seal = None if self._idx is None else self._idx.seals.get(version)
        return 0 if seal is None else seal.step

    def seek(self, version: int) -> dict[str, torch.Tensor]:
        """The model's tensors at ``version`` (a version after the current one)."""
        self.ceiling = version
        self.poll()
        if self._version != version:
            raise IntegrityError(f"run {self.address.run_id!r}: the log reached version "
                                 f"{self._version}, not {version}")
        return self.tensors


class Publisher:
    """Publishes run ``address``'s weights stream; ``publish()`` once, or ``follow()``."""

    def __init__(self, address: RunAddress | str, config: WeightsConfig | None = None, *,
                 workers: int = 2) -> None:
        self.address = address if isinstance(address, RunAddress) else RunAddress.from_env(address)
        self.config = config or WeightsConfig()
        self._fold = _LogFold(self.address, workers)
        self._log = self.address.open_log()
        self._stream = WeightsStream(self._log)
        self._writer: LogWriter | None = None
        self._index: list[PublishedVersion] = []
        self._prev: dict[str, CastTensor] | None = None
        self._chunk_bytes = self.config.chunk_bytes  # a resumed stream keeps its own
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        """The newest version published (0: none)."""
        return self._index[-1].version if self._index else 0

    def publish(self, *, until: int | None = None) -> PublishReport:
        """Publish every sealed version after the newest published one, up to ``until``
        (default: the newest sealed version). A fresh stream starts with a keyframe of the
        oldest version the log can rebuild."""
        with self._lock:
            t0 = time.perf_counter()
            if not self._start():
                return PublishReport(0, 0, 0, 0, time.perf_counter() - t0)
            self._fold.ceiling = self._fold.version
            self._fold.poll()  # refresh the newest sealed version
            last = min(self._fold.newest, until if until is not None else self._fold.newest)
            done: list[PublishedVersion] = []
            if self._prev is None and last > 0:
                first = self._first_version(last)
                done.append(self._publish_one(first, self._fold.seek(first)))
            while self._fold.version < last:
                v = self._fold.version + 1
                done.append(self._publish_one(v, self._fold.seek(v)))
            return PublishReport(len(done), sum(p.keyframe for p in done), self.version,
                                 sum(p.encoded_bytes for p in done), time.perf_counter() - t0)

    def follow(self, stop: threading.Event, interval_s: float = 1.0, *, until: float | None = None,
               on_publish: Callable[[PublishReport], None] | None = None) -> int:
        """Publish new versions every ``interval_s`` until ``stop`` is set (or the monotonic
        clock reaches ``until``); ``on_publish`` sees each ``publish()`` that published some.
        Returns how many. While the run seals nothing new it says, as a warning, what it
        waits for."""
        total = 0
        with Idle(lambda: f"a version of run {self.address.run_id!r} after version {self.version} to "
                  "publish", _log, every_s=IDLE_REPEAT_S) as idle:
            while not stop.is_set() and (until is None or time.monotonic() < until):
                report = self.publish()
                total += report.published
                if report.published:
                    idle.progress()
                    if on_publish is not None:
                        on_publish(report)
                else:
                    idle.waiting()
                stop.wait(interval_s)
        return total

    def rebuild(self) -> PublishReport:
        """Delete the stream and publish it again from the log."""
        with self._lock:
            if self._start(resume=False):
                self._stream.clear()
            self._index, self._prev, self._chunk_bytes = [], None, self.config.chunk_bytes
            self._fold.close()
            self._fold = _LogFold(self.address, self._fold.workers)
        return self.publish()

    def close(self) -> None:
        """Release the log, the writer and the fold."""
        self._fold.close()
        if self._writer is not None:
            self._writer.close()
        self._log.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _start(self, *, resume: bool = True) -> bool:
        """Open the stream and pick up where it ends (``resume``); ``False`` while the run
        has no log."""
        if self._writer is not None:
            return True
        try:
            self._log.create_weights()
        except RunNotFoundError:
            return False
        self._writer = self._log.writer(WRITER_ID)  # fences any older publisher
        self._index = self._stream.index() if resume else []
        if self._index:
            self._resume(self._index[-1])
        return True

    def _resume(self, last: PublishedVersion) -> None:
        """Rebuild the previous published weights from the log, checked against the stream."""
        where = self._stream.where
        if last.dtype != self.config.dtype:
            raise ConfigError(f"{where} is published in {last.dtype}, not {self.config.dtype}: "
                              f"publish in {last.dtype}, or rebuild the stream (rewind publish --rebuild)")
        prev = cast_weights(self._fold.seek(last.version), self.config.dtype)
        self._chunk_bytes = last.chunk_bytes
        got = cast_digest(prev, last.chunk_bytes)
        if got != last.digest:
            raise IntegrityError(f"{where}: version {last.version} as published differs from the "
                                 f"log's (digest {last.digest.hex()} vs {got.hex()}): the stream was "
                                 "written with other settings; rebuild it (rewind publish --rebuild)")
        self._prev = prev

    def _first_version(self, latest: int) -> int:
        """The oldest sealed version the log can rebuild (a truncated log: the newest)."""
        oldest = self._fold.oldest_sealed() or latest
        try:
            self._fold.seek(oldest)
        except TruncatedHistoryError:
            self._fold.close()
            self._fold = _LogFold(self.address, self._fold.workers)
            return latest
        return oldest

    def _publish_one(self, version: int, tensors: dict[str, torch.Tensor]) -> PublishedVersion:
        """Cast, encode and write one version; apply retention after a keyframe."""
        cfg = self.config
        new = cast_weights(tensors, cfg.dtype)
        prev, base = self._prev, self.version
        keyframes = [p for p in self._index if p.keyframe]
        due = prev is None or not keyframes or version - keyframes[-1].version >= cfg.keyframe_every
        if due or prev is None or not same_layout(prev, new):
            chunks, kind, base = encode_version(new, None, 0, self._chunk_bytes), KEYFRAME, 0
        else:
            chunks, kind = encode_version(new, prev, base, self._chunk_bytes), PATCH
        digest = cast_digest(new, self._chunk_bytes)
        assert self._writer is not None
        step = self._fold.step_of(version)
        raw = sum(len(t.bits) for t in new.values())
        self._stream.publish(self._writer, version, step, kind, cfg.dtype, base, chunks, digest, raw,
                             self._chunk_bytes)
        self._index += self._stream.index(gt=self._index[-1].seal_offset if self._index else None)
        published = self._index[-1]
        self._prev = new
        if kind == KEYFRAME:
            self._retain()
        return published

    def _retain(self) -> None:
        """Delete what lies below the oldest of the ``keep_keyframes`` newest keyframes."""
        keyframes = [p for p in self._index if p.keyframe]
        if len(keyframes) <= self.config.keep_keyframes:
            return
        oldest_kept = keyframes[-self.config.keep_keyframes]
        self._stream.truncate_before(oldest_kept)
        self._index = [p for p in self._index if p.version >= oldest_kept.version]
        _log.info("%s: deleted what was published before version %d",
                  self._stream.where, oldest_kept.version)

