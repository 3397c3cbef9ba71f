"""Damage to the embedded store's own tables (runs, writers, followers, leases and their
indexes), made in a copy of a recorded database as a bad disk makes it: ``verify`` names it
and exits 1, a run id that reads as NULL is a ``CorruptStoreError`` naming the file, fencing
epochs and tokens never go back, and a replay names a damaged records index as verify does."""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

import pytest

from eventlog import RunAddress, Target, list_runs
from eventlog.embedded import EmbeddedCoordinator, EmbeddedLog
from eventlog.embedded.writer import EmbeddedWriter
from eventlog.errors import CorruptStoreError, FencedError
from eventlog.ports import CONTROL
from replayer.replay import replay
from snapshotter.verify import FAIL, verify_run

from .storage import index_loses_rows, page_size, pages_of
from .test_snapshotter import Trainer

RUN = "h3"
WRITER = f"{RUN}.trainer"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return record(tmp_path_factory.mktemp("recorded"))


def record(root: Path) -> Path:
    """A run of 6 versions by three trainer processes in turn (the trainer's epoch is 3),
    two followers and a snapshotter lease (token 2), every page in the database file."""
    url = f"sqlite://{root / 'rewind.db'}"
    address = RunAddress(url, url, RUN, f"file://{root / 'snapshots'}")
    for _ in range(3):
        trainer = Trainer(address)
        trainer.rec.restore()
        trainer.train(2)
        trainer.rec.close()
    with EmbeddedCoordinator(url) as coord:
        coord.report_follower(RUN, "actor-0", 5)
        coord.report_follower(RUN, "actor-1", 6)
        for _ in range(2):
            assert coord.acquire_lease(f"{RUN}.snapshotter", "s", 0.0) is not None
    with closing(sqlite3.connect(root / "rewind.db")) as conn:
        assert conn.execute("SELECT epoch FROM writers WHERE writer=?", (WRITER,)).fetchall() == [(3,)]
    page_size(root / "rewind.db")
    return root


@pytest.fixture
def copy(recorded: Path, tmp_path: Path) -> Path:
    """A copy of the recorded run's directory, to damage."""
    root = tmp_path / "run"
    shutil.copytree(recorded, root)
    return root


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["rewind", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})


def _in_page(db: Path, name: str, at: int, new: bytes, *, insert: bool = False) -> None:
    """Write ``new`` over the bytes at ``at`` of the first page of table or index ``name``,
    or insert them there (every byte after moves on, to the end of the file)."""
    size = page_size(db)
    offset = (pages_of(db, name)[0] - 1) * size + at
    data = db.read_bytes()
    db.write_bytes(data[:offset] + new + data[offset + (0 if insert else len(new)):])


def _zero_cells(db: Path, name: str) -> None:
    """Zero the last 4 KiB of the first page of ``name``, where SQLite keeps its cells."""
    _in_page(db, name, page_size(db) - 4096, bytes(4096))


def _address(root: Path) -> RunAddress:
    url = f"sqlite://{root / 'rewind.db'}"
    return RunAddress(url, url, RUN, f"file://{root / 'snapshots'}", read_only=True)


def _store_findings(root: Path) -> list[str]:
    report = verify_run(_address(root))
    assert not report.ok
    found = [f.detail for f in report.findings if f.subject == "database" and f.status == FAIL]
    assert found and all(str(root / "rewind.db") in d for d in found[:-1]), report.findings
    return found


def test_a_run_id_the_runs_index_reads_as_null_is_damage_naming_the_file(copy: Path) -> None:
    """44 bytes inserted into the runs table's index page (the damage a campaign found):
    ``SELECT run FROM runs ORDER BY run`` reads NULL. Without ``--run``, a replay says the
    database is damaged, names it and the run its table still holds (one line, exit 2);
    verify reports the damage and exits 1. With ``--run``, verify exits 1 too (the
    database is malformed), naming the file."""
    db = copy / "rewind.db"
    _in_page(db, "sqlite_autoindex_runs_1", 9255, bytes(range(7, 51)), insert=True)
    with closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT run FROM runs ORDER BY run").fetchall() == [(None,)]
    said = f"embedded database {db} is damaged: the runs table's index holds run id None, which is not a " \
        f"run id; the table itself holds runs '{RUN}': name one with --run"
    with pytest.raises(CorruptStoreError, match=re.escape(said)):
        list_runs(f"sqlite://{db}")
    done = _cli("replay", "--run-dir", str(copy))
    assert done.returncode == 2 and done.stderr == f"error: CorruptStoreError: {said}\n", done.stderr
    for named in ([], ["--run", RUN]):
        done = _cli("verify", "--run-dir", str(copy), *named)
        assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
        assert "PROBLEMS FOUND" in done.stdout, done.stdout
        # The text report names the run's directory once and the file within it (80 columns).
        assert f"paths below are in {copy})" in done.stdout, done.stdout
        assert "embedded database rewind.db is damaged" in done.stdout, done.stdout


