"""Seeded damage to the embedded store's own tables: ``runs``, ``writers`` and ``followers``
and their indexes. Verify tells the truth about it, nothing raises a traceback, and fencing
never goes back.

One run is recorded once (``test_store_damage.record``: the trainer at epoch 3, two
followers); each case copies it, then flips bytes in, zeroes a block of, or inserts bytes
into the page of one of those tables or indexes (an insert moves the page's bytes on; one
case in four inserts into the file itself, moving every later page). For every case:

* the damage is real when SQLite's ``PRAGMA integrity_check`` does not say ok, or when an
  independent reread of the three tables (here, with plain SQL: row by row past each index
  and through it) fails, or gives rows that differ between the two paths or from the
  recorded ones. Two changes to another valid value are not damage anyone can tell, and
  harm nothing: a follower's reported version or time (nothing else records them), and a
  writer's epoch raised (its fencing only moves on). ``verify`` reports damage exactly
  when it is real, and names the database file;
* listing the runs gives run ids (text) or raises a ``RewindError``; a replay rebuilds
  the recorded state of its version or raises one: nothing else escapes (no traceback);
* fencing never goes back: on the damaged copy, a trainer that registers again either
  fails with a ``RewindError``, or gets an epoch past every epoch the copy still holds, and
  the writer at the recorded epoch 3 is fenced; where the damage lowered or lost the
  trainer's row as SQLite still reads it (so no store can know the old epoch), verify has
  failed, naming the writer (the log records more sessions of it than its epoch counts).

A few cases also run the installed ``rewind`` with ``--run-dir`` and no ``--run``: verify
exits 1 on damage and 0 without, a replay exits 0 or 2 with one line on stderr.
``REWIND_FUZZ_TABLES_CASES`` changes the number of cases; ``REWIND_FUZZ_TABLES_FIRST``
starts at a later case (each case's damage depends only on its number).
"""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
import subprocess
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import pytest

from eventlog import RewindError, RunAddress, Target, list_runs
from eventlog.embedded import EmbeddedLog
from eventlog.embedded.writer import EmbeddedWriter
from eventlog.fold.engine import index_control
from eventlog.ports import CONTROL
from eventlog.settings import override
from replayer.replay import replay
from snapshotter.verify import FAIL, verify_run

from .storage import page_size, pages_of
from .test_fuzz_cli import CASE_TIMEOUT_S, _matches, _time_limit
from .test_store_damage import RUN, WRITER, record

pytestmark = pytest.mark.xdist_group("test_fuzz_tables")

CASES = int(os.environ.get("REWIND_FUZZ_TABLES_CASES", "30"))
FIRST = int(os.environ.get("REWIND_FUZZ_TABLES_FIRST", "0"))
TABLES = {"runs": "run", "writers": "run, writer", "followers": "run, follower"}
TARGETS = [name for t in TABLES for name in (t, f"sqlite_autoindex_{t}_1")]
#: Cases that also run through the installed command.
CLI_CASES = {3, 4, 5, 8}
RECORDED_EPOCH = 3
Rows = dict[str, list[tuple[object, ...]]]


@dataclass
class Recorded:
    root: Path
    rows: Rows
    seals: dict[int, object]


def _reread(db: Path) -> Rows:
    """Each table's rows, read past its index and through it; raises if the two differ or
    a read fails (``sqlite3.Error``)."""
    rows = {}
    with closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as conn:
        conn.text_factory = bytes  # (a damaged page may hold text that is not UTF-8)
        for table, key in TABLES.items():
            past = sorted(conn.execute(f"SELECT * FROM {table} NOT INDEXED").fetchall(), key=repr)
            through = sorted(conn.execute(
                f"SELECT * FROM {table} INDEXED BY sqlite_autoindex_{table}_1 ORDER BY {key}").fetchall(),
                key=repr)
            if past != through:
                raise sqlite3.DatabaseError(f"{table}: {past} past the index, {through} through it")
            rows[table] = past
    return rows


