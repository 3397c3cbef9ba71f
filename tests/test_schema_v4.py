"""Schema v4: the environment fingerprint a recorder logs at the start and at each resume,
the ``Resumed`` proof a ``restore()`` logs, what ``history`` and ``verify`` make of them,
and a whole log written before v4 (``tests/data/v3-run``) that stays readable."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import schemas
from eventlog import RunAddress, Target
from eventlog.commit.append import append_control
from eventlog.events import EnvironmentFingerprint, Resumed
from eventlog.fold.engine import index_control
from replayer.replay import replay
from rewind import fingerprint
from rewind.cli import run
from rewind.recorder import Recorder

V3_RUN = Path(__file__).resolve().parent / "data" / "v3-run"


def _train(rec: Recorder, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        model(torch.randn(2, 4)).pow(2).sum().backward()
        opt.step()
        rec.commit(step, {"loss": float(step)}, wait=True)


@pytest.fixture
def global_flags() -> Iterator[None]:
    """Leave torch's thread count and determinism flag as the test found them."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def _json(capsys: pytest.CaptureFixture[str], *args: str, status: int = 0) -> dict[str, Any]:
    capsys.readouterr()
    assert run([*args, "--json"]) == status
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def test_resumes_are_recorded_and_a_changed_environment_is_marked(
        tmp_path: Path, global_flags: None, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite://{tmp_path}/rewind.db"
    address = RunAddress(url, url, "r")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start_threads = torch.get_num_threads()
    changed = 1 if start_threads != 1 else 2
    with Recorder(address, model, opt, chunk_bytes=64) as rec:
        _train(rec, model, opt, range(3))
    with Recorder(address, model, opt, chunk_bytes=64) as rec:  # same environment
        assert rec.restore().version == 3
        _train(rec, model, opt, range(3, 5))
    torch.set_num_threads(changed)
    with Recorder(address, model, opt, chunk_bytes=64) as rec:
        assert rec.restore().version == 5
        _train(rec, model, opt, range(5, 6))
    torch.set_num_threads(start_threads)
    torch.use_deterministic_algorithms(not torch.are_deterministic_algorithms_enabled())
    with Recorder(address, model, opt, chunk_bytes=64) as rec:
        assert rec.restore().version == 6

    with address.open_log() as log:
        idx = index_control(log)
    kinds = [(type(e.body).__name__, getattr(e.body, "reason", None), e.version) for _, e in idx.environment]
    assert kinds == [("EnvironmentFingerprint", "start", 1),
                     ("EnvironmentFingerprint", "resume", 3), ("Resumed", None, 3),
                     ("EnvironmentFingerprint", "resume", 5), ("Resumed", None, 5),
                     ("EnvironmentFingerprint", "resume", 6), ("Resumed", None, 6)]
    proof = idx.environment[2][1].body
    assert isinstance(proof, Resumed)
    assert (proof.restored_version, proof.restored_step, proof.tail_versions) == (3, 2, 3)
    assert proof.state_digest == idx.seals[3].seal.state_digest and proof.snapshot_id is None

    rows = _json(capsys, "history", "--log", url, "--run", "r")["rows"]
    resumes = [r for r in rows if r["kind"] == "resume"]
    assert [r["version"] for r in resumes] == [3, 5, 6]
    assert [r["environment"] for r in resumes] == [
        {}, {"num_threads": [start_threads, changed]},
        {"deterministic_algorithms": [not torch.are_deterministic_algorithms_enabled(),
                                      torch.are_deterministic_algorithms_enabled()]}]
    assert "ENVIRONMENT DIFFERS" not in resumes[0]["detail"]
    assert f"ENVIRONMENT DIFFERS from the run's start: num_threads {start_threads} -> {changed}" \
        in resumes[1]["detail"]
    capsys.readouterr()
    assert run(["history", "--log", url, "--run", "r"]) == 0
    table = capsys.readouterr().out
    assert table.count("resume: restored version") == 3 and "3 resumes" in table

    report = _json(capsys, "verify", "--log", url, "--run", "r")
    resumed = [f for f in report["findings"] if f["subject"].startswith("resume at")]
    assert [f["status"] for f in resumed] == ["ok", "ok", "ok"]
    assert proof.state_digest.hex() in resumed[0]["detail"]


def test_a_forged_resume_makes_verify_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite://{tmp_path}/rewind.db"
    address = RunAddress(url, url, "r")
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(address, model, opt, chunk_bytes=64) as rec:
        _train(rec, model, opt, range(2))
    assert _json(capsys, "verify", "--log", url, "--run", "r")["ok"] is True
    with address.open_log() as log, address.open_coordinator() as coord:
        writer = log.writer("forger")
        forged = Resumed(2, 1, bytes(16), None, 0, 2, 10)
        append_control(writer, coord, "r", "forger#0", 2, 1, [forged])
        writer.close()
    report = _json(capsys, "verify", "--log", url, "--run", "r", status=1)
    assert report["ok"] is False
    (finding,) = [f for f in report["findings"] if f["status"] == "FAIL"]
    assert finding["subject"].startswith("resume at control offset")
    assert f"restored state digest {bytes(16).hex()}, but the seal of version 2 records" in finding["detail"]


def test_the_first_version_logs_the_start_fingerprint(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path}/rewind.db"
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(RunAddress(url, url, "r"), model, opt) as rec:
        _train(rec, model, opt, range(2))
    with RunAddress(url, url, "r").open_log() as log:
        idx = index_control(log)
    ((_, env),) = idx.environment
    assert isinstance(env.body, EnvironmentFingerprint)
    assert env.body == fingerprint.environment("start")
    assert env.version == 1 and env.body.torch_version == torch.__version__
    assert env.body.num_threads == torch.get_num_threads() and env.body.world_size == 1


@pytest.fixture
def v3_run(tmp_path: Path) -> Path:
    """A copy of a run recorded by Rewind with schema v3: four versions, a restore, two more."""
    folder = tmp_path / "v3-run"
    shutil.copytree(V3_RUN, folder)
    return folder


def test_a_log_written_with_schema_v3_stays_readable(v3_run: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert schemas.SCHEMA_VERSION == 4
    address = RunAddress.from_run_dir(v3_run)
    state, report = replay(address, Target("version", 6))
    assert (report.version, report.step, report.run_id) == (6, 5, "old-v3")
    rows = _json(capsys, "history", "--run-dir", str(v3_run))["rows"]
    assert [r["version"] for r in rows if r["kind"] == "version"] == [1, 2, 3, 4, 5, 6]
    assert [r["version"] for r in rows if r["kind"] == "recovery"] == [5]
    assert not [r for r in rows if r["kind"] == "resume"] and all(r["environment"] == {} for r in rows)
    assert _json(capsys, "verify", "--run-dir", str(v3_run))["ok"] is True
    with address.open_log() as log:
        assert index_control(log).environment == []


def test_bisect_compares_a_v3_run_with_a_copy_of_itself(v3_run: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    twin = tmp_path / "twin"
    shutil.copytree(v3_run, twin)
    doc = _json(capsys, "bisect", str(v3_run), str(twin))
    assert (doc["status"], doc["common_steps"], doc["seals_compared"]) == ("identical", 6, 1)
