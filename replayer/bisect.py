"""Where two runs of the same code stop being the same: ``rewind bisect A B``.

Every version's seal holds its shard digests and its small-state digest, so two runs are
compared without replaying them: their versions are aligned by step, and a binary search
over the seals finds the first step whose states differ. Equal digests mean equal states.
Where only the small-state digests differ, the small states are compared as decoded values
(``replayer.statediff``): one read of each run's control partition gives each version's
small states, never a tensor, and a key order or a measurement (a wall-clock time, a
compute count; ``strict`` counts them) does not make them differ. Only then is anything
replayed: in each run, the version before that step (the last one both runs agree on, from
the newest snapshot at or before it) and, on from it, the differing version itself. A
multi-rank version is compared gathered (``replayer.globalview``): whole tensors under
their plain names, whatever world size recorded it, and only the current ranks' small
states. The report names:

* the shards and tensors that differ first, with the count of differing elements and the
  largest absolute difference;
* the small states that differ (RNG streams, sampler cursor, scheduler, extras), each by
  the paths inside it that differ;
* for a predictive version, whether the logged gradients already differed (a data or
  forward/backward difference) or only the optimizer's result did (an optimizer, kernel or
  hyperparameter difference); the recorded prediction digests tell the two apart;
* the hyperparameters and the environment fingerprint fields (schema v4) that differ;
* apart, the measurements that differ (they do not make the runs differ unless ``strict``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from eventlog import RunAddress, Target, statecodec, tensorcodec
from eventlog.errors import ConfigError
from eventlog.events import OptimizerStep, RunStarted, TensorDelta
from eventlog.fold.engine import (
    ControlIndex,
    FoldStart,
    RebuiltState,
    SealInfo,
    events,
    fold_control,
    index_control,
    rebuild,
)
from eventlog.optimstep import unpack_hyperparams
from eventlog.ports import EventLog
from replayer.assemble import LAYOUT, rank_of, recorded_world
from replayer.audit import fingerprint_before
from replayer.globalview import GlobalView, gathered, global_view, live_states, owner
from replayer.replay import replay
from replayer.statediff import MAX_PATHS, grouped, short_repr, states_diff, tree_diff
from replayer.stepcompare import StepComparison

IDENTICAL, DIVERGED, FROM_START = "identical", "diverged", "differ-from-start"


@dataclass(frozen=True)
class TensorDifference:
    """One tensor that differs between the runs at the first differing version."""

    name: str
    shard: int
    dtype: str
    shape: list[int]
    #: Elements whose bits differ, of ``numel``.
    differing: int
    numel: int
    #: The largest absolute difference (``None``: not comparable, e.g. only in one run).
    max_abs_diff: float | None
    #: Why the tensors cannot be compared element by element ("" when they can).
    note: str = ""


@dataclass(frozen=True)
class StateDifference:
    """One small state (RNG, sampler, scheduler, optimizer groups, an extra) that differs."""

    name: str
    #: Its event type: RngAdvance, SamplerCursor, SchedulerStep or CustomState.
    kind: str
    #: What differs inside it: ``path: A's -> B's``, ``path: differs (N elements)`` for
    #: arrays and tensors, or ``a[*].b (N values)`` for the same field of several list items.
    paths: list[str]
    #: Paths not listed (``paths`` lists the first ``MAX_PATHS``).
    more: int = 0
    #: Leaves that differ, in all.
    total: int = 1


@dataclass(frozen=True)
class StepFinding:
    """What the logged optimizer step of a predictive version says about the divergence."""

    optimizer: str
    gradients_equal: bool
    optimizer_result_equal: bool
    verdict: str
    gradients: list[TensorDifference]
    #: Predicted tensors whose recorded prediction digests differ.
    predicted_differ: list[str]


@dataclass
class BisectReport:
    """Where and why two runs diverge; ``status``: identical, diverged or differ-from-start."""

    a: str
    b: str
    status: str
    #: Steps both runs sealed, and how many versions each run has.
    common_steps: int
    versions_a: int
    versions_b: int
    #: Seals compared by the binary search.
    seals_compared: int = 0
    #: The first step whose state digests differ, and its version in each run.
    step: int | None = None
    version_a: int | None = None
    version_b: int | None = None
    #: The last step before it both runs agree on (``None``: they differ from the start).
    previous_step: int | None = None
    previous_version_a: int | None = None
    previous_version_b: int | None = None
    #: Common steps whose states differ, in all.
    differing_steps: int = 0
    #: Whether measurements count as differences (``replayer.statediff``).
    strict: bool = False
    #: Common steps whose states differ in their measurements only (not counted as differing).
    measured_steps: int = 0
    #: Common steps whose small states differ as bytes only (equal as values).
    encoded_steps: int = 0
    shards: list[int] = field(default_factory=list)
    small_states_differ: bool = False
    #: The world size of each run's differing version (0: one process recorded it).
    world: list[int] = field(default_factory=list)
    tensors: list[TensorDifference] = field(default_factory=list)
    small_states: list[StateDifference] = field(default_factory=list)
    #: The measurements that differ: at the differing step, or for identical runs at the
    #: newest step where they do.
    measurements: list[StateDifference] = field(default_factory=list)
    measurements_step: int | None = None
    optimizer_step: StepFinding | None = None
    hyperparameters: list[str] = field(default_factory=list)
    environment: dict[str, list[Any]] = field(default_factory=dict)
    layout: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: Versions each run replayed (the fold base and the differing version).
    replayed: dict[str, list[int]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        """True when every common step holds equal states (measurements apart, unless strict)."""
        return self.status == IDENTICAL

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return dataclasses.asdict(self)


Progress = Callable[[str], None]


def bisect(a: RunAddress, b: RunAddress, *, workers: int = 2, strict: bool = False,
           on_phase: Progress | None = None, on_bytes: Callable[[int], None] | None = None) -> BisectReport:
    """Compare two runs by their seals, then replay only the first differing version and its
    predecessor in each (see the module docstring). ``strict``: measurements (wall-clock
    times, compute counts; ``replayer.statediff``) count as differences. ``on_phase`` is
    told each phase of the work, ``on_bytes`` each record a replay reads."""
    phase = on_phase or (lambda _text: None)
    t0 = time.perf_counter()
    phase("reading the seals")
    idx_a, idx_b = _index(a), _index(b)
    by_step_a, by_step_b = _by_step(idx_a), _by_step(idx_b)
    steps = sorted(by_step_a.keys() & by_step_b.keys())
    if not steps:
        raise ConfigError(f"runs {a.run_id!r} and {b.run_id!r} share no step: {_span(by_step_a)} vs "
                          f"{_span(by_step_b)}; bisect aligns versions by step")
    report = BisectReport(_name(a), _name(b), IDENTICAL, len(steps), len(idx_a.seals), len(idx_b.seals),
                          strict=strict)
    compare = StepComparison((a, b), (idx_a, idx_b), [(by_step_a[s], by_step_b[s]) for s in steps],
                             strict=strict, on_phase=phase)

    def differs(i: int) -> bool:
        report.seals_compared += 1
        return compare.differs(i)

    first = _first_true(len(steps), differs)
    # The search assumes a divergence persists; a later difference that went away again
    # (or one before the found step, which that assumption hides) is counted here.
    differing = [i for i in range(len(steps)) if compare.differs(i)]
    measured = [i for i in range(len(steps)) if compare.measured_only(i)]
    report.differing_steps, report.measured_steps = len(differing), len(measured)
    report.encoded_steps = sum(compare.encoding_only(i) for i in range(len(steps)))
    if differing and (first is None or differing[0] < first):
        report.notes.append(f"the runs differ at step {steps[differing[0]]} but agree again later: "
                            "the difference was undone")
        first = differing[0]
    report.seconds["seals"] = time.perf_counter() - t0
    extra_a, extra_b = len(by_step_a) - len(steps), len(by_step_b) - len(steps)
    if extra_a or extra_b:
        report.notes.append(f"versions at steps only one run has are not compared ({a.run_id}: "
                            f"{extra_a}, {b.run_id}: {extra_b})")
    if first is None:
        if measured:
            _measurements_at(report, (a, b), (idx_a, idx_b), by_step_a[steps[measured[-1]]],
                             by_step_b[steps[measured[-1]]])
        return report
    sa, sb = by_step_a[steps[first]], by_step_b[steps[first]]
    report.status = DIVERGED if first > 0 else FROM_START
    report.step, report.version_a, report.version_b = steps[first], sa.version, sb.version
    prev_a = prev_b = None
    if first > 0:
        prev_a, prev_b = by_step_a[steps[first - 1]], by_step_b[steps[first - 1]]
        report.previous_step = steps[first - 1]
        report.previous_version_a, report.previous_version_b = prev_a.version, prev_b.version
    report.shards = [i for i, (x, y) in enumerate(zip(sa.seal.shard_digests, sb.seal.shard_digests,
                                                      strict=False)) if x != y]
    if len(sa.seal.shard_digests) != len(sb.seal.shard_digests):
        report.notes.append(f"the runs have {len(sa.seal.shard_digests)} and "
                            f"{len(sb.seal.shard_digests)} tensor shards")
    env_a, env_b = fingerprint_before(idx_a, sa.offset), fingerprint_before(idx_b, sb.offset)
    if env_a is not None and env_b is not None:
        report.environment = {k: list(v) for k, v in env_a.differences(env_b).items()}
    elif env_a is None or env_b is None:
        report.notes.append("no environment fingerprint to compare (a log older than schema v4)")

    t1 = time.perf_counter()
    side_a = _replay_side(a, idx_a, prev_a, sa, workers, phase, on_bytes)
    side_b = _replay_side(b, idx_b, prev_b, sb, workers, phase, on_bytes)
    report.replayed = {a.run_id if a.run_id != b.run_id else "a": side_a.replayed,
                       b.run_id if a.run_id != b.run_id else "b": side_b.replayed}
    report.seconds["replay"] = time.perf_counter() - t1
    phase("comparing")
    _compare_sides(report, side_a, side_b, idx_a.layout_at(sa.version), idx_b.layout_at(sb.version))
    if first == 0:
        report.notes.append("the runs differ from their first common version: " + (
            "a different initialization or config" if report.tensors or report.layout
            else "in small states only"))
    report.seconds["total"] = time.perf_counter() - t0
    return report


def _compare_sides(report: BisectReport, side_a: _Side, side_b: _Side, layout_a: RunStarted,
                   layout_b: RunStarted) -> None:
    """Fill in what differs between the replayed versions, compared gathered."""
    view_a, view_b = global_view(side_a.state), global_view(side_b.state)
    report.world = [view_a.world, view_b.world]
    report.layout = _layout_differences(layout_a, layout_b, view_a, view_b)
    common = _common_ranks(view_a, view_b)
    if view_a.world != view_b.world and common is not None:
        ranks = ", ".join(map(str, range(common, max(view_a.world, view_b.world))))
        more = "A" if view_a.world > view_b.world else "B"
        report.notes.append(f"rank{'s' if ',' in ranks else ''} {ranks} only in {more}'s world: their own "
                            "states are not compared")
    report.tensors = _tensor_differences(view_a, view_b, common)
    report.small_states, report.measurements = _small_differences(view_a, view_b, common, report.strict)
    if report.measurements:
        report.measurements_step = report.step
    report.small_states_differ = bool(report.small_states)
    side_a.grads, side_b.grads = gathered(side_a.grads, view_a), gathered(side_b.grads, view_b)
    report.optimizer_step = _step_finding(side_a, side_b, bool(report.tensors), report)
    report.hyperparameters = _hyperparameters(side_a, side_b, view_a, view_b)


def _common_ranks(a: GlobalView, b: GlobalView) -> int | None:
    """How many ranks' own states both versions hold (``None``: neither is multi-rank)."""
    if not a.world and not b.world:
        return None
    return min(a.world or 1, b.world or 1)


