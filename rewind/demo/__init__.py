"""``rewind demo``: record PPO on CartPole, SIGKILL it, recover from the log, and compare.

Three trainer subprocesses run the same seeded job: one recorded and killed at a random
update, the same one resumed from the log to the end, and a reference run that is never
interrupted. The demo passes only if every state digest of the resumed run equals the
reference's, bit for bit.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from eventlog import RunAddress, Target
from replayer.replay import replay


@dataclass(frozen=True)
class DemoResult:
    """The demo's verdict and the figures behind it."""

    bit_exact: bool
    killed_at: int
    recovered_version: int
    recovered_step: int
    final_digest_recovered: str
    final_digest_reference: str


def _digests(path: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out[int(row["step"])] = row["digest"]
    return out


def _trainer(args: list[str], progress: Progress, task: object, updates: int) -> int:
    """Run one trainer subprocess, advancing ``task`` on each finished update."""
    cmd = [sys.executable, "-m", "rewind.demo.ppo", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        tail = (tail + [line.rstrip()])[-20:]
        if line.startswith("update "):
            progress.update(task, completed=min(updates, int(line.split()[1]) + 1))  # type: ignore[arg-type]
    rc = proc.wait()
    if rc not in (0, -signal.SIGKILL, 137):
        raise RuntimeError(f"trainer {' '.join(args)} failed ({rc}):\n" + "\n".join(tail))
    return rc


def run_demo(
    run_dir: Path,
    *,
    updates: int = 60,
    seed: int = 0,
    kill_at: int | None = None,
    log: str | None = None,
    coord: str | None = None,
    run: str | None = None,
    snapshot_every: int = 10,
    console: Console | None = None,
) -> DemoResult:
    """Run the whole demo and print its table; returns the verdict."""
    console = console or Console()
    if kill_at is None:
        kill_at = random.SystemRandom().randint(1, max(1, updates - 2))
    if not 0 <= kill_at < updates:
        raise ValueError(f"--kill-at must be in [0, {updates}), got {kill_at}")
    crashed, reference = run_dir / "recorded", run_dir / "reference"
    for d in (crashed, reference):
        shutil.rmtree(d, ignore_errors=True)
    run_id = run or f"demo-{random.SystemRandom().randrange(16**8):08x}"
    log_url = log or f"sqlite://{(crashed / 'rewind.db').resolve()}"
    address = RunAddress(log_url, coord or log_url, run_id,
                         f"file://{(crashed / 'snapshots').resolve()}")
    common = ["--updates", str(updates), "--seed", str(seed), "--quiet-progress"]
    rec = ["--record", "--log", address.log_url, "--coord", address.coord_url, "--run", run_id,
           "--snapshots", f"file://{(crashed / 'snapshots').resolve()}",
           "--snapshot-every", str(snapshot_every)]

    columns = (TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        t1 = progress.add_task(f"train (SIGKILL at update {kill_at})", total=updates)
        _trainer(["--run-dir", str(crashed), *common, *rec, "--kill-at", str(kill_at),
                  "--digest-file", str(crashed / "digests.jsonl")], progress, t1, updates)
        progress.update(t1, description=f"train (killed at update {kill_at})")
        t2 = progress.add_task("recover from the log, continue", total=updates)
        _trainer(["--run-dir", str(crashed), *common, *rec,
                  "--digest-file", str(crashed / "digests.jsonl")], progress, t2, updates)
        t3 = progress.add_task("reference run, never interrupted", total=updates)
        _trainer(["--run-dir", str(reference), *common,
                  "--digest-file", str(reference / "digests.jsonl")], progress, t3, updates)

    restored = json.loads((crashed / "restore.json").read_text())
    _, report = replay(address, Target())
    got, want = _digests(crashed / "digests.jsonl"), _digests(reference / "digests.jsonl")
    same_steps = sorted(set(got) & set(want))
    mismatched = [s for s in same_steps if got[s] != want[s]]
    final_got, final_want = got.get(updates - 1, "missing"), want.get(updates - 1, "missing")
    exact = not mismatched and len(same_steps) == updates and final_got == final_want

    table = Table(title=f"rewind demo: PPO on CartPole-v1, run {run_id}")
    table.add_column("what")
    table.add_column("value", overflow="fold")
    rows = [
        ("updates", str(updates)),
        ("killed (SIGKILL) during update", str(kill_at)),
        ("recovered version / step", f"{restored['version']} / {restored['step']}"),
        ("recovered from", restored.get("source") or "-"),
        ("events applied on recovery", str(restored["applied"])),
        ("events skipped on recovery", str(restored["skipped"])),
        ("recovery seconds", f"{restored['seconds']:.3f}"),
        ("log at the end: versions / events", f"{report.version} / {report.applied}"),
        ("steps compared, mismatched", f"{len(same_steps)}, {len(mismatched)}"),
        ("final digest, recovered run", final_got),
        ("final digest, reference run", final_want),
        ("log", address.log_url),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    return DemoResult(exact, kill_at, restored["version"], restored["step"], final_got, final_want)