def _intact(db: Path) -> bool:
    """Whether SQLite's integrity check says ok."""
    try:
        with closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            return conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    except sqlite3.Error:
        return False


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    root = record(tmp_path_factory.mktemp("recorded"))
    url = f"sqlite://{root / 'rewind.db'}"
    with EmbeddedLog(url, RUN, read_only=True) as log:
        seals = {v: s.seal for v, s in index_control(log).seals.items()}
    return Recorded(root, _reread(root / "rewind.db"), seals)


def _damage(rng: random.Random, db: Path) -> str:
    """Damage one page of the tables' (see the module docstring); says how."""
    name = rng.choice(TARGETS)
    size = page_size(db)
    start = (pages_of(db, name)[0] - 1) * size
    data = bytearray(db.read_bytes())
    page = data[start:start + size]
    live = [i for i in range(size) if page[i]] if rng.random() < 0.5 else []
    at = rng.choice(live) if live else rng.randrange(size)
    how = rng.choice(("flip", "flip", "zero", "insert"))
    if how == "flip":
        for i in {at, *(min(size - 1, at + rng.randrange(64)) for _ in range(rng.randrange(4)))}:
            page[i] ^= rng.randrange(1, 256)
        text = f"flipped bytes at {at}"
    elif how == "zero":
        n = rng.choice((16, 256, 4096))
        page[at:at + n] = bytes(len(page[at:at + n]))
        text = f"zeroed {n} bytes at {at}"
    else:
        n = rng.randrange(1, 65)
        new = bytes(rng.randrange(256) for _ in range(n))
        if rng.random() < 0.25:  # into the file: every later page moves
            db.write_bytes(bytes(data[:start + at] + new + data[start + at:]))
            return f"{name}: inserted {n} bytes into the file at {start + at}"
        page[at:] = new + page[at:size - n]
        text = f"inserted {n} bytes at {at} (the page's last {n} bytes lost)"
    data[start:start + size] = page
    db.write_bytes(bytes(data))
    return f"{name}: {text}"


def _fencing(root: Path, label: str, verify_ok: bool) -> str:
    """A trainer registers again on the damaged copy (see the module docstring); says how
    it went: refused, past the recorded epoch, or not (where verify failed)."""
    db = root / "rewind.db"
    with closing(sqlite3.connect(db)) as conn:
        try:
            held = [e for (e,) in conn.execute("SELECT epoch FROM writers NOT INDEXED WHERE writer=?",
                                               (WRITER,)) if isinstance(e, int)]
        except sqlite3.Error:
            held = []
    try:
        with EmbeddedLog(f"sqlite://{db}", RUN) as log:
            writer = log.writer(WRITER)
            zombie = EmbeddedWriter(log._db, RUN, Path(f"{db}.segments"), WRITER, RECORDED_EPOCH)
            try:
                epoch = writer._epoch  # noqa: SLF001 - what the store gave it
                if epoch != RECORDED_EPOCH:
                    with pytest.raises(RewindError), zombie.transaction() as txn:
                        txn.append(CONTROL, b"zombie")
            finally:
                zombie.close()
                writer.close()
    except RewindError as exc:
        return f"refused: {type(exc).__name__}"
    assert epoch > max(held, default=0), f"{label}: registered at epoch {epoch}, the copy held {held}"
    if epoch > RECORDED_EPOCH:
        return "fenced"
    assert not verify_ok, f"{label}: registered at epoch {epoch}, not past the recorded one; verify said ok"
    return "behind, found by verify"


def _harmless(rows: Rows, recorded: Rows) -> bool:
    """Whether ``rows`` differ from ``recorded`` only in a follower's version or time, or
    in a writer's epoch raised (see the module docstring)."""
    if rows["runs"] != recorded["runs"] or len(rows["writers"]) != len(recorded["writers"]) \
            or len(rows["followers"]) != len(recorded["followers"]):
        return False
    writers = all(a[:2] == b[:2] and isinstance(a[2], int) and a[2] >= b[2]  # type: ignore[operator]
                  for a, b in zip(rows["writers"], recorded["writers"], strict=True))
    followers = all(a[:2] == b[:2] and all(isinstance(v, int) and v >= 0 for v in a[2:])
                    for a, b in zip(rows["followers"], recorded["followers"], strict=True))
    return writers and followers