def test_a_writer_whose_row_its_index_lost_registers_past_every_epoch(copy: Path) -> None:
    """The writers index lost the trainer's row (epoch 3): a trainer that resumes gets
    epoch 4, not 1 beside the old row; a writer that held epoch 3 is fenced; verify names
    the damaged index."""
    db = copy / "rewind.db"
    index_loses_rows(db, "writers", "writer=?", (WRITER,))
    url = f"sqlite://{db}"
    with EmbeddedLog(url, RUN) as log:
        resumed = log.writer(WRITER)
        zombie = EmbeddedWriter(log._db, RUN, Path(f"{db}.segments"), WRITER, 3)
        with pytest.raises(FencedError, match="epoch 4 > 3"), zombie.transaction() as txn:
            txn.append(CONTROL, b"zombie")
        with resumed.transaction():
            pass
        zombie.close()
        resumed.close()
    with closing(sqlite3.connect(db)) as conn:
        held = conn.execute("SELECT epoch FROM writers NOT INDEXED WHERE writer=?", (WRITER,)).fetchall()
    assert held == [(4,)]
    assert any("integrity check finds" in d and "missing from index sqlite_autoindex_writers_1" in d
               for d in _store_findings(copy))


def test_a_second_writers_row_at_an_older_epoch_is_named_as_fencing_gone_back(copy: Path) -> None:
    """What an older Rewind did on such a copy: a second row for the trainer at epoch 1 beside
    the one at 3. Verify names it as fencing gone back, and the next writer still gets 4."""
    db = copy / "rewind.db"
    index_loses_rows(db, "writers", "writer=?", (WRITER,))
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("INSERT INTO writers VALUES (?,?,1)", (RUN, WRITER))
    assert any(f"its writers table holds 2 rows for writer {WRITER!r} of run {RUN!r}, with epochs 1, 3" in d
               and "fencing epoch going back" in d for d in _store_findings(copy))
    with EmbeddedLog(f"sqlite://{db}", RUN) as log:
        log.writer(WRITER).close()
    with closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT epoch FROM writers NOT INDEXED WHERE writer=?", (WRITER,)).fetchall() == \
            [(4,), (4,)]


def test_a_lease_whose_row_its_index_lost_takes_a_newer_token(copy: Path) -> None:
    """The leases index lost the snapshotter's lease (token 2): the next holder gets 3."""
    index_loses_rows(copy / "rewind.db", "leases", "1")
    with EmbeddedCoordinator(f"sqlite://{copy / 'rewind.db'}") as coord:
        assert coord.lease_token(f"{RUN}.snapshotter") == 2
        assert coord.acquire_lease(f"{RUN}.snapshotter", "t", 60.0) == 3


@pytest.mark.parametrize("table", ["writers", "sqlite_autoindex_followers_1"])
def test_an_unreadable_table_of_the_store_fails_verify(copy: Path, table: str) -> None:
    """The writers table's cells, or the followers index's, zeroed: replays still work,
    but the store is damaged (a trainer's restore fails on the writers table): verify exits
    1, naming the file, and says which tables still read."""
    db = copy / "rewind.db"
    _zero_cells(db, table)
    assert replay(_address(copy), Target())[0].version == 6
    done = _cli("verify", "--run-dir", str(copy), "--json")
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"embedded database {db} is damaged" in done.stdout
    assert f"of {db}, these tables still read row by row: runs (1 rows)" in done.stdout, done.stdout


def test_a_replay_names_a_damaged_records_index_as_verify_does(copy: Path) -> None:
    """The records index lost every control record (the table still holds them): a replay
    says the index is damaged, as verify does, not that the run has no events."""
    db = copy / "rewind.db"
    with closing(sqlite3.connect(db)) as conn:
        (end,) = conn.execute("SELECT next_offset FROM partitions WHERE run=? AND partition=?",
                              (RUN, CONTROL)).fetchone()
    index_loses_rows(db, "records", "partition=?", (CONTROL,))
    said = f"run {RUN!r} partition -1: reads skip offsets 0..{end - 1}, which the database holds: " \
        "its index is damaged"
    with pytest.raises(CorruptStoreError, match=re.escape(said)):
        replay(_address(copy), Target())
    report = verify_run(_address(copy))
    assert any(said in d.error for d in report.damaged), report.findings


@pytest.mark.parametrize("damage", ["epoch 3 -> 2", "writer renamed"])
def test_a_writers_row_damaged_to_another_valid_value_is_found_by_the_sessions_the_log_records(
        copy: Path, damage: str) -> None:
    """The trainer's row changed in place as a flipped byte can, the store still sound to
    SQLite: its epoch lowered to 2, or its writer id changed. The next trainer would register
    at epoch 3 or 1, which a fenced trainer of an earlier session holds. The log records three
    sessions of the trainer: verify finds the store's epoch below that count and fails."""
    db = copy / "rewind.db"
    with closing(sqlite3.connect(db)) as conn, conn:
        if damage == "epoch 3 -> 2":
            conn.execute("UPDATE writers SET epoch=2 WHERE writer=?", (WRITER,))
        else:
            conn.execute("UPDATE writers SET writer=? WHERE writer=?", (f"{RUN}.trainez", WRITER))
    page_size(db)
    report = verify_run(_address(copy))
    held = "epoch 2" if damage == "epoch 3 -> 2" else "no epoch"
    [found] = [f for f in report.findings if f.status == FAIL]
    assert found.subject == f"writer {WRITER}" and found.detail.startswith(
        f"the log records 3 sessions of it, each registered at a new epoch, but the store holds {held} "
        "for it"), found
    assert str(db) in found.detail
