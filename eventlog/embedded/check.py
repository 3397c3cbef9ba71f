"""What ``rewind verify`` asks of an embedded database beyond the records its fold reads:
SQLite's own check of every page, table and index, and every table but the records (whose
rows the fold reads) read row by row past its index, its values checked: run ids, keys
held once, fencing epochs and tokens, each partition's offsets, each run's partitions."""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from eventlog.embedded.db import Database, valid_run_id
from eventlog.errors import EventLogError, RunNotFoundError
from eventlog.ports import WEIGHTS

#: Lines of SQLite's integrity check that a report quotes (it may find thousands).
QUOTED = 3

#: Each table read past its index: its columns, key columns first (``KEYS`` of them).
TABLES: dict[str, tuple[str, ...]] = {
    "runs": ("run", "shards"),
    "partitions": ("run", "partition", "next_offset", "start_offset"),
    "writers": ("run", "writer", "epoch"),
    "versions": ("run", "version"),
    "gsns": ("run", "next_gsn"),
    "catalog": ("run", "snapshot_id", "entry"),
    "leases": ("name", "holder", "token", "expires"),
    "followers": ("run", "follower", "version", "time_ms"),
}
KEYS = {"runs": 1, "partitions": 2, "writers": 2, "versions": 1, "gsns": 1, "catalog": 2, "leases": 1,
        "followers": 2}

Row = tuple[object, ...]


def _count(low: int) -> Callable[[object], bool]:
    return lambda v: isinstance(v, int) and v >= low


def _text(v: object) -> bool:
    return isinstance(v, str) and v != ""


#: What each column must hold (a damaged page can hand back NULL, or a value of another type).
VALID: dict[str, Callable[[object], bool]] = {
    "run": valid_run_id, "shards": _count(1), "partition": _count(WEIGHTS), "next_offset": _count(0),
    "start_offset": _count(0), "writer": _text, "epoch": _count(1), "version": _count(0),
    "next_gsn": _count(1), "snapshot_id": _text, "entry": _text, "name": _text,
    "holder": lambda v: v is None or _text(v), "token": _count(1),
    "expires": lambda v: isinstance(v, (int, float)), "follower": _text, "time_ms": _count(0),
}


def store_damage(path: Path) -> list[str]:
    """Damage in the embedded database at ``path`` that a fold of its records does not meet,
    each a line naming the file; when there is some, a last line says which tables still
    read. Empty when there is none."""
    try:
        db = Database(path, EventLogError, read_only=True)
    except RunNotFoundError:
        return []  # no Rewind log there: nothing of one to be damaged
    except EventLogError as exc:
        return [f"{exc}; none of its tables can be read"]
    try:
        return _damage(db)
    finally:
        db.close()


def _damage(db: Database) -> list[str]:
    head = f"embedded database {db.path} is damaged"
    found = _integrity(db, head)
    tables: dict[str, list[Row]] = {}
    unread: dict[str, list[str]] = {}  # error -> the tables that fail with it
    for table, columns in TABLES.items():
        try:
            tables[table] = _rows(db.conn(), table, columns)
        except (sqlite3.Error, UnicodeDecodeError) as exc:
            unread.setdefault(str(exc), []).append(table)
            continue
        found += [f"{head}: {line}" for line in _table_damage(table, tables[table])]
    found += [f"{head}: {line}" for line in _partitions_of_runs(tables)]
    found += [f"{head}: its tables {', '.join(names)} do not read ({error})"
              for error, names in unread.items()]
    if found:
        reads = ", ".join(f"{t} ({len(rows)} rows)" for t, rows in tables.items())
        found.append(f"of {db.path}, these tables still read row by row: {reads or 'none'}")
    return found


def _integrity(db: Database, head: str) -> list[str]:
    """SQLite's integrity check of the whole file (every page, table and index)."""
    try:
        lines = [str(r[0]) for r in db.conn().execute("PRAGMA integrity_check(100)")]
    except (sqlite3.Error, UnicodeDecodeError) as exc:
        return [f"{head}: SQLite's integrity check cannot run: {exc}"]
    if lines == ["ok"]:
        return []
    more = f" (and {len(lines) - QUOTED} more)" if len(lines) > QUOTED else ""
    return [f"{head}: SQLite's integrity check finds {'; '.join(lines[:QUOTED])}{more}"]


def _rows(conn: sqlite3.Connection, table: str, columns: tuple[str, ...]) -> list[Row]:
    """Every row of ``table``, read from the table itself, not through its index."""
    return [tuple(r) for r in conn.execute(f"SELECT {', '.join(columns)} FROM {table} NOT INDEXED")]


def _table_damage(table: str, rows: list[Row]) -> list[str]:
    """Values that no row of ``table`` can hold, and keys held more than once (a damaged
    index lost a row, and a write put a second one beside it)."""
    columns, keys = TABLES[table], KEYS[table]
    found = []
    for row in rows:
        bad = [f"{c} {v!r}" for c, v in zip(columns, row, strict=True) if not VALID[c](v)]
        if bad:
            found.append(f"a row of its {table} table holds {', '.join(bad)} ({_said(columns, row)})")
    held = Counter(row[:keys] for row in rows)
    for key, n in sorted(held.items(), key=str):
        if n > 1:
            found.append(_twice(table, key, [row for row in rows if row[:keys] == key]))
    return found


def _twice(table: str, key: Row, rows: list[Row]) -> str:
    """The line for a key held by several rows of ``table``."""
    columns = TABLES[table]
    if table == "writers":
        epochs = sorted(str(row[2]) for row in rows)
        return (f"its writers table holds {len(rows)} rows for writer {key[1]!r} of run {key[0]!r}, with "
                f"epochs {', '.join(epochs)}: its index lost a row and the writer registered again, its "
                "fencing epoch going back (a writer it fenced may commit)")
    if table == "leases":
        tokens = sorted(str(row[2]) for row in rows)
        return (f"its leases table holds {len(rows)} rows for lease {key[0]!r}, with tokens "
                f"{', '.join(tokens)}: its index lost a row, and the fencing token went back")
    return (f"its {table} table holds {len(rows)} rows for {_said(columns[:len(key)], key)}: its index "
            "lost a row and a second one was written")


def _partitions_of_runs(tables: dict[str, list[Row]]) -> list[str]:
    """Each run's partitions: control and one per shard, created with its row in ``runs`` (and
    the weights stream's, once published); each partition's start offset at or below its end."""
    if "runs" not in tables or "partitions" not in tables:
        return []
    found = []
    have: dict[object, set[object]] = {}
    for run, partition, nxt, start in tables["partitions"]:
        have.setdefault(run, set()).add(partition)
        if isinstance(nxt, int) and isinstance(start, int) and start > nxt:
            found.append(f"partition {partition} of run {run!r} starts at offset {start}, past its end {nxt}")
    shards = {run: n for run, n in tables["runs"]}
    for run, n in shards.items():
        if isinstance(n, int) and have.get(run, set()) - {WEIGHTS} != set(range(-1, n)):
            found.append(f"run {run!r} has {n} shards, but its partitions are "
                         f"{sorted(have.get(run, set()), key=str)}")
    for run in sorted(set(have) - set(shards), key=str):
        found.append(f"partitions of run {run!r} are held, but the runs table has no row for it")
    return found


def _said(columns: tuple[str, ...], row: Row) -> str:
    return ", ".join(f"{c} {v!r}" for c, v in zip(columns, row, strict=True))
