"""The embedded backend's reads: records found in one read transaction, their bytes read
straight from SQLite blobs or mapped segment files, and decoded as the caller reaches them."""

from __future__ import annotations

import io
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from eventlog import filemaps
from eventlog.embedded import segments
from eventlog.embedded.db import SUM_ENDS, Database, checksum_mismatch, integer_read, record_sum, wrapped
from eventlog.errors import CorruptMessageError, CorruptStoreError, RewindError, TruncatedHistoryError
from eventlog.ports import Decoded, Decoder, MessageStream, Record, paged

R = TypeVar("R")


class BlobStream:
    """A record's blob as a ``MessageStream``, valid while the blob is open (during one
    ``decode`` call): short reads are served from one read of its first bytes; a read
    beyond them (a tensor chunk's payload) goes straight from SQLite into its own bytes
    object, with the GIL released, the one copy of it that a fold makes (decryption makes
    another for an encrypted one). SQLite's errors there are the store's, not the
    message's: they name the database file, as a plain read's would."""

    HEAD = 4096

    def __init__(self, blob: sqlite3.Blob, db: Database) -> None:
        self._blob, self._db, self._size, self._pos = blob, db, len(blob), 0
        self._head = blob.read(min(self._size, self.HEAD))

    @classmethod
    def over(cls, blob: sqlite3.Blob, db: Database) -> MessageStream:
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


class ViewStream:
    """A segment-file record as a ``MessageStream``: the read of its bulk field returns a
    view of the map (no copy); every other read, its own bytes."""

    def __init__(self, view: memoryview, bulk_at: int) -> None:
        self._view, self._bulk, self._pos = view, bulk_at, 0
        # The fields before the bulk one are read a few bytes at a time: slices of one copy
        # of them cost less than a view and a copy per read.
        self._head = bytes(view[:max(0, min(bulk_at, len(view)))])
        self._head_len = len(self._head)

    def read(self, n: int = -1, /) -> bytes:
        start = self._pos
        if n >= 0 and start + n <= self._head_len:
            self._pos = start + n
            return self._head[start:start + n]
        end = len(self._view) if n < 0 else min(len(self._view), start + n)
        self._pos = end
        if start == self._bulk and end > start:
            return self._view[start:end]  # type: ignore[return-value]  # read-only view
        return bytes(self._view[start:end])

    def tell(self) -> int:
        return self._pos


class Stored(NamedTuple):
    """Where one record's bytes are: a SQLite blob, or a view of a segment file; and the
    checksum its row holds (``None``: a row from before checksums)."""

    blob: sqlite3.Blob | None
    view: memoryview | None
    bulk_at: int
    db: Database
    error: RewindError | None = None  # the record cannot be read (``_stored(lazy_errors=True)``)
    sum: int | None = None
    where: str = ""  # the record and its file, for the checksum's error

    def size(self) -> int:
        return len(self.blob) if self.blob is not None else len(self.view or b"")

    def value(self) -> bytes:
        """The record's bytes (a copy), checked against its checksum."""
        value = self.blob.read() if self.blob is not None else bytes(self.view or b"")
        self._check(value)
        return value

    def _check(self, data: bytes | memoryview | None = None) -> bytes | None:
        """Raise unless the record's bytes (``data``, or read for it) make its checksum: all
        of a blob's, a segment record's ends (see ``record_sum``). Returns a blob's bytes
        if it read them, for the decoder to read from instead of the blob again."""
        if self.sum is None:
            return None
        read = None
        if data is None and self.blob is not None:
            data = read = _blob_bytes(self.blob, self.db)
        data = data if data is not None else (self.view or b"")
        if record_sum(data, SUM_ENDS if self.view is not None else None) != self.sum:
            raise checksum_mismatch(self.where)
        return read

    def stream(self) -> MessageStream:
        if self.blob is not None:
            return BlobStream.over(self.blob, self.db)
        return ViewStream(self.view or memoryview(b""), self.bulk_at)

    def decoded(self, decode: Decoder[Any], offset: int) -> Any:
        """The record decoded by ``decode``. A segment record whose bytes do not decode with
        its bulk hint is decoded again without it: the hint is the database's, and damage
        there must not make intact bytes unreadable."""
        read = self._check()
        try:
            return decode(self.stream() if read is None else io.BytesIO(read), self.size(), offset)
        except CorruptMessageError:
            if self.view is None or self.bulk_at < 0:
                raise
            return decode(ViewStream(self.view, -1), self.size(), offset)
        finally:
            # Reading the checksum's ends and the envelope faulted in whole folios of the
            # file, most of a big record: the fold maps each part again when it reads it.
            filemaps.release(self.view)


