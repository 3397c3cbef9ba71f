"""Waits a user meets that last over 10 s say so, as a WARNING naming what they wait for."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rewind import Follower, Recorder

from .conftest import make_address

#: A process that holds the write lock of an SQLite file for a while: ``sys.argv[1]`` the
#: file, ``sys.argv[2]`` seconds; prints ``locked`` once it holds it.
HOLD_LOCK = (
    "import sqlite3, sys, time\n"
    "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
    "c.execute('BEGIN IMMEDIATE')\n"
    "print('locked', flush=True)\n"
    "time.sleep(float(sys.argv[2]))\n"
    "c.execute('COMMIT')\n"
)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_commit_behind_another_writer_of_the_log_says_what_it_waits_for(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Another process holds the embedded log's write lock for 13 s: the commit waits (and
    then succeeds), and after 10 s a WARNING names the lock and the commit."""
    address = make_address("embedded", tmp_path)
    model, opt = _model()
    caplog.set_level(logging.WARNING)
    with Recorder(address, model, opt, rng=False) as rec:
        rec.commit(0, wait=True)
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path / "rewind.db"), "13"],
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        assert rec.commit(1, wait=True).result().version == 2
        waited = time.monotonic() - t0
        assert holder.wait(30) == 0
    said = _warnings(caplog)
    assert waited > 10, waited
    assert any(s.startswith(f"waiting for the write lock of {tmp_path / 'rewind.db'}") for s in said), said
    assert any(s.startswith(f"waiting for the commit of step 1 of run '{address.run_id}' to be durable; "
                            "the committer is writing version 2 (step 1) to the log") for s in said), said


def test_an_idle_follower_says_what_it_waits_for(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    address = make_address("embedded", tmp_path)
    model, opt = _model()
    with Recorder(address, model, opt, rng=False) as rec:
        rec.commit(0, wait=True)
    caplog.set_level(logging.WARNING)
    stop = threading.Event()
    timer = threading.Timer(12, stop.set)
    timer.start()
    with Follower(address, _model()[0], name="actor-1") as follower:
        assert follower.follow(stop, interval_s=0.2) == 1  # version 1, then nothing new
    said = _warnings(caplog)
    assert any(s.startswith(f"waiting for a version of run '{address.run_id}' after version 1 (follower "
                            "actor-1; the trainer commits none) (1") for s in said), said
