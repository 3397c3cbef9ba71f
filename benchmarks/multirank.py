"""``python -m benchmarks --only multirank``: Rewind on every rank of an FSDP2 job, beside DCP.

For each world size (``--ranks``, default 2 and 4), one ``torchrun`` job
(``python -m torch.distributed.run --nproc-per-node N``, gloo, CPU, a free master port) runs
``benchmarks._multirank_worker`` on every rank: the same model (``--size`` fp32 parameters,
default 25M, sharded by ``fully_shard``), AdamW, the same warm-up, then DCP's saves, Rewind's
recording, and both recoveries, side by side. This module aggregates the ranks' figures
(a rank's figure is its median over versions or repeats; the job's is the slowest rank's,
since a job waits for its slowest rank), judges the issue's four targets per world size, and
prints one table.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from ._multirank_worker import WorkerConfig
from .fmt import MB, fmt

SCENARIO = "multirank"
DEFAULT_SIZE = "25M"
DEFAULT_RANKS = (2, 4)

#: (key, figure, comparison, limit, text): the issue's targets, judged per world size.
TARGETS = [
    ("blocking_vs_async_save", "blocking_vs_async_save", "<=", 0.75,
     "commit blocking <= 0.75 x async_save blocking"),
    ("bytes_vs_dcp_checkpoint", "bytes_vs_dcp_checkpoint", "<=", 0.4,
     "bytes per commit <= 0.4 x DCP checkpoint"),
    ("snapshot_restore_vs_dcp_load", "snapshot_restore_vs_dcp_load", "<=", 1.2,
     "snapshot restore, no tail <= 1.2 x dcp.load"),
    ("tail_vs_bare_steps", "tail_vs_bare_steps", "<=", 1.3,
     "10-version tail <= 1.3 x 10 optimizer.step()"),
]


def _med(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(world: int, cfg: WorkerConfig, conf: Path, timeout: float) -> None:
    """Run one torchrun job of the worker on ``world`` ranks; raise with its output's tail on
    failure."""
    conf.write_text(json.dumps(asdict(cfg)))
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
         "-m", "benchmarks._multirank_worker", str(conf)],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=conf.parent)
    if done.returncode != 0:
        raise RuntimeError(f"the {world}-rank job exited with {done.returncode}: "
                           f"{(done.stderr or done.stdout)[-2000:]}")


def _slowest(ranks: Sequence[dict[str, Any]], key: str, skip: int = 0) -> float | None:
    """The largest over ranks of each rank's median of ``key`` (its first ``skip`` left out)."""
    meds = [_med(r[key][skip:]) for r in ranks]
    known = [m for m in meds if m is not None]
    return max(known) if known else None


def _per_repeat(ranks: Sequence[dict[str, Any]], key: str) -> list[float]:
    """Each repeat's slowest rank: the time the whole job took for that repeat."""
    return [max(vals) for vals in zip(*(r[key] for r in ranks), strict=True)]


