"""Auditing a run: its history (versions, snapshots, recoveries), diffs between two points,
and a timeline plot."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eventlog import RunAddress, Target
from eventlog.fold.engine import ControlIndex, index_control
from replayer.replay import replay, tensors_of


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


def history(address: RunAddress) -> tuple[ControlIndex, list[HistoryRow]]:
    """Every sealed version, snapshot marker and recovery of the run, in log order."""
    with address.open_log() as log:
        idx = index_control(log)
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
            info.seal.encoding, ratio)))
    for offset, env in idx.markers:
        kind = "snapshot-begin" if env.kind == "SnapshotBegin" else "snapshot-end"
        rows.append((offset, HistoryRow(kind, env.version, env.step, env.gsn, env.time_ms,
                                        env.writer, env.body.snapshot_id, {})))  # type: ignore[union-attr]
    return idx, [r for _, r in sorted(rows, key=lambda r: r[0])]


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


def plot(address: RunAddress, out: Path) -> Path:
    """Draw the run's metrics against versions, with snapshots and recoveries marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idx, rows = history(address)
    versions = [r for r in rows if r.kind == "version"]
    names = sorted({k for r in versions for k in r.metrics})[:6]
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
    fig.suptitle(f"run {address.run_id}: {len(versions)} versions")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
