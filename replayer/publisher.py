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

from eventlog import IntegrityError, RunAddress, TruncatedHistoryError
from eventlog.waits import IDLE_REPEAT_S, Idle
from eventlog.weightcodec import WeightsConfig
from eventlog.weightstream import PublishedVersion
from eventlog.weightwriter import WRITER_ID, StreamWriter
from replayer.follower import MODEL, Follower

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
        self._out = StreamWriter(self._log, self.config)
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        """The newest version published (0: none)."""
        return self._out.version

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
            if self._out.prev is None and last > 0:
                first = self._first_version(last)
                done.append(self._publish_one(first))
            while self._fold.version < last:
                done.append(self._publish_one(self._fold.version + 1))
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
                self._out.clear()
            self._fold.close()
            self._fold = _LogFold(self.address, self._fold.workers)
        return self.publish()

    def close(self) -> None:
        """Release the log, the writer and the fold."""
        self._fold.close()
        self._out.close()
        self._log.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _start(self, *, resume: bool = True) -> bool:
        """Open the stream and pick up where it ends (``resume``): the log is folded to the
        newest published version, which must match its digest; ``False`` while the run has
        no log."""
        if self._out.opened:
            return True
        if not self._out.open(resume=resume):
            return False
        if self._out.index:
            self._out.resume(self._fold.seek(self._out.version))
        return True

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

    def _publish_one(self, version: int) -> PublishedVersion:
        return self._out.publish(version, self._fold.step_of(version), self._fold.seek(version))
