"""Crash matrix: SIGKILL a recorded PPO trainer at 20 random points, resume each time, and
check the final run is bit-identical to one that was never interrupted.

Half of the kill points fall between updates (the work of the update is lost), half inside
a commit's log transaction (``tests.faulthook``: the version must not appear at all).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from eventlog import RunAddress, Target
from eventlog.fold.engine import index_control, rebuild

from .conftest import make_address
from .faulthook import killing_at

UPDATES = 14
TRAINER = ["--updates", str(UPDATES), "--rollout-steps", "64", "--epochs", "2", "--quiet"]


def _trainer(run_dir: Path, *extra: str, env: dict[str, str] | None = None,
             address: RunAddress | None = None) -> int:
    cmd = [sys.executable, "-m", "rewind.demo.trainer", "--run-dir", str(run_dir), *TRAINER,
           "--digest-file", str(run_dir / "digests.jsonl"), *extra]
    if address is not None:
        cmd += ["--record", "--log", address.log_url, "--coord", address.coord_url,
                "--run", address.run_id]
    proc = subprocess.run(cmd, env=env or dict(os.environ), capture_output=True, text=True, timeout=300)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"trainer failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.returncode


def _last_digests(path: Path) -> dict[int, str]:
    out: dict[int, list[str]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], []).append(row["digest"])
    # A re-done update must reproduce exactly the digest it had before the crash.
    for step, seen in out.items():
        assert len(set(seen)) == 1, f"update {step} gave different states across resumes"
    return {s: d[0] for s, d in out.items()}


def kill_plan(seed: int, count: int = 20) -> list[tuple[int, str, int]]:
    """``(update, kind, event index)`` kill points, ordered as a resumed run meets them."""
    rng = random.Random(seed)
    points = []
    for i in range(count):
        update = rng.randrange(UPDATES)
        if i % 2:
            points.append((update, "in-commit", rng.randrange(0, 30)))
        else:
            points.append((update, "before-commit", 0))
    return sorted(points)


@pytest.mark.slow
def test_twenty_random_kills_then_resume_is_bit_exact(backend: str, tmp_path: Path) -> None:
    seed = int(os.environ.get("REWIND_CRASH_SEED", "20261129"))
    plan = kill_plan(seed)
    recorded, reference = tmp_path / "recorded", tmp_path / "reference"
    recorded.mkdir()
    if backend == "embedded":
        url = f"sqlite://{recorded / 'rewind.db'}"
        address = RunAddress(url, url, "ppo")
    else:
        address = make_address(backend, tmp_path)
    for update, kind, index in plan:
        if kind == "before-commit":
            rc = _trainer(recorded, "--kill-at", str(update), address=address)
        else:
            # Version v is the commit of update v-1: die after `index` events of its transaction.
            rc = _trainer(recorded, env=killing_at(f"commit:{update + 1}:{index}"), address=address)
        assert rc == -signal.SIGKILL, f"kill point {(update, kind, index)} did not fire"
        restored = json.loads((recorded / "restore.json").read_text())
        # Each process restores what the previous one committed, never more, never less.
        assert restored["version"] == (0 if restored["step"] is None else restored["step"] + 1)
        assert restored["skipped"] == 0
    assert _trainer(recorded, address=address) == 0
    assert _trainer(reference) == 0

    got, want = _last_digests(recorded / "digests.jsonl"), _last_digests(reference / "digests.jsonl")
    assert sorted(got) == list(range(UPDATES))
    assert got == want, "resumed run diverged from the uninterrupted run"

    # The log holds every version exactly once, each one sealed and verified.
    with address.open_log() as log:
        idx = index_control(log)
        assert sorted(idx.seals) == list(range(1, UPDATES + 1))
        assert [idx.seals[v].step for v in sorted(idx.seals)] == list(range(UPDATES))
        # PPO's two Adam steps per update are logged as gradients (predictive codec) from
        # version 2 on, across every restart; version 1 writes the whole state.
        codecs = [idx.seals[v].seal.encoding.split(" + ")[0] for v in sorted(idx.seals)]
        assert codecs[1:] == ["predictive/Adam x2"] * (UPDATES - 1), codecs
        state = rebuild(log, Target())
    assert state.counts.skipped_duplicate == 0 and state.counts.skipped_unsealed == 0
    assert state.version == UPDATES
