"""Where two runs of the same code stop being the same: ``rewind bisect A B``.

Every version's seal holds its shard digests and its small-state digest, so two runs are
compared without replaying them: their versions are aligned by step, and a binary search
over the seals finds the first step whose state digests differ. Only then is anything
replayed: in each run, the version before that step (the last one both runs agree on, from
the newest snapshot at or before it) and, on from it, the differing version itself. The
report names:

* the shards and tensors that differ first, with the count of differing elements and the
  largest absolute difference;
* the small states that differ (RNG streams, sampler cursor, scheduler, extras), each by
  the paths inside it that differ;
* for a predictive version, whether the logged gradients already differed (a data or
  forward/backward difference) or only the optimizer's result did (an optimizer, kernel or
  hyperparameter difference); the recorded prediction digests tell the two apart;
* the hyperparameters and the environment fingerprint fields (schema v4) that differ.
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
    SmallStates,
    events,
    index_control,
    rebuild,
)
from eventlog.optimstep import unpack_hyperparams
from eventlog.ports import EventLog
from replayer.audit import fingerprint_before
from replayer.replay import replay

IDENTICAL, DIVERGED, FROM_START = "identical", "diverged", "differ-from-start"
#: Paths listed per differing small state; the rest are counted.
MAX_PATHS = 12


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
    #: What differs inside it: ``path: A's -> B's``, or ``path: differs`` for big values.
    paths: list[str]
    more: int = 0


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
    #: Common steps whose digests differ, in all.
    differing_steps: int = 0
    shards: list[int] = field(default_factory=list)
    small_states_differ: bool = False
    tensors: list[TensorDifference] = field(default_factory=list)
    small_states: list[StateDifference] = field(default_factory=list)
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
        """True when every common step's state digest is equal."""
        return self.status == IDENTICAL

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return dataclasses.asdict(self)


Progress = Callable[[str], None]


def bisect(a: RunAddress, b: RunAddress, *, workers: int = 2, on_phase: Progress | None = None,
           on_bytes: Callable[[int], None] | None = None) -> BisectReport:
    """Compare two runs by their seals, then replay only the first differing version and its
    predecessor in each (see the module docstring). ``on_phase`` is told each phase of the
    work, ``on_bytes`` each record a replay reads."""
    phase = on_phase or (lambda _text: None)
    t0 = time.perf_counter()
    phase("reading the seals")
    idx_a, idx_b = _index(a), _index(b)
    by_step_a, by_step_b = _by_step(idx_a), _by_step(idx_b)
    steps = sorted(by_step_a.keys() & by_step_b.keys())
    if not steps:
        raise ConfigError(f"runs {a.run_id!r} and {b.run_id!r} share no step: {_span(by_step_a)} vs "
                          f"{_span(by_step_b)}; bisect aligns versions by step")
    report = BisectReport(_name(a), _name(b), IDENTICAL, len(steps), len(idx_a.seals), len(idx_b.seals))

    def differs(i: int) -> bool:
        report.seals_compared += 1
        return by_step_a[steps[i]].seal.state_digest != by_step_b[steps[i]].seal.state_digest

    first = _first_true(len(steps), differs)
    # The search assumes a divergence persists; a later difference that went away again
    # (or one before the found step, which that assumption hides) is counted here.
    differing = [i for i, s in enumerate(steps)
                 if by_step_a[s].seal.state_digest != by_step_b[s].seal.state_digest]
    report.differing_steps = len(differing)
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
        return report
    sa, sb = by_step_a[steps[first]], by_step_b[steps[first]]
    report.status = DIVERGED if first > 0 else FROM_START
    report.step, report.version_a, report.version_b = steps[first], sa.version, sb.version
    prev_a = prev_b = None
    if first > 0:
        prev_a, prev_b = by_step_a[steps[first - 1]], by_step_b[steps[first - 1]]
        report.previous_step = steps[first - 1]
        report.previous_version_a, report.previous_version_b = prev_a.version, prev_b.version
    else:
        report.notes.append("the runs differ from their first common version: a different "
                            "initialization or config")
    report.shards = [i for i, (x, y) in enumerate(zip(sa.seal.shard_digests, sb.seal.shard_digests,
                                                      strict=False)) if x != y]
    if len(sa.seal.shard_digests) != len(sb.seal.shard_digests):
        report.notes.append(f"the runs have {len(sa.seal.shard_digests)} and "
                            f"{len(sb.seal.shard_digests)} tensor shards")
    report.small_states_differ = sa.seal.small_digest != sb.seal.small_digest
    layout_a, layout_b = idx_a.layout_at(sa.version), idx_b.layout_at(sb.version)
    report.layout = _layout_differences(layout_a, layout_b)
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
    report.tensors = _tensor_differences(side_a.state, side_b.state)
    report.small_states = _small_differences(side_a.state.small, side_b.state.small)
    report.optimizer_step = _step_finding(side_a, side_b, bool(report.tensors), report)
    report.hyperparameters = _hyperparameters(side_a, side_b)
    report.seconds["total"] = time.perf_counter() - t0
    return report


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


