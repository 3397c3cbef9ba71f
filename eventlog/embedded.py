"""The embedded backend: one SQLite file holds the log and the coordinator (no servers).

SQLite gives the contract the Kafka backend gets from transactions: a transaction's records
become visible together at commit, a crash before commit leaves nothing (rollback journal
/ WAL), and a commit is durable on return (``synchronous=FULL``). Writers are fenced with
an epoch per writer id, checked inside the commit, like Kafka's ``transactional.id``.

URL: ``sqlite://<path>``, e.g. ``sqlite:///tmp/run/rewind.db`` (absolute) or
``sqlite://runs/rewind.db`` (relative).
"""

from __future__ import annotations

import functools
import io
import json
import math
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, ParamSpec, TypeVar

from eventlog import knobs, segments
from eventlog.errors import (
    ConfigError,
    CoordinationError,
    CorruptStoreError,
    EventLogError,
    FencedError,
    RewindError,
    StaleVersionError,
    TruncatedHistoryError,
)
from eventlog.ports import (
    CONTROL,
    Coordinator,
    Decoded,
    Decoder,
    EventLog,
    LogTransaction,
    LogWriter,
    MessageStream,
    Record,
    paged,
)

P = ParamSpec("P")
R = TypeVar("R")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (run TEXT PRIMARY KEY, shards INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS partitions (
    run TEXT, partition INTEGER, next_offset INTEGER NOT NULL, start_offset INTEGER NOT NULL,
    PRIMARY KEY (run, partition));
CREATE TABLE IF NOT EXISTS records (
    run TEXT, partition INTEGER, offset INTEGER, value BLOB NOT NULL,
    PRIMARY KEY (run, partition, offset));
CREATE TABLE IF NOT EXISTS extents (run TEXT, partition INTEGER, offset INTEGER,
    file TEXT NOT NULL, pos INTEGER NOT NULL, length INTEGER NOT NULL, bulk INTEGER NOT NULL,
    PRIMARY KEY (run, partition, offset));
CREATE TABLE IF NOT EXISTS writers (run TEXT, writer TEXT, epoch INTEGER NOT NULL,
    PRIMARY KEY (run, writer));
CREATE TABLE IF NOT EXISTS versions (run TEXT PRIMARY KEY, version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS gsns (run TEXT PRIMARY KEY, next_gsn INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS catalog (run TEXT, snapshot_id TEXT, entry TEXT NOT NULL,
    PRIMARY KEY (run, snapshot_id));
CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, holder TEXT, token INTEGER NOT NULL,
    expires REAL NOT NULL);
CREATE TABLE IF NOT EXISTS followers (run TEXT, follower TEXT, version INTEGER NOT NULL,
    time_ms INTEGER NOT NULL, PRIMARY KEY (run, follower));
"""


def path_from_url(url: str) -> Path:
    """The database path of a ``sqlite://`` URL."""
    if not url.startswith("sqlite://") or len(url) <= len("sqlite://"):
        raise EventLogError(f"not an embedded (sqlite://<path>) URL: {url!r}")
    return Path(url[len("sqlite://") :])


#: The layout of an embedded database, kept in SQLite's ``user_version``: 1 = tensor chunks
#: may live in segment files (``extents``). Files from before the marker read 0 and are
#: marked on open (this version reads both layouts; a read-only file is read unmarked). A
#: file marked newer is refused when it is opened: a newer layout may keep messages where
#: this version would read empty values. (A process that has it open already is not told
#: of a later upgrade.)
FORMAT = 1


class _Database:
    """One SQLite file with a connection per thread (sqlite3 connections are not shareable)."""

    def __init__(self, path: Path, error: type[RewindError]) -> None:
        self.path = path
        self._error = error
        self._local = threading.local()
        path.parent.mkdir(parents=True, exist_ok=True)
        c = self.conn()
        try:
            self._check_format(c)
            c.executescript(_SCHEMA)
            self._mark_format(c)
        except BaseException:
            self.close()
            raise

    def _check_format(self, c: sqlite3.Connection) -> int:
        """The file's format, refused if newer than ``FORMAT``."""
        found = int(c.execute("PRAGMA user_version").fetchone()[0])
        if found > FORMAT:
            raise self._error(f"{self.path} holds an embedded log of format {found}, written by a newer "
                              f"Rewind; this version reads formats up to {FORMAT}: upgrade it")
        return found

    def _mark_format(self, c: sqlite3.Connection) -> None:
        """Mark an unmarked file, checking again inside the write lock, so that a newer
        version's mark made since the first check is refused, not overwritten."""
        if self._check_format(c) == FORMAT:
            return
        try:
            c.execute("BEGIN IMMEDIATE")
            try:
                if self._check_format(c) < FORMAT:
                    c.execute(f"PRAGMA user_version={FORMAT}")
            except BaseException:
                c.execute("ROLLBACK")
                raise
            c.execute("COMMIT")
        except sqlite3.OperationalError as exc:
            if "readonly" not in str(exc):
                raise
            # A read-only file stays unmarked, and is read as it is.

    def connect(self, shared: bool = False) -> sqlite3.Connection:
        """A new connection; ``shared`` ones may move between threads (one at a time)."""
        try:
            c = sqlite3.connect(
                self.path, timeout=60.0, isolation_level=None, check_same_thread=not shared
            )
            # Large pages suit multi-MiB chunk blobs (only takes effect on a new file), and a
            # rowid table keeps blobs out of the index b-tree (WITHOUT ROWID copies them in).
            c.execute("PRAGMA page_size=65536")
            c.execute("PRAGMA journal_mode=WAL")
            c.execute("PRAGMA synchronous=FULL")
        except sqlite3.Error as exc:
            raise self.wrap(exc) from exc
        return c

    def records_have_rowid(self) -> bool:
        """Whether ``records`` is a rowid table (files made before it was are WITHOUT ROWID,
        and their blobs cannot be opened incrementally)."""
        known: bool | None = getattr(self, "_rowid", None)
        if known is None:
            row = self.conn().execute(
                "SELECT sql FROM sqlite_master WHERE type='table' AND name='records'"
            ).fetchone()
            known = row is not None and "WITHOUT ROWID" not in str(row[0]).upper()
            self._rowid = known
        return known

    def conn(self) -> sqlite3.Connection:
        """This thread's connection."""
        c: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if c is None:
            c = self._local.conn = self.connect()
        return c

    def wrap(self, exc: sqlite3.Error) -> RewindError:
        """Our error for a driver error, naming the file."""
        msg = str(exc)
        if isinstance(exc, sqlite3.DatabaseError) and (
            "malformed" in msg or "not a database" in msg or "disk image" in msg
        ):
            return CorruptStoreError(f"embedded database {self.path} is damaged: {msg}")
        return self._error(f"embedded database {self.path}: {msg}")

    @contextmanager
    def txn(self, c: sqlite3.Connection | None = None) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT, rolled back if the block raises."""
        c = c or self.conn()
        try:
            c.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            raise self.wrap(exc) from exc
        try:
            yield c
        except BaseException:
            c.execute("ROLLBACK")
            raise
        try:
            c.execute("COMMIT")
        except sqlite3.Error as exc:
            c.execute("ROLLBACK")
            raise self.wrap(exc) from exc

    def close(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
            self._local.conn = None


def _wrapped(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn sqlite3 errors raised by a method into the backend's own error type."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except sqlite3.Error as exc:
            raise args[0]._db.wrap(exc) from exc  # type: ignore[attr-defined]

    return run


class _Transaction(LogTransaction):
    def __init__(self, log: EmbeddedLog, conn: sqlite3.Connection) -> None:
        self._log, self._conn = log, conn
        self._next: dict[int, int] = {}
        self._appender: segments.Appender | None = None
        self._segment: dict[int, str | None] = {}  # partition -> the segment file it appends to

    def append(self, partition: int, value: bytes, *, bulk_at: int | None = None) -> None:
        nxt = self._next.get(partition)
        if nxt is None:
            row = self._conn.execute(
                "SELECT next_offset FROM partitions WHERE run=? AND partition=?",
                (self._log.run_id, partition),
            ).fetchone()
            if row is None:
                raise EventLogError(f"run {self._log.run_id!r} has no partition {partition}")
            nxt = row[0]
        if bulk_at is not None and len(value) >= knobs.EMBEDDED_SEGMENT_MIN_BYTES \
                and self._log._db.records_have_rowid():
            self._out_of_line(partition, nxt, value, bulk_at)
        else:
            self._conn.execute(
                "INSERT INTO records VALUES (?,?,?,?)", (self._log.run_id, partition, nxt, value)
            )
        self._next[partition] = nxt + 1

    def _out_of_line(self, partition: int, offset: int, value: bytes, bulk_at: int) -> None:
        """The message in the partition's segment file; its row says where (and holds no bytes)."""
        run = self._log.run_id
        if self._appender is None:
            self._appender = segments.Appender(self._log._segments_root, knobs.EMBEDDED_SEGMENT_BYTES)
        if partition not in self._segment:
            row = self._conn.execute(
                "SELECT file FROM extents WHERE run=? AND partition=? ORDER BY offset DESC LIMIT 1",
                (run, partition),
            ).fetchone()
            self._segment[partition] = None if row is None else str(row[0])
        name, pos = self._appender.append(self._segment[partition], partition, offset, value, bulk_at)
        self._segment[partition] = name
        self._conn.execute("INSERT INTO records VALUES (?,?,?,?)", (run, partition, offset, b""))
        self._conn.execute("INSERT INTO extents VALUES (?,?,?,?,?,?,?)",
                           (run, partition, offset, name, pos, len(value), bulk_at))

    def close(self) -> None:
        if self._appender is not None:
            self._appender.close()

    def finish(self) -> None:
        if self._appender is not None:
            self._appender.flush()  # the bytes are durable before the rows naming them commit
        for partition, nxt in self._next.items():
            self._conn.execute(
                "UPDATE partitions SET next_offset=? WHERE run=? AND partition=?",
                (nxt, self._log.run_id, partition),
            )


class _Writer(LogWriter):
    def __init__(self, log: EmbeddedLog, writer_id: str, epoch: int) -> None:
        self._log, self.writer_id, self._epoch = log, writer_id, epoch
        # Its own connection: readers in this process must not see an open transaction.
        self._conn = log._db.connect(shared=True)
        self._lock = threading.Lock()
        # Copying the WAL back into the database would double the commit's writes; a
        # background thread does it between commits instead (durability needs only the WAL).
        self._conn.execute("PRAGMA wal_autocheckpoint=0")
        self._checkpoint = _Checkpointer(log._db, knobs.CHECKPOINT_IDLE_S)

    @contextmanager
    def transaction(self) -> Iterator[LogTransaction]:
        db = self._log._db
        try:
            with self._lock, db.txn(self._conn) as conn:
                row = conn.execute(
                    "SELECT epoch FROM writers WHERE run=? AND writer=?",
                    (self._log.run_id, self.writer_id),
                ).fetchone()
                if row is None or row[0] != self._epoch:
                    raise FencedError(
                        f"writer {self.writer_id!r} of run {self._log.run_id!r} was fenced by a "
                        f"newer writer with the same id (epoch {row[0] if row else '?'} > {self._epoch})"
                    )
                txn = _Transaction(self._log, conn)
                try:
                    yield txn
                    txn.finish()
                finally:
                    txn.close()
        except sqlite3.Error as exc:
            raise db.wrap(exc) from exc
        self._checkpoint.request()

    def maintenance_window(self) -> None:
        self._checkpoint.window()

    def close(self) -> None:
        self._checkpoint.stop()
        self._conn.close()


class _Checkpointer:
    """Runs passive WAL checkpoints in a background thread, between commits.

    A checkpoint reads back and rewrites everything the last commit wrote (400 MB per
    version at 100M params). Run right after that commit, it shared the memory bus with the
    training thread's copy of the next version's state, and made ``commit()`` 20-40%
    slower on 2 cores. So a committed transaction only marks a checkpoint as due. It runs
    at the writer's next maintenance window (right after the next ``commit()`` has copied
    its state), ``idle_s`` seconds after the first commit it has not covered, or when the
    writer closes. A checkpoint that a reader kept from finishing is due again ``idle_s``
    later.
    """

    def __init__(self, db: _Database, idle_s: float) -> None:
        if not (math.isfinite(idle_s) and idle_s >= 0):
            raise ConfigError(f"REWIND_CHECKPOINT_IDLE_S must be a finite number of seconds >= 0, got {idle_s}")
        self._db, self._idle_s = db, idle_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._due: float | None = None  # monotonic deadline of the pending checkpoint
        self._now = self._stopping = False
        #: Checkpoints run so far (tests wait on it).
        self.runs = 0
        self._thread = threading.Thread(target=self._run, name="rewind-wal-checkpoint", daemon=True)
        self._thread.start()

    def request(self) -> None:
        """The WAL holds a new commit: checkpoint it at the next window (or the deadline)."""
        with self._lock:
            if self._due is None:
                self._due = time.monotonic() + self._idle_s
        self._wake.set()

    def window(self) -> None:
        """Let a pending checkpoint start now (it runs in the background thread)."""
        with self._lock:
            self._now = self._due is not None
        self._wake.set()

    def stop(self) -> None:
        """Run the pending checkpoint, if any, then end the thread."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout=60)

    def _take(self) -> tuple[bool, bool]:
        """Whether a checkpoint runs now (it is then no longer pending), and whether this
        is the last round; decided together, so a stop never skips a pending checkpoint."""
        with self._lock:
            run = self._due is not None and (self._now or self._stopping or time.monotonic() >= self._due)
            if run:
                self._due, self._now = None, False
            return run, self._stopping

    def _run(self) -> None:
        conn = self._db.connect()
        try:
            while True:
                with self._lock:
                    wait = None if self._due is None else max(0.0, self._due - time.monotonic())
                self._wake.wait(wait)
                self._wake.clear()
                run, last = self._take()
                if run:
                    self._checkpoint(conn)
                if last:
                    return
        finally:
            conn.close()

    def _checkpoint(self, conn: sqlite3.Connection) -> None:
        try:
            busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error:
            busy, frames, copied = 1, 1, 0  # a busy database
        with self._lock:
            self.runs += 1
            if (busy or copied < frames) and self._due is None and not self._stopping:
                self._due = time.monotonic() + self._idle_s  # a reader held frames: retry


class _BlobStream:
    """A record's blob as a ``MessageStream``, valid while the blob is open (during one
    ``decode`` call): short reads are served from one read of its first bytes; a read
    beyond them (a tensor chunk's payload) goes straight from SQLite into its own bytes
    object, with the GIL released, the one copy of it that a fold makes (decryption makes
    another for an encrypted one). SQLite's errors there are the store's, not the
    message's: they name the database file, as a plain read's would."""

    HEAD = 4096

    def __init__(self, blob: sqlite3.Blob, db: _Database) -> None:
        self._blob, self._db, self._size, self._pos = blob, db, len(blob), 0
        self._head = blob.read(min(self._size, self.HEAD))

    @classmethod
    def over(cls, blob: sqlite3.Blob, db: _Database) -> MessageStream:
        """A stream of the blob: a plain in-memory one for a record that fits in one read."""
        return io.BytesIO(blob.read()) if len(blob) <= cls.HEAD else cls(blob, db)

    def read(self, n: int = -1, /) -> bytes:
        start = self._pos
        end = self._size if n < 0 else min(self._size, start + n)
        if end <= len(self._head):
            out = self._head[start:end]
        else:
            try:
                self._blob.seek(start)
                out = self._blob.read(end - start)
            except sqlite3.Error as exc:
                raise self._db.wrap(exc) from exc
        self._pos = end
        return out

    def tell(self) -> int:
        return self._pos


class _ViewStream:
    """A segment-file record as a ``MessageStream``: the read of its bulk field returns a
    view of the map (no copy); every other read, its own bytes."""

    def __init__(self, view: memoryview, bulk_at: int) -> None:
        self._view, self._bulk, self._pos = view, bulk_at, 0

    def read(self, n: int = -1, /) -> bytes:
        start = self._pos
        end = len(self._view) if n < 0 else min(len(self._view), start + n)
        self._pos = end
        if start == self._bulk and end > start:
            return self._view[start:end]  # type: ignore[return-value]  # read-only view
        return bytes(self._view[start:end])

    def tell(self) -> int:
        return self._pos


class _Stored(NamedTuple):
    """Where one record's bytes are: a SQLite blob, or a view of a segment file."""

    blob: sqlite3.Blob | None
    view: memoryview | None
    bulk_at: int
    db: _Database
    error: RewindError | None = None  # the record cannot be read (``_stored(lazy_errors=True)``)

    def size(self) -> int:
        return len(self.blob) if self.blob is not None else len(self.view or b"")

    def value(self) -> bytes:
        """The record's bytes (a copy)."""
        return self.blob.read() if self.blob is not None else bytes(self.view or b"")

    def stream(self) -> MessageStream:
        if self.blob is not None:
            return _BlobStream.over(self.blob, self.db)
        return _ViewStream(self.view or memoryview(b""), self.bulk_at)


class _Located(NamedTuple):
    """A record a scan found: ``take()`` decodes it (see ``EmbeddedLog.scan_decoded``)."""

    offset: int
    take: Callable[[], list[Decoded]]


#: Records kept in SQLite up to this size are copied into a scan's page; a larger one is
#: read again when the scan reaches it, so a page of 16 never holds 16 x 4 MiB.
_PAGE_COPY_BYTES = 256 * 1024


def _raise(error: BaseException) -> list[Decoded]:
    raise error


class EmbeddedLog(EventLog):
    """A run's log in a SQLite file."""

    def scan_batch(self, partition: int) -> int:
        # Rows per read transaction (see ``scan_decoded``; records are decoded one at a time).
        return knobs.READ_BATCH if partition == CONTROL else knobs.EMBEDDED_READ_BATCH

    def __init__(self, url: str, run_id: str) -> None:
        self.url, self.run_id = url, run_id
        self._segments_root = segments.directory(path_from_url(url), run_id)
        self._segments = segments.Reader(self._segments_root)
        try:
            self._db = _Database(path_from_url(url), EventLogError)
        except sqlite3.Error as exc:
            raise CorruptStoreError(
                f"embedded database {path_from_url(url)} cannot be opened: {exc}"
            ) from exc

    @_wrapped
    def create(self, shards: int) -> None:
        with self._db.txn() as c:
            row = c.execute("SELECT shards FROM runs WHERE run=?", (self.run_id,)).fetchone()
            if row is not None:
                if row[0] != shards:
                    raise EventLogError(
                        f"run {self.run_id!r} exists with {row[0]} shards, not {shards}"
                    )
                return
            c.execute("INSERT INTO runs VALUES (?,?)", (self.run_id, shards))
            for p in range(-1, shards):
                c.execute("INSERT INTO partitions VALUES (?,?,0,0)", (self.run_id, p))

    @_wrapped
    def shard_count(self) -> int | None:
        row = self._db.conn().execute(
            "SELECT shards FROM runs WHERE run=?", (self.run_id,)
        ).fetchone()
        return None if row is None else int(row[0])

    @_wrapped
    def writer(self, writer_id: str) -> LogWriter:
        with self._db.txn() as c:
            c.execute(
                "INSERT INTO writers VALUES (?,?,1) ON CONFLICT(run, writer) "
                "DO UPDATE SET epoch=epoch+1",
                (self.run_id, writer_id),
            )
            (epoch,) = c.execute(
                "SELECT epoch FROM writers WHERE run=? AND writer=?", (self.run_id, writer_id)
            ).fetchone()
        return _Writer(self, writer_id, int(epoch))

    @_wrapped
    def read(
        self, partition: int, *, gt: int | None = None, lte: int | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        if not self._db.records_have_rowid():  # a file from before the rowid table
            rows = self._db.conn().execute(
                "SELECT offset, value FROM records WHERE run=? AND partition=? AND offset>? "
                "AND offset<=? ORDER BY offset LIMIT ?",
                self._range(partition, gt, lte, limit),
            ).fetchall()
            return [Record(partition, int(o), bytes(v)) for o, v in rows]
        return self._stored(partition, gt, lte, limit,
                            lambda at, offset: Record(partition, offset, at.value()))

    @_wrapped
    def read_decoded(
        self, partition: int, decode: Decoder[Any], *, gt: int | None = None,
        lte: int | None = None, limit: int | None = None,
    ) -> list[Decoded]:
        if not self._db.records_have_rowid():
            return super().read_decoded(partition, decode, gt=gt, lte=lte, limit=limit)
        return self._stored(partition, gt, lte, limit, lambda at, offset: Decoded(
            offset, at.size(), decode(at.stream(), at.size(), offset)))

    @_wrapped
    def scan_decoded(
        self, partition: int, decode: Decoder[Any], *, gt: int | None = None,
        lte: int | None = None, batch: int = 256,
    ) -> Iterator[Decoded]:
        """Records found ``batch`` rows per read transaction, each decoded only when the
        caller reaches it (so a fold that stops at its target never fails on a record past
        it): the first of a page at once, inside its transaction; the others from views of
        their segment files (no copy), from copies of their bytes (up to
        ``_PAGE_COPY_BYTES``), or, a larger record kept in SQLite, read again on its own
        then (one copy alive at a time)."""
        if not self._db.records_have_rowid():  # whole copies: one large record per read
            return super().scan_decoded(partition, decode, gt=gt, lte=lte,
                                        batch=batch if partition == CONTROL else 1)

        def page(cursor: int | None) -> list[_Located]:
            first = True

            def locate(at: _Stored, offset: int) -> _Located:
                nonlocal first
                reached, first = first, False  # the first row: the record the caller waits for
                if at.error is not None:
                    if reached:
                        raise at.error
                    error = at.error
                    return _Located(offset, lambda: _raise(error))
                if reached:
                    box = [Decoded(offset, at.size(), decode(at.stream(), at.size(), offset))]
                    return _Located(offset, lambda: [box.pop()])  # (not kept alive by the page)
                if at.view is not None:
                    return _Located(offset, lambda: [
                        Decoded(offset, at.size(), decode(at.stream(), at.size(), offset))])
                if at.size() <= _PAGE_COPY_BYTES:
                    try:
                        value = at.value()
                    except sqlite3.Error:  # reported if the scan reaches it: read it again then
                        return _Located(offset, lambda: self._reread(partition, decode, offset))
                    return _Located(offset, lambda: [
                        Decoded(offset, len(value), decode(io.BytesIO(value), len(value), offset))])
                return _Located(offset, lambda: self._reread(partition, decode, offset))

            return self._stored(partition, cursor, lte, batch, locate, lazy_errors=True)

        return (d for found in paged(page, gt, batch) for d in found.take())

    def _reread(self, partition: int, decode: Decoder[Any], offset: int) -> list[Decoded]:
        """One record found by an earlier read transaction; if it is gone since, a
        truncation that committed meanwhile (or a hand) deleted it: ``_gone`` says which."""
        got = self.read_decoded(partition, decode, gt=offset - 1, lte=offset, limit=1)
        if not got or got[0].offset != offset:
            raise self._gone(partition, offset, "its row is missing")
        return got

    def _range(self, partition: int, gt: int | None, lte: int | None,
               limit: int | None) -> tuple[object, ...]:
        return (self.run_id, partition, -1 if gt is None else gt,
                (1 << 62) if lte is None else lte, -1 if limit is None else limit)

    @_wrapped
    def _stored(self, partition: int, gt: int | None, lte: int | None, limit: int | None,
                each: Callable[[_Stored, int], R], *, lazy_errors: bool = False) -> list[R]:
        """``each(stored, offset)`` for every record in ``(gt, lte]``, oldest first.

        The rows are found first. A record kept in SQLite is then read through an
        incremental blob handle: ``sqlite3.Blob.read`` copies once, straight into the
        bytes object, with the GIL released, where ``SELECT value`` copies twice holding
        it (readers of several shards in threads then run one at a time). A record kept in
        a segment file is a view of its map. The read transaction makes the lookup and the
        blob reads see one snapshot of the database, as one SELECT would. With
        ``lazy_errors``, a record whose segment file or blob cannot be opened is handed to
        ``each`` with that ``error``, for its reader to raise if it reaches it."""
        conn = self._db.conn()
        own = not conn.in_transaction
        if own:
            conn.execute("BEGIN")
        try:
            rows = conn.execute(
                "SELECT r.rowid, r.offset, e.file, e.pos, e.length, e.bulk FROM records r "
                "LEFT JOIN extents e ON e.run=r.run AND e.partition=r.partition AND e.offset=r.offset "
                "WHERE r.run=? AND r.partition=? AND r.offset>? AND r.offset<=? ORDER BY r.offset LIMIT ?",
                self._range(partition, gt, lte, limit),
            ).fetchall()
            out = []
            for rowid, o, file, pos, length, bulk in rows:
                view, blob = None, None
                try:  # (opening only: an error from ``each`` is never deferred)
                    if file is not None:
                        view = self._segment_view(partition, int(o), str(file), int(pos), int(length))
                    else:
                        blob = conn.blobopen("records", "value", rowid, readonly=True)
                except (RewindError, sqlite3.Error) as exc:
                    if not lazy_errors:
                        raise
                    error = self._db.wrap(exc) if isinstance(exc, sqlite3.Error) else exc
                    # (no traceback: it would keep this frame, and the page, alive)
                    out.append(each(_Stored(None, None, 0, self._db, error.with_traceback(None)), int(o)))
                    continue
                if blob is None:
                    out.append(each(_Stored(None, view, int(bulk), self._db), int(o)))
                    continue
                with blob:
                    out.append(each(_Stored(blob, None, 0, self._db), int(o)))
            if own:
                conn.execute("COMMIT")  # read only: ends the snapshot, writes nothing
        except BaseException:
            if own and conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return out

    def _segment_view(self, partition: int, offset: int, name: str, pos: int, length: int) -> memoryview:
        """A record's bytes in its segment file. A file that is gone was deleted by a
        truncation that committed after this read began (or by hand): which one, the
        partition's start offset now says, on a connection outside this read."""
        where = f"run {self.run_id!r} partition {partition} offset {offset}"
        try:
            return self._segments.view(name, pos, length, where)
        except FileNotFoundError as exc:
            raise self._gone(partition, offset, f"segment file {self._segments_root / name} is missing") from exc

    def _gone(self, partition: int, offset: int, what: str) -> RewindError:
        """The error for a record found by a read but gone when read: truncated meanwhile
        (the partition's start offset, read on a connection outside that read, is past
        it), or damage (``what`` says which)."""
        where = f"run {self.run_id!r} partition {partition} offset {offset}"
        other = self._db.connect()
        try:
            start = other.execute(
                "SELECT start_offset FROM partitions WHERE run=? AND partition=?",
                (self.run_id, partition)).fetchone()
        except sqlite3.Error as exc:
            error = self._db.wrap(exc)
            error.add_note(f"while checking why {where} is gone ({what})")
            error.__cause__ = exc
            return error
        finally:
            other.close()
        if start is not None and offset < int(start[0]):
            return TruncatedHistoryError(
                f"{where} was truncated while it was being read (the partition now starts "
                f"at offset {int(start[0])})")
        return CorruptStoreError(f"{where}: {what}")

    def _partition_row(self, partition: int) -> tuple[int, int]:
        row = self._db.conn().execute(
            "SELECT next_offset, start_offset FROM partitions WHERE run=? AND partition=?",
            (self.run_id, partition),
        ).fetchone()
        return (0, 0) if row is None else (int(row[0]), int(row[1]))

    @_wrapped
    def end_offset(self, partition: int) -> int:
        return self._partition_row(partition)[0]

    @_wrapped
    def start_offset(self, partition: int) -> int:
        return self._partition_row(partition)[1]

    @_wrapped
    def truncate_before(self, partition: int, offset: int) -> None:
        key = (self.run_id, partition)
        with self._db.txn() as c:
            for table in ("records", "extents"):
                c.execute(f"DELETE FROM {table} WHERE run=? AND partition=? AND offset<?", (*key, offset))
            c.execute(
                "UPDATE partitions SET start_offset=MAX(start_offset, MIN(?, next_offset)) "
                "WHERE run=? AND partition=?",
                (offset, *key),
            )
            start = self._partition_row(partition)[1]
            referenced = {str(f) for (f,) in c.execute(
                "SELECT DISTINCT file FROM extents WHERE run=? AND partition=?", key)}
        # Only after the commit: a failed one would bring back rows naming deleted files.
        segments.remove_below(self._segments_root, partition, start, referenced)
        self._segments.release_deleted()

    def close(self) -> None:
        self._segments.close()
        self._db.close()


def inline_segments(path: Path, segments_of: Path | None = None) -> int:
    """Move every message of the database at ``path`` that lives in a segment file into
    SQLite, the layout that versions before segment files read (for a downgrade, or for a
    tool that reads messages with SQL). ``segments_of``: the database whose segment files
    hold them, for a copy of it (default: ``path``). The segment files are left in place.
    Returns the number of messages moved."""
    source = segments_of or path
    db = _Database(path, EventLogError)
    try:
        with db.txn() as c:
            rows = c.execute("SELECT run, partition, offset, file, pos, length FROM extents").fetchall()
            readers: dict[str, segments.Reader] = {}  # one per run: each file is mapped once
            for run, partition, offset, name, pos, length in rows:
                where = f"run {run!r} partition {partition} offset {offset}"
                reader = readers.setdefault(run, segments.Reader(segments.directory(source, run)))
                value = bytes(reader.view(name, pos, length, where))
                c.execute("UPDATE records SET value=? WHERE run=? AND partition=? AND offset=?",
                          (value, run, partition, offset))
            c.execute("DELETE FROM extents")
            for reader in readers.values():
                reader.close()
    except sqlite3.Error as exc:
        raise db.wrap(exc) from exc
    finally:
        db.close()
    return len(rows)


def list_runs(url: str) -> list[str]:
    """Runs recorded in an embedded database."""
    path = path_from_url(url)
    if not path.exists():
        return []
    db = _Database(path, EventLogError)
    try:
        return [r[0] for r in db.conn().execute("SELECT run FROM runs ORDER BY run")]
    except sqlite3.Error as exc:
        raise db.wrap(exc) from exc
    finally:
        db.close()


class EmbeddedCoordinator(Coordinator):
    """Coordinator state in a SQLite file (usually the log's own file)."""

    def __init__(self, url: str, clock: Callable[[], float] = time.time) -> None:
        self.url = url
        self._clock = clock
        try:
            self._db = _Database(path_from_url(url), CoordinationError)
        except sqlite3.Error as exc:
            raise CoordinationError(f"embedded coordinator {url}: {exc}") from exc

    @_wrapped
    def current_version(self, run: str) -> int:
        row = self._db.conn().execute("SELECT version FROM versions WHERE run=?", (run,)).fetchone()
        return 0 if row is None else int(row[0])

    @_wrapped
    def compare_and_set_version(self, run: str, expected: int, new: int) -> None:
        with self._db.txn() as c:
            row = c.execute("SELECT version FROM versions WHERE run=?", (run,)).fetchone()
            actual = 0 if row is None else int(row[0])
            if actual != expected:
                raise StaleVersionError(expected, actual)
            c.execute("INSERT OR REPLACE INTO versions VALUES (?,?)", (run, new))

    @_wrapped
    def reset_version(self, run: str, version: int) -> None:
        with self._db.txn() as c:
            c.execute("INSERT OR REPLACE INTO versions VALUES (?,?)", (run, version))

    @_wrapped
    def allocate_gsns(self, run: str, count: int) -> int:
        with self._db.txn() as c:
            row = c.execute("SELECT next_gsn FROM gsns WHERE run=?", (run,)).fetchone()
            first = 1 if row is None else int(row[0])
            c.execute("INSERT OR REPLACE INTO gsns VALUES (?,?)", (run, first + count))
        return first

    @_wrapped
    def raise_gsn_floor(self, run: str, floor: int) -> None:
        with self._db.txn() as c:
            c.execute(
                "INSERT INTO gsns VALUES (?,?) ON CONFLICT(run) "
                "DO UPDATE SET next_gsn=MAX(next_gsn, excluded.next_gsn)",
                (run, floor + 1),
            )

    @_wrapped
    def catalog_put(self, run: str, snapshot_id: str, entry: dict[str, Any]) -> None:
        with self._db.txn() as c:
            c.execute(
                "INSERT OR REPLACE INTO catalog VALUES (?,?,?)",
                (run, snapshot_id, json.dumps(entry, sort_keys=True)),
            )

    @_wrapped
    def catalog(self, run: str) -> dict[str, dict[str, Any]]:
        rows = self._db.conn().execute(
            "SELECT snapshot_id, entry FROM catalog WHERE run=?", (run,)
        ).fetchall()
        return {sid: json.loads(entry) for sid, entry in rows}

    @_wrapped
    def catalog_delete(self, run: str, snapshot_id: str) -> None:
        with self._db.txn() as c:
            c.execute("DELETE FROM catalog WHERE run=? AND snapshot_id=?", (run, snapshot_id))

    @_wrapped
    def acquire_lease(self, name: str, holder: str, ttl_s: float) -> int | None:
        now = self._clock()
        with self._db.txn() as c:
            row = c.execute("SELECT holder, token, expires FROM leases WHERE name=?", (name,)).fetchone()
            if row is None:
                token = 1
            else:
                cur_holder, token, expires = row
                if cur_holder == holder and expires > now:
                    c.execute("UPDATE leases SET expires=? WHERE name=?", (now + ttl_s, name))
                    return int(token)
                if cur_holder is not None and expires > now:
                    return None
                token = int(token) + 1
            c.execute("INSERT OR REPLACE INTO leases VALUES (?,?,?,?)", (name, holder, token, now + ttl_s))
        return token

    @_wrapped
    def release_lease(self, name: str, holder: str) -> None:
        with self._db.txn() as c:
            c.execute("UPDATE leases SET holder=NULL, expires=0 WHERE name=? AND holder=?", (name, holder))

    @_wrapped
    def lease_token(self, name: str) -> int:
        row = self._db.conn().execute("SELECT token FROM leases WHERE name=?", (name,)).fetchone()
        return 0 if row is None else int(row[0])

    @_wrapped
    def report_follower(self, run: str, follower: str, version: int) -> None:
        with self._db.txn() as c:
            c.execute(
                "INSERT OR REPLACE INTO followers VALUES (?,?,?,?)",
                (run, follower, version, int(self._clock() * 1000)),
            )

    @_wrapped
    def followers(self, run: str) -> dict[str, dict[str, int]]:
        rows = self._db.conn().execute(
            "SELECT follower, version, time_ms FROM followers WHERE run=?", (run,)
        ).fetchall()
        return {f: {"version": int(v), "time_ms": int(t)} for f, v, t in rows}

    @_wrapped
    def forget_follower(self, run: str, follower: str) -> bool:
        with self._db.txn() as c:
            return c.execute("DELETE FROM followers WHERE run=? AND follower=?",
                             (run, follower)).rowcount > 0

    def close(self) -> None:
        self._db.close()
