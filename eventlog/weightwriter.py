"""The writing side of a run's weights stream, shared by its two writers: ``rewind publish``
(``replayer.publisher``, which folds the log to each version) and a recorder that publishes
from its base copy (``rewind.weights``). Given each version's model tensors in order, it
casts them, writes a patch against the previous published version (a keyframe when one is
due), and applies retention after each keyframe. Both writers call it with the same bits,
so they publish identical streams.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch

from eventlog.errors import ConfigError, IntegrityError, RunNotFoundError
from eventlog.ports import EventLog, LogWriter
from eventlog.weightcodec import CastTensor, Published, WeightsConfig, cast_spec, cast_weights, encode_cast
from eventlog.weightstream import KEYFRAME, PATCH, PublishedVersion, WeightsStream

#: The writer id of a stream's writer: one at a time, so a second one fences the first.
WRITER_ID = "weights-publisher"
_log = logging.getLogger(__name__)


class StreamWriter:
    """Writes one run's weights stream, version after version."""

    def __init__(self, log: EventLog, config: WeightsConfig) -> None:
        self.config = config
        self.stream = WeightsStream(log)
        self.index: list[PublishedVersion] = []
        self.prev: Published | None = None
        self.chunk_bytes = config.chunk_bytes  # a resumed stream keeps its own
        self._log = log
        self._writer: LogWriter | None = None

    @property
    def version(self) -> int:
        """The newest version published (0: none)."""
        return self.index[-1].version if self.index else 0

    @property
    def opened(self) -> bool:
        return self._writer is not None

    def open(self, *, resume: bool = True) -> bool:
        """Open the stream, fencing any older writer, and read what it holds (``resume``; else
        start it afresh); ``False`` while the run has no log."""
        if self._writer is not None:
            return True
        try:
            self._log.create_weights()
        except RunNotFoundError:
            return False
        self._writer = self._log.writer(WRITER_ID)
        self.index = self.stream.index() if resume else []
        if self.index and self.index[-1].dtype != self.config.dtype:
            last = self.index[-1]
            raise ConfigError(f"{self.stream.where} is published in {last.dtype}, not {self.config.dtype}: "
                              f"publish in {last.dtype}, or rebuild the stream (rewind publish --rebuild)")
        return True

    def resume(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Continue after the newest published version, whose model tensors are ``tensors``:
        checked against its published digest, they are the base of the next patch."""
        self.resume_cast(cast_weights(tensors, self.config.dtype))

    def resume_cast(self, prev: dict[str, CastTensor]) -> None:
        """``resume`` with tensors already cast to the stream's dtype (kept: not copied)."""
        last = self.index[-1]
        self.chunk_bytes = last.chunk_bytes
        published = Published.of(prev, last.chunk_bytes)
        got = published.digest()
        if got != last.digest:
            raise IntegrityError(f"{self.stream.where}: version {last.version} as published differs from the "
                                 f"log's (digest {last.digest.hex()} vs {got.hex()}): the stream was "
                                 "written with other settings; rebuild it (rewind publish --rebuild)")
        self.prev = published

    def clear(self) -> None:
        """Delete the whole stream (to publish it again)."""
        self.stream.clear()
        self.index, self.prev, self.chunk_bytes = [], None, self.config.chunk_bytes

    def publish(self, version: int, step: int, tensors: Mapping[str, torch.Tensor], *,
                on_read: Callable[[], None] | None = None) -> PublishedVersion:
        """Cast, encode and write one version (after the newest published one), each chunk
        cast and compared in cache (``weightcodec.encode_cast``); apply retention after a
        keyframe. ``tensors`` are only read, and only until the chunks are encoded, when
        ``on_read`` is called (before the write)."""
        assert self._writer is not None, "open() the stream first"
        cfg, prev, base = self.config, self.prev, self.version
        keyframes = [p for p in self.index if p.keyframe]
        due = prev is None or not keyframes or version - keyframes[-1].version >= cfg.keyframe_every
        if due or prev is None or prev.specs() != {n: cast_spec(t, cfg.dtype) for n, t in tensors.items()}:
            prev, kind, base = None, KEYFRAME, 0
        else:
            kind = PATCH
        # ``prev`` becomes the new version in place: until the version is written, none is kept.
        self.prev = None
        chunks, new = encode_cast(tensors, cfg.dtype, prev, base, self.chunk_bytes)
        if on_read is not None:
            on_read()
        raw = sum(len(t.bits) for t in new.tensors.values())
        self.stream.publish(self._writer, version, step, kind, cfg.dtype, base, chunks, new.digest(), raw,
                            self.chunk_bytes)
        self.index += self.stream.index(gt=self.index[-1].seal_offset if self.index else None)
        published = self.index[-1]
        self.prev = new
        if kind == KEYFRAME:
            self._retain()
        return published

    def _retain(self) -> None:
        """Delete what lies below the oldest of the ``keep_keyframes`` newest keyframes."""
        keyframes = [p for p in self.index if p.keyframe]
        if len(keyframes) <= self.config.keep_keyframes:
            return
        oldest_kept = keyframes[-self.config.keep_keyframes]
        self.stream.truncate_before(oldest_kept)
        self.index = [p for p in self.index if p.version >= oldest_kept.version]
        _log.info("%s: deleted what was published before version %d", self.stream.where, oldest_kept.version)

    def close(self) -> None:
        """Release the writer (the log stays its owner's)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
