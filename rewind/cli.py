"""The ``rewind`` command line: demo, recovery, time travel and audit.

Every command that reads a run takes the same address options: ``--run-dir DIR`` (an
embedded run, as the demo writes it) or ``--log URL --coord URL --run ID``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from eventlog import RewindError, RunAddress, Target
from replayer.replay import ReplayReport, replay, write_checkpoint
from rewind.allocator import tune_for_replay

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
console = Console()
err = Console(stderr=True)

RunDir = Annotated[Path | None, typer.Option("--run-dir", help="embedded run directory")]
LogUrl = Annotated[str | None, typer.Option("--log", help="log URL: sqlite://PATH or kafka://HOST:PORT")]
CoordUrl = Annotated[str | None, typer.Option("--coord", help="coordinator URL: sqlite://PATH or redis://HOST:PORT")]
RunId = Annotated[str | None, typer.Option("--run", help="run id")]
Snaps = Annotated[str | None, typer.Option("--snapshots", help="snapshot store URL (file://DIR); --run-dir implies DIR/snapshots")]
To = Annotated[str, typer.Option("--to", help="latest, version=V, step=N, gsn=G or offset=P")]
Workers = Annotated[int, typer.Option("--workers", help="shards replayed in parallel")]
AsJson = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def address_of(
    run_dir: Path | None, log: str | None, coord: str | None, run: str | None,
    snapshots: str | None = None,
) -> RunAddress:
    """The run the address options name."""
    if run_dir is not None:
        if log or coord:
            raise RewindError("give either --run-dir or --log/--coord, not both")
        address = RunAddress.from_run_dir(run_dir, run)
        return address if snapshots is None else RunAddress(
            address.log_url, address.coord_url, address.run_id, snapshots)
    if not log or not run:
        raise RewindError("name a run: --run-dir DIR, or --log URL [--coord URL] --run ID")
    return RunAddress(log, coord or log, run, snapshots)


def _replay_with_progress(address: RunAddress, target: Target, workers: int):  # type: ignore[no-untyped-def]
    with address.open_log() as log:
        total = sum(log.end_offset(p) - log.start_offset(p) for p in log.partitions())
    cols = (TextColumn("replaying {task.description}"), BarColumn(), TextColumn("{task.completed} msgs"),
            TimeElapsedColumn())
    with Progress(*cols, console=err, transient=True) as progress:
        task = progress.add_task(f"{address.run_id} to {target}", total=total)
        return replay(address, target, workers=workers,
                      on_bytes=lambda _n: progress.advance(task))


@app.command()
def demo(
    run_dir: Annotated[Path, typer.Option("--run-dir", help="where the demo writes its runs")] = Path("rewind-demo"),
    updates: Annotated[int, typer.Option(help="PPO updates")] = 60,
    seed: int = 0,
    kill_at: Annotated[int | None, typer.Option("--kill-at", help="update to SIGKILL in (default: random)")] = None,
    log: LogUrl = None,
    coord: CoordUrl = None,
    run: RunId = None,
) -> None:
    """Record PPO on CartPole, SIGKILL it, recover from the log, compare with an uninterrupted run."""
    from rewind.demo import run_demo

    result = run_demo(run_dir, updates=updates, seed=seed, kill_at=kill_at, log=log,
                      coord=coord, run=run, console=console)
    console.print(f"bit-exact: {'yes' if result.bit_exact else 'no'}", markup=False, highlight=False)
    raise typer.Exit(0 if result.bit_exact else 1)


@app.command("replay")
def replay_cmd(
    to: To = "latest", workers: Workers = 2, json_out: AsJson = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> None:
    """Rebuild and verify the state at a target; print what was applied and skipped."""
    address = address_of(run_dir, log, coord, run, snapshots)
    _, report = _replay_with_progress(address, Target.parse(to), workers)
    if json_out:
        console.print_json(json.dumps(report.to_json()))
        return
    table = Table(title=f"replay of {report.run_id} to {report.target}: verified")
    for col in ("version", "step", "applied", "skipped_by_snapshot", "skipped_duplicate",
                "skipped_unsealed", "MB", "seconds"):
        table.add_column(col, justify="right")
    table.add_row(str(report.version), str(report.step), str(report.applied),
                  str(report.skipped_by_snapshot), str(report.skipped_duplicate),
                  str(report.skipped_unsealed), f"{report.bytes / 1e6:.1f}", f"{report.seconds:.3f}")
    console.print(table)
    _explain_start(report)


def _explain_start(report: ReplayReport) -> None:
    for sid, why in report.passed_over:
        console.print(f"passed over snapshot {sid}: {why}", markup=False, highlight=False)
    source = report.snapshot or "the start of the log"
    console.print(f"started from {source}; replayed {report.tail_versions} versions of tail",
                  markup=False, highlight=False)


@app.command()
def recover(
    out: Annotated[Path, typer.Option("--out", help="checkpoint directory to write")],
    to: To = "latest", workers: Workers = 2,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> None:
    """Write a restorable checkpoint (torch state_dicts, msgpack states, recovery.json)."""
    address = address_of(run_dir, log, coord, run, snapshots)
    state, report = _replay_with_progress(address, Target.parse(to), workers)
    for path in write_checkpoint(state, report, out):
        console.print(f"wrote {path}")
    _explain_start(report)
    console.print(f"recovered version {report.version} (step {report.step}) in {report.seconds:.3f}s")


@app.command()
def history(
    json_out: AsJson = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
) -> None:
    """List versions, steps, times, metrics, snapshot markers, recoveries and writers."""
    from replayer.audit import history as run_history
    from replayer.audit import history_json

    address = address_of(run_dir, log, coord, run)
    _, rows = run_history(address)
    if json_out:
        console.print_json(json.dumps(history_json(rows)))
        return
    table = Table(title=f"history of {address.run_id} (--json for every field)")
    for col in ("kind", "version", "step", "time", "session", "detail", "metrics"):
        table.add_column(col, overflow="fold")
    for r in rows:
        metrics = " ".join(f"{k[:12]}={v:.3g}" for k, v in sorted(r.metrics.items())[:2])
        when = time.strftime("%H:%M:%S", time.localtime(r.time_ms / 1000))
        session = r.writer.rpartition("#")[2] if "#" in r.writer else r.writer
        detail = r.detail.replace("xor-delta/blosc2-zstd, ", "")
        table.add_row(r.kind, str(r.version), str(r.step), when, session, detail, metrics)
    console.print(table)


@app.command()
def export(
    out: Annotated[Path, typer.Option("--out", help="directory to write")],
    to: To = "latest",
    fmt: Annotated[str, typer.Option("--format", help="torch, safetensors or hf")] = "torch",
    config_hook: Annotated[str | None, typer.Option("--config-hook", help="module:function writing HF config.json")] = None,
    workers: Workers = 2,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> None:
    """Write the state at any reachable point (time travel) as torch, safetensors or HF."""
    from replayer.export import export as do_export

    address = address_of(run_dir, log, coord, run, snapshots)
    state, report = _replay_with_progress(address, Target.parse(to), workers)
    for path in do_export(state, report, out, fmt, config_hook):
        console.print(f"wrote {path}")
    console.print(f"exported version {report.version} (step {report.step})")


@app.command()
def diff(
    from_: Annotated[str, typer.Option("--from", help="first point, e.g. step=10")],
    to: To = "latest", json_out: AsJson = False, workers: Workers = 2,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> None:
    """Per tensor: how many elements changed, the L2 norm of the change, bit equality."""
    from replayer.audit import diff as run_diff

    address = address_of(run_dir, log, coord, run, snapshots)
    rows = run_diff(address, Target.parse(from_), Target.parse(to), workers=workers)
    if json_out:
        console.print_json(json.dumps([r.__dict__ for r in rows]))
        return
    table = Table(title=f"diff {from_} -> {to}")
    for col in ("tensor", "dtype", "shape", "changed", "L2 of change", "bit-equal"):
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(r.name, r.dtype, str(r.shape), str(r.changed), f"{r.l2:.6g}",
                      "yes" if r.bit_equal else "no")
    console.print(table)


@app.command()
def plot(
    out: Annotated[Path, typer.Option("--out", help="PNG file to write")],
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
) -> None:
    """Draw a PNG timeline of metrics, versions, snapshots and recoveries."""
    from replayer.audit import plot as run_plot

    console.print(f"wrote {run_plot(address_of(run_dir, log, coord, run), out)}")


@app.command()
def followers(
    json_out: AsJson = False,
    forget_silent_for: Annotated[float | None, typer.Option(
        "--forget-silent-for", help="first drop followers silent for more than SECONDS")] = None,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
) -> None:
    """List the run's followers (actors): the version each runs and its lag behind the newest.
    A follower drops its own entry when it closes; one that crashed stays until forgotten."""
    from replayer.follower import followers_table, forget_silent_followers

    address = address_of(run_dir, log, coord, run)
    forgotten = [] if forget_silent_for is None else forget_silent_followers(address, forget_silent_for)
    rows = followers_table(address)
    if json_out:
        console.print_json(json.dumps({"followers": rows, "forgotten": forgotten})
                           if forget_silent_for is not None else json.dumps(rows))
        return
    if forget_silent_for is not None:
        console.print(f"forgot {len(forgotten)} follower(s) silent for more than "
                      f"{forget_silent_for:g} s" + (f": {', '.join(forgotten)}" if forgotten else ""))
    table = Table(title=f"followers of {address.run_id}")
    for col in ("name", "version", "latest", "lag", "last report"):
        table.add_column(col, justify="left" if col == "name" else "right")
    for r in rows:
        table.add_row(r["name"], str(r["version"]), str(r["latest_version"]), str(r["lag"]),
                      f"{r['seconds_since_report']:.1f}s ago")
    console.print(table)


def _policies(every: int, seconds: float, keep: int, best: str | None, every_steps: int | None):  # type: ignore[no-untyped-def]
    from snapshotter.policies import every_seconds, every_versions, keep_best, keep_every, keep_last

    trigger = every_versions(every) | every_seconds(seconds)
    retention = keep_last(keep)
    if best:
        metric, _, rest = best.partition(":")
        k, _, mode = rest.partition(":")
        retention = retention | keep_best(int(k or 1), metric, mode or "max")
    if every_steps:
        retention = retention | keep_every(every_steps)
    return trigger, retention


Every = Annotated[int, typer.Option("--every-versions", help="snapshot every N versions")]
Seconds = Annotated[float, typer.Option("--every-seconds", help="or every S seconds")]
Keep = Annotated[int, typer.Option("--keep-last", help="keep the N newest snapshots")]
Best = Annotated[str | None, typer.Option("--keep-best", help="also keep the best: METRIC:K[:max|min]")]
EverySteps = Annotated[int | None, typer.Option("--keep-every", help="also keep one per M steps")]
History = Annotated[str, typer.Option("--history", help="keep-all, since-oldest-snapshot, or N steps")]
Holder = Annotated[str | None, typer.Option(
    "--holder", help="lease holder id; a restarted snapshotter with the same id takes its lease back "
                     "at once (default: a random id, which waits for the old lease to expire)")]


def _snapshotter(address: RunAddress, every: int, seconds: float, keep: int, best: str | None,
                 every_steps: int | None, history: str, holder: str | None):  # type: ignore[no-untyped-def]
    from snapshotter.service import Snapshotter, SnapshotterConfig
    from snapshotter.store import SnapshotStore

    if not address.snapshots_url:
        raise RewindError("no snapshot store: pass --snapshots file://DIR (or use --run-dir)")
    trigger, retention = _policies(every, seconds, keep, best, every_steps)
    config = SnapshotterConfig(trigger=trigger, retention=retention, history=history)
    return Snapshotter(address, SnapshotStore(address.snapshots_url), config, holder=holder,
                       on_event=lambda m: console.print(m, markup=False, highlight=False))


@app.command()
def snapshot(
    keep: Keep = 3, best: Best = None, every_steps: EverySteps = None, history: History = "keep-all",
    holder: Holder = None,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> None:
    """Write one snapshot of the newest sealed version now."""
    address = address_of(run_dir, log, coord, run, snapshots)
    with _snapshotter(address, 1, 0.0, keep, best, every_steps, history, holder) as snap:
        result = snap.snapshot(force=True)
    if result is None:
        console.print("nothing new to snapshot")
    else:
        console.print(f"snapshot {result.snapshot_id}: version {result.version}, step "
                      f"{result.step}, {result.seconds:.2f}s, deleted {len(result.deleted)}")


@app.command("snapshotter")
def snapshotter_cmd(
    every: Every = 100, seconds: Seconds = 600.0, keep: Keep = 3, best: Best = None,
    every_steps: EverySteps = None, history: History = "keep-all", holder: Holder = None,
    max_snapshots: Annotated[int | None, typer.Option("--max-snapshots", help="exit after N snapshots")] = None,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> None:
    """Follow the run's log and snapshot it on a policy (a lease allows one writer)."""
    from eventlog import FencedError

    address = address_of(run_dir, log, coord, run, snapshots)
    with _snapshotter(address, every, seconds, keep, best, every_steps, history, holder) as snap:
        try:
            snap.run(max_snapshots=max_snapshots)
        except FencedError as exc:
            print(f"fenced: {exc}", file=sys.stderr)
            raise typer.Exit(3) from None


@app.command()
def verify(
    json_out: AsJson = False, workers: Workers = 2,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> None:
    """Check every snapshot's files and digests and the log after them; non-zero on damage."""
    from snapshotter.verify import verify_run

    address = address_of(run_dir, log, coord, run, snapshots)
    report = verify_run(address, workers=workers)
    if json_out:
        console.print_json(json.dumps({"ok": report.ok, "findings": [f.__dict__ for f in report.findings]}))
    else:
        table = Table(title=f"verify {address.run_id}: {'ok' if report.ok else 'PROBLEMS FOUND'}")
        for col in ("subject", "status", "detail"):
            table.add_column(col, overflow="fold")
        for f in report.findings:
            table.add_row(f.subject, f.status, f.detail)
        console.print(table)
    raise typer.Exit(0 if report.ok else 1)


def main() -> None:
    """Console-script entry point: Rewind errors become one clear line and exit code 2."""
    tune_for_replay()  # this process is Rewind's own: let replayed payloads reuse memory
    try:
        app(standalone_mode=False)
    except RewindError as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":  # python -m rewind.cli, as the rewind script
    main()
