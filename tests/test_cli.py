"""The ``rewind`` command as a user runs it: the demo, replay, recover and history."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import KAFKA, REDIS


def _rewind(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from rewind.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_demo_prints_bit_exact_yes_and_recover_writes_a_safe_checkpoint(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    demo = _rewind("demo", "--run-dir", str(run_dir), "--updates", "8", "--kill-at", "5")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    lines = demo.stdout.strip().splitlines()
    assert lines[-1] == "bit-exact: yes"
    assert "killed (SIGKILL) during update" in demo.stdout

    recorded = run_dir / "recorded"
    assert lines[-2] == f"the recorded run, for other commands: rewind history --run-dir {recorded}"
    hist = _rewind("history", "--run-dir", str(recorded), "--json")
    assert hist.returncode == 0, hist.stderr
    rows = json.loads(hist.stdout)["rows"]
    versions = [r for r in rows if r["kind"] == "version"]
    assert [r["version"] for r in versions] == list(range(1, 9))
    assert [r["step"] for r in versions] == list(range(8))
    # Killed during update 5: the resumed session's first version (6) is marked a recovery.
    assert [r["version"] for r in rows if r["kind"] == "recovery"] == [6]

    rep = _rewind("replay", "--run-dir", str(recorded), "--to", "step=3", "--json")
    assert rep.returncode == 0, rep.stderr
    report = json.loads(rep.stdout)["report"]
    assert (report["version"], report["step"], report["skipped_duplicate"]) == (4, 3, 0)

    out = tmp_path / "ckpt"
    rec = _rewind("recover", "--run-dir", str(recorded), "--out", str(out))
    assert rec.returncode == 0, rec.stderr
    model = torch.load(out / "model.pt", weights_only=True)
    optim = torch.load(out / "optimizer.pt", weights_only=True)
    assert any(k.endswith("weight") for k in model) and "param_groups" in optim
    assert json.loads((out / "recovery.json").read_text())["version"] == 8
    assert (out / "rng.msgpack").exists() and (out / "env.msgpack").exists()


@pytest.mark.slow
@pytest.mark.kafka
def test_a_demo_on_kafka_names_its_run_by_log_coordinator_and_id(tmp_path: Path) -> None:
    """Its run is in Kafka and Redis, not in its directory: the demo prints (and ``--json``
    gives) the ``--log --coord --run`` options that address it, and they work."""
    log = f"kafka://{KAFKA}?prefix=rewindtest"
    demo = _rewind("demo", "--run-dir", str(tmp_path / "demo"), "--updates", "4", "--kill-at", "2",
                   "--log", log, "--coord", str(REDIS), "--json")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    args = json.loads(demo.stdout)["run_args"]
    assert args[:5] == ["--log", log, "--coord", REDIS, "--run"] and len(args) == 6, args
    said = demo.stderr.splitlines()  # --json: the table and its lines go to stderr
    assert said[-1] == f"the recorded run, for other commands: rewind history {shlex.join(args)}", said[-3:]
    assert "--run-dir" not in demo.stderr
    hist = _rewind("history", *args, "--json")
    assert hist.returncode == 0, hist.stderr
    assert [r["version"] for r in json.loads(hist.stdout)["rows"] if r["kind"] == "version"] == [1, 2, 3, 4]


def test_unknown_target_and_missing_run_give_one_clear_line(tmp_path: Path) -> None:
    missing = _rewind("replay", "--run-dir", str(tmp_path / "nowhere"))
    assert missing.returncode == 2
    assert "no Rewind run in" in missing.stderr and "Traceback" not in missing.stderr
    bad = _rewind("replay", "--log", "sqlite:///x.db", "--run", "r", "--to", "yesterday")
    assert bad.returncode == 2 and "bad replay target 'yesterday'" in bad.stderr


def test_child_processes_import_the_tree_under_test(tmp_path: Path) -> None:
    """A process a test starts (the ``rewind`` script, a torchrun rank), run from anywhere,
    imports this checkout's packages, whichever checkout an editable install last pointed
    at (tests/conftest.py puts it first on the path)."""
    out = subprocess.run([sys.executable, "-c", "import snapshotter.walk as w; print(w.__file__)"],
                         capture_output=True, text=True, timeout=120, check=True, cwd=tmp_path)
    tree = Path(__file__).resolve().parents[1]
    assert Path(out.stdout.strip()).resolve() == tree / "snapshotter" / "walk.py"


def test_python_dash_m_runs_the_same_command_line(tmp_path: Path) -> None:
    """``python -m rewind.cli`` is the ``rewind`` script (it did nothing before)."""
    out = subprocess.run([sys.executable, "-m", "rewind.cli", "replay", "--run-dir", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=300, check=False,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 2 and "no Rewind run in" in out.stderr
