"""``rewind bisect A B``: the first step where two runs stop being the same, and why."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from eventlog import ConfigError, RunAddress
from rewind.cli.common import CHECK_FAILED, OK, AsJson, Workers, address_of, err
from rewind.cli.output import count, emit_json, print_lines, table_lines, terminal_width

if TYPE_CHECKING:
    from replayer.bisect import BisectReport, TensorDifference

_RUN_HELP = ("a run: DIR (an embedded run directory), DIR#RUN, or LOG_URL#RUN "
             "(e.g. sqlite:///data/rewind.db#run-a, kafka://host:9092#run-b)")
RunA = Annotated[str, typer.Argument(metavar="A", help=_RUN_HELP, show_default=False)]
RunB = Annotated[str, typer.Argument(metavar="B", help="the other run, named alike", show_default=False)]


def run_spec(spec: str) -> RunAddress:
    """The run ``spec`` names: ``DIR``, ``DIR#RUN`` or ``LOG_URL#RUN``, opened read-only."""
    if "://" in spec:
        url, sep, run = spec.rpartition("#")
        if not sep or not url or not run:
            raise ConfigError(f"run {spec!r}: name the run after the log URL, as LOG_URL#RUN")
        return RunAddress(url, url, run, read_only=True)
    folder, _, run = spec.partition("#")
    return address_of(Path(folder), None, None, run or None, read_only=True)


Strict = Annotated[bool, typer.Option(
    "--strict", help="count measurements (wall-clock times such as SB3 Monitor's t_start, HF's "
    "total_flos) as differences")]
#: Rows of a difference table; the rest are counted (``--json`` lists them all).
MAX_ROWS = 20


def bisect_cmd(
    a: RunA, b: RunB, json_out: AsJson = False, workers: Workers = 2, strict: Strict = False,
) -> int:
    """Find the first step where runs A and B differ: a binary search over their seals
    (versions aligned by step), then a replay of only that version and the one before it
    in each run. States are compared as decoded values (a dict's key order does not count),
    a multi-rank run gathered (whole tensors, whatever its world size; the ranks it left
    behind do not count). Names the tensors that differ (differing elements, largest
    absolute difference), the small states (RNG streams, sampler, scheduler), for a
    predictive version whether the gradients already differed or only the optimizer's
    result, the hyperparameters and the environment fingerprints. Measurements (values
    that measure the run and feed nothing back into training: SB3 Monitor's wall-clock
    t_start and episode times, HF TrainerState's total_flos) are listed apart and do not
    make runs differ, unless --strict. Exit status: 0 identical, 1 diverged, 2 error."""
    from replayer.bisect import bisect

    run_a, run_b = run_spec(a), run_spec(b)
    cols = (SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.completed} msgs"),
            TimeElapsedColumn())
    # Drawn on a terminal only: a pipe or a log file gets no progress lines.
    with Progress(*cols, console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("bisect", total=None)
        report = bisect(run_a, run_b, workers=workers, strict=strict,
                        on_phase=lambda text: progress.update(task, description=text),
                        on_bytes=lambda _n: progress.advance(task))
    status = OK if report.identical else CHECK_FAILED
    if json_out:
        emit_json("bisect", report.identical, **report.to_json())
    else:
        print_lines(fitted(report_lines(report), terminal_width()))
    return status


def fitted(lines: list[str], width: int) -> list[str]:
    """``lines`` wrapped to ``width`` at spaces, each one's further lines indented under it."""
    out = []
    for line in lines:
        if len(line) <= width:
            out.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()) + 2)
        out += textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=False,
                             break_on_hyphens=False)
    return out


