"""The two ports every backend implements: ``EventLog`` (the truth) and ``Coordinator`` (a cache).

A run's log has a control partition (``CONTROL = -1``: run layout, small states, seals,
snapshot markers, in global commit order) and one partition per tensor shard (0..S-1).
Offsets increase within a partition but need not be dense (Kafka's transaction markers
use offsets too); only committed transactions are ever visible.
"""

from __future__ import annotations

import abc
import io
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

from eventlog.errors import ConfigError
from eventlog.events import CONTROL_SHARD, WEIGHTS_SHARD
from eventlog.settings import current

CONTROL = CONTROL_SHARD
#: The weights stream's partition: a derived view beside the log, never folded by a replay.
WEIGHTS = WEIGHTS_SHARD


@dataclass(frozen=True)
class Record:
    """One committed message of a partition."""

    partition: int
    offset: int
    value: bytes


class MessageStream(Protocol):
    """One record's bytes as a stream: ``read(n)`` returns the next ``n`` bytes (fewer at
    the end; all the rest for -1), ``tell()`` the position. A read of exactly the
    message's bulk field (see ``LogTransaction.append``) may return a read-only
    ``memoryview`` of the store instead of a copy."""

    def read(self, n: int = -1, /) -> bytes: ...

    def tell(self) -> int: ...


T = TypeVar("T")
#: Decodes one record from its stream, given its size and offset.
Decoder = Callable[[MessageStream, int, int], T]


class Decoded(NamedTuple):
    """A record as its decoder returned it, with its offset and size in bytes."""

    offset: int
    size: int
    value: Any


#: A message to append: one buffer, or the consecutive parts that make it (so that a
#: multi-MiB payload can be written without being copied into one buffer first).
MessageBytes = bytes | tuple[bytes, ...]


def joined(message: MessageBytes) -> bytes:
    """The message as one buffer (a copy only when it came in parts)."""
    if isinstance(message, bytes):
        return message
    return message[0] if len(message) == 1 else b"".join(message)


def message_size(message: MessageBytes) -> int:
    """The message's length in bytes."""
    return len(message) if isinstance(message, bytes) else sum(len(p) for p in message)


class LogTransaction(abc.ABC):
    """Messages appended inside one atomic transaction."""

    @abc.abstractmethod
    def append(self, partition: int, value: MessageBytes, *, bulk_at: int | None = None) -> None:
        """Queue one message for ``partition``; visible only if the transaction commits.

        ``bulk_at``: where the message's bulk field (a tensor chunk's payload) begins. A store
        that can keep it aligned, and hand it to readers as a view instead of a copy, does so;
        others ignore it."""


class LogWriter(abc.ABC):
    """The single writer of a run's partitions, identified (and fenced) by its writer id."""

    writer_id: str

    @abc.abstractmethod
    def transaction(self) -> AbstractContextManager[LogTransaction]:
        """Open a transaction: committed when the block exits, aborted if it raises.

        Raises ``FencedError`` at commit if a newer writer with the same id took over.
        """

    def maintenance_window(self) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """A hint that the caller's latency-critical work is done (the recorder calls it
        right after ``commit()`` has copied the state): deferred maintenance may run now.
        Does nothing unless a backend has such work."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the writer's resources (after any deferred maintenance)."""