def _layout_differences(a: RunStarted, b: RunStarted) -> list[str]:
    out = []
    for key in ("shard_count", "chunk_bytes", "torch_version", "device"):
        if getattr(a, key) != getattr(b, key):
            out.append(f"{key}: {getattr(a, key)} vs {getattr(b, key)}")
    ta = {t.name: (t.dtype, tuple(t.shape)) for t in a.tensors}
    tb = {t.name: (t.dtype, tuple(t.shape)) for t in b.tensors}
    out += [f"tensor {n} only in A" for n in sorted(ta.keys() - tb.keys())]
    out += [f"tensor {n} only in B" for n in sorted(tb.keys() - ta.keys())]
    out += [f"tensor {n}: {ta[n][0]}{list(ta[n][1])} vs {tb[n][0]}{list(tb[n][1])}"
            for n in sorted(ta.keys() & tb.keys()) if ta[n] != tb[n]]
    if set(a.small_states) != set(b.small_states):
        out.append(f"small states: {', '.join(a.small_states)} vs {', '.join(b.small_states)}")
    return out


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


def _tensor_differences(a: RebuiltState, b: RebuiltState) -> list[TensorDifference]:
    shard_of = {t.name: t.shard for t in a.layout.tensors} | {t.name: t.shard for t in b.layout.tensors}
    ta = {n: t for s in a.shards for n, t in s.tensors.items()}
    tb = {n: t for s in b.shards for n, t in s.tensors.items()}
    out = []
    for name in sorted(ta.keys() | tb.keys()):
        x, y = ta.get(name), tb.get(name)
        if x is None or y is None:
            ref = x if x is not None else y
            assert ref is not None
            out.append(TensorDifference(name, shard_of.get(name, -1), ref.dtype, list(ref.shape),
                                        _numel(ref.shape), _numel(ref.shape), None,
                                        "only in A" if y is None else "only in B"))
            continue
        diff = compare_bits(name, shard_of.get(name, -1), (x.dtype, x.shape, x.bits),
                            (y.dtype, y.shape, y.bits))
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


def _small_differences(small_a: SmallStates, small_b: SmallStates) -> list[StateDifference]:
    a, b = small_a.states, small_b.states
    out = []
    for name in sorted(a.keys() | b.keys()):
        if a.get(name) == b.get(name):
            continue
        kind = small_a.kinds.get(name) or small_b.kinds.get(name, "")
        if name not in a or name not in b:
            out.append(StateDifference(name, kind, [f"only in {'B' if name not in a else 'A'}"]))
            continue
        paths: list[str] = []
        _tree_diff(statecodec.unpack(a[name], f"A's small state {name!r}"),
                   statecodec.unpack(b[name], f"B's small state {name!r}"), "", paths)
        paths = [p.removeprefix(".") for p in paths]
        out.append(StateDifference(name, kind, paths[:MAX_PATHS], max(0, len(paths) - MAX_PATHS)))
    return out


def _tree_diff(x: Any, y: Any, path: str, out: list[str]) -> None:
    """Append ``path: x -> y`` for each leaf that differs (arrays and tensors by their bits)."""
    if isinstance(x, dict) and isinstance(y, dict):
        for k in sorted(x.keys() | y.keys(), key=str):
            if k not in x or k not in y:
                out.append(f"{path}.{k}: only in {'A' if k in x else 'B'}")
            else:
                _tree_diff(x[k], y[k], f"{path}.{k}", out)
        return
    if isinstance(x, list | tuple) and isinstance(y, list | tuple) and len(x) == len(y):
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            _tree_diff(u, v, f"{path}[{i}]", out)
        return
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        same = (x.dtype, x.shape) == (y.dtype, y.shape) and torch.equal(
            x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        if not same:
            out.append(f"{path}: differs ({x.numel()} elements)")
        return
    if isinstance(x, np.ndarray) and isinstance(y, np.ndarray):
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            out.append(f"{path}: differs ({x.size} elements)")
        return
    if type(x) is not type(y) or x != y:
        out.append(f"{path}: {_short(x)} -> {_short(y)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{type(value).__name__} of {len(text)} chars"


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


def _hyperparameters(a: _Side, b: _Side) -> list[str]:
    """Hyperparameters that differ, ``group G NAME: A's -> B's``: those the differing
    version's optimizer steps logged, else the optimizer's param groups (a small state)."""
    if a.steps and b.steps:
        pairs = [(unpack_hyperparams(x.hyperparams, "A's optimizer step"),
                  unpack_hyperparams(y.hyperparams, "B's optimizer step"))
                 for x, y in zip(a.steps, b.steps, strict=False)]
    else:
        pairs = [(_param_groups(a.state.small.states, "A"), _param_groups(b.state.small.states, "B"))]
    out: list[str] = []
    for groups_a, groups_b in pairs:
        for g, (x, y) in enumerate(zip(groups_a, groups_b, strict=False)):
            for key in sorted(x.keys() | y.keys()):
                if key != "params" and x.get(key) != y.get(key):
                    out.append(f"group {g} {key}: {_short(x.get(key))} -> {_short(y.get(key))}")
    return list(dict.fromkeys(out))


def _param_groups(states: Mapping[str, bytes], run: str) -> list[dict[str, Any]]:
    """The optimizer's param groups from its small state ([] without one)."""
    if "optimizer" not in states:
        return []
    tree = statecodec.unpack(states["optimizer"], f"{run}'s small state 'optimizer'")
    groups = tree.get("param_groups") if isinstance(tree, dict) else None
    return [g for g in groups if isinstance(g, dict)] if isinstance(groups, list) else []
