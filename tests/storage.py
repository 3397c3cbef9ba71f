"""Test support: reach into an embedded log's files the way the damage tests need."""

from __future__ import annotations

import shutil
import sqlite3
from contextlib import closing
from pathlib import Path

from eventlog import embedded


def plain_records(db: Path) -> int:
    """Make every record of an embedded log plain to read and damage with SQL: each message
    kept in a segment file moved into SQLite (the layout of logs written before segments,
    which stays readable; the segment files go), and the rows' checksums dropped (as in a
    log written before them, read unchecked), so that a test's damage reaches the checks
    behind the store's: decoding, authentication, digests. Returns the number moved."""
    moved = embedded.inline_segments(db)
    shutil.rmtree(f"{db}.segments", ignore_errors=True)
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE records SET sum=NULL")
    return moved


def unchecked(db: Path, run: str, partition: int, offset: int) -> None:
    """Drop one record's checksum (see ``plain_records``), after a test damaged its bytes."""
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("UPDATE records SET sum=NULL WHERE run=? AND partition=? AND offset=?",
                     (run, partition, offset))


def page_size(db: Path) -> int:
    """The database's page size, after moving every page from its WAL into the file (so
    that a test's damage to the file is what a reader sees)."""
    with closing(sqlite3.connect(db)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return int(conn.execute("PRAGMA page_size").fetchone()[0])


def pages_of(db: Path, name: str) -> list[int]:
    """The page numbers (from 1) of table or index ``name``."""
    with closing(sqlite3.connect(db)) as conn:
        return [int(p) for (p,) in conn.execute("SELECT pageno FROM dbstat WHERE name=?", (name,))]


def index_loses_rows(db: Path, table: str, where: str, params: tuple[object, ...] = ()) -> None:
    """Damage ``table``'s primary-key index as a bad page can: the entries of the rows
    ``where`` selects gone from its pages, the rows themselves left in the table (what
    ``PRAGMA integrity_check`` calls rows missing from the index). Made by deleting them from
    a copy and taking its index pages."""
    size, index = page_size(db), f"sqlite_autoindex_{table}_1"
    pages = pages_of(db, index)
    edited = db.with_name(f"{db.name}.edited")
    shutil.copy(db, edited)
    with closing(sqlite3.connect(edited)) as conn, conn:
        conn.execute(f"DELETE FROM {table} WHERE {where}", params)
    page_size(edited)
    data, lacking = bytearray(db.read_bytes()), edited.read_bytes()
    for p in pages:
        data[(p - 1) * size:p * size] = lacking[(p - 1) * size:p * size]
    db.write_bytes(bytes(data))
    edited.unlink()
