"""The embedded backend's writer: epoch-fenced SQLite transactions, large tensor chunks in
segment files, and WAL checkpoints run in the background between commits."""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eventlog.embedded import segments
from eventlog.embedded.db import SUM_ENDS, Database, record_sum
from eventlog.errors import ConfigError, CorruptStoreError, EventLogError, FencedError
from eventlog.ports import LogTransaction, LogWriter, MessageBytes, joined, message_size
from eventlog.settings import current

_INSERT = "INSERT INTO records (run, partition, offset, value, sum) VALUES (?,?,?,?,?)"


class EmbeddedTransaction(LogTransaction):
    """Appends of one open SQLite transaction of run ``run_id``; a large tensor chunk goes
    to its partition's segment file under ``segments_root``, its row saying where."""

    def __init__(self, db: Database, run_id: str, segments_root: Path, conn: sqlite3.Connection) -> None:
        self._db, self._run_id, self._segments_root, self._conn = db, run_id, segments_root, conn
        self._next: dict[int, int] = {}
        self._appender: segments.Appender | None = None
        self._segment: dict[int, str | None] = {}  # partition -> the segment file it appends to

    def append(self, partition: int, value: MessageBytes, *, bulk_at: int | None = None) -> None:
        nxt = self._next.get(partition)
        if nxt is None:
            row = self._conn.execute(
                "SELECT next_offset FROM partitions WHERE run=? AND partition=?",
                (self._run_id, partition),
            ).fetchone()
            if row is None:
                raise EventLogError(f"run {self._run_id!r} has no partition {partition}")
            nxt = row[0]
        if bulk_at is not None and message_size(value) >= current().embedded_segment_min_bytes \
                and self._db.records_have_rowid():
            self._out_of_line(partition, nxt, value, bulk_at)
        else:
            data = joined(value)
            self._conn.execute(_INSERT, (self._run_id, partition, nxt, data, record_sum(data)))
        self._next[partition] = nxt + 1

    def _out_of_line(self, partition: int, offset: int, value: MessageBytes, bulk_at: int) -> None:
        """The message in the partition's segment file; its row says where (and holds no bytes)."""
        run = self._run_id
        if self._appender is None:
            self._appender = segments.Appender(self._segments_root, current().embedded_segment_bytes)
        if partition not in self._segment:
            row = self._conn.execute(
                "SELECT file FROM extents WHERE run=? AND partition=? ORDER BY offset DESC LIMIT 1",
                (run, partition),
            ).fetchone()
            self._segment[partition] = None if row is None else str(row[0])
        name, pos = self._appender.append(self._segment[partition], partition, offset, value, bulk_at)
        self._segment[partition] = name
        self._conn.execute(_INSERT, (run, partition, offset, b"", record_sum(value, SUM_ENDS)))
        self._conn.execute("INSERT INTO extents VALUES (?,?,?,?,?,?,?)",
                           (run, partition, offset, name, pos, message_size(value), bulk_at))

    def close(self) -> None:
        if self._appender is not None:
            self._appender.close()

    def finish(self) -> None:
        if self._appender is not None:
            self._appender.flush()  # the bytes are durable before the rows naming them commit
        for partition, nxt in self._next.items():
            self._conn.execute(
                "UPDATE partitions SET next_offset=? WHERE run=? AND partition=?",
                (nxt, self._run_id, partition),
            )


def held_epochs(db: Database, conn: sqlite3.Connection, run_id: str, writer_id: str) -> list[int]:
    """The epochs the store holds for writer ``writer_id`` of run ``run_id``, read through
    the table's index and row by row past it: an index that lost the writer's row (a
    damaged page) must not make its epoch look unused. One that is not an epoch is damage."""
    key = (run_id, writer_id)
    rows = conn.execute("SELECT epoch FROM writers WHERE run=? AND writer=?", key).fetchall() + \
        conn.execute("SELECT epoch FROM writers NOT INDEXED WHERE run=? AND writer=?", key).fetchall()
    for (epoch,) in rows:
        if not isinstance(epoch, int) or epoch < 1:
            raise CorruptStoreError(f"embedded database {db.path} is damaged: writer {writer_id!r} of run "
                                    f"{run_id!r} has epoch {epoch!r}, which is not an epoch; its fencing "
                                    "cannot be trusted")
    return [int(epoch) for (epoch,) in rows]


def register(db: Database, conn: sqlite3.Connection, run_id: str, writer_id: str) -> int:
    """Make writer ``writer_id`` of run ``run_id`` the newest, inside the open transaction of
    ``conn``: its epoch is one past every epoch the store holds for that id (``held_epochs``),
    so a writer never registers at an epoch a fenced one may still hold. Returns it."""
    epoch = max(held_epochs(db, conn, run_id, writer_id), default=0) + 1
    key = (run_id, writer_id)
    # Past the index too: a row it lost gets the new epoch, not a second row beside it.
    if conn.execute("UPDATE writers NOT INDEXED SET epoch=? WHERE run=? AND writer=?",
                    (epoch, *key)).rowcount:
        return epoch
    try:
        conn.execute("INSERT INTO writers VALUES (?,?,?)", (*key, epoch))
    except sqlite3.IntegrityError as exc:
        raise CorruptStoreError(f"embedded database {db.path} is damaged: the writers index holds writer "
                                f"{writer_id!r} of run {run_id!r}, which its table does not") from exc
    return epoch


class EmbeddedWriter(LogWriter):
    """Writer ``writer_id`` of run ``run_id`` at ``epoch``; a transaction fails once a newer
    writer with the same id raised the epoch."""

    def __init__(self, db: Database, run_id: str, segments_root: Path, writer_id: str, epoch: int) -> None:
        self._db, self._run_id, self._segments_root = db, run_id, segments_root
        self.writer_id, self._epoch = writer_id, epoch
        # Its own connection: readers in this process must not see an open transaction.
        self._conn = db.connect(shared=True)
        self._lock = threading.Lock()
        # Copying the WAL back into the database would double the commit's writes; a
        # background thread does it between commits instead (durability needs only the WAL).
        self._conn.execute("PRAGMA wal_autocheckpoint=0")
        self._checkpoint = Checkpointer(db, current().checkpoint_idle_s)

    @contextmanager
    def transaction(self) -> Iterator[LogTransaction]:
        db = self._db
        try:
            with self._lock, db.txn(self._conn) as conn:
                held = held_epochs(db, conn, self._run_id, self.writer_id)
                if max(held, default=None) != self._epoch:
                    raise FencedError(
                        f"writer {self.writer_id!r} of run {self._run_id!r} was fenced by a "
                        f"newer writer with the same id (epoch {max(held, default='?')} > {self._epoch})"
                    )
                txn = EmbeddedTransaction(db, self._run_id, self._segments_root, conn)
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


class Checkpointer:
    """Runs passive WAL checkpoints in a background thread, between commits.

    A checkpoint reads back and rewrites everything the last commit wrote. Run right after
    that commit, it shares the memory bus with the training thread's copy of the next
    version's state and slows ``commit()`` (figures: docs/performance.md). So a committed
    transaction only marks a checkpoint as due. It runs
    at the writer's next maintenance window (right after the next ``commit()`` has copied
    its state), ``idle_s`` seconds after the first commit it has not covered, or when the
    writer closes. A checkpoint that a reader kept from finishing is due again ``idle_s``
    later.
    """

    def __init__(self, db: Database, idle_s: float) -> None:
        if not (math.isfinite(idle_s) and idle_s >= 0):
            raise ConfigError(
                f"REWIND_CHECKPOINT_IDLE_S must be a finite number of seconds >= 0, got {idle_s}")
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