@dataclass
class Outcome:
    seed: int
    real: bool
    verify_ok: bool
    replayed: bool
    fencing: str


def _case(recorded: Recorded, seed: int, base: Path) -> tuple[Outcome, Path]:
    rng = random.Random(seed)
    root = base / f"case-{seed}"
    shutil.copytree(recorded.root, root)
    db = root / "rewind.db"
    how = _damage(rng, db)
    label = f"case {seed}: {how}"
    try:
        rows = _reread(db)
        real = not _intact(db) or not (rows == recorded.rows or _harmless(rows, recorded.rows))
    except sqlite3.Error:
        real = True
    url = f"sqlite://{db}"
    address = RunAddress(url, url, RUN, f"file://{root / 'snapshots'}", read_only=True)
    try:
        runs = list_runs(url)
        assert all(isinstance(r, str) and r for r in runs), f"{label}: runs {runs}"
    except RewindError:
        pass
    try:
        state, _ = replay(address, Target())
        assert _matches(state, recorded.seals), f"{label}: a replay returned a state no seal recorded"  # type: ignore[arg-type]
        replayed = True
    except RewindError:
        replayed = False
    report = verify_run(address)
    assert report.ok == (not real), f"{label}: damage {real}, verify says ok={report.ok}: {report.findings}"
    if not report.ok:
        named = [f for f in report.findings if f.status == FAIL]
        assert any(str(db) in f.detail for f in named), f"{label}: {named}"
    fencing = _fencing(root, label, report.ok)
    return Outcome(seed, real, report.ok, replayed, fencing), root


def _cli(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["rewind", *args, "--run-dir", str(root)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "REWIND_SETTLE_S": "0"})


def test_damaged_store_tables_never_fool_verify_nor_fencing(recorded: Recorded, tmp_path: Path) -> None:
    t0 = time.monotonic()
    outcomes = []
    with override(settle_s=0.0):
        for seed in range(FIRST, CASES):
            with _time_limit(CASE_TIMEOUT_S, f"case {seed}"):
                outcome, root = _case(recorded, seed, tmp_path)
            outcomes.append(outcome)
            if seed in CLI_CASES:
                # (a copy damaged the same way: the case's own copy was written by its fencing check)
                again = tmp_path / f"cli-{seed}"
                shutil.copytree(recorded.root, again)
                _damage(random.Random(seed), again / "rewind.db")
                done = _cli(again, "verify")
                assert done.returncode == (0 if outcome.verify_ok else 1), (seed, done.stdout, done.stderr)
                assert "Traceback" not in done.stderr, (seed, done.stderr)
                done = _cli(again, "replay")
                assert done.returncode in (0, 2) and "Traceback" not in done.stderr, (seed, done.stderr)
                if done.returncode == 2:
                    assert len(done.stderr.strip().splitlines()) == 1, (seed, done.stderr)
                shutil.rmtree(again)
            shutil.rmtree(root)
    real = [o for o in outcomes if o.real]
    print(f"\n{len(outcomes)} cases in {time.monotonic() - t0:.1f} s: {len(real)} damaged (verify failed "
          f"on each), {len(outcomes) - len(real)} not (verify ok on each); replays that raised: "
          f"{sum(not o.replayed for o in outcomes)}; fencing: "
          f"{sum(o.fencing == 'fenced' for o in outcomes)} registered past every epoch, "
          f"{sum(o.fencing.startswith('behind') for o in outcomes)} behind the recorded one where verify "
          f"failed, {sum(o.fencing.startswith('refused') for o in outcomes)} refused")
    assert len(outcomes) == CASES - FIRST
    assert len(real) >= len(outcomes) // 3, "the damage must reach what is checked"
