"""The ``rewind`` command line: demo, recovery, time travel and audit.

Every command that reads a run takes the same address options: ``--run-dir DIR`` (an
embedded run, as the demo writes it) or ``--log URL --coord URL --run ID``. Commands that
only read (replay, recover, history, export, diff, plot, followers, verify) create nothing:
a log or snapshot store that does not exist is an error, not a new empty one.

Exit status, for every command: 0 success. 1 the command ran and its check failed
(``verify`` found damage, ``demo`` was not bit-exact, ``diff --exit-code`` found a
difference). 2 a usage error (unknown command or option, a missing or bad value) or a
Rewind error (no such run, damaged data, an unreachable server): one line on stderr,
``error: <kind>: <what and where>``, no traceback. 130 interrupted (Ctrl-C). Anything
else is a bug.

An unreachable Kafka broker or Redis server fails within 5 seconds of the first contact.

``--json``, on every command: stdout holds one JSON object, ``{"command": NAME, "ok": BOOL,
...}``, where ``ok`` is false exactly when the exit status is 1; errors stay one line on
stderr. The other keys, per command: demo: ``bit_exact killed_at recovered_version
recovered_step final_digest_recovered final_digest_reference``. replay: ``report`` (the
replay report). recover: ``report files``. export: ``report format files``. history:
``run rows`` (each: ``kind version step gsn time_ms writer detail metrics encoding
of_raw``). diff: ``from to differs tensors`` (each: ``name dtype shape changed l2
bit_equal``; ``l2`` is null for tensors that cannot be compared). plot: ``run file``.
followers: ``run followers forgotten``. snapshot: ``run snapshot`` (null when nothing was
new). snapshotter: ``run written``. verify: ``run findings`` (each: ``subject status
detail``), plus what else the patrol reports.

Process-wide tuning happens here only, in the CLI's own process: ``main()`` fixes glibc's
mmap threshold (``rewind.allocator``; ``REWIND_MALLOC_MMAP_THRESHOLD=0`` leaves malloc
alone), and replays divide torch's threads among their workers
(``REWIND_REPLAY_TORCH_THREADS=0`` turns it off). Library calls change neither.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from eventlog import ConfigError, RewindError, RunAddress, Target
from eventlog.settings import current
from replayer.replay import ReplayReport, replay, write_checkpoint
from rewind.allocator import tune_for_replay

if TYPE_CHECKING:
    from eventlog.fold.engine import RebuiltState
    from replayer.audit import HistoryRow
    from snapshotter.policies import Retention, Trigger
    from snapshotter.service import Snapshotter

#: Exit statuses (see the module docstring).
OK, CHECK_FAILED, ERROR = 0, 1, 2


def _help(doc: str) -> str:
    """The docstring as ``--help`` text: each paragraph one line (the terminal wraps it)."""
    return "\n\n".join(" ".join(p.split()).replace("``", "") for p in doc.strip().split("\n\n"))


app = typer.Typer(add_completion=False, help=_help(__doc__ or ""), pretty_exceptions_enable=False)
console = Console()
err = Console(stderr=True)

RunDir = Annotated[Path | None, typer.Option("--run-dir", help="embedded run directory")]
LogUrl = Annotated[str | None, typer.Option("--log", help="log URL: sqlite://PATH or kafka://HOST:PORT")]
CoordUrl = Annotated[str | None, typer.Option("--coord", help="coordinator URL: sqlite://PATH or redis://HOST:PORT")]
RunId = Annotated[str | None, typer.Option("--run", help="run id")]
Snaps = Annotated[str | None, typer.Option(
    "--snapshots", help="snapshot store URL (file://DIR); --run-dir implies DIR/snapshots")]
To = Annotated[str, typer.Option("--to", help="latest, version=V, step=N, gsn=G or offset=P")]
Workers = Annotated[int, typer.Option("--workers", min=1, help="shards replayed in parallel")]
AsJson = Annotated[bool, typer.Option("--json", help="print one JSON object (shape: rewind --help)")]


def address_of(
    run_dir: Path | None, log: str | None, coord: str | None, run: str | None,
    snapshots: str | None = None, *, read_only: bool = False,
) -> RunAddress:
    """The run the address options name. ``read_only``: for a command that only reads, so
    the embedded log is opened read-only and a snapshot store given must exist."""
    if run_dir is not None:
        if log or coord:
            raise ConfigError("give either --run-dir or --log/--coord, not both")
        address = RunAddress.from_run_dir(run_dir, run)
        if snapshots is not None:
            address = dataclasses.replace(address, snapshots_url=snapshots)
    elif not log or not run:
        raise ConfigError("name a run: --run-dir DIR, or --log URL [--coord URL] --run ID")
    else:
        address = RunAddress(log, coord or log, run, snapshots)
    if read_only and snapshots is not None:
        from snapshotter.store import SnapshotStore

        root = SnapshotStore(snapshots).root
        if not root.is_dir():
            raise ConfigError(f"no snapshot store at {root}: the directory does not exist")
    return dataclasses.replace(address, read_only=read_only)


# ---------------------------------------------------------------------------- output
def _width() -> int:
    """The terminal's width (``COLUMNS``, else 80 when not a terminal)."""
    return max(40, shutil.get_terminal_size((80, 24)).columns)