def _measurements_at(report: BisectReport, runs: tuple[RunAddress, RunAddress],
                     idx: tuple[ControlIndex, ControlIndex], sa: SealInfo, sb: SealInfo) -> None:
    """Name the measurements that differ at ``sa`` and ``sb`` (identical runs' newest step
    that differs in them), from the control partitions alone."""
    views = []
    for address, index, info in zip(runs, idx, (sa, sb), strict=True):
        with address.open_log() as log:
            states = fold_control(log, index, info.version).states
        names = {t.name for t in index.layout_at(info.version).tensors}
        world = recorded_world(states, names)
        views.append(GlobalView(world, {}, live_states(states, world), {}))
    _, report.measurements = _small_differences(views[0], views[1], _common_ranks(*views), False)
    report.measurements_step = sa.step


def _first_true(n: int, pred: Callable[[int], bool]) -> int | None:
    """The smallest ``i < n`` with ``pred(i)``, for a ``pred`` that stays true once true."""
    if n == 0 or not pred(n - 1):
        return None
    lo, hi = 0, n - 1  # pred(hi) holds
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _index(address: RunAddress) -> ControlIndex:
    with address.open_log() as log:
        return index_control(log)


def _by_step(idx: ControlIndex) -> dict[int, SealInfo]:
    """Each step's sealed version (the first, should a step have been sealed twice)."""
    out: dict[int, SealInfo] = {}
    for info in sorted(idx.seals.values(), key=lambda i: i.version):
        out.setdefault(info.step, info)
    return out


