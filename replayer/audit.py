"""Auditing a run: its history (versions, snapshots, recoveries), diffs between two points,
and a timeline plot."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from eventlog import ConfigError, RunAddress, Target
from eventlog.events import Envelope, EnvironmentFingerprint, Resumed
from eventlog.fold.engine import ControlIndex, index_control
from eventlog.provenance import Consumed
from replayer.replay import replay, tensors_of
from snapshotter.provenance import consumed, stamps_of


@dataclass(frozen=True)
class HistoryRow:
    """One line of a run's history: a sealed version, a snapshot marker, or a recovery."""

    kind: str  # version | snapshot-begin | snapshot-end | recovery
    version: int
    step: int
    gsn: int
    time_ms: int
    writer: str
    detail: str
    metrics: dict[str, float]
    #: A version's encoding (codec, and why a predictive one was not used), else "".
    encoding: str = ""
    #: A version's encoded size as a fraction of its raw size, else ``None``.
    of_raw: float | None = None
    #: A resume whose environment fingerprint differs from the run's start: each setting
    #: that differs, ``{field: [at the start, at this resume]}``.
    environment: dict[str, list[Any]] = field(default_factory=dict)
    #: A version whose steps consumed stamped rollouts of this run: how many versions behind
    #: it their policies were, ``{min, median, max, count}`` over the rollouts (else ``None``).
    policy_lag: dict[str, float] | None = None
    #: The rollouts it consumed that another run's policy produced, by run.
    other_run_stamps: dict[str, int] = field(default_factory=dict)


def history(address: RunAddress) -> tuple[ControlIndex, list[HistoryRow]]:
    """Every sealed version, snapshot marker, recovery and resume of the run, in log order."""
    with address.open_log() as log:
        idx = index_control(log)
        stamps = consumed(log, idx)
    rows: list[tuple[int, HistoryRow]] = []
    last_session = None
    for info in sorted(idx.seals.values(), key=lambda i: i.offset):
        session = info.writer.partition("#")[2]
        if last_session is not None and session != last_session:
            rows.append((info.offset, HistoryRow(
                "recovery", info.version, info.step, info.gsn, info.time_ms, info.writer,
                f"a new writer session resumed after version {info.seal.base_version}", {})))
        last_session = session
        ratio = info.seal.encoded_bytes / info.seal.raw_bytes if info.seal.raw_bytes else 0.0
        rows.append((info.offset, HistoryRow(
            "version", info.version, info.step, info.gsn, info.time_ms, info.writer,
            f"{info.seal.encoding}, {ratio:.3f} of raw", idx.metrics.get(info.version, {}),
            info.seal.encoding, ratio,
            **lag_fields(address.run_id, info.version, stamps.get(info.version, [])))))
    for offset, env in idx.markers:
        kind = "snapshot-begin" if env.kind == "SnapshotBegin" else "snapshot-end"
        rows.append((offset, HistoryRow(kind, env.version, env.step, env.gsn, env.time_ms,
                                        env.writer, env.body.snapshot_id, {})))  # type: ignore[union-attr, arg-type]
    rows += resume_rows(idx)
    return idx, [r for _, r in sorted(rows, key=lambda r: r[0])]