def _blob_bytes(blob: sqlite3.Blob, db: Database) -> bytes:
    """A whole blob, read for its checksum (the blob is left at its start for the decoder)."""
    try:
        blob.seek(0)
        data = blob.read()
        blob.seek(0)
    except sqlite3.Error as exc:
        raise db.wrap(exc) from exc
    return data


class Located(NamedTuple):
    """A record a scan found: ``take()`` decodes it (see ``EmbeddedLog.scan_decoded``)."""

    offset: int
    take: Callable[[], list[Decoded]]


#: Records kept in SQLite up to this size are copied into a scan's page; a larger one is
#: read again when the scan reaches it, so a page of 16 never holds 16 x 4 MiB.
PAGE_COPY_BYTES = 256 * 1024


def raise_(error: BaseException) -> list[Decoded]:
    raise error


class RunReader:
    """The read side of one run's embedded log (``EmbeddedLog`` delegates its reads here);
    ``maps`` maps the run's segment files (the log owns it and closes it)."""

    def __init__(self, db: Database, run_id: str, segments_root: Path, maps: segments.Reader) -> None:
        self._db, self.run_id, self._segments_root, self._segments = db, run_id, segments_root, maps

    @wrapped
    def read(
        self, partition: int, *, gt: int | None = None, lte: int | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """Committed records with ``gt < offset <= lte``, each a copy of its bytes."""
        if not self._db.records_have_rowid():  # a file from before the rowid table
            rows = self._db.conn().execute(
                "SELECT offset, value FROM records WHERE run=? AND partition=? AND offset>? "
                "AND offset<=? ORDER BY offset LIMIT ?",
                self._range(partition, gt, lte, limit),
            ).fetchall()
            return [Record(partition, int(o), bytes(v)) for o, v in rows]
        return self._stored(partition, gt, lte, limit,
                            lambda at, offset: Record(partition, offset, at.value()))

    @wrapped
    def read_decoded(
        self, partition: int, decode: Decoder[Any], *, gt: int | None = None,
        lte: int | None = None, limit: int | None = None,
    ) -> list[Decoded]:
        """Records with ``gt < offset <= lte``, each decoded from a stream over its blob or
        segment file (a rowid ``records`` table only)."""
        return self._stored(partition, gt, lte, limit, lambda at, offset: Decoded(
            offset, at.size(), at.decoded(decode, offset)))

    @wrapped
    def scan_decoded(
        self, partition: int, decode: Decoder[Any], *, gt: int | None = None,
        lte: int | None = None, batch: int = 256,
    ) -> Iterator[Decoded]:
        """Records found ``batch`` rows per read transaction, each decoded only when the
        caller reaches it (so a fold that stops at its target never fails on a record past
        it): the first of a page at once, inside its transaction; the others from views of
        their segment files (no copy), from copies of their bytes (up to
        ``PAGE_COPY_BYTES``), or, a larger record kept in SQLite, read again on its own
        then (one copy alive at a time). A rowid ``records`` table only."""

        def page(cursor: int | None) -> list[Located]:
            first = True

            def locate(at: Stored, offset: int) -> Located:
                nonlocal first
                reached, first = first, False  # the first row: the record the caller waits for
                if at.error is not None:
                    if reached:
                        raise at.error
                    error = at.error
                    return Located(offset, lambda: raise_(error))
                if reached:
                    box = [Decoded(offset, at.size(), at.decoded(decode, offset))]
                    return Located(offset, lambda: [box.pop()])  # (not kept alive by the page)
                if at.view is not None:
                    return Located(offset, lambda: [
                        Decoded(offset, at.size(), at.decoded(decode, offset))])
                if at.size() <= PAGE_COPY_BYTES:
                    try:
                        value = at.value()
                    except sqlite3.Error:  # reported if the scan reaches it: read it again then
                        return Located(offset, lambda: self._reread(partition, decode, offset))
                    return Located(offset, lambda: [
                        Decoded(offset, len(value), decode(io.BytesIO(value), len(value), offset))])
                return Located(offset, lambda: self._reread(partition, decode, offset))

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

    @wrapped
    def _stored(self, partition: int, gt: int | None, lte: int | None, limit: int | None,
                each: Callable[[Stored, int], R], *, lazy_errors: bool = False) -> list[R]:
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
            sums = "r.sum" if self._db.records_have_sums() else "NULL"
            # The rows reached by rowid (rr, ee) say whose they are: see ``_misled``.
            rows = conn.execute(
                "SELECT r.rowid, r.offset, e.file, e.pos, e.length, e.bulk, e.rowid IS NOT NULL, "
                f"rr.run, rr.partition, rr.offset, ee.run, ee.partition, ee.offset, {sums} FROM records r "
                "LEFT JOIN extents e ON e.run=r.run AND e.partition=r.partition AND e.offset=r.offset "
                "LEFT JOIN records rr ON rr.rowid=r.rowid LEFT JOIN extents ee ON ee.rowid=e.rowid "
                "WHERE r.run=? AND r.partition=? AND r.offset>? AND r.offset<=? ORDER BY r.offset LIMIT ?",
                self._range(partition, gt, lte, limit),
            ).fetchall()
            out = []
            low = -1 if gt is None else gt
            misled = self._misled(partition, rows)
            for rowid, o, file, pos, length, bulk, *_, want in rows:
                o = self._integer(o, f"partition {partition} lists an offset of")
                where = f"run {self.run_id!r} partition {partition} offset {o} " \
                        f"(in {self._db.path if file is None else self._segments_root / str(file)})"
                if not low < o <= (1 << 62 if lte is None else lte):
                    # Only a damaged index returns a row outside the range it was asked for.
                    raise CorruptStoreError(f"embedded database {self._db.path} is damaged: run "
                                            f"{self.run_id!r} partition {partition} lists offset {o} "
                                            f"after {low}")
                view, blob = None, None
                try:  # (opening only: an error from ``each`` is never deferred)
                    if o in misled:
                        raise misled[o]
                    if file is not None:
                        pos, length, bulk = (self._integer(v, f"the extent of {where} holds")
                                             for v in (pos, length, bulk))
                        view = self._segment_view(partition, o, str(file), pos, length)
                    else:
                        blob = conn.blobopen("records", "value", rowid, readonly=True)
                except (RewindError, sqlite3.Error) as exc:
                    if not lazy_errors:
                        raise
                    error = self._db.wrap(exc) if isinstance(exc, sqlite3.Error) else exc
                    # (no traceback: it would keep this frame, and the page, alive)
                    out.append(each(Stored(None, None, 0, self._db, error.with_traceback(None)), o))
                    continue
                if blob is None:
                    out.append(each(Stored(None, view, bulk, self._db, None, want, where), o))
                    continue
                with blob:
                    out.append(each(Stored(blob, None, 0, self._db, None, want, where), o))
            if own:
                conn.execute("COMMIT")  # read only: ends the snapshot, writes nothing
        except BaseException:
            if own and conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return out

    def _integer(self, value: object, what: str) -> int:
        """A row's integer column, or the error naming the damage (``integer_read``)."""
        return integer_read(value, self._db.path, what)

    def _misled(self, partition: int, rows: list[Any]) -> dict[int, CorruptStoreError]:
        """The offsets among ``rows`` (from ``_stored``'s lookup) whose index entry leads to
        another record's row. SQLite answers such a lookup with the key from the index and
        the other columns from the row its entry points at, so a damaged entry would hand
        one record's bytes or extent to another offset, intact and silently; the rows
        themselves, joined again by rowid, say whose they are."""
        misled: dict[int, CorruptStoreError] = {}
        for row in rows:
            if not isinstance(row[1], int):
                continue  # (``_stored`` names it)
            offset, want = row[1], (self.run_id, partition, row[1])
            for table, found in (("records", tuple(row[7:10])), ("extents", tuple(row[10:13]))):
                if table == "extents" and not row[6] or found == want:
                    continue
                whose = "no row" if found[0] is None else \
                    f"the row of run {found[0]!r} partition {found[1]} offset {found[2]}"
                misled.setdefault(offset, CorruptStoreError(
                    f"embedded database {self._db.path} is damaged: the {table} index leads "
                    f"run {self.run_id!r} partition {partition} offset {offset} to {whose}"))
        return misled

    def _segment_view(self, partition: int, offset: int, name: str, pos: int, length: int) -> memoryview:
        """A record's bytes in its segment file. A file that is gone was deleted by a
        truncation that committed after this read began (or by hand): which one, the
        partition's start offset now says, on a connection outside this read."""
        where = f"run {self.run_id!r} partition {partition} offset {offset}"
        try:
            return self._segments.view(name, pos, length, where)
        except FileNotFoundError as exc:
            missing = f"segment file {self._segments_root / name} is missing"
            raise self._gone(partition, offset, missing) from exc

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

    def record_file(self, partition: int, offset: int | None = None) -> str:
        """The record's segment file, or the database file (also when the database is too
        damaged to say)."""
        database = str(self._db.path)
        if offset is None:
            return database
        try:
            row = self._db.conn().execute(
                "SELECT file FROM extents WHERE run=? AND partition=? AND offset=?",
                (self.run_id, partition, offset)).fetchone()
        except sqlite3.Error:
            return database
        return database if row is None else str(self._segments_root / str(row[0]))