def _span(by_step: Mapping[int, SealInfo]) -> str:
    return f"steps {min(by_step)}..{max(by_step)}" if by_step else "no sealed version"


def _name(address: RunAddress) -> str:
    return f"{address.run_id} ({address.log_url})"


def _layout_differences(a: RunStarted, b: RunStarted, view_a: GlobalView, view_b: GlobalView) -> list[str]:
    """How the versions' layouts differ; a multi-rank one's tensors as gathered."""
    out = []
    if view_a.world != view_b.world:
        out.append(f"world size: {view_a.world or 1} vs {view_b.world or 1}")
    for key in ("shard_count", "chunk_bytes", "torch_version", "device"):
        if getattr(a, key) != getattr(b, key):
            out.append(f"{key}: {getattr(a, key)} vs {getattr(b, key)}")
    ta = {n: (t[0], t[1]) for n, t in view_a.tensors.items()}
    tb = {n: (t[0], t[1]) for n, t in view_b.tensors.items()}
    out += [f"tensor {n} only in A" for n in sorted(ta.keys() - tb.keys()) if _kept(n, view_b)]
    out += [f"tensor {n} only in B" for n in sorted(tb.keys() - ta.keys()) if _kept(n, view_a)]
    out += [f"tensor {n}: {ta[n][0]}{list(ta[n][1])} vs {tb[n][0]}{list(tb[n][1])}"
            for n in sorted(ta.keys() & tb.keys()) if ta[n] != tb[n]]
    names_a, names_b = _plain_names(view_a.small), _plain_names(view_b.small)
    if names_a != names_b:
        out.append(f"small states: {', '.join(sorted(names_a))} vs {', '.join(sorted(names_b))}")
    return out


