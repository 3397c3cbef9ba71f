"""A recorder that publishes its run's weights stream itself (``Recorder(weights=...)``).

The recorder holds each committed version's exact bits in its base copy (the XOR base of the
next commit), so it publishes a version without the fold that ``rewind publish`` runs to
rebuild it: no optimizer step is replayed, and the trainer's cores do only the cast and the
patch. A thread of its own reads the version straight from the base, casting and encoding it
a chunk at a time (no cast copy of the model), then writes it; the committer waits for that
read to end only before the next commit rewrites the base. Both writers go through
``eventlog.weightwriter``, so a stream written here is bit for bit the one ``rewind
publish`` writes from the log, and either may take over from the other (the newer fences the
older).

The stream is a derived view: a failure to publish (a fenced writer, a broker down past its
timeouts) stops publishing with a warning, never the training; ``rewind publish`` then
carries the stream on from the log.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from eventlog import RunAddress, intraop
from eventlog.errors import IntegrityError
from eventlog.events import TensorSpec
from eventlog.optimstep import tensor_view
from eventlog.ports import EventLog
from eventlog.waits import warned_wait
from eventlog.weightcodec import CastTensor, WeightsConfig, cast_weights
from eventlog.weightwriter import StreamWriter

_log = logging.getLogger(__name__)
_MODEL = "model/"

_Version = tuple[int, int, int, dict[str, torch.Tensor]]  # ticket, version, step, views of its model tensors


Bits = Mapping[str, np.ndarray]


def model_views(specs: Sequence[TensorSpec], bits: Bits) -> dict[str, torch.Tensor]:
    """The model's tensors in ``bits`` (by log name), as views, by state_dict key."""
    return {s.name.removeprefix(_MODEL): tensor_view(bits[s.name], s.dtype, tuple(s.shape))
            for s in specs if s.name.startswith(_MODEL)}


class CommittedWeights:
    """Publishes a single-process recorder's committed versions to its run's weights stream."""

    def __init__(self, address: RunAddress, config: WeightsConfig) -> None:
        self.config = config
        self._address = address
        self._log: EventLog | None = None  # opened on the thread that writes (a connection of its own)
        self._out: StreamWriter | None = None
        self._where = f"weights stream of run {address.run_id!r}"
        self._queue: queue.Queue[_Version | None] = queue.Queue(maxsize=1)
        self._failure: BaseException | None = None
        # Tickets: offers made, and offers whose bits the thread is done reading. The committer
        # may change the base once every offer is read; a ticket ties "read" to its version.
        self._reads = threading.Condition()
        self._offered = self._read = 0
        self._resume: dict[str, CastTensor] | None = None
        self._resume_version = 0
        self._thread = threading.Thread(target=self._run, name="rewind-weights", daemon=True)
        self._thread.start()

    def restored(self, version: int, specs: Sequence[TensorSpec], bits: Bits) -> None:
        """The recorder restored ``version``: if the stream ends there, its next version is a
        patch against it; otherwise (a stream that ends earlier) a keyframe."""
        self._resume = cast_weights(model_views(specs, bits), self.config.dtype)
        self._resume_version = version

    def offer(self, version: int, step: int, specs: Sequence[TensorSpec], bits: Bits) -> None:
        """Publish committed ``version`` from ``bits``, which its thread reads until
        ``wait_base`` returns: the caller must not change them before."""
        if self._failure is not None or not self._thread.is_alive():
            return
        with self._reads:
            self._offered += 1
            ticket = self._offered
        self._queue.put((ticket, version, step, model_views(specs, bits)))

    def wait_base(self) -> None:
        """Wait until every version offered has been read (the base may then change)."""
        with warned_wait(lambda: f"the {self._where} to finish reading the version before", _log), \
                self._reads:
            while self._read < self._offered and self._thread.is_alive():
                self._reads.wait(1.0)

    def close(self) -> None:
        """Write the versions offered, then stop the thread and release the writer."""
        try:
            with warned_wait(lambda: f"the {self._where} to write its last version", _log):
                if self._thread.is_alive():
                    self._queue.put(None)
                self._thread.join()
        finally:
            if self._out is not None:
                self._out.close()
            if self._log is not None:
                self._log.close()

    def _done_reading(self, ticket: int) -> None:
        with self._reads:
            self._read = max(self._read, ticket)
            self._reads.notify_all()

    def _run(self) -> None:
        intraop.serial_torch()
        while (item := self._queue.get()) is not None:
            ticket, version, step, views = item
            try:
                if self._failure is None:
                    self._publish(version, step, views, functools.partial(self._done_reading, ticket))
            except Exception as exc:  # noqa: BLE001 - a derived view: training goes on
                self._failure = exc
                _log.warning("%s: publishing stopped at version %d (%s: %s); training goes on, and "
                             "`rewind publish --follow` carries the stream on from the log",
                             self._where, version, type(exc).__name__, exc)
            finally:
                self._done_reading(ticket)

    def _publish(self, version: int, step: int, views: dict[str, torch.Tensor],
                 read: Callable[[], None]) -> None:
        if self._out is None:
            self._log = self._address.open_log()
            self._out = StreamWriter(self._log, self.config)
        out = self._out
        if not out.opened:
            if not out.open():
                return  # (never: a committed version has a log)
            resume, self._resume = self._resume, None
            if resume is not None and out.version == self._resume_version and out.version:
                try:
                    out.resume_cast(resume)
                except IntegrityError as exc:  # written with other settings: start anew
                    _log.warning("%s; this recorder publishes a keyframe next", exc)
        if version <= out.version:
            return  # published already (by `rewind publish` before this recorder took over)
        out.publish(version, step, views, on_read=read)
