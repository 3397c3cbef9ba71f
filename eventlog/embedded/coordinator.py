"""The embedded coordinator: versions, GSNs, the snapshot catalog, leases and followers
in a SQLite file (usually the log's own file)."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from eventlog.embedded.db import Database, integer_read, path_from_url, wrapped
from eventlog.errors import CoordinationError, CorruptStoreError, StaleVersionError
from eventlog.ports import Coordinator


class EmbeddedCoordinator(Coordinator):
    """Coordinator state in a SQLite file (usually the log's own file)."""

    def __init__(self, url: str, clock: Callable[[], float] = time.time, *, read_only: bool = False) -> None:
        self.url = url
        self._clock = clock
        self._db = Database(path_from_url(url), CoordinationError, read_only=read_only)

    @wrapped
    def current_version(self, run: str) -> int:
        row = self._db.conn().execute("SELECT version FROM versions WHERE run=?", (run,)).fetchone()
        return 0 if row is None else self._integer(row[0], f"run {run!r} holds a version of")

    @wrapped
    def compare_and_set_version(self, run: str, expected: int, new: int) -> None:
        with self._db.txn() as c:
            row = c.execute("SELECT version FROM versions WHERE run=?", (run,)).fetchone()
            actual = 0 if row is None else self._integer(row[0], f"run {run!r} holds a version of")
            if actual != expected:
                raise StaleVersionError(expected, actual)
            c.execute("INSERT OR REPLACE INTO versions VALUES (?,?)", (run, new))

    @wrapped
    def reset_version(self, run: str, version: int) -> None:
        with self._db.txn() as c:
            c.execute("INSERT OR REPLACE INTO versions VALUES (?,?)", (run, version))

    @wrapped
    def allocate_gsns(self, run: str, count: int) -> int:
        with self._db.txn() as c:
            row = c.execute("SELECT next_gsn FROM gsns WHERE run=?", (run,)).fetchone()
            first = 1 if row is None else self._integer(row[0], f"run {run!r} holds a next gsn of")
            c.execute("INSERT OR REPLACE INTO gsns VALUES (?,?)", (run, first + count))
        return first

    @wrapped
    def raise_gsn_floor(self, run: str, floor: int) -> None:
        with self._db.txn() as c:
            c.execute(
                "INSERT INTO gsns VALUES (?,?) ON CONFLICT(run) "
                "DO UPDATE SET next_gsn=MAX(next_gsn, excluded.next_gsn)",
                (run, floor + 1),
            )

    @wrapped
    def catalog_put(self, run: str, snapshot_id: str, entry: dict[str, Any]) -> None:
        with self._db.txn() as c:
            c.execute(
                "INSERT OR REPLACE INTO catalog VALUES (?,?,?)",
                (run, snapshot_id, json.dumps(entry, sort_keys=True)),
            )

    @wrapped
    def catalog(self, run: str) -> dict[str, dict[str, Any]]:
        rows = self._db.conn().execute(
            "SELECT snapshot_id, entry FROM catalog WHERE run=?", (run,)
        ).fetchall()
        return {sid: json.loads(entry) for sid, entry in rows}

    @wrapped
    def catalog_delete(self, run: str, snapshot_id: str) -> None:
        with self._db.txn() as c:
            c.execute("DELETE FROM catalog WHERE run=? AND snapshot_id=?", (run, snapshot_id))

    @wrapped
    def acquire_lease(self, name: str, holder: str, ttl_s: float) -> int | None:
        now = self._clock()
        with self._db.txn() as c:
            row = self._lease(c, name)
            if row is None:
                token = 1
            else:
                cur_holder, token, expires = row
                if cur_holder == holder and expires > now:
                    c.execute("UPDATE leases NOT INDEXED SET expires=? WHERE name=?", (now + ttl_s, name))
                    return int(token)
                if cur_holder is not None and expires > now:
                    return None
                token = int(token) + 1
            # Past the index: a row it lost takes the new token, not a second row beside it.
            if not c.execute("UPDATE leases NOT INDEXED SET holder=?, token=?, expires=? WHERE name=?",
                             (holder, token, now + ttl_s, name)).rowcount:
                c.execute("INSERT INTO leases VALUES (?,?,?,?)", (name, holder, token, now + ttl_s))
        return token

    def _lease(self, c: sqlite3.Connection, name: str) -> tuple[str | None, int, float] | None:
        """The lease's row with the highest token, read through the table's index and row by
        row past it: a damaged index that lost the row must not bring a token back."""
        query = "SELECT holder, token, expires FROM leases {} WHERE name=?"
        rows = [*c.execute(query.format(""), (name,)), *c.execute(query.format("NOT INDEXED"), (name,))]
        for _, token, expires in rows:
            if not isinstance(token, int) or not isinstance(expires, (int, float)):
                raise CorruptStoreError(f"embedded database {self._db.path} is damaged: lease {name!r} "
                                        f"has token {token!r} and expiry {expires!r}")
        return max(rows, key=lambda r: int(r[1]), default=None)

    @wrapped
    def release_lease(self, name: str, holder: str) -> None:
        with self._db.txn() as c:
            c.execute("UPDATE leases NOT INDEXED SET holder=NULL, expires=0 WHERE name=? AND holder=?",
                      (name, holder))

    @wrapped
    def lease_token(self, name: str) -> int:
        row = self._lease(self._db.conn(), name)
        return 0 if row is None else int(row[1])

    @wrapped
    def lease_holder(self, name: str) -> tuple[str, float] | None:
        row = self._db.conn().execute("SELECT holder, expires FROM leases WHERE name=?", (name,)).fetchone()
        if row is None or row[0] is None:
            return None
        left = float(row[1]) - self._clock()
        return (str(row[0]), left) if left > 0 else None

    @wrapped
    def report_follower(self, run: str, follower: str, version: int) -> None:
        with self._db.txn() as c:
            c.execute(
                "INSERT OR REPLACE INTO followers VALUES (?,?,?,?)",
                (run, follower, version, int(self._clock() * 1000)),
            )

    @wrapped
    def followers(self, run: str) -> dict[str, dict[str, int]]:
        rows = self._db.conn().execute(
            "SELECT follower, version, time_ms FROM followers WHERE run=?", (run,)
        ).fetchall()
        return {f: {"version": self._integer(v, f"follower {f!r} holds a version of"),
                    "time_ms": self._integer(t, f"follower {f!r} holds a time of")} for f, v, t in rows}

    @wrapped
    def forget_follower(self, run: str, follower: str) -> bool:
        with self._db.txn() as c:
            return c.execute("DELETE FROM followers WHERE run=? AND follower=?",
                             (run, follower)).rowcount > 0

    def _integer(self, value: object, what: str) -> int:
        return integer_read(value, self._db.path, what)

    def close(self) -> None:
        self._db.close()
