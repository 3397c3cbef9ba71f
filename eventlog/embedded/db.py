"""The SQLite file of the embedded backend: its schema and format marker, a connection per
thread (or a read-only one that creates nothing), transactions, and our errors for SQLite's."""

from __future__ import annotations

import functools
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ParamSpec, TypeVar

import xxhash

from eventlog.errors import ConfigError, CorruptStoreError, EventLogError, RewindError, RunNotFoundError
from eventlog.ports import MessageBytes
from eventlog.waits import warned_wait

_log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (run TEXT PRIMARY KEY, shards INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS partitions (
    run TEXT, partition INTEGER, next_offset INTEGER NOT NULL, start_offset INTEGER NOT NULL,
    PRIMARY KEY (run, partition));
CREATE TABLE IF NOT EXISTS records (
    run TEXT, partition INTEGER, offset INTEGER, value BLOB NOT NULL, sum INTEGER,
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
#: may live in segment files (``extents``); 2 = each record's row holds a checksum of it
#: (``records.sum``, see ``record_sum``), checked on every read. Older files are
#: brought up to it on open (their rows hold no checksum and are read unchecked; a
#: read-only file is read as it is). A file marked newer is refused when it is opened: a
#: newer layout may keep messages where this version would read empty values. (A process
#: that has it open already is not told of a later upgrade.)
FORMAT = 2


#: A record kept in a segment file (a tensor chunk) is checksummed by its first and last
#: this many bytes: its envelope (the payload's own digest checks the bytes between once
#: decoded, so a replay does not pass over them twice).
SUM_ENDS = 4096


def record_sum(message: MessageBytes | memoryview, ends: int | None = None) -> int:
    """The checksum of a record, as SQLite's signed 64-bit integer: the xxh3-64 of its bytes,
    or, with ``ends``, of its first and last ``ends`` bytes (all of them when it is no longer
    than twice that). Without it a flipped byte in a record's envelope (its gsn or version)
    can decode and mislead the fold; with it the store names the very record."""
    parts = message if isinstance(message, tuple) else (message,)
    size = sum(len(p) for p in parts)
    h = xxhash.xxh3_64()
    if ends is None or size <= 2 * ends:
        for part in parts:
            h.update(part)
    else:
        h.update(_span(parts, 0, ends))
        h.update(_span(parts, size - ends, size))
    value = h.intdigest()
    return value - (1 << 64) if value >= 1 << 63 else value


def valid_run_id(value: object) -> bool:
    """Whether ``value`` can be a run id: non-empty text of printable characters."""
    return isinstance(value, str) and value != "" and value.isprintable()


def check_run_id(run_id: object) -> str:
    """``run_id``, refused (``ConfigError``) unless it can be a run id (``valid_run_id``)."""
    if not valid_run_id(run_id):
        raise ConfigError(f"run id {run_id!r} is not a run id: use non-empty text of printable characters")
    return str(run_id)


def run_id_read(value: object, path: Path, what: str) -> str:
    """A run id read from the database at ``path`` (``what``: where it was read). One that
    reads as NULL, or as anything else that is not a run id, is damage (a damaged page or
    index hands back such values): the error names the file."""
    if valid_run_id(value):
        return str(value)
    raise CorruptStoreError(f"embedded database {path} is damaged: {what} holds run id {value!r}, "
                            "which is not a run id")


def integer_read(value: object, path: Path, what: str) -> int:
    """An integer column's value read from the database at ``path`` (``what``: whose, as
    "run 'r' holds a shard count of"); a damaged page can hand back NULL, text or a blob
    there: that is damage, and the error names the file."""
    if isinstance(value, int):
        return value
    raise CorruptStoreError(f"embedded database {path} is damaged: {what} {value!r}, not an integer")


def checksum_mismatch(where: str) -> CorruptStoreError:
    """The error for a record (``where``: it and its file) whose bytes fail its checksum."""
    return CorruptStoreError(f"{where}: the record's bytes do not make the checksum its row holds: "
                             "they are damaged")


def _span(parts: tuple[bytes | memoryview, ...], start: int, stop: int) -> bytes:
    """Bytes ``start:stop`` of the message made of ``parts`` (copied; a few KiB)."""
    out, at = [], 0
    for part in parts:
        lo, hi = max(start - at, 0), min(stop - at, len(part))
        if lo < hi:
            out.append(bytes(part[lo:hi]))
        at += len(part)
    return b"".join(out)


class Database:
    """One SQLite file with a connection per thread (sqlite3 connections are not shareable).

    ``read_only``: the file must exist and hold a Rewind log; it is opened with SQLite's
    ``mode=ro`` and nothing is created (no directory, file or table) or marked.
    """

    def __init__(self, path: Path, error: type[RewindError], *, read_only: bool = False) -> None:
        self.path = path
        self._error = error
        self.read_only = read_only
        self._local = threading.local()
        if read_only and not path.is_file():
            raise RunNotFoundError(f"no Rewind log at {path}: the file does not exist")
        if not read_only:
            path.parent.mkdir(parents=True, exist_ok=True)
        c = self.conn()
        try:
            self._check_format(c)
            if read_only:
                tables = c.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='runs'")
                if tables.fetchone() is None:
                    raise RunNotFoundError(f"no Rewind log at {path}: the file holds no Rewind tables")
            else:
                c.executescript(SCHEMA)
                self._mark_format(c)
        except sqlite3.Error as exc:
            self.close()
            raise self.wrap(exc) from exc
        except UnicodeDecodeError as exc:
            self.close()
            raise self.wrap(driver_error(exc)) from exc
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
                    if not _has_column(c, "records", "sum"):
                        c.execute("ALTER TABLE records ADD COLUMN sum INTEGER")
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
            if self.read_only:
                return sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=60.0,
                                       isolation_level=None, check_same_thread=not shared)
            c = sqlite3.connect(
                self.path, timeout=60.0, isolation_level=None, check_same_thread=not shared
            )
            # Large pages suit multi-MiB chunk blobs (only takes effect on a new file), and a
            # rowid table keeps blobs out of the index b-tree (WITHOUT ROWID copies them in).
            c.execute("PRAGMA page_size=65536")
            _journal_wal(c)
            c.execute("PRAGMA synchronous=FULL")
        except sqlite3.Error as exc:
            raise self.wrap(exc) from exc
        except UnicodeDecodeError as exc:
            raise self.wrap(driver_error(exc)) from exc
        return c

    def records_have_sums(self) -> bool:
        """Whether ``records`` has the checksum column (a read-only file from before format
        2 has not)."""
        known: bool | None = getattr(self, "_sums", None)
        if known is None:
            known = self._sums = _has_column(self.conn(), "records", "sum")
        return known

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
        if isinstance(exc, sqlite3.OperationalError) and msg.startswith("Could not decode to UTF-8"):
            # Rewind writes only UTF-8 text: a damaged page holds what it read.
            return CorruptStoreError(f"embedded database {self.path} is damaged: {msg}")
        if isinstance(exc, sqlite3.OperationalError) and msg.startswith(("no such table", "no such column")):
            # The file was opened as a Rewind log, so its schema held every table and column
            # once: one missing now is a damaged schema (or a file Rewind never wrote).
            return CorruptStoreError(f"embedded database {self.path} is damaged or not a Rewind log: {msg}")
        return self._error(f"embedded database {self.path}: {msg}")

    @contextmanager
    def txn(self, c: sqlite3.Connection | None = None) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT, rolled back if the block raises."""
        c = c or self.conn()
        try:
            with warned_wait(f"the write lock of {self.path} (another connection or process is writing it)",
                             _log):
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


def wrapped(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn sqlite3 errors raised by a method (of an object whose ``_db`` is its ``Database``)
    into the backend's own error type."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except sqlite3.Error as exc:
            raise args[0]._db.wrap(exc) from exc  # type: ignore[attr-defined]
        except UnicodeDecodeError as exc:
            raise args[0]._db.wrap(driver_error(exc)) from exc  # type: ignore[attr-defined]

    return run


def driver_error(exc: UnicodeDecodeError) -> sqlite3.DatabaseError:
    """SQLite's error whose message Python could not decode: it quotes bytes of a damaged
    file (a table's name in a malformed schema, say)."""
    return sqlite3.DatabaseError(bytes(exc.object).decode("utf-8", "replace"))


def _journal_wal(c: sqlite3.Connection) -> None:
    """Switch ``c`` to WAL. Processes that open a new file at once (the ranks of a job) race
    for this switch, and SQLite reports the loser busy without waiting: retry for a while."""
    for attempt in range(600):
        try:
            c.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == 599:
                raise
            time.sleep(0.05)


def _has_column(c: sqlite3.Connection, table: str, column: str) -> bool:
    return any(row[1] == column for row in c.execute(f"PRAGMA table_info({table})"))
