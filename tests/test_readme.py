"""The README's Python code runs as written.

The trainer snippet runs twice, each time in a fresh process in an empty directory (its
default log location): the first trains and commits with snapshots on, the second restores.
The second must start from a snapshot, replay a tail no longer than the snapshot interval,
and hold state bit-equal to the first's at its end. Every other Python block runs after
them, in the same directory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# Its module-scoped fixture is built once: every test of the file on one xdist worker.
pytestmark = pytest.mark.xdist_group("test_readme")

README = Path(__file__).resolve().parents[1] / "README.md"

#: Appended to the trainer snippet: a digest of every bit the run's state is made of (model,
#: optimizer, global RNG), and the restore report.
REPORT = '''
import hashlib as _hashlib, json as _json
def _walk(tree, out):
    if isinstance(tree, torch.Tensor):
        out.append(tree.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(tree, dict):
        for k in sorted(tree, key=str):
            out.append(str(k).encode()); _walk(tree[k], out)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            _walk(v, out)
    else:
        out.append(repr(tree).encode())
_parts = []
_walk([model.state_dict(), opt.state_dict(), torch.get_rng_state()], _parts)
print("REPORT " + _json.dumps({
    "digest": _hashlib.sha256(b"".join(_parts)).hexdigest(), "fresh": start.fresh,
    "step": start.step, "snapshot": start.snapshot, "tail": start.tail}))
'''


def python_blocks() -> list[str]:
    """Every fenced ```python block of the README, in order."""
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)


def _trainer_snippet() -> str:
    found = [b for b in python_blocks() if "Recorder(" in b and "snapshots" in b]
    assert len(found) == 1, "the README has one trainer snippet, with snapshots on"
    return found[0]


def _run(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # The README's defaults: no backend chosen in the environment.
    env = {k: v for k, v in os.environ.items()
           if k not in ("REWIND_LOG", "REWIND_COORD", "REWIND_SNAPSHOTS")}
    env["SB3_LOGDIR"] = str(cwd / "sb3")  # SB3's logger would make a folder in /tmp per learn()
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"README code failed:\n{code}\n{proc.stderr[-3000:]}"
    return proc


def _report(proc: subprocess.CompletedProcess[str]) -> dict[str, object]:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert len(lines) == 1, proc.stdout
    return dict(json.loads(lines[0][len("REPORT "):]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object], dict[str, object]]:
    """The trainer snippet run twice in one directory: (directory, first report, second)."""
    cwd = tmp_path_factory.mktemp("readme")
    snippet = _trainer_snippet()
    first = _report(_run(snippet + REPORT, cwd))
    second = _report(_run(snippet + REPORT, cwd))
    return cwd, first, second


def test_the_trainer_snippet_restores_from_a_snapshot_bit_exact(
    trained: tuple[Path, dict[str, object], dict[str, object]],
) -> None:
    cwd, first, second = trained
    interval = re.search(r"every_versions\((\d+)\)", _trainer_snippet())
    assert interval, "the trainer snippet takes a snapshot every N versions"
    assert first["fresh"] is True and second["fresh"] is False
    snapshot = second["snapshot"]
    # The snapshot it started from is in the default store, beside the default log.
    assert isinstance(snapshot, str) and len(list(cwd.glob(f"snapshots/*/{snapshot}"))) == 1
    assert isinstance(second["tail"], int) and 0 <= second["tail"] <= int(interval.group(1))
    assert second["digest"] == first["digest"]


def test_every_other_python_block_runs(
    trained: tuple[Path, dict[str, object], dict[str, object]],
) -> None:
    cwd, _, _ = trained
    snippet = _trainer_snippet()
    for block in python_blocks():
        if block != snippet:
            _run(block, cwd)
