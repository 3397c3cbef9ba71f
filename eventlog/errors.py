"""Rewind's error hierarchy: one root, and a child for each kind of failure a user can act on.

Driver errors (sqlite3, confluent_kafka, redis) never leak out bare: backends wrap them in
``EventLogError`` or ``CoordinationError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class RewindError(Exception):
    """Root of every error Rewind raises on purpose."""


class ConfigError(RewindError):
    """A setting, URL or argument is invalid (raised before anything is written)."""


class EventLogError(RewindError):
    """The log backend failed (I/O, broker, database), after any retries ran out."""


class CorruptStoreError(EventLogError):
    """A backend's own storage is damaged (e.g. a truncated or overwritten database file)."""


class CoordinationError(RewindError):
    """The coordinator (Redis, embedded store) failed, after any retries ran out."""


class DecodeError(RewindError):
    """Bytes read from the log or a snapshot are not a valid Rewind event or payload."""


class CorruptMessageError(DecodeError):
    """A message is damaged: bad magic, truncated body, or a digest that does not match."""


class ChunkDigestError(CorruptMessageError):
    """A tensor chunk's bits differ from the digest it records: its payload or that digest
    is damaged (the seal's shard digests tell which)."""


class UnknownSchemaError(DecodeError):
    """A message was written with a schema fingerprint this Rewind does not know."""


class IntegrityError(RewindError):
    """The log contradicts itself: a shard digest differs from its seal, a count is short."""


class GsnOrderError(IntegrityError):
    """An applied event's gsn is past that of a later event of its own version that no applied
    event has: the first gsn is damaged (the events after it would read as duplicates)."""


class DigestMismatchError(IntegrityError):
    """A rebuilt shard's digest differs from the digest its version's seal recorded."""


class BatchedStepsMismatchError(DigestMismatchError):
    """A shard digest mismatch after optimizer steps that ran as one batch, without each
    step's prediction check (and perhaps without each gradient chunk's digest): rerunning
    with every check names the diverging step or the damaged chunk. ``mismatch`` is the
    mismatch alone, without that advice. ``rebuilt``: the shard's tensors as the batched
    steps left them, by name (each a ``TensorBits``), so that a caller that folds again
    with every check can say which tensors the two folds rebuilt differently."""

    def __init__(self, message: str, *, mismatch: str = "", rebuilt: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.mismatch = mismatch or message
        self.rebuilt: Mapping[str, Any] = rebuilt or {}


class WrongRunError(RewindError):
    """An event, snapshot or checkpoint belongs to another run than the one asked for."""


class StateMismatchError(RewindError):
    """Recorded state does not fit the objects it is restored into (names, shapes, dtypes)."""


class StaleVersionError(RewindError):
    """``commit(base_version)`` lost the optimistic race: the run is at another version."""

    def __init__(self, expected: int, actual: int) -> None:
        super().__init__(
            f"stale version: commit was based on version {expected}, "
            f"but the run is at version {actual}; restore() and retry"
        )
        self.expected = expected
        self.actual = actual


class FencedError(RewindError):
    """A newer writer (or snapshotter) with the same identity took over; this one must stop."""


class TargetNotFoundError(RewindError):
    """A replay target (version, step, gsn, offset) does not exist in the run's log."""


class TruncatedHistoryError(TargetNotFoundError):
    """A replay target lies in a part of the log that retention has truncated."""


class RunNotFoundError(RewindError):
    """The run has no ``RunStarted`` event in this log."""