def report_lines(r: BisectReport) -> list[str]:
    """The report as text: the verdict first, then each kind of difference."""
    head = [f"bisect A = {r.a}", f"       B = {r.b}"]
    seals = (f"{r.common_steps} common steps ({r.versions_a} versions in A, {r.versions_b} in B), "
             f"{count(r.seals_compared, 'seal')} compared")
    if r.step is None:
        same = "the same state digest" if not r.encoded_steps and not r.measured_steps else "equal states"
        return [*head, f"identical: every common step has {same} ({seals})", *_decoded_lines(r),
                *_measurement_lines(r), *(f"note: {n}" for n in r.notes)]
    where = f"step {r.step} (version {r.version_a} in A, {r.version_b} in B)"
    if r.previous_step is None:
        verdict = f"differ from the start: the first common step, {where}, already differs"
    else:
        verdict = (f"diverged at {where}; step {r.previous_step} (version {r.previous_version_a} "
                   f"in A, {r.previous_version_b} in B) is the last they agree on")
    lines = [*head, verdict, f"seals: {seals}; {r.differing_steps} common steps differ"]
    lines += _decoded_lines(r)
    if not any(r.world):
        lines.append(f"shards that differ: {', '.join(map(str, r.shards)) or 'none'}"
                     + ("; small states differ" if r.small_states_differ else ""))
    if r.tensors:
        lines.append(f"tensors that differ at step {r.step}: {len(r.tensors)}")
        lines += _tensor_table(r.tensors, "tensor", with_shard=not any(r.world))
    else:
        lines.append(f"tensors: all equal at step {r.step}")
    lines += _state_lines(r)
    if r.optimizer_step is not None:
        st = r.optimizer_step
        lines.append(f"optimizer step ({st.optimizer}): {st.verdict}")
        if st.gradients:
            lines += _tensor_table(st.gradients, "gradient", with_shard=False)
    lines += [f"hyperparameter: {h}" for h in r.hyperparameters]
    lines += [f"environment: {key} {x} (A) vs {y} (B)" for key, (x, y) in r.environment.items()]
    lines += [f"layout: {d}" for d in r.layout]
    lines += [f"note: {n}" for n in r.notes]
    replayed = "; ".join(f"{run}: versions {', '.join(map(str, vs))}" for run, vs in r.replayed.items())
    lines.append(f"replayed {replayed} in {r.seconds.get('replay', 0.0):.2f} s "
                 f"(seals read in {r.seconds.get('seals', 0.0):.2f} s)")
    return lines


def _decoded_lines(r: BisectReport) -> list[str]:
    """What made seal digests differ where the states are equal."""
    out = []
    if r.encoded_steps:
        out.append(f"{count(r.encoded_steps, 'common step')} with other small-state bytes hold equal "
                   "values (a dict's key order, say)")
    if r.measured_steps:
        out.append(f"{count(r.measured_steps, 'common step')} differ in measurements only (not counted; "
                   "--strict counts them)")
    return out


def _state_lines(r: BisectReport) -> list[str]:
    lines = []
    for s in r.small_states:
        more = f" (+{s.more} more)" if s.more else ""
        if s.kind == "RngAdvance":  # each top-level key of the RNG state is one generator
            streams = sorted({p.split(":")[0].split(".")[0].split("[")[0] for p in s.paths})
            lines.append(f"RNG streams differ ({s.name}): {', '.join(streams)}")
        else:
            lines.append(f"small state {s.name} differs: {'; '.join(s.paths)}{more}")
    return lines + _measurement_lines(r)


def _measurement_lines(r: BisectReport) -> list[str]:
    if not r.measurements:
        return []
    lines = [f"measurements that differ at step {r.measurements_step} (not counted; --strict counts them):"]
    for s in r.measurements:
        more = f" (+{s.more} more)" if s.more else ""
        lines.append(f"  {s.name}: {'; '.join(s.paths)}{more}")
    return lines


def _tensor_table(rows: list[TensorDifference], label: str, *, with_shard: bool) -> list[str]:
    """Tensors as a table that fits the terminal: its name last, on a line of its own below
    the row when it does not fit beside it."""
    cells = []
    for t in rows[:MAX_ROWS]:
        worst = "-" if t.max_abs_diff is None or math.isnan(t.max_abs_diff) else f"{t.max_abs_diff:.4g}"
        shape = "x".join(map(str, t.shape)) or "scalar"
        differing = f"{t.differing} of {t.numel}" if not t.note else _short_note(t.note)
        cells.append((*((str(t.shard),) if with_shard else ()), t.dtype, shape, differing, worst, t.name))
    headers = (*(("shard",) if with_shard else ()), "dtype", "shape", "differing", "max |A-B|",
               label)
    n = len(headers)
    table = table_lines(headers, cells, flex=n - 1, right=(n - 3, n - 2), width=terminal_width() - 2)
    lines = ["  " + line for line in table]
    if len(rows) > MAX_ROWS:
        lines.append(f"  ... and {len(rows) - MAX_ROWS} more (--json lists them all)")
    return lines


def _short_note(note: str) -> str:
    """A table cell for a tensor that cannot be compared element by element."""
    return note if note.startswith("only in") else "shape differs"
