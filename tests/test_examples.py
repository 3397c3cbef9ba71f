"""The examples run as a user runs them, and do what their docstrings say."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from eventlog import RunAddress
from eventlog.weightstream import WeightsStream

ROOT = Path(__file__).resolve().parents[1]


def test_rl_actors_act_with_sealed_bf16_versions_that_advance(tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "rl_actors.py"), "--actors", "2",
                           "--updates", "6", "--dir", str(tmp_path), "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "6 rollouts from 2 actors" in done.stdout
    seen = json.loads(out.read_text())
    rollouts = seen["rollouts"]
    assert len(rollouts) == 6 and {r["actor"] for r in rollouts} == {0, 1}
    assert seen["sealed"] == list(range(1, 8))  # the first version and one per rollout
    for actor in (0, 1):
        versions = [r["version"] for r in rollouts if r["actor"] == actor]
        assert versions == sorted(versions) and versions[-1] > versions[0], versions
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    with RunAddress(url, url, "rl-actors").open_log() as log:
        published = {v.version: v.digest.hex() for v in WeightsStream(log).index()}
    # Every rollout names a version the learner sealed, and the digest of its bf16 weights
    # is the one the stream published for that version.
    assert all(published[r["version"]] == r["digest"] and r["kind"] == "weights/bfloat16" for r in rollouts)
    # The learner recorded each update's stamp: verify checks every one against its seal.
    verify = subprocess.run([sys.executable, "-m", "rewind.cli", "verify", "--run-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=300)
    assert verify.returncode == 0, verify.stdout[-2000:] + verify.stderr[-2000:]