def _kept(name: str, other: GlobalView) -> bool:
    """Whether ``name`` is compared with ``other``: not a rank's own beyond ``other``'s world."""
    r = owner(name)
    return r is None or not other.world or r < other.world


def _plain_names(states: Mapping[str, bytes]) -> set[str]:
    """Small-state names without their rank (``rank1/rng`` is ``rng``); layouts left out."""
    return {n.split("/", 1)[1] if rank_of(n) is not None else n for n in states if not n.startswith(LAYOUT)}


@dataclass
class _Side:
    """One run's state at the differing version, and what that version logged."""

    state: RebuiltState
    replayed: list[int]
    grads: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = field(default_factory=dict)
    steps: list[OptimizerStep] = field(default_factory=list)


def _replay_side(address: RunAddress, idx: ControlIndex, prev: SealInfo | None, first: SealInfo,
                 workers: int, phase: Progress, on_bytes: Callable[[int], None] | None) -> _Side:
    """Replay the version before ``first`` (the fold base), then fold on to ``first``, reading
    the gradients and optimizer steps ``first`` logged on the way."""
    if prev is None:
        phase(f"replaying {address.run_id} to version {first.version}")
        state, _ = replay(address, Target("version", first.version), workers=workers, on_bytes=on_bytes)
        side = _Side(state, [first.version])
        with address.open_log() as log:
            _read_logged_step(log, side, first.version, [None] * state.layout.shard_count)
        return side
    phase(f"replaying {address.run_id} to version {prev.version}")
    base, _ = replay(address, Target("version", prev.version), workers=workers, on_bytes=on_bytes)
    gts = [s.next_offset - 1 for s in base.shards]
    start = FoldStart(prev.version, base.shards, base.small,
                      [base.small.next_offset, *(s.next_offset for s in base.shards)], base.layout,
                      f"version {prev.version}")
    phase(f"replaying {address.run_id} on to version {first.version}")
    with address.open_log() as log:
        side = _Side(base, [prev.version, first.version])
        _read_logged_step(log, side, first.version, gts)
        side.state = rebuild(log, Target("version", first.version), workers=workers, on_bytes=on_bytes,
                             idx=idx, start=start)
    return side


