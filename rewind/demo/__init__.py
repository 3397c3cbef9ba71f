"""``rewind demo``: record PPO on CartPole, SIGKILL it, recover from the log, and compare.

Three trainer processes (:mod:`rewind.demo.trainer`) run the same seeded job: one recorded
and killed at a random update, the same one resumed from the log to the end, and a
reference run that is never interrupted. The demo passes only if every state digest of the
resumed run equals the reference's, bit for bit.

The embedded demo writes to ``rewind-demo/`` (the run the README's examples address); a
demo on Kafka writes to ``rewind-demo-kafka/``, so that it never replaces the embedded run.
"""

from __future__ import annotations

import json
import random
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from eventlog import RunAddress, Target
from eventlog.errors import ConfigError, RewindError
from replayer.replay import replay

__all__ = ["DemoResult", "default_run_dir", "run_demo"]

SNAPSHOT_EVERY = 10


@dataclass(frozen=True)
class DemoResult:
    """The demo's verdict and the figures behind it (``rewind demo`` exits 0 when
    ``bit_exact``, 1 otherwise)."""

    bit_exact: bool
    killed_at: int
    recovered_version: int
    recovered_step: int
    final_digest_recovered: str
    final_digest_reference: str
    #: The options that name the recorded run to every other ``rewind`` command.
    run_args: tuple[str, ...] = ()


def default_run_dir(log: str | None = None) -> Path:
    """Where the demo writes when no directory is given: one directory per kind of log."""
    return Path("rewind-demo" if log is None or log.startswith("sqlite://") else "rewind-demo-kafka")


def run_args(address: RunAddress, run_dir: Path | None) -> tuple[str, ...]:
    """The options that name the recorded run to the other ``rewind`` commands: its
    directory for the demo's own embedded log (``run_dir``), else the log, coordinator and
    run id (readers find the snapshots through the log)."""
    if run_dir is not None:
        return ("--run-dir", str(run_dir))
    return ("--log", address.log_url, "--coord", address.coord_url, "--run", address.run_id)


def _digests(path: Path) -> dict[int, str]:
    if not path.exists():
        return {}
    return {int(row["step"]): str(row["digest"])
            for row in map(json.loads, path.read_text().splitlines())}


def _trainer(args: list[str], expect: int, progress: Progress, task: TaskID, updates: int) -> None:
    """Run one trainer process to exit status ``expect``, advancing ``task`` per update."""
    cmd = [sys.executable, "-m", "rewind.demo.trainer", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    tail: list[str] = []
    for line in proc.stdout:
        tail = [*tail[-19:], line.rstrip()]
        if line.startswith("update "):
            progress.update(task, completed=min(updates, int(line.split()[1]) + 1))
    rc = proc.wait()
    if rc != expect:
        raise RewindError(f"demo trainer exited with {rc}, expected {expect}: {' '.join(cmd)}\n"
                          + "\n".join(tail))


def run_demo(
    run_dir: Path | None = None,
    *,
    updates: int = 60,
    seed: int = 0,
    kill_at: int | None = None,
    log: str | None = None,
    coord: str | None = None,
    run: str | None = None,
    console: Console | None = None,
) -> DemoResult:
    """Run the whole demo in ``run_dir`` (default :func:`default_run_dir`) and print its table."""
    console = console or Console()
    run_dir = default_run_dir(log) if run_dir is None else run_dir
    if kill_at is None:
        kill_at = random.SystemRandom().randint(1, max(1, updates - 2))
    if not 0 <= kill_at < updates:
        raise ConfigError(f"--kill-at must be in [0, {updates}), got {kill_at}")
    crashed, reference = run_dir / "recorded", run_dir / "reference"
    for d in (crashed, reference):
        shutil.rmtree(d, ignore_errors=True)
    run_id = run or f"demo-{random.SystemRandom().randrange(16**8):08x}"
    log_url = log or f"sqlite://{(crashed / 'rewind.db').resolve()}"
    address = RunAddress(log_url, coord or log_url, run_id, f"file://{(crashed / 'snapshots').resolve()}")
    common = ["--updates", str(updates), "--seed", str(seed)]
    recorded = ["--run-dir", str(crashed), *common, "--digest-file", str(crashed / "digests.jsonl"),
                "--record", "--log", address.log_url, "--coord", address.coord_url, "--run", run_id,
                "--snapshot-every", str(SNAPSHOT_EVERY)]

    columns = (TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        t1 = progress.add_task(f"train (SIGKILL at update {kill_at})", total=updates)
        _trainer([*recorded, "--kill-at", str(kill_at)], -signal.SIGKILL, progress, t1, updates)
        progress.update(t1, description=f"train (killed at update {kill_at})")
        t2 = progress.add_task("recover from the log, continue", total=updates)
        _trainer(recorded, 0, progress, t2, updates)
        t3 = progress.add_task("reference run, never interrupted", total=updates)
        _trainer(["--run-dir", str(reference), *common, "--digest-file", str(reference / "digests.jsonl")],
                 0, progress, t3, updates)

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
    for k, v in (
        ("updates", str(updates)),
        ("killed (SIGKILL) during update", str(kill_at)),
        ("recovered version / step", f"{restored['version']} / {restored['step']}"),
        ("recovered from", restored.get("source") or "-"),
        ("events applied on recovery", str(restored["applied"])),
        ("events skipped on recovery", str(restored["skipped"])),
        ("recovery seconds", f"{restored['seconds']:.3f}"),
        ("replay of the log at the end: version / events applied", f"{report.version} / {report.applied}"),
        ("steps compared, mismatched", f"{len(same_steps)}, {len(mismatched)}"),
        ("final trainer digest, recovered run", final_got),
        ("final trainer digest, reference run", final_want),
    ):
        table.add_row(k, v)
    console.print(table)
    args = run_args(address, crashed if log is None else None)
    # A line of its own, never wrapped: it is there to be copied.
    console.print(f"the recorded run, for other commands: rewind history {shlex.join(args)}",
                  soft_wrap=True, markup=False, highlight=False)
    return DemoResult(exact, kill_at, restored["version"], restored["step"], final_got, final_want, args)

