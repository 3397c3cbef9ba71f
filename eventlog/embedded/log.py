"""``EmbeddedLog``: a run's ``EventLog`` in a SQLite file, composed of the database
(``db``), the writer (``writer``) and the reads (``reader``); and whole-file operations
(listing runs, moving segment-file messages back into SQLite)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eventlog.embedded import segments
from eventlog.embedded.db import (
    SUM_ENDS,
    Database,
    check_run_id,
    checksum_mismatch,
    integer_read,
    path_from_url,
    record_sum,
    run_id_read,
    wrapped,
)
from eventlog.embedded.reader import RunReader
from eventlog.embedded.writer import EmbeddedWriter, register
from eventlog.errors import CorruptStoreError, EventLogError, RunNotFoundError
from eventlog.ports import CONTROL, WEIGHTS, Decoded, Decoder, EventLog, LogWriter, Record
from eventlog.settings import current


class EmbeddedLog(EventLog):
    """A run's log in a SQLite file; ``read_only`` opens an existing one for reading only."""

    dense_offsets = True

    def scan_batch(self, partition: int) -> int:
        # Rows per read transaction (see ``scan_decoded``; records are decoded one at a time).
        settings = current()
        return settings.read_batch if partition == CONTROL else settings.embedded_read_batch

    def __init__(self, url: str, run_id: str, *, read_only: bool = False) -> None:
        self.url, self.run_id = url, check_run_id(run_id)
        self._segments_root = segments.directory(path_from_url(url), run_id)
        self._segments = segments.Reader(self._segments_root)
        self._db = Database(path_from_url(url), EventLogError, read_only=read_only)
        self._reader = RunReader(self._db, run_id, self._segments_root, self._segments)

    @wrapped
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

    @wrapped
    def create_weights(self) -> None:
        with self._db.txn() as c:
            if c.execute("SELECT 1 FROM runs WHERE run=?", (self.run_id,)).fetchone() is None:
                raise RunNotFoundError(f"run {self.run_id!r} is not in {self.url}")
            c.execute("INSERT OR IGNORE INTO partitions VALUES (?,?,0,0)", (self.run_id, WEIGHTS))

    @wrapped
    def shard_count(self) -> int | None:
        row = self._db.conn().execute(
            "SELECT shards FROM runs WHERE run=?", (self.run_id,)
        ).fetchone()
        return None if row is None else \
            integer_read(row[0], self._db.path, f"run {self.run_id!r} holds a shard count of")

    @wrapped
    def writer(self, writer_id: str) -> LogWriter:
        with self._db.txn() as c:
            epoch = register(self._db, c, self.run_id, writer_id)
        return EmbeddedWriter(self._db, self.run_id, self._segments_root, writer_id, epoch)

    def read(
        self, partition: int, *, gt: int | None = None, lte: int | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        return self._reader.read(partition, gt=gt, lte=lte, limit=limit)

    @wrapped
    def read_decoded(
        self, partition: int, decode: Decoder[Any], *, gt: int | None = None,
        lte: int | None = None, limit: int | None = None,
    ) -> list[Decoded]:
        if not self._db.records_have_rowid():
            return super().read_decoded(partition, decode, gt=gt, lte=lte, limit=limit)
        return self._reader.read_decoded(partition, decode, gt=gt, lte=lte, limit=limit)

    @wrapped
    def scan_decoded(
        self, partition: int, decode: Decoder[Any], *, gt: int | None = None,
        lte: int | None = None, batch: int = 256,
    ) -> Iterator[Decoded]:
        """Records found ``batch`` rows per read transaction, each decoded only when the
        caller reaches it (``RunReader.scan_decoded``)."""
        if not self._db.records_have_rowid():  # whole copies: one large record per read
            return super().scan_decoded(partition, decode, gt=gt, lte=lte,
                                        batch=batch if partition == CONTROL else 1)
        return self._reader.scan_decoded(partition, decode, gt=gt, lte=lte, batch=batch)

    def record_file(self, partition: int, offset: int | None = None) -> str:
        """The record's segment file, or the database file (also when the database is too
        damaged to say)."""
        return self._reader.record_file(partition, offset)

    @wrapped
    def holds_unindexed(self, partition: int, lo: int, hi: int) -> bool:
        """Looked for row by row through the table itself, past the index a read uses."""
        row = self._db.conn().execute(
            "SELECT 1 FROM records NOT INDEXED WHERE run=? AND partition=? AND offset BETWEEN ? AND ? "
            "LIMIT 1",
            (self.run_id, partition, lo, hi),
        ).fetchone()
        return row is not None

    @wrapped
    def writer_epochs(self) -> dict[str, int] | None:
        """Read row by row past the index (an epoch that is no integer is left out: the
        store's check names it)."""
        epochs: dict[str, int] = {}
        for writer, epoch in self._db.conn().execute(
                "SELECT writer, epoch FROM writers NOT INDEXED WHERE run=?", (self.run_id,)):
            if isinstance(writer, str) and isinstance(epoch, int):
                epochs[writer] = max(epoch, epochs.get(writer, epoch))
        return epochs

    def _partition_row(self, partition: int) -> tuple[int, int]:
        row = self._db.conn().execute(
            "SELECT next_offset, start_offset FROM partitions WHERE run=? AND partition=?",
            (self.run_id, partition),
        ).fetchone()
        if row is None:
            return 0, 0
        what = f"run {self.run_id!r} partition {partition} holds {{}} offset of"
        return (integer_read(row[0], self._db.path, what.format("an end")),
                integer_read(row[1], self._db.path, what.format("a start")))

    @wrapped
    def end_offset(self, partition: int) -> int:
        return self._partition_row(partition)[0]

    @wrapped
    def start_offset(self, partition: int) -> int:
        return self._partition_row(partition)[1]

    @wrapped
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
    db = Database(path, EventLogError)
    try:
        with db.txn() as c:
            rows = c.execute("SELECT e.run, e.partition, e.offset, e.file, e.pos, e.length, r.sum "
                             "FROM extents e JOIN records r ON r.run=e.run AND r.partition=e.partition "
                             "AND r.offset=e.offset").fetchall()
            readers: dict[str, segments.Reader] = {}  # one per run: each file is mapped once
            for run, partition, offset, name, pos, length, want in rows:
                where = f"run {run!r} partition {partition} offset {offset}"
                reader = readers.setdefault(run, segments.Reader(segments.directory(source, run)))
                value = bytes(reader.view(name, pos, length, where))
                if want is not None and record_sum(value, SUM_ENDS) != want:
                    raise checksum_mismatch(f"{where} (in segment file {name})")
                # (In SQLite, a record's checksum is of all its bytes.)
                c.execute("UPDATE records SET value=?, sum=? WHERE run=? AND partition=? AND offset=?",
                          (value, None if want is None else record_sum(value), run, partition, offset))
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
    db = Database(path, EventLogError, read_only=True)
    try:
        listed = [r[0] for r in db.conn().execute("SELECT run FROM runs ORDER BY run")]
        try:
            return [run_id_read(run, path, "the runs table's index") for run in listed]
        except CorruptStoreError as exc:
            raise CorruptStoreError(f"{exc}; {_held_past_the_index(db)}") from None
    except sqlite3.Error as exc:
        raise db.wrap(exc) from exc
    finally:
        db.close()


def _held_past_the_index(db: Database) -> str:
    """What the runs table itself holds, read row by row past its index (for the error of an
    index that lists a value that is not a run id)."""
    try:
        held = sorted(str(r) for (r,) in db.conn().execute("SELECT run FROM runs NOT INDEXED"))
    except sqlite3.Error as exc:
        return f"the table itself does not read either: {exc}"
    return f"the table itself holds runs {', '.join(map(repr, held))}: name one with --run"
