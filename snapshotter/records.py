"""Reading a partition's records for the patrol: one at a time after a read fails, so
that a damaged record is named by its very offset, and records a log with dense offsets
should hold but does not are found."""

from __future__ import annotations

from dataclasses import dataclass

from eventlog import RewindError
from eventlog.events import Envelope
from eventlog.fold.engine import events
from eventlog.fold.gaps import MissingRecordsError, skipped
from eventlog.ports import CONTROL, EventLog

__all__ = ["DamagedRecord", "MissingRecordsError", "Records"]


@dataclass(frozen=True)
class DamagedRecord:
    """A record a replay fails on (or, ``offset`` ``None``, records a seal counts that the
    log does not hold)."""

    #: The version it belongs to (``None``: it does not decode and no count says which).
    version: int | None
    #: ``eventlog.ports.CONTROL`` (-1), or a tensor shard.
    partition: int
    offset: int | None
    #: The file that holds it: a segment file, the database, or the log's address.
    file: str
    error: str

    def where(self) -> str:
        """``version V, shard S, offset O`` as a reader says it."""
        version = "version ?" if self.version is None else f"version {self.version}"
        part = "control" if self.partition == CONTROL else f"shard {self.partition}"
        at = "records missing" if self.offset is None else f"offset {self.offset}"
        return f"{version}, {part}, {at}"


class Records:
    """A partition's records after an offset, with a look at the next one before it is taken.

    A read fetches several records at once; after one fails, they are read one at a time,
    so that ``failed_at`` names the very record that does not read or decode."""

    def __init__(self, log: EventLog, partition: int, gt: int | None) -> None:
        self.log, self.partition = log, partition
        #: The offset and version of the last record taken.
        self.last_offset: int | None = gt
        self.last_version: int | None = None
        #: The offset of the record that did not read or decode (after ``peek`` raised).
        self.failed_at: int | None = None
        self._end = log.end_offset(partition)
        self._it = events(log, partition, gt=gt, lte=self._end - 1)
        self._next: tuple[int, int, Envelope] | None = None
        self._one_by_one = False

    def peek(self) -> tuple[int, int, Envelope] | None:
        """The next record, or ``None`` at the end (raises if it does not read or decode,
        or if records before it, or at the end, are missing from a log with dense offsets)."""
        if self._next is not None:
            return self._next
        if not self._one_by_one:
            try:
                self._next = next(self._it, None)
            except RewindError:
                self._one_by_one = True
        if self._one_by_one:
            self._next = self._single()
        if self.log.dense_offsets:
            want = self.log.start_offset(self.partition) if self.last_offset is None else self.last_offset + 1
            found = self._end if self._next is None else self._next[0]
            if found > want:
                self._next, self.failed_at = None, want
                raise self._gap(want, found)
        return self._next

    def _gap(self, want: int, found: int) -> RewindError:
        """The error for offsets ``want..found - 1`` that a read of a log with dense offsets
        skipped (``eventlog.fold.gaps.skipped``)."""
        return skipped(self.log, self.partition, want, found, lookup=not self._one_by_one)

    def _single(self) -> tuple[int, int, Envelope] | None:
        gt = self.last_offset
        want = self.log.start_offset(self.partition) if gt is None else gt + 1
        self.failed_at = want
        found = []
        if self.log.dense_offsets:  # the very offset first: a range can fail where a lookup works
            found = self.log.read(self.partition, gt=want - 1, lte=want, limit=1)
        if not found:  # (Kafka's offsets have gaps where its transaction markers are)
            found = self.log.read(self.partition, gt=gt, lte=self._end - 1, limit=1)
        if not found:
            self.failed_at = None
            return None
        self.failed_at = found[0].offset
        record = next(events(self.log, self.partition, gt=found[0].offset - 1, lte=found[0].offset), None)
        self.failed_at = None
        return record

    def take(self) -> None:
        """Move past the record ``peek`` returned."""
        assert self._next is not None
        self.last_offset, self.last_version = self._next[0], self._next[2].version
        self._next = None

    def newer(self) -> bool:
        """Whether records were committed since the scan began (a log being written, or a
        transaction whose partitions become visible a moment apart); scan them too."""
        end = self.log.end_offset(self.partition)
        if end <= self._end:
            return False
        self._it = events(self.log, self.partition, gt=self.last_offset, lte=end - 1)
        self._end = end
        return True