def _read_logged_step(log: EventLog, side: _Side, version: int, gts: Sequence[int | None]) -> None:
    """Collect the gradient chunks and optimizer steps ``version`` logged on each shard."""
    for shard, gt in enumerate(gts):
        stepped = 0  # a version may hold two optimizer steps: gradients are per step
        for offset, _, env in events(log, shard, gt=None if gt is None or gt < 0 else gt):
            if env.version > version:
                break
            if env.version < version:
                continue
            body = env.body
            if isinstance(body, OptimizerStep):
                side.steps.append(body)
                stepped += 1
            elif isinstance(body, TensorDelta) and body.encoding == TensorDelta.GRAD:
                where = f"run {log.run_id!r} shard {shard} offset {offset}"
                name = body.name if stepped == 0 else f"{body.name} (optimizer step {stepped})"
                if name not in side.grads:
                    size = tensorcodec.nbytes_of(body.dtype, tuple(body.shape), where)
                    side.grads[name] = (body.dtype, tuple(body.shape), np.zeros(size, dtype=np.uint8))
                tensorcodec.decode_chunk(body, side.grads[name][2], where)


def _tensor_differences(a: GlobalView, b: GlobalView, common: int | None) -> list[TensorDifference]:
    out = []
    for name in sorted(a.tensors.keys() | b.tensors.keys()):
        if common is not None and (r := owner(name)) is not None and r >= common:
            continue
        x, y = a.tensors.get(name), b.tensors.get(name)
        if x is None or y is None:
            ref = x if x is not None else y
            assert ref is not None
            out.append(TensorDifference(name, ref[3], ref[0], list(ref[1]), _numel(ref[1]), _numel(ref[1]),
                                        None, "only in A" if y is None else "only in B"))
            continue
        diff = compare_bits(name, x[3] if x[3] == y[3] else -1, x[:3], y[:3])
        if diff is not None:
            out.append(diff)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def compare_bits(name: str, shard: int, x: tuple[str, tuple[int, ...], np.ndarray],
                 y: tuple[str, tuple[int, ...], np.ndarray]) -> TensorDifference | None:
    """How two tensors' bits differ (``None``: bit-equal): differing elements and the largest
    absolute difference."""
    (dx, sx, bx), (dy, sy, by) = x, y
    if (dx, tuple(sx)) != (dy, tuple(sy)):
        return TensorDifference(name, shard, dx, list(sx), _numel(sx), _numel(sx), None,
                                f"A is {dx}{list(sx)}, B is {dy}{list(sy)}")
    if np.array_equal(bx, by):
        return None
    tx = tensorcodec.bits_to_tensor(bx, dx, tuple(sx)).reshape(-1)
    ty = tensorcodec.bits_to_tensor(by, dy, tuple(sy)).reshape(-1)
    size = tx.element_size()
    per_elem = (bx != by).reshape(-1, size).any(axis=1)
    # In float64 (complex128), so the difference of two fp16 or int64 values is not rounded.
    wide = torch.complex128 if tx.is_complex() else torch.float64
    worst = float((ty.to(wide) - tx.to(wide)).abs().max())
    return TensorDifference(name, shard, dx, list(sx), int(per_elem.sum()), _numel(sx), worst)


def _small_differences(a: GlobalView, b: GlobalView, common: int | None,
                       strict: bool) -> tuple[list[StateDifference], list[StateDifference]]:
    """The small states that differ as values, and those whose measurements differ (the
    current ranks' in both runs; their layouts only at one world size)."""
    def compared(name: str) -> bool:
        r = owner(name)
        if common is None or r is None:
            return True
        return r < common and (a.world == b.world or not name.startswith(LAYOUT))

    out: list[StateDifference] = []
    measured: list[StateDifference] = []
    for name in sorted(n for n in a.small.keys() | b.small.keys() if compared(n)):
        x, y = a.small.get(name), b.small.get(name)
        if x == y:
            continue
        kind = a.kinds.get(name) or b.kinds.get(name, "")
        if x is None or y is None:
            out.append(StateDifference(name, kind, [f"only in {'B' if x is None else 'A'}"]))
            continue
        diff = states_diff(name, x, y, strict=strict)
        for paths, into in ((diff.paths, out), (diff.measured, measured)):
            if paths:
                folded = grouped(paths)
                into.append(StateDifference(name, kind, folded[:MAX_PATHS], max(0, len(folded) - MAX_PATHS),
                                            len(paths)))
    return out, measured