def say(text: str, *, to_stderr: bool = False) -> None:
    """One message line, printed as is (no markup; long paths are not broken)."""
    print(text, file=sys.stderr if to_stderr else sys.stdout, flush=True)


def _emit_json(command: str, ok: bool, **fields: Any) -> None:
    """The command's one JSON object on stdout (NaN and infinities become null)."""
    print(json.dumps(_finite({"command": command, "ok": ok, **fields}), indent=2, allow_nan=False))


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _wrap(text: str, width: int) -> list[str]:
    """``text`` wrapped at spaces only: a name longer than ``width`` gets a line of its own."""
    return textwrap.wrap(text, max(1, width), break_long_words=False, break_on_hyphens=False) or [""]


def table_lines(headers: Sequence[str], rows: Sequence[Sequence[str]], *, flex: int,
                right: Sequence[int] = (), width: int | None = None) -> list[str]:
    """A plain table that fits ``width`` (default: the terminal): columns two spaces apart,
    each as wide as its widest cell, except column ``flex``, which takes the room that is
    left and wraps its cells at spaces, never inside a word. If a word of the last column
    does not fit there, that column's cells go on indented lines below their rows. A row
    with fewer cells than there are headers ends with a cell that spans the remaining
    columns (wrapped alike)."""
    width = width or _width()
    n = len(headers)
    full = [r for r in rows if len(r) == n]
    widths = [max([len(headers[i]), *(len(r[i]) for r in full)]) for i in range(n)]
    room = width - sum(w for i, w in enumerate(widths) if i != flex) - 2 * (n - 1)
    longest_word = max([len(headers[flex]), *(len(w) for r in full for w in r[flex].split())])
    below = flex == n - 1 and longest_word > room
    widths[flex] = len(headers[flex]) if below else max(longest_word, min(widths[flex], room))

    def cells_of(cells: Sequence[str]) -> list[str]:
        return [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)]

    lines = ["  ".join(cells_of(headers)).rstrip()]
    for r in rows:
        if len(r) < n:  # the last cell spans to the end of the line
            head = "".join(f"{c}  " for c in cells_of(r[:-1]))
            for k, part in enumerate(_wrap(r[-1], width - len(head))):
                lines.append((head if k == 0 else " " * len(head)) + part)
            continue
        if below:
            lines.append("  ".join(cells_of([*r[:-1], ""])).rstrip())
            lines += [f"    {part}" for part in _wrap(r[flex], width - 4)]
            continue
        for k, part in enumerate(_wrap(r[flex], widths[flex])):
            row = [part if i == flex else (c if k == 0 else "") for i, c in enumerate(r)]
            lines.append("  ".join(cells_of(row)).rstrip())
    return lines


