"""When the embedded log copies its WAL into the database: between commits, not during one.

A committed version is durable in the WAL. Copying it into the database (a checkpoint)
rewrites every byte of it, so it waits for the recorder's next maintenance window (right
after ``commit()`` has copied the state), an idle deadline, or the writer's close. The
checkpointer counts the checkpoints it ran; the database file's size shows their effect.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from eventlog import RunAddress
from eventlog.embedded import EmbeddedLog
from eventlog.errors import ConfigError
from eventlog.settings import Settings, current
from rewind.recorder import Recorder

RECORD = os.urandom(1 << 20)  # incompressible: a checkpoint grows the database by as much


def _runs(writer: Any) -> int:
    return int(writer._checkpoint.runs)


def _wait_runs(writer: Any, n: int, within_s: float = 10.0) -> int:
    deadline = time.monotonic() + within_s
    while _runs(writer) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return _runs(writer)


def _commit_one(writer: Any) -> None:
    with writer.transaction() as txn:
        txn.append(0, RECORD)


def _open(tmp_path: Path) -> tuple[Path, EmbeddedLog, Any]:
    """A fresh one-shard log and its writer."""
    db = tmp_path / "rewind.db"
    log = EmbeddedLog(f"sqlite://{db}", "wal")
    log.create(1)
    return db, log, log.writer("w")


def test_a_checkpoint_waits_for_the_window_then_runs(
        tmp_path: Path, configure: Callable[..., Settings]) -> None:
    configure(checkpoint_idle_s=3600.0)
    db, log, writer = _open(tmp_path)
    _commit_one(writer)
    time.sleep(0.3)
    assert _runs(writer) == 0, "checkpointed before any window"
    assert [r.value for r in log.read(0)] == [RECORD]  # readable (and durable) from the WAL
    writer.maintenance_window()
    assert _wait_runs(writer, 1) == 1, "the window did not checkpoint"
    size = db.stat().st_size
    assert size >= len(RECORD)
    _commit_one(writer)
    writer.close()  # the pending checkpoint runs before close returns
    assert _runs(writer) == 2
    assert db.stat().st_size >= size + len(RECORD)
    log.close()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM records WHERE run='wal'").fetchone() == (2,)


def test_without_a_window_the_idle_deadline_checkpoints(
        tmp_path: Path, configure: Callable[..., Settings]) -> None:
    configure(checkpoint_idle_s=0.5)
    _, log, writer = _open(tmp_path)
    _commit_one(writer)
    assert _wait_runs(writer, 1) == 1, "the idle deadline did not checkpoint"
    writer.close()
    assert _runs(writer) == 1  # nothing was pending at close
    log.close()


@pytest.mark.parametrize("bad", ["nan", "inf", "-1", "5s"])
def test_a_bad_idle_deadline_is_refused(bad: str) -> None:
    """From the environment, or set in code: the error names the variable and the value."""
    with pytest.raises(ConfigError, match=f"REWIND_CHECKPOINT_IDLE_S.*{bad}"):
        Settings.from_env({"REWIND_CHECKPOINT_IDLE_S": bad})
    if bad != "5s":
        with pytest.raises(ConfigError, match="REWIND_CHECKPOINT_IDLE_S"):
            current().with_changes(checkpoint_idle_s=float(bad))


def test_the_recorder_opens_a_window_at_each_commit(
        tmp_path: Path, configure: Callable[..., Settings]) -> None:
    """Version 1's checkpoint waits for version 2's commit()."""
    configure(checkpoint_idle_s=3600.0)
    db = tmp_path / "rewind.db"
    address = RunAddress(f"sqlite://{db}", f"sqlite://{db}", "wal-rec")
    model = torch.nn.Linear(512, 512)
    with Recorder(address, model) as rec:
        rec.commit(1, wait=True)
        time.sleep(0.3)
        writer = rec._pipe.log_writer
        assert _runs(writer) == 0
        with torch.no_grad():
            model.weight.add_(1.0)
        rec.commit(2, wait=True)
        assert _wait_runs(writer, 1) >= 1
