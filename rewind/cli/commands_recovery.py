"""Recovery commands: ``replay`` (rebuild and verify), ``recover`` (write a restorable
checkpoint) and ``export`` (time travel to torch, safetensors or HF)."""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from eventlog import ConfigError, RunAddress
from eventlog.settings import current
from rewind.cli.common import (
    OK,
    AsJson,
    CoordUrl,
    LogUrl,
    RunDir,
    RunId,
    Snaps,
    To,
    Workers,
    address_of,
    err,
    target_of,
)
from rewind.cli.output import emit_json, print_lines, table_lines

if TYPE_CHECKING:
    from eventlog import Target
    from eventlog.fold.engine import RebuiltState
    from replayer.replay import ReplayReport


def replay_with_progress(address: RunAddress, target: Target,
                          workers: int) -> tuple[RebuiltState, ReplayReport]:
    from replayer.replay import replay

    with address.open_log() as log:
        total = sum(log.end_offset(p) - log.start_offset(p) for p in log.partitions())
    cols = (TextColumn("replaying {task.description}"), BarColumn(), TextColumn("{task.completed} msgs"),
            TimeElapsedColumn())
    # Drawn on a terminal only: a pipe or a log file gets no progress lines.
    with Progress(*cols, console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task(f"{address.run_id} to {target}", total=total)
        return replay(address, target, workers=workers,
                      on_bytes=lambda _n: progress.advance(task),
                      share_torch_threads=current().replay_torch_threads)


def report_lines(report: ReplayReport, verb: str) -> list[str]:
    rows = [
        ("version / step", f"{report.version} / {report.step}"),
        ("events applied", str(report.applied)),
        ("skipped: below the start snapshot", str(report.skipped_by_snapshot)),
        ("skipped: duplicates", str(report.skipped_duplicate)),
        ("skipped: never sealed", str(report.skipped_unsealed)),
        ("read", f"{report.bytes / 1e6:.1f} MB in {report.seconds:.3f} s"),
        ("state digest", report.state_digest),
    ]
    lines = [f"{verb} {report.run_id} to {report.target}: verified against its seal"]
    lines += table_lines(("", ""), rows, flex=1)[1:]
    lines += [f"passed over snapshot {sid}: {why}" for sid, why in report.passed_over]
    source = report.snapshot or "the start of the log"
    lines.append(f"started from {source}; replayed {report.tail_versions} versions of tail")
    return lines


def replay_cmd(
    to: To = "latest", workers: Workers = 2, json_out: AsJson = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> int:
    """Rebuild and verify the state at a target; print what was applied and skipped."""
    target = target_of(to)
    address = address_of(run_dir, log, coord, run, snapshots, read_only=True)
    _, report = replay_with_progress(address, target, workers)
    if json_out:
        emit_json("replay", True, report=report.to_json())
    else:
        print_lines(report_lines(report, "replay of"))
    return OK


Overwrite = Annotated[bool, typer.Option(
    "--overwrite", help="replace a non-empty --out directory: what it holds is removed once the "
                        "new files are written")]


def out_dir(out: Path, overwrite: bool) -> None:
    """Refuse, before any replay, an ``--out`` that is a file, or a directory that holds
    anything unless ``overwrite`` (the new files would mix with the old ones)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: name the directory to write")
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty: name a new or empty directory, or pass "
                          "--overwrite to replace what it holds")
    if overwrite and Path.cwd().resolve().is_relative_to(out.resolve()):
        raise ConfigError(f"--out {out} holds the current directory: --overwrite would remove it")


@contextmanager
def written_into(out: Path) -> Iterator[Path]:
    """The directory to write ``out``'s files in: ``out`` itself when it is new or empty,
    else a new directory beside it that replaces ``out`` once every file is written (a
    failure leaves ``out`` as it was)."""
    if not out.is_dir() or not any(out.iterdir()):
        yield out
        return
    token = secrets.token_hex(4)
    staging, old = out.parent / f".{out.name}.new-{token}", out.parent / f".{out.name}.old-{token}"
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    out.rename(old)
    staging.rename(out)
    shutil.rmtree(old)


def moved(files: list[Path], written: Path, out: Path) -> list[Path]:
    """``files``, written under ``written``, as they are named once in ``out``."""
    return [out / p.relative_to(written) for p in files]


def recover(
    out: Annotated[Path, typer.Option("--out", help="checkpoint directory to write (new or empty)")],
    to: To = "latest", workers: Workers = 2, overwrite: Overwrite = False, json_out: AsJson = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> int:
    """Write a restorable checkpoint (torch state_dicts, msgpack states, recovery.json)."""
    from replayer.replay import write_checkpoint

    out_dir(out, overwrite)
    target = target_of(to)
    address = address_of(run_dir, log, coord, run, snapshots, read_only=True)
    state, report = replay_with_progress(address, target, workers)
    with written_into(out) as where:
        files = moved(write_checkpoint(state, report, where), where, out)
    if json_out:
        emit_json("recover", True, report=report.to_json(), files=[str(p) for p in files])
        return OK
    print_lines([*(f"wrote {p}" for p in files), *report_lines(report, "recovered")])
    return OK


def export(
    out: Annotated[Path, typer.Option("--out", help="directory to write (new or empty)")],
    to: To = "latest",
    fmt: Annotated[str, typer.Option("--format", help="torch, safetensors or hf")] = "torch",
    config_hook: Annotated[str | None, typer.Option(
        "--config-hook",
        help="module:function writing HF config.json (default: the config the run recorded)")] = None,
    workers: Workers = 2, overwrite: Overwrite = False, json_out: AsJson = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> int:
    """Write the state at any reachable point (time travel) as torch, safetensors or HF."""
    from replayer.export import FORMATS, load_hook
    from replayer.export import export as do_export

    if fmt not in FORMATS:  # before the replay, which may take long
        raise ConfigError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    if config_hook:
        load_hook(config_hook)
    out_dir(out, overwrite)
    target = target_of(to)
    address = address_of(run_dir, log, coord, run, snapshots, read_only=True)
    state, report = replay_with_progress(address, target, workers)
    with written_into(out) as where:
        files = moved(do_export(state, report, where, fmt, config_hook), where, out)
    if json_out:
        emit_json("export", True, report=report.to_json(), format=fmt, files=[str(p) for p in files])
        return OK
    lacking = fmt == "hf" and not any(p.name == "config.json" for p in files)
    print_lines([*(f"wrote {p}" for p in files),
                 f"exported version {report.version} (step {report.step}) as {fmt}",
                 *(["no config.json: the run recorded no model config (--config-hook writes one)"]
                   if lacking else [])])
    return OK
