"""Naming offsets that a read of a log with dense offsets skipped: a damaged index, where a
lookup or the table itself still finds them, else missing records. Replays and the patrol
(``snapshotter.records``) say it alike."""

from __future__ import annotations

from eventlog.errors import CorruptStoreError, IntegrityError, RewindError
from eventlog.ports import EventLog


class MissingRecordsError(IntegrityError):
    """Records a log with dense offsets should hold are not found (no read failed)."""


def skipped(log: EventLog, partition: int, want: int, found: int, *, lookup: bool = True) -> RewindError:
    """The error for offsets ``want..found - 1`` of ``partition`` that a read skipped.
    ``lookup``: ask for offset ``want`` alone first (a scan and a lookup take different
    paths through a damaged index). A damaged index can also hide records without any
    error: the table itself is asked, past the index, before records are called missing."""
    what = f"run {log.run_id!r} partition {partition}"
    if lookup and log.read(partition, gt=want - 1, lte=want, limit=1):
        return CorruptStoreError(f"{what}: a scan skips offsets {want}..{found - 1}, which a lookup of "
                                 f"offset {want} finds: the database's index is damaged")
    if log.holds_unindexed(partition, want, found - 1):
        return CorruptStoreError(f"{what}: reads skip offsets {want}..{found - 1}, which the database "
                                 "holds: its index is damaged")
    return MissingRecordsError(f"{what}: records at offsets {want}..{found - 1} are missing (the "
                               f"partition ends at {log.end_offset(partition)})")