def aggregate(ranks: Sequence[dict[str, Any]], tail: int) -> dict[str, Any]:
    """One world size's figures from its ranks' JSON (see ``benchmarks/README.md``)."""
    ranks = sorted(ranks, key=lambda r: int(r["rank"]))
    r0 = ranks[0]
    state = sum(int(r["local_state_bytes"]) for r in ranks)
    # Version 1 is FULL: the medians are over the one-step versions after it.
    raw = [sum(v) for v in zip(*(r["raw_bytes"] for r in ranks), strict=True)][1:]
    encoded = [sum(v) for v in zip(*(r["encoded_bytes"] for r in ranks), strict=True)][1:]
    durable = _per_repeat(ranks, "durable_s")[1:]
    blocking = _slowest(ranks, "blocking_s", skip=1)
    async_blocking = _slowest(ranks, "dcp_async_blocking_s")
    dcp_save = _med(_per_repeat(ranks, "dcp_save_s"))
    bytes_per_commit = _med([float(b) for b in encoded])
    checkpoint = int(r0["dcp_checkpoint_bytes"])
    loads = _per_repeat(ranks, "dcp_load_s")
    restore_tail = _med(_per_repeat(ranks, "restore_tail_s"))
    restore_snapshot = _med(_per_repeat(ranks, "restore_snapshot_s"))
    restore_ahead = _med(_per_repeat(ranks, "restore_snapshot_ahead_s"))
    dcp_load = _med(loads)
    bare = _med(_per_repeat(ranks, "bare_steps_s"))
    tail_cost = None if restore_tail is None or restore_snapshot is None else restore_tail - restore_snapshot
    in_tail = [r["optimizer_step_s"][-tail:] for r in ranks]
    return {
        "world": len(ranks),
        "params": int(r0["params"]),
        "width": int(r0["width"]),
        "layers": int(r0["layers"]),
        "state_bytes": state,
        "versions": len(durable),
        "tail_versions": tail,
        "blocking_s": blocking,
        "blocking_s_per_rank": [_med(r["blocking_s"][1:]) for r in ranks],
        "durable_s": _med(durable),
        "throughput_mb_s": sum(raw) / sum(durable) / MB if durable and sum(durable) else None,
        "bytes_per_commit": bytes_per_commit,
        "bytes_per_commit_vs_state": _ratio(bytes_per_commit, state),
        "full_commit_bytes": sum(r["encoded_bytes"][0] for r in ranks),
        "log_bytes": r0.get("log_bytes"),
        "restore_tail_s": restore_tail,
        "restore_snapshot_s": restore_snapshot,
        "restore_snapshot_ahead_s": restore_ahead,
        "tail_s": tail_cost,
        "snapshot_s": r0.get("snapshot_s"),
        "dcp_save_s": dcp_save,
        "dcp_save_mb_s": _ratio(state / MB, dcp_save),
        "dcp_async_blocking_s": async_blocking,
        "dcp_async_total_s": _med(_per_repeat(ranks, "dcp_async_total_s")),
        "dcp_load_s": dcp_load,
        "dcp_checkpoint_bytes": checkpoint,
        "bare_steps_s": bare,
        "tail_optimizer_steps_s": max(sum(steps) for steps in in_tail),
        "warmup_s": max(float(r["warmup_s"]) for r in ranks),
        "blocking_vs_async_save": _ratio(blocking, async_blocking),
        "bytes_vs_dcp_checkpoint": _ratio(bytes_per_commit, checkpoint),
        "snapshot_restore_vs_dcp_load": _ratio(restore_snapshot, dcp_load),
        "restore_tail_vs_dcp_load": _ratio(restore_tail, dcp_load),
        "tail_vs_bare_steps": _ratio(tail_cost, bare),
        "samples": {r["rank"]: {k: v for k, v in r.items() if isinstance(v, list)} for r in ranks},
    }