def _print_lines(lines: Sequence[str]) -> None:
    """Print ``lines``; one longer than the terminal (a title naming a long run id, say) is
    wrapped at spaces, never inside a word."""
    width = _width()
    out = [part for ln in lines for part in (_wrap(ln, width) if len(ln) > width else [ln])]
    sys.stdout.write("".join(f"{ln}\n" for ln in out))
    sys.stdout.flush()


def _notes(lines: list[str], notes: dict[str, int]) -> None:
    """Numbered notes below a table (each long text once, not on every row)."""
    width = _width()
    for text, k in notes.items():
        lines.extend(textwrap.wrap(f"[{k}] {text}", width, subsequent_indent="    ",
                                   break_long_words=False, break_on_hyphens=False))


# ---------------------------------------------------------------------------- replay
def _replay_with_progress(address: RunAddress, target: Target,
                          workers: int) -> tuple[RebuiltState, ReplayReport]:
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


def _report_lines(report: ReplayReport, verb: str) -> list[str]:
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


@app.command("replay")
def replay_cmd(
    to: To = "latest", workers: Workers = 2, json_out: AsJson = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> int:
    """Rebuild and verify the state at a target; print what was applied and skipped."""
    target = Target.parse(to)
    address = address_of(run_dir, log, coord, run, snapshots, read_only=True)
    _, report = _replay_with_progress(address, target, workers)
    if json_out:
        _emit_json("replay", True, report=report.to_json())
    else:
        _print_lines(_report_lines(report, "replay of"))
    return OK


@app.command()
def recover(
    out: Annotated[Path, typer.Option("--out", help="checkpoint directory to write")],
    to: To = "latest", workers: Workers = 2, json_out: AsJson = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> int:
    """Write a restorable checkpoint (torch state_dicts, msgpack states, recovery.json)."""
    target = Target.parse(to)
    address = address_of(run_dir, log, coord, run, snapshots, read_only=True)
    state, report = _replay_with_progress(address, target, workers)
    files = write_checkpoint(state, report, out)
    if json_out:
        _emit_json("recover", True, report=report.to_json(), files=[str(p) for p in files])
        return OK
    _print_lines([*(f"wrote {p}" for p in files), *_report_lines(report, "recovered")])
    return OK


@app.command()
def export(
    out: Annotated[Path, typer.Option("--out", help="directory to write")],
    to: To = "latest",
    fmt: Annotated[str, typer.Option("--format", help="torch, safetensors or hf")] = "torch",
    config_hook: Annotated[str | None, typer.Option(
        "--config-hook", help="module:function writing HF config.json")] = None,
    workers: Workers = 2, json_out: AsJson = False,
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
    target = Target.parse(to)
    address = address_of(run_dir, log, coord, run, snapshots, read_only=True)
    state, report = _replay_with_progress(address, target, workers)
    files = do_export(state, report, out, fmt, config_hook)
    if json_out:
        _emit_json("export", True, report=report.to_json(), format=fmt, files=[str(p) for p in files])
        return OK
    _print_lines([*(f"wrote {p}" for p in files),
                  f"exported version {report.version} (step {report.step}) as {fmt}"])
    return OK


# ---------------------------------------------------------------------------- audit
def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _codec_label(encoding: str) -> str:
    """The codec family of an encoding text (``predictive``, ``xor-delta``, ...)."""
    return re.split(r"[/ (]", encoding, maxsplit=1)[0] or "-"


def history_lines(run_id: str, rows: Sequence[HistoryRow]) -> list[str]:
    """The history table: a line per version (metrics wrapped, never cut), snapshot markers
    and recoveries as lines of their own; each distinct encoding once, as a numbered note."""
    notes: dict[str, int] = {}
    cells: list[tuple[str, ...]] = []
    counts = {"version": 0, "snapshot-end": 0, "recovery": 0}
    for r in rows:
        counts[r.kind] = counts.get(r.kind, 0) + 1
        when = time.strftime("%H:%M:%S", time.localtime(r.time_ms / 1000))
        head = (str(r.version), str(r.step), when)
        if r.kind == "version":
            note = notes.setdefault(r.encoding, len(notes) + 1)
            metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(r.metrics.items())) or "-"
            ratio = "-" if r.of_raw is None else f"{r.of_raw:.0%}"
            cells.append((*head, f"{_codec_label(r.encoding)} [{note}]", ratio, metrics))
        elif r.kind == "recovery":
            cells.append((*head, f"recovery: {r.detail}"))
        else:
            verb = "begun" if r.kind == "snapshot-begin" else "published"
            cells.append((*head, f"snapshot {r.detail} {verb} by {r.writer}"))
    title = (f"history of {run_id}: {_count(counts['version'], 'version')}, "
             f"{_count(counts['snapshot-end'], 'snapshot')}, "
             f"{_count(counts['recovery'], 'recovery', 'recoveries')} (--json for every field)")
    lines = [title, *table_lines(("version", "step", "time", "codec", "of raw", "metrics"), cells,
                                 flex=5, right=(0, 1, 4))]
    _notes(lines, notes)
    return lines


@app.command()
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
        _emit_json("history", True, run=address.run_id, rows=history_json(rows))
    else:
        _print_lines(history_lines(address.run_id, rows))
    return OK


@app.command()
def diff(
    from_: Annotated[str, typer.Option("--from", help="first point, e.g. step=10")],
    to: To = "latest", json_out: AsJson = False, workers: Workers = 2,
    exit_code: Annotated[bool, typer.Option("--exit-code", help="exit 1 if any tensor differs")] = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> int:
    """Per tensor: how many elements changed, the L2 norm of the change, bit equality."""
    from replayer.audit import diff as run_diff

    a, b = Target.parse(from_), Target.parse(to)
    address = address_of(run_dir, log, coord, run, snapshots, read_only=True)
    rows = run_diff(address, a, b, workers=workers)
    differs = any(not r.bit_equal for r in rows)
    status = CHECK_FAILED if exit_code and differs else OK
    if json_out:
        _emit_json("diff", status == OK, **{"from": str(a), "to": str(b)}, differs=differs,
                   tensors=[dataclasses.asdict(r) for r in rows])
        return status
    cells = [(r.name, r.dtype, "x".join(map(str, r.shape)) or "scalar", str(r.changed),
              "-" if math.isnan(r.l2) else f"{r.l2:.4g}", "yes" if r.bit_equal else "no") for r in rows]
    changed = sum(not r.bit_equal for r in rows)
    _print_lines([f"diff {a} -> {b}: {changed} of {len(rows)} tensors changed",
                  *table_lines(("tensor", "dtype", "shape", "changed", "L2 of change", "bit-equal"),
                               cells, flex=0, right=(3, 4))])
    return status


@app.command()
def plot(
    out: Annotated[Path, typer.Option("--out", help="PNG file to write")],
    json_out: AsJson = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
) -> int:
    """Draw a PNG timeline of metrics, versions, snapshots and recoveries."""
    from replayer.audit import plot as run_plot

    address = address_of(run_dir, log, coord, run, read_only=True)
    path = run_plot(address, out)
    if json_out:
        _emit_json("plot", True, run=address.run_id, file=str(path))
    else:
        say(f"wrote {path}")
    return OK


@app.command()
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
        _emit_json("followers", True, run=address.run_id, followers=rows, forgotten=forgotten)
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
    _print_lines(lines)
    return OK


# ---------------------------------------------------------------------------- snapshots
def _policies(every: int, seconds: float, keep: int | None, best: str | None,
              every_steps: int | None) -> tuple[Trigger, Retention]:
    """The trigger, and the union of the retention options given (none given: keep all)."""
    from snapshotter.policies import every_seconds, every_versions, keep_all, keep_best, keep_every, keep_last

    trigger = every_versions(every) | every_seconds(seconds)
    retention = keep_all() if keep is None else keep_last(keep)
    if keep is None and (best or every_steps is not None):
        retention = keep_last(0)  # the other options alone say what to keep
    if best:
        metric, _, rest = best.partition(":")
        k, _, mode = rest.partition(":")
        if not metric or not (k or "1").isdigit():
            raise ConfigError(f"--keep-best {best!r}: use METRIC:K[:max|min], e.g. reward:2:max")
        retention = retention | keep_best(int(k or 1), metric, mode or "max")
    if every_steps is not None:
        retention = retention | keep_every(every_steps)
    return trigger, retention


Every = Annotated[int, typer.Option("--every-versions", min=1, help="snapshot every N versions")]
Seconds = Annotated[float, typer.Option("--every-seconds", min=0.0, help="or every S seconds")]
Keep = Annotated[int, typer.Option("--keep-last", min=0, help="keep the N newest snapshots")]
KeepNow = Annotated[int | None, typer.Option(
    "--keep-last", min=0, help="delete all but the N newest snapshots (default: delete none, unless "
                        "--keep-best or --keep-every is given)")]
Best = Annotated[str | None, typer.Option("--keep-best", help="also keep the best: METRIC:K[:max|min]")]
EverySteps = Annotated[int | None, typer.Option("--keep-every", min=1, help="also keep one per M steps")]
History = Annotated[str, typer.Option("--history", help="keep-all, since-oldest-snapshot, or N steps")]
Holder = Annotated[str | None, typer.Option(
    "--holder", help="lease holder id; a restarted snapshotter with the same id takes its lease back "
                     "at once (default: a random id, which waits for the old lease to expire)")]


def _snapshotter(address: RunAddress, every: int, seconds: float, keep: int | None, best: str | None,
                 every_steps: int | None, history: str, holder: str | None,
                 on_event: Callable[[str], None]) -> Snapshotter:
    from snapshotter.service import Snapshotter, SnapshotterConfig
    from snapshotter.store import SnapshotStore

    if not address.snapshots_url:
        raise ConfigError("no snapshot store: pass --snapshots file://DIR (or use --run-dir)")
    trigger, retention = _policies(every, seconds, keep, best, every_steps)
    config = SnapshotterConfig(trigger=trigger, retention=retention, history=history)
    return Snapshotter(address, SnapshotStore(address.snapshots_url), config, holder=holder,
                       on_event=on_event)


@app.command()
def snapshot(
    keep: KeepNow = None, best: Best = None, every_steps: EverySteps = None, history: History = "keep-all",
    holder: Holder = None, json_out: AsJson = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> int:
    """Write one snapshot of the newest sealed version now; deletes no older snapshot
    unless a retention option (--keep-last, --keep-best, --keep-every) is given."""
    address = address_of(run_dir, log, coord, run, snapshots)
    with dataclasses.replace(address, read_only=True).open_log():
        pass  # the run's log must exist: a snapshot of nothing creates nothing
    with _snapshotter(address, 1, 0.0, keep, best, every_steps, history, holder,
                      lambda m: say(m, to_stderr=json_out)) as snap:
        result = snap.snapshot(force=True)
    if json_out:
        _emit_json("snapshot", True, run=address.run_id,
                   snapshot=None if result is None else dataclasses.asdict(result))
    elif result is None:
        say("nothing new to snapshot")
    else:
        say(f"snapshot {result.snapshot_id}: version {result.version}, step {result.step}, "
            f"{result.seconds:.2f} s, deleted {len(result.deleted)}")
    return OK


@app.command("snapshotter")
def snapshotter_cmd(
    every: Every = 100, seconds: Seconds = 600.0, keep: Keep = 3, best: Best = None,
    every_steps: EverySteps = None, history: History = "keep-all", holder: Holder = None,
    max_snapshots: Annotated[int | None, typer.Option(
        "--max-snapshots", min=1, help="exit after N snapshots")] = None,
    json_out: AsJson = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> int:
    """Follow the run's log and snapshot it on a policy (a lease allows one writer); a
    snapshotter fenced by another one stops with a FencedError (exit 2)."""
    address = address_of(run_dir, log, coord, run, snapshots)
    with _snapshotter(address, every, seconds, keep, best, every_steps, history, holder,
                      lambda m: say(m, to_stderr=json_out)) as snap:
        written = snap.run(max_snapshots=max_snapshots)
    if json_out:
        _emit_json("snapshotter", True, run=address.run_id, written=written)
    return OK


@app.command()
def verify(
    json_out: AsJson = False, workers: Workers = 2,
    deep: Annotated[bool, typer.Option(
        "--deep", help="also check every version's shard digests against its seal")] = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> int:
    """Check every kept snapshot and every version a replay can reach; exit 1 on damage."""
    from snapshotter.verify import verify_run

    address = address_of(run_dir, log, coord, run, snapshots, read_only=True)
    report = verify_run(address, workers=workers, deep=deep)
    status = OK if report.ok else CHECK_FAILED
    if json_out:
        _emit_json("verify", report.ok, **{**dataclasses.asdict(report), "run": address.run_id,
                                           "findings": [dataclasses.asdict(f) for f in report.findings]})
        return status
    width = _width()
    lines = [f"verify {address.run_id}: {'ok' if report.ok else 'PROBLEMS FOUND'}"]
    for f in report.findings:
        text = textwrap.wrap(f"{f.subject}: {f.detail}", width - 6, break_long_words=False,
                             break_on_hyphens=False)
        lines += [f"{f.status if k == 0 else '':<4}  {part}" for k, part in enumerate(text)]
    _print_lines(lines)
    return status


@app.command()
def demo(
    run_dir: Annotated[Path | None, typer.Option(
        "--run-dir", help="where the demo writes (default: rewind-demo, or rewind-demo-kafka)")] = None,
    updates: Annotated[int, typer.Option(min=1, help="PPO updates")] = 60,
    seed: int = 0,
    kill_at: Annotated[int | None, typer.Option(
        "--kill-at", help="update to SIGKILL in (default: random)")] = None,
    json_out: AsJson = False,
    log: LogUrl = None,
    coord: CoordUrl = None,
    run: RunId = None,
) -> int:
    """Record PPO on CartPole, SIGKILL it, recover from the log, compare with an uninterrupted run."""
    from rewind.demo import run_demo

    result = run_demo(run_dir, updates=updates, seed=seed, kill_at=kill_at, log=log,
                      coord=coord, run=run, console=err if json_out else console)
    if json_out:
        _emit_json("demo", result.bit_exact, **dataclasses.asdict(result))
    else:
        say(f"bit-exact: {'yes' if result.bit_exact else 'no'}")
    return OK if result.bit_exact else CHECK_FAILED


# ---------------------------------------------------------------------------- entry point
for _info in app.registered_commands:  # each command's help reflowed, as the app's is
    if _info.callback is not None and _info.help is None:
        _info.help = _help(_info.callback.__doc__ or "")


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", text).strip()


def run(args: Sequence[str]) -> int:
    """Run one command line; returns its exit status (see the module docstring)."""
    args = list(args) or ["--help"]
    try:
        status = app(args=args, prog_name="rewind", standalone_mode=False)
    except RewindError as exc:
        print(f"error: {type(exc).__name__}: {_one_line(str(exc))}", file=sys.stderr)
        return ERROR
    except typer.TyperException as exc:  # click's usage errors (typer vendors its own click)
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "rewind"
        print(f"error: usage: {_one_line(exc.format_message())} (see: {where} --help)", file=sys.stderr)
        return ERROR
    except OSError as exc:  # e.g. an --out directory that cannot be written
        print(f"error: {type(exc).__name__}: {_one_line(str(exc))}", file=sys.stderr)
        return ERROR
    except (KeyboardInterrupt, typer.Abort):
        print("error: interrupted", file=sys.stderr)
        return 130
    return status if isinstance(status, int) else OK


def main() -> None:
    """Console-script entry point: exit 0, 1 (a check failed) or 2 (one line on stderr)."""
    tune_for_replay()  # this process is Rewind's own: let replayed payloads reuse memory
    sys.exit(run(sys.argv[1:]))


if __name__ == "__main__":  # python -m rewind.cli, as the rewind script
    main()
