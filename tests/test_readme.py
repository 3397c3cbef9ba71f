"""The README's Python code (and the integrations guide's) runs as written.

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
import shutil
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


#: The integrations' guide, whose blocks run as the README's do.
INTEGRATIONS = README.parent / "docs" / "integrations.md"


def python_blocks() -> list[str]:
    """Every fenced ```python block of the README, then of ``docs/integrations.md``, in order."""
    return [block for doc in (README, INTEGRATIONS)
            for block in re.findall(r"^```python\n(.*?)^```", doc.read_text(encoding="utf-8"), re.M | re.S)]


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


def test_a_resumed_framework_run_shows_it(tmp_path: Path) -> None:
    """The SB3 block run twice in one directory: ``callback.restored`` says the first is a
    fresh run and the second what it resumed from, and ``rewind history`` has that resume's row."""
    (block,) = [b for b in python_blocks() if "stable_baselines3" in b]
    block += "print(callback.restored)\n"
    first, second = (_run(block, tmp_path).stdout.splitlines() for _ in range(2))
    assert "fresh run: nothing to restore" in first
    assert [ln for ln in second if ln.startswith("restored version ")], second
    rewind = shutil.which("rewind")
    assert rewind, "the rewind console script is not installed (pip install -e .)"
    history = subprocess.run([rewind, "history", "--run-dir", str(tmp_path), "--json"], capture_output=True,
                             text=True, timeout=300, check=True)
    rows = json.loads(history.stdout)["rows"]
    assert [r["kind"] for r in rows].count("resume") == 1


@pytest.mark.parametrize("fact", [
    # a multi-rank run restores at any world size up to its shard count (tests/test_multirank.py)
    "at any world size up to the run's shard count, bit-exact (3 shards at 2 ranks",
    # a failed commit stops the recorder (tests/test_recorder.py)
    "After a failed commit every later `commit()` raises a `RewindError` naming it",
    # how a framework run's resume shows (test_a_resumed_framework_run_shows_it)
    "`callback.restored.fresh` is False", "HF's `checkpoint()` is not None",
    "`rewind history` has a `resume` row",
    # the snapshot cadence (tests/test_snapshotter.py::test_the_snapshot_cadence_the_readme_states)
    "(`every_versions(10)`: 10, 20, 30)", "skips the versions sealed while it writes (12, 25, 38, 48)",
])
def test_the_readme_states_what_a_user_meets(fact: str) -> None:
    assert fact in " ".join(README.read_text(encoding="utf-8").split())


def test_the_multirank_doc_agrees_on_world_sizes() -> None:
    doc = " ".join((README.parent / "docs" / "multirank.md").read_text(encoding="utf-8").split())
    assert "restores into any `M` ranks up to its shard count `S`" in doc
    assert "divides the run's shard count" not in " ".join(README.read_text(encoding="utf-8").split())


@pytest.mark.skipif(shutil.which("git") is None or not (README.parent / ".git").exists(),
                    reason="not a git checkout")
def test_what_the_demo_writes_is_ignored_by_git(tmp_path: Path) -> None:
    """The folders ``rewind demo`` writes where it runs (and the README trainer's store)."""
    from rewind.demo import default_run_dir

    root = README.parent
    paths = [str(default_run_dir(log) / "recorded" / "rewind.db") for log in (None, "kafka://h:9092")]
    paths.append("snapshots/my-run/v0000000010-t1-abcdef/manifest.json")
    out = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=root, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.splitlines() == paths, out.stdout + out.stderr


def _cuda_wheel() -> bool:
    from importlib import metadata

    return any((d.metadata["Name"] or "").startswith("nvidia-") for d in metadata.distributions())


@pytest.mark.skipif(not _cuda_wheel(), reason="torch is not PyPI's default (CUDA) wheel here")
def test_the_install_size_the_readme_states_is_what_is_installed() -> None:
    """The README's figure for a fresh venv with the demo extra, within 10%: the sizes of the
    files of every distribution ``rewind[demo]`` needs, as installed here."""
    from importlib import metadata

    from packaging.requirements import Requirement

    stated = re.search(r"Install size: about ([\d.]+) GB", README.read_text(encoding="utf-8"))
    assert stated, "the README states the install size"
    seen: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [("rewind", frozenset({"demo"}))]
    total = 0
    while todo:
        name, extras = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        dist = metadata.distribution(name)
        if key != "rewind":
            total += sum(os.path.getsize(dist.locate_file(f)) for f in dist.files or []
                         if os.path.isfile(dist.locate_file(f)))
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras or {""}):
                todo.append((req.name, frozenset(req.extras)))
    assert abs(total / 1e9 - float(stated.group(1))) <= 0.1 * float(stated.group(1)), total / 1e9
