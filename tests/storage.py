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
