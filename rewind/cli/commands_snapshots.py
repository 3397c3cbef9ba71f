"""Snapshot commands: ``snapshot`` (one now), ``snapshotter`` (follow the run on a policy)
and ``verify`` (check every kept snapshot and every reachable version)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from eventlog import ConfigError, RunAddress
from eventlog.backends import run_dir_url
from eventlog.errors import CorruptStoreError
from rewind.cli.common import (
    CHECK_FAILED,
    OK,
    AsJson,
    CoordUrl,
    LogUrl,
    RunDir,
    RunId,
    Snaps,
    Workers,
    address_of,
)
from rewind.cli.output import emit_json, print_lines, say, terminal_width, wrap_words

if TYPE_CHECKING:
    from snapshotter.policies import Retention, Trigger
    from snapshotter.service import Snapshotter


def policies(every: int, seconds: float, keep: int | None, best: str | None,
              every_steps: int | None) -> tuple[Trigger, Retention]:
    """The trigger, and the union of the retention options given (none given: keep all)."""
    from snapshotter.policies import every_seconds, every_versions, keep_all, keep_best, keep_every, keep_last

    trigger = every_versions(every) | every_seconds(seconds)
    retention = keep_all() if keep is None else keep_last(keep)
    if keep is None and (best or every_steps is not None):
        retention = keep_last(0)  # the other options alone say what to keep
    if best:
        retention = retention | keep_best(*parse_best(best))
    if every_steps is not None:
        retention = retention | keep_every(every_steps)
    return trigger, retention


def parse_best(best: str) -> tuple[int, str, str]:
    """``--keep-best METRIC:K:max|min`` (or ``METRIC:max|min``, K=1) as ``(k, metric, mode)``:
    the mode is never guessed, since which end is best depends on the metric."""
    metric, *rest = best.split(":")
    mode = rest.pop() if rest and rest[-1] in ("max", "min") else ""
    k = rest.pop() if len(rest) == 1 else ("1" if not rest else "")
    if not metric or not k.isdigit() or int(k) < 1 or rest:
        raise ConfigError(f"--keep-best {best!r}: use METRIC:K:max or METRIC:K:min, e.g. reward:2:max "
                          "or loss:2:min")
    if not mode:
        raise ConfigError(f"--keep-best {best!r} does not say which {metric} is best: use "
                          f"{metric}:{k}:max (keep the highest) or {metric}:{k}:min (keep the lowest)")
    return int(k), metric, mode


Every = Annotated[int, typer.Option("--every-versions", min=1, help="snapshot every N versions")]
Seconds = Annotated[float, typer.Option("--every-seconds", min=0.0, help="or every S seconds")]
Keep = Annotated[int, typer.Option("--keep-last", min=0, help="keep the N newest snapshots")]
KeepNow = Annotated[int | None, typer.Option(
    "--keep-last", min=0, help="delete all but the N newest snapshots (default: delete none, unless "
                        "--keep-best or --keep-every is given)")]
Best = Annotated[str | None, typer.Option(
    "--keep-best", help="also keep the K best by a metric: METRIC:K:max or METRIC:K:min (e.g. loss:2:min)")]
EverySteps = Annotated[int | None, typer.Option("--keep-every", min=1, help="also keep one per M steps")]
History = Annotated[str, typer.Option("--history", help="keep-all, since-oldest-snapshot, or N steps")]
Holder = Annotated[str | None, typer.Option(
    "--holder", help="lease holder id; a restarted snapshotter with the same id takes its lease back "
                     "at once (default: a random id, which waits for a stopped holder's lease to "
                     "expire, saying until when; a running holder keeps it, and this one exits 2)")]


def open_snapshotter(address: RunAddress, every: int, seconds: float, keep: int | None, best: str | None,
                 every_steps: int | None, history: str, holder: str | None,
                 on_event: Callable[[str], None]) -> Snapshotter:
    from snapshotter.service import Snapshotter, SnapshotterConfig
    from snapshotter.store import SnapshotStore

    if not address.snapshots_url:
        raise ConfigError("no snapshot store: pass --snapshots file://DIR (or use --run-dir)")
    trigger, retention = policies(every, seconds, keep, best, every_steps)
    config = SnapshotterConfig(trigger=trigger, retention=retention, history=history)
    return Snapshotter(address, SnapshotStore(address.snapshots_url), config, holder=holder,
                       on_event=on_event)


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
    with open_snapshotter(address, 1, 0.0, keep, best, every_steps, history, holder,
                      lambda m: say(m, to_stderr=json_out)) as snap:
        snap.take_lease()  # (waits out the lease of a snapshotter that was killed)
        result = snap.snapshot(force=True)
        retains = keep is not None or best or every_steps is not None or history != "keep-all"
        deleted, truncated = snap.retain() if result is None and retains else ([], None)
    if json_out:
        emit_json("snapshot", True, run=address.run_id,
                   snapshot=None if result is None else dataclasses.asdict(result),
                   **({} if result is not None else {"deleted": deleted, "truncated_before": truncated}))
    elif result is None:
        say("nothing new to snapshot" + (f"; retention deleted {len(deleted)}" if retains else "")
            + (f"; log truncated before offsets {truncated}" if truncated else ""))
    else:
        say(f"snapshot {result.snapshot_id}: version {result.version}, step {result.step}, "
            f"{result.seconds:.2f} s, deleted {len(result.deleted)}")
    return OK


def snapshotter_cmd(
    every: Every = 100, seconds: Seconds = 600.0, keep: Keep = 3, best: Best = None,
    every_steps: EverySteps = None, history: History = "keep-all", holder: Holder = None,
    max_snapshots: Annotated[int | None, typer.Option(
        "--max-snapshots", min=1, help="exit after N snapshots")] = None,
    json_out: AsJson = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> int:
    """Follow the run's log and snapshot it on a policy (a lease allows one writer). It first
    waits for the lease of a snapshotter that stopped without releasing it to expire; one
    whose holder is running stops with a FencedError (exit 2). SIGTERM, like Ctrl-C, stops
    it and releases the lease (exit 0; Ctrl-C: 130)."""
    address = address_of(run_dir, log, coord, run, snapshots)
    stop = threading.Event()
    with _terminated_by(stop), open_snapshotter(address, every, seconds, keep, best, every_steps, history,
                                                 holder, lambda m: say(m, to_stderr=json_out)) as snap:
        written = snap.run(stop, max_snapshots=max_snapshots)
    if stop.is_set():
        say("snapshotter stopped (SIGTERM); its lease is released", to_stderr=json_out)
    if json_out:
        emit_json("snapshotter", True, run=address.run_id, written=written)
    return OK


@contextlib.contextmanager
def _terminated_by(stop: threading.Event) -> Iterator[None]:
    """SIGTERM sets ``stop`` while the block runs (in the main thread, where signals go)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda _sig, _frame: stop.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def verify(
    json_out: AsJson = False, workers: Workers = 2,
    deep: Annotated[bool, typer.Option(
        "--deep", help="also check every version's shard digests against its seal")] = False,
    run_dir: RunDir = None, log: LogUrl = None, coord: CoordUrl = None, run: RunId = None,
    snapshots: Snaps = None,
) -> int:
    """Check every kept snapshot and every version a replay can reach; exit 1 on damage."""
    from snapshotter.verify import verify_run, verify_store

    try:
        address = address_of(run_dir, log, coord, run, snapshots, read_only=True)
    except CorruptStoreError as exc:
        if run_dir is None:
            raise
        # The store's run ids do not read (--run not given): the store is what is damaged.
        report, run_id = verify_store(run_dir_url(run_dir), exc), None
    else:
        report, run_id = verify_run(address, workers=workers, deep=deep), address.run_id
    status = OK if report.ok else CHECK_FAILED
    if json_out:
        emit_json("verify", report.ok, **{**dataclasses.asdict(report), "run": run_id,
                                           "findings": [dataclasses.asdict(f) for f in report.findings]})
        return status
    # Paths inside the run directory (else the directory the paths share) are shown relative
    # to it, and it is named once.
    base = run_dir if run_dir is not None else shared_dir([f.detail for f in report.findings])
    details = [f.detail if base is None else relative_paths(f.detail, base) for f in report.findings]
    shortened = base is not None and details != [f.detail for f in report.findings]
    lines = [f"verify {run_id or '(no run can be named)'}: {'ok' if report.ok else 'PROBLEMS FOUND'}"
             + (f" (paths below are in {base})" if shortened else "")]
    for f, detail in zip(report.findings, details, strict=True):
        text = wrap_words(f"{f.subject}: {detail}", terminal_width() - 6)
        lines += [f"{f.status if k == 0 else '':<4}  {part}" for k, part in enumerate(text)]
    print_lines(lines)
    return status


def shared_dir(texts: list[str]) -> Path | None:
    """The deepest directory that holds every absolute path ``texts`` name (``None``: they
    name none, or share no more than a top-level directory)."""
    paths = [m for t in texts for m in re.findall(r"(?<![\w.:/])/[^\s()'\",;]+", t)]
    if not paths:
        return None
    base = Path(os.path.commonpath([os.path.dirname(p) for p in paths]))
    return base if len(base.parts) > 2 else None


def relative_paths(text: str, base: Path) -> str:
    """``text`` with the paths under ``base`` written relative to it."""
    return text.replace(f"{base.resolve()}{os.sep}", "")
