"""Audit commands: ``history``, ``diff``, ``plot`` and ``followers``."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from rewind.cli.common import (
    CHECK_FAILED,
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
    checked_target,
    target_of,
)
from rewind.cli.output import add_notes, count, emit_json, print_lines, say, table_lines

if TYPE_CHECKING:
    from replayer.audit import HistoryRow


def codec_label(encoding: str) -> str:
    """The codec family of an encoding text (``predictive``, ``xor-delta``, ...)."""
    return re.split(r"[/ (]", encoding, maxsplit=1)[0] or "-"


def metrics_text(metrics: Mapping[str, float]) -> str:
    """A version's metrics as ``name=value`` words; names in a group (SB3's ``train/...``,
    ``rollout/...``) follow their group's name, given once: ``loss=0.5 train: kl=0.01 n=4``."""
    groups: dict[str, list[str]] = {}
    for name, value in sorted(metrics.items()):
        group, _, short = name.rpartition("/")
        groups.setdefault(group, []).append(f"{short}={value:.4g}")
    words = groups.pop("", [])
    for group, items in groups.items():
        words += [f"{group}:", *items]
    return " ".join(words) or "-"


def history_lines(run_id: str, rows: Sequence[HistoryRow]) -> list[str]:
    """The history table: a line per version (metrics wrapped, never cut), snapshot markers
    and recoveries as lines of their own; each distinct encoding once, as a numbered note."""
    notes: dict[str, int] = {}
    cells: list[tuple[str, ...]] = []
    counts = {"version": 0, "snapshot-end": 0, "recovery": 0, "resume": 0}
    for r in rows:
        counts[r.kind] = counts.get(r.kind, 0) + 1
        when = time.strftime("%H:%M:%S", time.localtime(r.time_ms / 1000))
        head = (str(r.version), str(r.step), when)
        if r.kind == "version":
            note = notes.setdefault(r.encoding, len(notes) + 1)
            metrics = metrics_text(r.metrics)
            ratio = "-" if r.of_raw is None else f"{r.of_raw:.0%}"
            cells.append((*head, f"{codec_label(r.encoding)} [{note}]", ratio, metrics))
        elif r.kind == "recovery":
            cells.append((*head, f"recovery: {r.detail}"))
        elif r.kind == "resume":
            cells.append((*head, f"resume: {r.detail}"))
        else:
            verb = "begun" if r.kind == "snapshot-begin" else "published"
            cells.append((*head, f"snapshot {r.detail} {verb} by {r.writer}"))
    title = (f"history of {run_id}: {count(counts['version'], 'version')}, "
             f"{count(counts['snapshot-end'], 'snapshot')}, "
             f"{count(counts['recovery'], 'recovery', 'recoveries')}"
             + (f", {count(counts['resume'], 'resume')}" if counts["resume"] else "")
             + " (--json for every field)")
    lines = [title, *table_lines(("version", "step", "time", "codec", "of raw", "metrics"), cells,
                                 flex=5, right=(0, 1, 4))]
    add_notes(lines, notes)
    return lines


def history(
    json_out: AsJson = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
) -> int:
    """List versions, steps, times, metrics, snapshot markers, recoveries and writers."""
    from replayer.audit import history as run_history
    from replayer.audit import history_json

    address = address_of(run_dir, log, coord, run, read_only=True)
    _, rows = run_history(address)
    if json_out:
        emit_json("history", True, run=address.run_id, rows=history_json(rows))
    else:
        print_lines(history_lines(address.run_id, rows))
    return OK


def diff(
    from_: Annotated[str, typer.Option("--from", callback=checked_target, help="first point, e.g. step=10")],
    to: To = "latest", json_out: AsJson = False, workers: Workers = 2,
    exit_code: Annotated[bool, typer.Option("--exit-code", help="exit 1 if any tensor differs")] = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> int:
    """Per tensor: how many elements changed, the L2 norm of the change, bit equality."""
    from replayer.audit import diff as run_diff

    a, b = target_of(from_), target_of(to)
    address = address_of(run_dir, log, coord, run, snapshots, read_only=True)
    rows = run_diff(address, a, b, workers=workers)
    differs = any(not r.bit_equal for r in rows)
    status = CHECK_FAILED if exit_code and differs else OK
    if json_out:
        emit_json("diff", status == OK, **{"from": str(a), "to": str(b)}, differs=differs,
                   tensors=[dataclasses.asdict(r) for r in rows])
        return status
    cells = [(r.name, r.dtype, "x".join(map(str, r.shape)) or "scalar", str(r.changed),
              "-" if math.isnan(r.l2) else f"{r.l2:.4g}", "yes" if r.bit_equal else "no") for r in rows]
    changed = sum(not r.bit_equal for r in rows)
    print_lines([f"diff {a} -> {b}: {changed} of {len(rows)} tensors changed",
                  *table_lines(("tensor", "dtype", "shape", "changed", "L2 of change", "bit-equal"),
                               cells, flex=0, right=(3, 4))])
    return status


def plot(
    out: Annotated[Path, typer.Option(
        "--out", help="PNG file to write (.png is added to a name without a suffix)")],
    json_out: AsJson = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
) -> int:
    """Draw a PNG timeline of metrics, versions, snapshots and recoveries."""
    from replayer.audit import plot as run_plot

    address = address_of(run_dir, log, coord, run, read_only=True)
    path = run_plot(address, out)
    if json_out:
        emit_json("plot", True, run=address.run_id, file=str(path))
    else:
        say(f"wrote {path}")
    return OK


def followers(
    json_out: AsJson = False,
    forget_silent_for: Annotated[float | None, typer.Option(
        "--forget-silent-for", help="first drop followers silent for more than SECONDS")] = None,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
) -> int:
    """List the run's followers (actors): the version each runs and its lag behind the newest.
    A follower drops its own entry when it closes; one that crashed stays until forgotten."""
    from replayer.follower import followers_table, forget_silent_followers

    address = address_of(run_dir, log, coord, run, read_only=forget_silent_for is None)
    forgotten = [] if forget_silent_for is None else forget_silent_followers(address, forget_silent_for)
    rows = followers_table(address)
    if json_out:
        emit_json("followers", True, run=address.run_id, followers=rows, forgotten=forgotten)
        return OK
    lines = []
    if forget_silent_for is not None:
        lines.append(f"forgot {len(forgotten)} follower(s) silent for more than {forget_silent_for:g} s"
                     + (f": {', '.join(forgotten)}" if forgotten else ""))
    lines.append(f"followers of {address.run_id}: {len(rows)}")
    cells = [(r["name"], str(r["version"]), str(r["latest_version"]), str(r["lag"]),
              f"{r['seconds_since_report']:.1f} s ago") for r in rows]
    if cells:
        lines += table_lines(("name", "version", "latest", "lag", "last report"), cells, flex=0,
                             right=(1, 2, 3, 4))
    print_lines(lines)
    return OK