def evaluate(figures: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each target at each world size: ``multirank_<N>_<key>`` -> ``{value, limit, op, pass, text}``."""
    out: dict[str, Any] = {}
    for world, fig in figures.items():
        for key, path, op, limit, text in TARGETS:
            value = fig.get(path)
            ok = None if value is None else (value <= limit if op == "<=" else value >= limit)
            out[f"{SCENARIO}_{world}_{key}"] = {"value": value, "limit": limit, "op": op, "pass": ok,
                                                "text": f"{text} ({world} ranks)"}
    return out


def run(params: int, worlds: Sequence[int], *, warmup_steps: int, versions: int, tail: int, repeats: int,
        workdir: str | None, keep: bool, log: Callable[[str], None], timeout: float = 7200.0,
        cores: int | None = None) -> dict[str, Any]:
    """Run one job per world size; returns ``{meta, multirank: {N: figures}, targets}``."""
    versions = max(2, versions)
    tail = max(1, min(tail, versions // 2))
    cores = cores or os.cpu_count() or 1
    figures: dict[str, dict[str, Any]] = {}
    t_all = time.perf_counter()
    for world in worlds:
        if workdir:
            Path(workdir).mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix=f"rewind-bench-multirank{world}-", dir=workdir))
        (root / "log").mkdir()
        (root / "out").mkdir()
        cfg = WorkerConfig(
            params=params, warmup_steps=warmup_steps, versions=versions, tail=tail, repeats=repeats,
            dcp_saves=max(3, repeats), log_url=f"sqlite://{root / 'log' / 'rewind.db'}",
            run_id=f"bench-mr{world}", snapshots_url=f"file://{root / 'snapshots'}",
            dcp_dir=str(root / "dcp"), out=str(root / "out"))
        log(f"multirank, {world} ranks: torchrun job in {root} ({warmup_steps} warm-up steps, "
            f"v1 FULL + {versions} versions, snapshot at v{1 + versions - tail}, {repeats} repeats)")
        t0 = time.perf_counter()
        try:
            launch(world, cfg, root / "config.json", timeout)
            ranks = [json.loads((root / "out" / f"rank{r}.json").read_text()) for r in range(world)]
            fig = aggregate(ranks, tail)
            fig["job_s"] = time.perf_counter() - t0
            fig["ranks_per_core"] = world / cores
            figures[str(world)] = fig
            log(f"  {world} ranks done in {fig['job_s']:.0f} s")
        except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
            figures[str(world)] = {"world": world, "error": str(exc)[-2000:]}
            log(f"  {world} ranks failed: {str(exc)[-2000:]}")
        finally:
            if not keep:
                shutil.rmtree(root, ignore_errors=True)
    meta = {"params_requested": params, "ranks": list(worlds), "cores": cores, "warmup_steps": warmup_steps,
            "versions": versions, "tail": tail, "repeats": repeats, "wall_s": time.perf_counter() - t_all,
            "backend": "embedded (SQLite + segment files), gloo, CPU", "mb": "10^6 bytes",
            "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"), "load_average": os.getloadavg()}
    ok = {w: f for w, f in figures.items() if "error" not in f}
    return {"meta": meta, SCENARIO: figures, "targets": evaluate(ok)}


def notes(fig: dict[str, Any], cores: int) -> dict[str, str]:
    """Where this machine bounds a figure, per row key."""
    world = int(fig["world"])
    fold = "each rank folds its own shards"
    if world <= cores:
        return {"restore": fold}
    over = f"{world} ranks, {cores} cores"
    return {
        "blocking": f"{over}: copy vs others' encoding",
        "durable": f"{over}: encoders share them",
        "restore": f"{over}; {fold}",
        "dcp": over,
        "steps": f"{over}; {fold}",
    }


def table(doc: dict[str, Any]) -> Table:
    """The figures of every world size, Rewind beside DCP, and the targets judged PASS/FAIL."""
    cores = int(doc["meta"]["cores"])
    t = Table(title=f"Multi-rank FSDP2 (gloo, CPU, {cores} cores): Rewind vs DCP, slowest rank, medians")
    for col in ("ranks", "figure", "Rewind", "DCP / bare", "ratio", "target", "result", "notes"):
        t.add_column(col, justify="right" if col in ("Rewind", "DCP / bare", "ratio") else "left")
    targets = doc.get("targets", {})

    def verdict(world: str, key: str) -> tuple[str, str]:
        tg = targets.get(f"{SCENARIO}_{world}_{key}")
        if not tg:
            return "", ""
        text = f"{tg['op']} {tg['limit']}x"
        if tg["pass"] is None:
            return text, "[yellow]n/a[/]"
        return text, "[green]PASS[/]" if tg["pass"] else "[red]FAIL[/]"

    for world, fig in doc[SCENARIO].items():
        if "error" in fig:
            t.add_row(world, "failed", "", "", "", "", "[red]error[/]", fig["error"][-200:])
            continue
        n = notes(fig, cores)
        tail = fig["tail_versions"]
        t.add_row(world, f"state: {fig['params'] / 1e6:.1f}M params + AdamW", fmt(fig["state_bytes"], "MB"),
                  "", "", "", "", "")
        t.add_row("", "commit blocking / async_save blocking", fmt(fig["blocking_s"], "ms"),
                  fmt(fig["dcp_async_blocking_s"], "ms"), fmt(fig["blocking_vs_async_save"], "x", 2),
                  *verdict(world, "blocking_vs_async_save"), n.get("blocking", ""))
        t.add_row("", "durable commit / dcp.save", fmt(fig["durable_s"], "s"), fmt(fig["dcp_save_s"], "s"),
                  fmt(_ratio(fig["durable_s"], fig["dcp_save_s"]), "x", 2), "", "", n.get("durable", ""))
        t.add_row("", "throughput, state MB/s: commits / save", fmt(fig["throughput_mb_s"], "MB/s"),
                  fmt(fig["dcp_save_mb_s"], "MB/s"), "", "", "", "")
        t.add_row("", "dcp.async_save total", "", fmt(fig["dcp_async_total_s"], "s"), "", "", "",
                  n.get("dcp", ""))
        t.add_row("", "bytes per commit / DCP checkpoint", fmt(fig["bytes_per_commit"], "MB"),
                  fmt(fig["dcp_checkpoint_bytes"], "MB"), fmt(fig["bytes_vs_dcp_checkpoint"], "x", 3),
                  *verdict(world, "bytes_vs_dcp_checkpoint"), "predictive codec on each rank's shards")
        t.add_row("", f"restore, snapshot + {tail} / dcp.load", fmt(fig["restore_tail_s"], "s"),
                  fmt(fig["dcp_load_s"], "s"), fmt(fig["restore_tail_vs_dcp_load"], "x", 2), "", "",
                  n.get("restore", ""))
        t.add_row("", "restore, snapshot alone / dcp.load", fmt(fig["restore_snapshot_s"], "s"),
                  fmt(fig["dcp_load_s"], "s"), fmt(fig["snapshot_restore_vs_dcp_load"], "x", 2),
                  *verdict(world, "snapshot_restore_vs_dcp_load"), n.get("restore", ""))
        t.add_row("", "  its staging thread, after it returned",
                  fmt(fig.get("restore_snapshot_ahead_s"), "s"),
                  "", "", "", "", "the base's own bits, a staging set; the first commit waits for it")
        t.add_row("", f"the {tail}-version tail / {tail} bare steps", fmt(fig["tail_s"], "s"),
                  fmt(fig["bare_steps_s"], "s"), fmt(fig["tail_vs_bare_steps"], "x", 2),
                  *verdict(world, "tail_vs_bare_steps"), n.get("steps", "tail: the two restores' difference"))
    return t


def run_from_args(args: Any, log: Callable[[str], None]) -> dict[str, Any]:
    """``run`` with ``python -m benchmarks``'s options (``--size``, ``--ranks``, ``--versions``,
    ``--tail``, ``--repeats``, ``--warmup-steps``, ``--workdir``, ``--keep``)."""
    from .model import parse_size

    params = parse_size(args.size or DEFAULT_SIZE)
    ranks = args.ranks or ",".join(map(str, DEFAULT_RANKS))
    worlds = tuple(int(w) for w in ranks.split(",") if w.strip().isdigit())
    if not worlds or min(worlds) < 1 or len(worlds) != len([w for w in ranks.split(",") if w.strip()]):
        raise ValueError(f"--ranks {ranks!r}: use world sizes of at least 1, such as 2,4")
    doc = run(params, worlds,
               warmup_steps=100 if args.warmup_steps is None else args.warmup_steps,
               versions=20 if args.versions is None else args.versions,
               tail=10 if args.tail is None else args.tail,
               repeats=3 if args.repeats is None else max(1, args.repeats),
               workdir=args.workdir, keep=args.keep, log=log)
    doc["meta"]["command"] = "python -m benchmarks " + " ".join(getattr(args, "argv", None) or sys.argv[1:])
    return doc