def lag_fields(run_id: str, version: int, records: list[Consumed]) -> dict[str, Any]:
    """The ``policy_lag`` and ``other_run_stamps`` of a version of run ``run_id`` whose steps
    consumed the stamps of ``records``. The median of an even count is the mean of the two
    middle lags."""
    lags: Counter[int] = Counter()
    others: Counter[str] = Counter()
    for stamp, n in stamps_of(records):
        if stamp.run == run_id:
            lags[version - stamp.version] += n
        else:
            others[stamp.run] += n
    total = sum(lags.values())
    if not total:
        return {"other_run_stamps": dict(others)}
    ordered = sorted(lags.items())

    def nth(i: int) -> int:  # the i-th smallest lag, 0-based
        for lag, n in ordered:
            if i < n:
                return lag
            i -= n
        raise AssertionError("index past the count")

    median = (nth((total - 1) // 2) + nth(total // 2)) / 2
    return {"policy_lag": {"min": ordered[0][0], "median": median, "max": ordered[-1][0], "count": total},
            "other_run_stamps": dict(others)}


def start_fingerprint(idx: ControlIndex) -> EnvironmentFingerprint | None:
    """The environment the run started in (``None``: a log older than schema v4)."""
    for _, env in idx.environment:
        if isinstance(env.body, EnvironmentFingerprint) and env.body.reason == EnvironmentFingerprint.START:
            return env.body
    return None


def fingerprint_before(idx: ControlIndex, offset: int) -> EnvironmentFingerprint | None:
    """The newest environment fingerprint logged before control ``offset``."""
    found = None
    for at, env in idx.environment:
        if at < offset and isinstance(env.body, EnvironmentFingerprint):
            found = env.body
    return found


def resume_rows(idx: ControlIndex) -> list[tuple[int, HistoryRow]]:
    """A history row per ``Resumed`` event, marked where the environment differs from the
    run's start."""
    start = start_fingerprint(idx)
    rows = []
    for offset, env in idx.environment:
        if not isinstance(env.body, Resumed):
            continue
        now = fingerprint_before(idx, offset)
        changed = {} if start is None or now is None else start.differences(now)
        detail = resume_text(env)
        if changed:
            detail += "; ENVIRONMENT DIFFERS from the run's start: " + ", ".join(
                f"{k} {a} -> {b}" for k, (a, b) in changed.items())
        rows.append((offset, HistoryRow(
            "resume", env.body.restored_version, env.body.restored_step, env.gsn, env.time_ms,
            env.writer, detail, {}, environment={k: list(v) for k, v in changed.items()})))
    return rows


def resume_text(env: Envelope) -> str:
    """What a ``Resumed`` event says, in words."""
    body = env.body
    assert isinstance(body, Resumed)
    source = ("the start of the log" if body.snapshot_id is None
              else f"snapshot {body.snapshot_id} (version {body.snapshot_version})")
    return (f"restored version {body.restored_version} (step {body.restored_step}) from {source} + "
            f"{body.tail_versions} versions of log tail, state digest {body.state_digest.hex()}")


def history_json(rows: list[HistoryRow]) -> list[dict[str, Any]]:
    """History rows as JSON-ready dicts."""
    return [asdict(r) for r in rows]


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor changed between two points of the run."""

    name: str
    dtype: str
    shape: list[int]
    changed: int
    l2: float
    bit_equal: bool


def diff(address: RunAddress, a: Target, b: Target, *, workers: int = 2) -> list[TensorDiff]:
    """Per tensor: elements whose bits changed, L2 norm of the change, bit equality."""
    ta = tensors_of(replay(address, a, workers=workers)[0])
    tb = tensors_of(replay(address, b, workers=workers)[0])
    out = []
    for name in sorted(ta.keys() | tb.keys()):
        x, y = ta.get(name), tb.get(name)
        if x is None or y is None or x.shape != y.shape or x.dtype != y.dtype:
            ref = y if x is None else x
            assert ref is not None  # the name came from one of the two
            out.append(TensorDiff(name, str(ref.dtype).removeprefix("torch."), list(ref.shape),
                                  ref.numel(), float("nan"), False))
            continue
        bits_x, bits_y = x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)
        size = x.element_size()
        per_elem = (bits_x != bits_y).reshape(-1, size).any(dim=1) if x.numel() else bits_x[:0]
        changed = int(per_elem.sum())
        # The change in float64, so the norm of an fp16/bf16 change is not itself rounded.
        delta = (y.to(torch.float64) - x.to(torch.float64)) if not x.is_complex() else (y - x)
        l2 = float(torch.linalg.vector_norm(delta.reshape(-1))) if x.numel() else 0.0
        out.append(TensorDiff(name, str(x.dtype).removeprefix("torch."), list(x.shape), changed,
                              l2, changed == 0))
    return out


#: The metrics a timeline draws at most (one panel each); it names how many it left out.
PLOTTED_METRICS = 12


def plot_path(out: Path) -> Path:
    """The PNG file ``plot`` writes for ``--out``: ``out`` with ``.png`` added when it has
    no suffix; a clear error for a directory or another format."""
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory: name the PNG file to write")
    if out.suffix.lower() not in ("", ".png"):
        raise ConfigError(f"--out {out}: the timeline is a PNG; name a .png file")
    return out if out.suffix else out.with_name(out.name + ".png")


def plot(address: RunAddress, out: Path) -> Path:
    """Draw the run's metrics against versions, with snapshots and recoveries marked;
    returns the PNG file written (see ``plot_path``)."""
    out = plot_path(out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    idx, rows = history(address)
    versions = [r for r in rows if r.kind == "version"]
    every = sorted({k for r in versions for k in r.metrics})
    names = every[:PLOTTED_METRICS]
    fig, axes = plt.subplots(max(1, len(names)), 1, figsize=(10, 2.2 * max(1, len(names)) + 0.6),
                             sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names or ["(no metrics)"], strict=True):
        xs = [r.version for r in versions if name in r.metrics]
        ax.plot(xs, [r.metrics[name] for r in versions if name in r.metrics], lw=1.2)
        ax.set_ylabel(name, fontsize=8)
        for r in rows:
            if r.kind == "snapshot-end":
                ax.axvline(r.version, color="tab:green", lw=0.8, ls="--")
            elif r.kind == "recovery":
                ax.axvline(r.version, color="tab:red", lw=1.2)
    axes[-1, 0].set_xlabel("version (green dashed: snapshot, red: recovery)")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    left = f" ({len(every) - len(names)} more metrics not drawn)" if len(every) > len(names) else ""
    fig.suptitle(f"run {address.run_id}: {len(versions)} versions{left}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, format="png")
    plt.close(fig)
    return out
