"""``rewind bisect A B``: the first step where two runs stop being the same, and why."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from eventlog import ConfigError, RunAddress
from rewind.cli.common import CHECK_FAILED, OK, AsJson, Workers, address_of, err
from rewind.cli.output import count, emit_json, print_lines, table_lines

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


def bisect_cmd(
    a: RunA, b: RunB, json_out: AsJson = False, workers: Workers = 2,
) -> int:
    """Find the first step where runs A and B differ: a binary search over their seals
    (versions aligned by step), then a replay of only that version and the one before it
    in each run. Names the shards and tensors that differ (differing elements, largest
    absolute difference), the small states (RNG streams, sampler, scheduler), for a
    predictive version whether the gradients already differed or only the optimizer's
    result, the hyperparameters and the environment fingerprints. Exit status: 0 identical,
    1 diverged, 2 error."""
    from replayer.bisect import bisect

    run_a, run_b = run_spec(a), run_spec(b)
    cols = (SpinnerColumn(), TextColumn("{task.description}"), TextColumn("{task.completed} msgs"),
            TimeElapsedColumn())
    # Drawn on a terminal only: a pipe or a log file gets no progress lines.
    with Progress(*cols, console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("bisect", total=None)
        report = bisect(run_a, run_b, workers=workers,
                        on_phase=lambda text: progress.update(task, description=text),
                        on_bytes=lambda _n: progress.advance(task))
    status = OK if report.identical else CHECK_FAILED
    if json_out:
        emit_json("bisect", report.identical, **report.to_json())
    else:
        print_lines(report_lines(report))
    return status


def report_lines(r: BisectReport) -> list[str]:
    """The report as text: the verdict first, then each kind of difference."""
    head = f"bisect A = {r.a}\n       B = {r.b}"
    seals = (f"{r.common_steps} common steps ({r.versions_a} versions in A, {r.versions_b} in B), "
             f"{count(r.seals_compared, 'seal')} compared")
    if r.step is None:
        return [*head.splitlines(), f"identical: every common step has the same state digest ({seals})",
                *(f"note: {n}" for n in r.notes)]
    where = f"step {r.step} (version {r.version_a} in A, {r.version_b} in B)"
    if r.previous_step is None:
        verdict = f"differ from the start: the first common step, {where}, already differs"
    else:
        verdict = (f"diverged at {where}; step {r.previous_step} (version {r.previous_version_a} "
                   f"in A, {r.previous_version_b} in B) is the last they agree on")
    lines = [*head.splitlines(), verdict, f"seals: {seals}; {r.differing_steps} common steps differ"]
    lines.append(f"shards that differ: {', '.join(map(str, r.shards)) or 'none'}"
                 + ("; small states differ" if r.small_states_differ else ""))
    if r.tensors:
        lines.append(f"tensors that differ at step {r.step}: {len(r.tensors)}")
        lines += _tensor_table(r.tensors, with_shard=True)
    else:
        lines.append(f"tensors: all equal at step {r.step}")
    for s in r.small_states:
        more = f" (+{s.more} more)" if s.more else ""
        if s.kind == "RngAdvance":  # each top-level key of the RNG state is one generator
            streams = sorted({p.split(":")[0].split(".")[0].split("[")[0] for p in s.paths})
            lines.append(f"RNG streams differ ({s.name}): {', '.join(streams)}")
        else:
            lines.append(f"small state {s.name} differs: {'; '.join(s.paths)}{more}")
    if r.optimizer_step is not None:
        st = r.optimizer_step
        lines.append(f"optimizer step ({st.optimizer}): {st.verdict}")
        if st.gradients:
            lines += _tensor_table(st.gradients, with_shard=False)
    for h in r.hyperparameters:
        lines.append(f"hyperparameter: {h}")
    for key, (x, y) in r.environment.items():
        lines.append(f"environment: {key} {x} (A) vs {y} (B)")
    lines += [f"layout: {d}" for d in r.layout]
    lines += [f"note: {n}" for n in r.notes]
    replayed = "; ".join(f"{run}: versions {', '.join(map(str, vs))}" for run, vs in r.replayed.items())
    lines.append(f"replayed {replayed} in {r.seconds.get('replay', 0.0):.2f} s "
                 f"(seals read in {r.seconds.get('seals', 0.0):.2f} s)")
    return lines


def _tensor_table(rows: list[TensorDifference], *, with_shard: bool) -> list[str]:
    cells = []
    for t in rows:
        worst = "-" if t.max_abs_diff is None or math.isnan(t.max_abs_diff) else f"{t.max_abs_diff:.4g}"
        shape = "x".join(map(str, t.shape)) or "scalar"
        cell = (t.name, *((str(t.shard),) if with_shard else ()), t.dtype, shape,
                f"{t.differing} of {t.numel}" if not t.note else t.note, worst)
        cells.append(cell)
    headers = ("tensor" if with_shard else "gradient", *(("shard",) if with_shard else ()), "dtype", "shape",
               "differing", "max |A-B|")
    n = len(headers)
    return ["  " + line for line in table_lines(headers, cells, flex=0, right=(n - 2, n - 1))]