class EventLog(abc.ABC):
    """One run's log."""

    run_id: str
    url: str
    #: Whether every offset from the start offset to the end offset holds a committed
    #: record (Kafka's transaction markers take offsets of their own: not there).
    dense_offsets: bool = False

    @abc.abstractmethod
    def create(self, shards: int) -> None:
        """Create the run's partitions (control + ``shards``); a no-op if they exist."""

    def create_weights(self) -> None:
        """Create the run's weights-stream partition (``WEIGHTS``) if missing; the run must
        exist. A backend without one raises ``ConfigError``."""
        raise ConfigError(f"the log at {self.url} cannot hold a weights stream")

    @abc.abstractmethod
    def shard_count(self) -> int | None:
        """Number of tensor shards, or ``None`` if the run does not exist in this log."""

    @abc.abstractmethod
    def writer(self, writer_id: str) -> LogWriter:
        """Become the writer ``writer_id``, fencing any older writer with that id."""

    @abc.abstractmethod
    def read(
        self, partition: int, *, gt: int | None = None, lte: int | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """Committed records of ``partition`` with ``gt < offset <= lte``, oldest first."""

    @abc.abstractmethod
    def end_offset(self, partition: int) -> int:
        """The offset the next committed record of ``partition`` will get."""

    @abc.abstractmethod
    def start_offset(self, partition: int) -> int:
        """The oldest offset still held (records below it were truncated)."""

    def describe_reads(self, partition: int) -> str:
        """What the backend's readers of ``partition`` hold (positions, caches), for a
        diagnostic when a read comes up short; empty if there is nothing to tell."""
        return ""

    def forget_reads(self, partition: int) -> None:
        """Drop whatever the backend cached about reads of ``partition`` (positioned
        readers, ranges known to be empty), so that the next read asks the store afresh."""
        return None  # a backend that caches nothing has nothing to forget

    def record_file(self, partition: int, offset: int | None = None) -> str:
        """Where the record at ``offset`` of ``partition`` is kept (a file, or the log's
        address), for a report naming a damaged record; ``None``: where the partition is."""
        return self.url

    def holds_unindexed(self, partition: int, lo: int, hi: int) -> bool:
        """Whether records with offsets in ``[lo, hi]`` are kept but a read does not find
        them (a damaged index: asked after a read skipped those offsets). Only a log with an
        index of its own can say yes."""
        return False

    def writer_epochs(self) -> dict[str, int] | None:
        """The fencing epoch the store holds for each writer id of the run (the highest, where
        a damaged store holds several); ``None`` where a server keeps them (Kafka's broker)."""
        return None

    @abc.abstractmethod
    def truncate_before(self, partition: int, offset: int) -> None:
        """Delete the records of ``partition`` below ``offset``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections."""

    def read_decoded(
        self, partition: int, decode: Decoder[Any], *, gt: int | None = None,
        lte: int | None = None, limit: int | None = None,
    ) -> list[Decoded]:
        """Like ``read``, each record handed to ``decode`` as a stream (valid during that
        call only), every record of the range decoded before this returns. A backend that
        stores records may serve each ``read`` of the stream straight from its store: a
        decoder that reads a large field in one call gets it without copying the record."""
        return [_decoded(r, decode) for r in self.read(partition, gt=gt, lte=lte, limit=limit)]

    def scan_batch(self, partition: int) -> int:
        """Records per ``read`` call when a fold scans ``partition`` (``scan(batch=...)``)."""
        return current().read_batch

    def partitions(self) -> list[int]:
        """Control first, then every shard partition."""
        return [CONTROL, *range(self.shard_count() or 0)]

    def scan(
        self, partition: int, *, gt: int | None = None, lte: int | None = None,
        batch: int = 256,
    ) -> Iterator[Record]:
        """Every committed record of ``partition`` in ``(gt, lte]``, fetched in batches."""
        return paged(lambda cursor: self.read(partition, gt=cursor, lte=lte, limit=batch), gt, batch)

    def scan_decoded(
        self, partition: int, decode: Decoder[Any], *, gt: int | None = None,
        lte: int | None = None, batch: int = 256,
    ) -> Iterator[Decoded]:
        """Every committed record of ``partition`` in ``(gt, lte]``, fetched in batches and
        decoded by ``decode`` one at a time, as the caller reaches it: a caller that stops
        at its target never decodes (or fails on) the records of the batch after it."""
        return (_decoded(r, decode) for r in self.scan(partition, gt=gt, lte=lte, batch=batch))

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _decoded(record: Record, decode: Decoder[Any]) -> Decoded:
    """One record decoded from memory."""
    size = len(record.value)
    return Decoded(record.offset, size, decode(io.BytesIO(record.value), size, record.offset))


def paged(fetch: Callable[[int | None], list[Any]], gt: int | None, batch: int) -> Iterator[Any]:
    """Every item of ``fetch(cursor)`` pages (items with an ``offset``), from ``gt`` on."""
    if batch < 1:
        raise ConfigError(f"a log read batch must be at least 1 record (REWIND_READ_BATCH, "
                          f"REWIND_EMBEDDED_READ_BATCH), got {batch}")

    def pages() -> Iterator[Any]:
        cursor = gt
        while True:
            items = fetch(cursor)
            if not items:
                return
            yield from items
            cursor = items[-1].offset

    return pages()


class Coordinator(abc.ABC):
    """Coordination state: a cache that can always be rebuilt from the log."""

    url: str

    @abc.abstractmethod
    def current_version(self, run: str) -> int:
        """The run's newest committed version as the coordinator knows it (0: none)."""

    @abc.abstractmethod
    def compare_and_set_version(self, run: str, expected: int, new: int) -> None:
        """Move the version from ``expected`` to ``new`` atomically, or raise ``StaleVersionError``."""

    @abc.abstractmethod
    def reset_version(self, run: str, version: int) -> None:
        """Overwrite the version with the one the log proves (rebuild after loss)."""

    @abc.abstractmethod
    def allocate_gsns(self, run: str, count: int) -> int:
        """Reserve ``count`` consecutive gsns; returns the first."""

    @abc.abstractmethod
    def raise_gsn_floor(self, run: str, floor: int) -> None:
        """Ensure every later allocation is above ``floor`` (rebuild after loss)."""

    @abc.abstractmethod
    def catalog_put(self, run: str, snapshot_id: str, entry: dict[str, Any]) -> None:
        """Cache one snapshot's catalog entry."""

    @abc.abstractmethod
    def catalog(self, run: str) -> dict[str, dict[str, Any]]:
        """Every cached snapshot entry of the run."""

    @abc.abstractmethod
    def catalog_delete(self, run: str, snapshot_id: str) -> None:
        """Forget one snapshot entry."""

    @abc.abstractmethod
    def acquire_lease(self, name: str, holder: str, ttl_s: float) -> int | None:
        """Take or renew lease ``name`` for ``holder``; returns its fencing token, or ``None``
        if another holder has it. A new holder always gets a larger token."""

    @abc.abstractmethod
    def release_lease(self, name: str, holder: str) -> None:
        """Give the lease up if ``holder`` has it."""

    @abc.abstractmethod
    def lease_token(self, name: str) -> int:
        """The newest fencing token issued for ``name`` (0: never)."""

    @abc.abstractmethod
    def lease_holder(self, name: str) -> tuple[str, float] | None:
        """Who holds lease ``name`` and in how many seconds it expires unless renewed;
        ``None`` if it is free (released, expired, or never taken)."""

    @abc.abstractmethod
    def report_follower(self, run: str, follower: str, version: int) -> None:
        """Record the version a follower (actor) runs."""

    @abc.abstractmethod
    def followers(self, run: str) -> dict[str, dict[str, int]]:
        """Each follower's ``version`` and ``time_ms`` of its last report."""

    @abc.abstractmethod
    def forget_follower(self, run: str, follower: str) -> bool:
        """Drop a follower's report (it stopped, or went silent); whether there was one."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections."""

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
