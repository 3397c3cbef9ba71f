"""When the embedded log copies its WAL into the database: between commits, not during one.

A committed version is durable in the WAL. Copying it into the database (a checkpoint)
rewrites every byte of it, so it waits for the recorder's next maintenance window (right
after ``commit()`` has copied the state), an idle deadline, or the writer's close. The
database file's size shows whether a checkpoint has run.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from eventlog import Recorder, RunAddress, knobs
from eventlog.embedded import EmbeddedLog

RECORD = os.urandom(1 << 20)  # incompressible: the database grows by about this much


def _grows(db: Path, above: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if db.stat().st_size > above:
            return True
        time.sleep(0.05)
    return db.stat().st_size > above


def _commit_one(writer: Any) -> None:
    with writer.transaction() as txn:
        txn.append(0, RECORD)


def _open(tmp_path: Path) -> tuple[Path, EmbeddedLog, Any, int]:
    """A fresh one-shard log, its writer, and the database's size before any record."""
    db = tmp_path / "rewind.db"
    log = EmbeddedLog(f"sqlite://{db}", "wal")
    log.create(1)
    writer = log.writer("w")
    return db, log, writer, db.stat().st_size


def test_a_checkpoint_waits_for_the_window_then_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(knobs, "CHECKPOINT_IDLE_S", 3600.0)
    db, log, writer, start = _open(tmp_path)
    _commit_one(writer)
    assert not _grows(db, start + len(RECORD) // 2, within_s=0.5), "checkpointed before any window"
    assert [r.value for r in log.read(0)] == [RECORD]  # readable (and durable) from the WAL
    writer.maintenance_window()
    assert _grows(db, start + len(RECORD) // 2, within_s=10), "the window did not checkpoint"
    size = db.stat().st_size
    _commit_one(writer)
    writer.close()  # the pending checkpoint runs before close returns
    assert db.stat().st_size > size + len(RECORD) // 2
    log.close()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM records WHERE run='wal'").fetchone() == (2,)


def test_without_a_window_the_idle_deadline_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(knobs, "CHECKPOINT_IDLE_S", 0.5)
    db, log, writer, start = _open(tmp_path)
    _commit_one(writer)
    assert _grows(db, start + len(RECORD) // 2, within_s=10), "the idle deadline did not checkpoint"
    writer.close()
    log.close()


def test_the_recorder_opens_the_window_after_its_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Version 1's checkpoint runs only once version 2's commit() has copied the state."""
    monkeypatch.setattr(knobs, "CHECKPOINT_IDLE_S", 3600.0)
    db = tmp_path / "rewind.db"
    address = RunAddress(f"sqlite://{db}", f"sqlite://{db}", "wal-rec")
    model = torch.nn.Linear(512, 512)
    with Recorder(address, model) as rec:
        rec.commit(1, wait=True)
        size = db.stat().st_size
        assert not _grows(db, size + 512 * 512 * 4 // 2, within_s=0.5)
        with torch.no_grad():
            model.weight.add_(1.0)
        rec.commit(2, wait=True)
        assert _grows(db, size + 512 * 512 * 4 // 2, within_s=10)