def _step_finding(a: _Side, b: _Side, tensors_differ: bool, report: BisectReport) -> StepFinding | None:
    """Gradients first, then the optimizer's prediction, then the state after it."""
    if not a.steps or not b.steps:
        which = " and ".join(r for r, s in (("A", a), ("B", b)) if not s.steps)
        report.notes.append(f"the differing version of {which} is not predictive: it logged no "
                            "gradients, so the optimizer step cannot be told apart from its inputs")
        return None
    grads = []
    for name in sorted(a.grads.keys() | b.grads.keys()):
        x, y = a.grads.get(name), b.grads.get(name)
        if x is None or y is None:
            grads.append(TensorDifference(name, -1, "", [], 0, 0, None,
                                          "only in A" if y is None else "only in B"))
            continue
        diff = compare_bits(name, -1, x, y)
        if diff is not None:
            grads.append(diff)
    pred_a, pred_b = _predictions(a.steps), _predictions(b.steps)
    predicted = sorted({n for key in pred_a.keys() | pred_b.keys() for n in key[1:]
                        if pred_a.get(key) != pred_b.get(key)})
    optimizers = sorted({s.optimizer for s in a.steps + b.steps})
    if grads:
        verdict = ("gradients differ: the step's inputs already differed (a data or "
                   "forward/backward difference)")
    elif predicted:
        verdict = ("gradients equal, optimizer result differs: an optimizer, kernel or "
                   "hyperparameter difference")
    elif tensors_differ:
        verdict = ("gradients equal and the optimizer step computes the same result, yet the "
                   "tensors differ: they were changed outside the optimizer step")
    else:
        verdict = "gradients and the optimizer step's result equal: only small states differ"
    return StepFinding("/".join(optimizers), not grads, not predicted, verdict, grads, predicted)


def _predictions(steps: list[OptimizerStep]) -> dict[tuple[int, str], bytes]:
    """The digest each step predicted for each tensor it writes (before residuals)."""
    return {(s.index, n): d for s in steps for n, d in zip(s.predicted, s.predicted_digests, strict=False)}


def _hyperparameters(a: _Side, b: _Side, view_a: GlobalView, view_b: GlobalView) -> list[str]:
    """Hyperparameters that differ, ``group G NAME: A's -> B's``: those the differing
    version's optimizer steps logged, else the optimizer's param groups (a small state)."""
    if a.steps and b.steps:
        pairs = [(unpack_hyperparams(x.hyperparams, "A's optimizer step"),
                  unpack_hyperparams(y.hyperparams, "B's optimizer step"))
                 for x, y in zip(a.steps, b.steps, strict=False)]
    else:
        pairs = [(_param_groups(view_a.small, "A"), _param_groups(view_b.small, "B"))]
    out: list[str] = []
    for groups_a, groups_b in pairs:
        for g, (x, y) in enumerate(zip(groups_a, groups_b, strict=False)):
            for key in sorted(x.keys() | y.keys()):
                if key != "params" and tree_diff(x.get(key), y.get(key)).paths:
                    out.append(f"group {g} {key}: {short_repr(x.get(key))} -> {short_repr(y.get(key))}")
    return list(dict.fromkeys(out))


def _param_groups(states: Mapping[str, bytes], run: str) -> list[dict[str, Any]]:
    """The optimizer's param groups from its small state (rank 0's in a multi-rank run; []
    without one)."""
    name = next((n for n in ("optimizer", "rank0/optimizer") if n in states), None)
    if name is None:
        return []
    tree = statecodec.unpack(states[name], f"{run}'s small state {name!r}")
    groups = tree.get("param_groups") if isinstance(tree, dict) else None
    return [g for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []
