"""Faults of the real services: the demo on Kafka+Redis, Redis losing its data, and the
broker stopping for 10 s mid-run. Needs scripts/test (or scripts/services start)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
import torch

from eventlog import RunAddress, Target
from eventlog.fold.engine import index_control, rebuild
from replayer.replay import state_dicts
from rewind.recorder import Recorder

from .conftest import REDIS, make_address
from .test_snapshotter import Trainer, _bit_equal

pytestmark = pytest.mark.kafka
ROOT = Path(__file__).resolve().parents[1]


def _service(*args: str) -> None:
    subprocess.run([str(ROOT / "scripts" / args[0]), *args[1:]], check=True, timeout=180,
                   capture_output=True)


@pytest.mark.slow
def test_demo_on_kafka_and_redis_is_bit_exact(tmp_path: Path) -> None:
    address = make_address("kafka", tmp_path)
    demo = subprocess.run(
        [sys.executable, "-c", "from rewind.cli import main; main()", "demo", "--run-dir",
         str(tmp_path / "demo"), "--updates", "8", "--kill-at", "4", "--log", address.log_url,
         "--coord", address.coord_url, "--run", address.run_id],
        capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert demo.stdout.strip().splitlines()[-1] == "bit-exact: yes"


def _restore_matches(address: RunAddress, trainer: Trainer) -> int:
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Recorder(address, model, opt, rng=False) as rec:
        result = rec.restore()
    assert _bit_equal(model.state_dict(), trainer.states[trainer.step - 1])
    return result.version


@pytest.mark.exclusive
@pytest.mark.parametrize("loss", ["flushall", "restart"])
def test_losing_redis_loses_nothing(tmp_path: Path, loss: str) -> None:
    address = make_address("kafka", tmp_path)
    trainer = Trainer(address)
    trainer.train(4)
    if loss == "flushall":
        redis.Redis.from_url(str(REDIS)).flushall()
    else:  # Redis here keeps no data on disk: a restart comes back empty
        _service("redis", "stop")
        _service("redis", "start")
    trainer.train(4)  # the recorder rebuilds the lost version from the log and goes on
    trainer.rec.close()
    with address.open_coordinator() as coord:
        assert coord.current_version(address.run_id) == 8
        redis.Redis.from_url(str(REDIS)).flushall()
        assert coord.current_version(address.run_id) == 0
    assert _restore_matches(address, trainer) == 8
    with address.open_coordinator() as coord:
        assert coord.current_version(address.run_id) == 8  # rebuilt from the log by restore()


@pytest.mark.exclusive
@pytest.mark.slow
def test_broker_stopped_for_ten_seconds_blocks_commits_and_loses_none(tmp_path: Path) -> None:
    address = make_address("kafka", tmp_path)
    trainer = Trainer(address)
    versions = 16
    errors: list[BaseException] = []
    progress = threading.Event()

    def train() -> None:
        try:
            for _ in range(versions):
                trainer.train(1)  # commit(..., wait=True): blocks while the broker is away
                if trainer.step == 5:
                    progress.set()
                time.sleep(0.2)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            progress.set()

    thread = threading.Thread(target=train)
    thread.start()
    assert progress.wait(120)
    _service("kafka", "stop")
    stopped_at = trainer.step
    time.sleep(10)
    assert trainer.step <= stopped_at + 1  # commits are blocked, not dropped
    _service("kafka", "start")
    thread.join(300)
    assert not thread.is_alive() and not errors, errors
    trainer.rec.close()
    with address.open_log() as log:
        idx = index_control(log)
        assert sorted(idx.seals) == list(range(1, versions + 1))
        state = rebuild(log, Target())
    assert _bit_equal(state_dicts(state)["model"], trainer.states[versions - 1])

    # ... and equal to the same training never interrupted (embedded backend).
    reference = Trainer(make_address("embedded", tmp_path / "reference"))
    reference.train(versions)
    reference.rec.close()
    assert _bit_equal(trainer.states[versions - 1], reference.states[versions - 1])
