"""``python -m benchmarks --sizes 1M,5M,25M,100M``: the core scenarios at each size, one table.

Each size runs in fresh processes, one after the other, so that no size inherits what another
allocated: ``python -m benchmarks --size S --only commit_blocking_s,commit_throughput_mb_s,
recovery_s`` (its replays, loads and snapshotter in processes of their own), then the
recorder's memory runs of ``benchmarks.memory`` (each codec with snapshots on, and
``clone()`` staging), then a weights follower's first sync (``benchmarks.weights``). The
table has one column per size and judges each target per size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .memory import RESTORE_TARGET, recorder_runs
from .memory import TARGET as MEMORY_LIMIT
from .model import parse_size
from .scenarios import RECOVERY_LIMIT
from .weights import FOLLOWER_LIMIT, follower_memory

#: The scenarios each size runs.
CORE = ("commit_blocking_s", "commit_throughput_mb_s", "recovery_s")
#: Below this many parameters a commit or a recovery is judged by its milliseconds too: at
#: these sizes a fixed cost of a few milliseconds is a large ratio and no user-visible wait.
SMALL_PARAMS = 5_000_000
COMMIT_ABSOLUTE_S = 0.002
RECOVERY_ABSOLUTE_S = 0.050
COMMIT_LIMIT = 1.5
THROUGHPUT_LIMIT = 0.75
#: 2 workers' speedup over 1, as a share of the floor's own 2-vs-1 speedup in the same run.
SPEEDUP_SHARE = 0.95
#: Peak resident memory above the process's baseline, as a multiple of the state.
SNAPSHOTTER_LIMIT = 1.5
RECOVERY_PROCESS_LIMIT = 2.0
RESTORE_LIMIT = RESTORE_TARGET
#: The recorder's commits in each memory run (snapshots every ``memory.SNAPSHOT_EVERY``).
MEMORY_COMMITS = 12
#: Flags passed on to each size's scenario run: (attribute, flag).
PASSED_ON = (("repeats", "--repeats"), ("versions", "--versions"), ("tail", "--tail"),
             ("warmup_steps", "--warmup-steps"), ("kafka", "--kafka"), ("redis", "--redis"),
             ("kafka_home", "--kafka-home"), ("workdir", "--workdir"))
HERE = Path(__file__).resolve().parent.parent


def parse_sizes(text: str) -> list[str]:
    """``1M,5M,25M`` -> the sizes, each checked by ``parse_size``; a bad one raises ``ValueError``."""
    sizes = [s.strip() for s in text.split(",") if s.strip()]
    if not sizes:
        raise ValueError(f"--sizes {text!r} names no size: use e.g. 1M,5M,25M,100M")
    for s in sizes:
        parse_size(s)
    return sizes


def scenario_argv(size: str, json_path: str, args: argparse.Namespace) -> list[str]:
    """The ``python -m benchmarks`` arguments of one size's scenario run."""
    argv = ["--size", size, "--only", ",".join(CORE), "--json", json_path]
    for attr, flag in PASSED_ON:
        value = getattr(args, attr, None)
        if value is not None:
            argv += [flag, str(value)]
    return argv + [flag for attr, flag in (("keep", "--keep"), ("quiet", "--quiet")) if getattr(args, attr)]


def run_size(size: str, args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """One size: its scenario run and memory runs, each in fresh processes; their figures
    (``scenarios``, ``memory``) and ``targets``. A run that fails leaves ``error`` in its place."""
    out: dict[str, Any] = {"params": parse_size(size)}
    with tempfile.TemporaryDirectory(prefix="rewind-sizes-") as tmp:
        path = str(Path(tmp) / "scenarios.json")
        log(f"== {size}: scenarios {', '.join(CORE)}")
        done = subprocess.run([sys.executable, "-m", "benchmarks", *scenario_argv(size, path, args)],
                              cwd=str(HERE), check=False)
        if done.returncode == 0 and os.path.exists(path):
            with open(path) as f:
                out["scenarios"] = json.load(f)
        else:
            out["scenarios"] = {"error": f"python -m benchmarks --size {size} exited with "
                                         f"status {done.returncode}"}
    log(f"== {size}: the recorder's memory (fresh processes, {MEMORY_COMMITS} commits each)")
    out["memory"] = recorder_runs(size, MEMORY_COMMITS)
    for key, row in out["memory"].items():
        log(f"  {key}: " + (row["error"] if "error" in row else
                            f"peak {row['peak']:.2f}x, after {MEMORY_COMMITS} commits "
                            f"{row['rss_after_last']:.2f}x the state"))
    log(f"== {size}: a weights follower's first sync (bf16, embedded, a fresh process)")
    try:
        out["follower"] = follower_memory(parse_size(size))
        log(f"  follower: peak {out['follower']['peak_ratio']:.2f}x its bf16 model")
    except (RuntimeError, subprocess.SubprocessError) as exc:
        out["follower"] = {"error": str(exc)[-500:]}
        log(f"  follower: {out['follower']['error']}")
    out["targets"] = judge(out)
    return out


def _target(value: float | None, op: str, limit: float, text: str,
            absolute: tuple[float | None, float] | None = None) -> dict[str, Any]:
    """One judged target; ``absolute``: (seconds, limit) that passes whatever the ratio."""
    verdict: bool | None = None
    by_absolute = False
    if value is not None:
        verdict = value <= limit if op == "<=" else value >= limit
    if absolute is not None and absolute[0] is not None and absolute[0] < absolute[1]:
        by_absolute = verdict is not True
        verdict = True
    return {"value": value, "limit": limit, "op": op, "pass": verdict, "text": text,
            "passed_by_absolute": by_absolute,
            "absolute_limit_s": absolute[1] if absolute is not None else None}


def judge(size: dict[str, Any]) -> dict[str, Any]:
    """The targets of one size's figures (``run_size``); ``pass`` is ``None`` where a figure
    is missing. Below ``SMALL_PARAMS``, a commit blocking under ``COMMIT_ABSOLUTE_S`` or a
    2-worker recovery under ``RECOVERY_ABSOLUTE_S`` passes whatever its ratio."""
    sc = size.get("scenarios", {})
    blocking = sc.get("commit_blocking_s", {})
    throughput = sc.get("commit_throughput_mb_s", {})
    recovery = sc.get("recovery_s", {})
    small = size["params"] < SMALL_PARAMS
    floor_speedup = recovery.get("floor_speedup_2_vs_1")
    speedup = recovery.get("speedup_2_vs_1")
    out = {
        "commit_blocking_vs_memcpy": _target(
            blocking.get("ratio_vs_memcpy"), "<=", COMMIT_LIMIT, f"blocking <= {COMMIT_LIMIT} x memcpy",
            (blocking.get("rewind"), COMMIT_ABSOLUTE_S) if small else None),
        "throughput_vs_torch_save_fsync": _target(
            throughput.get("ratio_embedded"), ">=", THROUGHPUT_LIMIT,
            f"durable >= {THROUGHPUT_LIMIT} x torch.save+fsync"),
        "recovery_2_workers_vs_torch_load": _target(
            recovery.get("ratio_2_workers_vs_torch_load"), "<=", RECOVERY_LIMIT,
            f"2 workers <= {RECOVERY_LIMIT} x torch.load",
            (recovery.get("workers_2"), RECOVERY_ABSOLUTE_S) if small else None),
        "replay_speedup_vs_floor": _target(
            None if speedup is None or not floor_speedup else speedup / floor_speedup, ">=", SPEEDUP_SHARE,
            f"2-vs-1 >= {SPEEDUP_SHARE} x the floor's 2-vs-1"),
    }
    for codec in ("predictive", "xor"):
        row = size.get("memory", {}).get(codec, {})
        out[f"recorder_memory_{codec}"] = _target(row.get("peak"), "<=", MEMORY_LIMIT,
                                                  f"{codec} + snapshots, peak <= {MEMORY_LIMIT} x state")
    out["follower_memory"] = _target(size.get("follower", {}).get("peak_ratio"), "<=", FOLLOWER_LIMIT,
                                     f"weights follower's first sync, peak <= {FOLLOWER_LIMIT} x bf16 model")
    restore = size.get("memory", {}).get("restore", {})
    out["restore_memory"] = _target(restore.get("peak"), "<=", RESTORE_LIMIT,
                                    f"trainer's restore(), peak <= {RESTORE_LIMIT} x state")
    state = recovery.get("raw_state_bytes")
    for key, field, limit, text in (
            ("snapshotter_memory", "peak_extra_bytes_snapshotter", SNAPSHOTTER_LIMIT, "snapshotter process"),
            ("recovery_memory", "peak_extra_bytes_recover", RECOVERY_PROCESS_LIMIT,
             "rewind recover process")):
        out[key] = _target(_per_state(recovery.get(field), state), "<=", limit,
                           f"{text}, peak <= {limit} x state")
    return out


# ---------------------------------------------------------------------------- the table
def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.1f}" if s < 10 else f"{s * 1e3:.0f}"


def _x(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}x"


def _verdict(t: dict[str, Any] | None, value: str) -> str:
    if t is None or t["pass"] is None:
        return f"{value} [yellow]n/a[/]"
    word = "[green]PASS[/]" if t["pass"] else "[red]FAIL[/]"
    return f"{value} {word}" + (" (ms)" if t["passed_by_absolute"] else "")


def _per_state(b: int | None, state: int | None) -> float | None:
    return None if b is None or not state else b / state


def table(results: dict[str, Any]) -> Table:
    """One row per figure, one column per size; targets judged per size."""
    sizes: dict[str, dict[str, Any]] = results["sizes"]
    t = Table(title="Rewind at each size (medians; memory: peak resident above the baseline)")
    t.add_column("figure")
    t.add_column("target")
    for name in sizes:
        t.add_column(name, justify="right")

    def row(label: str, target: str, cell: Callable[[dict[str, Any]], str]) -> None:
        t.add_row(label, target, *(cell(s) for s in sizes.values()))

    def sc(s: dict[str, Any], key: str) -> dict[str, Any]:
        got: dict[str, Any] = s.get("scenarios", {}).get(key, {})
        return got

    def judged(key: str, fmt: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], str]:
        return lambda s: _verdict(s["targets"].get(key), fmt(s["targets"][key]))

    def mem(key: str, field: str = "peak") -> Callable[[dict[str, Any]], str]:
        def cell(s: dict[str, Any]) -> str:
            r = s.get("memory", {}).get(key, {})
            return "[red]error[/]" if "error" in r else _x(r.get(field))
        return cell

    def rec_mem(key: str) -> Callable[[dict[str, Any]], str]:
        def cell(s: dict[str, Any]) -> str:
            r = sc(s, "recovery_s")
            return _x(_per_state(r.get(key), r.get("raw_state_bytes")))
        return cell

    def state_mb(s: dict[str, Any]) -> str:
        state = s.get("scenarios", {}).get("meta", {}).get("raw_state_bytes") or next(
            (r["state_bytes"] for r in s.get("memory", {}).values() if "state_bytes" in r), None)
        return "-" if state is None else f"{state / 1e6:.0f}"

    row("state (MB)", "", state_mb)
    if any("error" in s.get("scenarios", {}) for s in sizes.values()):
        row("scenario run", "", lambda s: "[red]failed[/]" if "error" in s.get("scenarios", {}) else "ok")
    row("commit() blocking vs memcpy", f"<= {COMMIT_LIMIT}x", judged("commit_blocking_vs_memcpy",
                                                                      lambda g: _x(g["value"])))
    row("  ms: commit() / memcpy / torch.save", "", lambda s: " / ".join(
        _ms(sc(s, "commit_blocking_s").get(k)) for k in ("rewind", "memcpy", "torch_save")))
    row("  training step, recording vs alone", "",
        lambda s: _x(sc(s, "commit_blocking_s").get("train_step_ratio")))
    row("durable throughput vs torch.save+fsync", f">= {THROUGHPUT_LIMIT}x",
        judged("throughput_vs_torch_save_fsync", lambda g: _x(g["value"])))
    row("  ms: durable commit / save+fsync", "", lambda s: " / ".join((
        _ms(sc(s, "commit_throughput_mb_s").get("embedded_median_durable_s")),
        _ms(sc(s, "commit_blocking_s").get("torch_save_fsync")))))
    row("  ms: its bytes appended / rewritten", "", lambda s: " / ".join(
        _ms((sc(s, "commit_throughput_mb_s").get("write_floor") or {}).get(k))
        for k in ("append_s", "rewrite_s")))
    if any(sc(s, "commit_throughput_mb_s").get("ratio_kafka") is not None for s in sizes.values()):
        row("  kafka durable vs torch.save+fsync", "",
            lambda s: _x(sc(s, "commit_throughput_mb_s").get("ratio_kafka")))
    row("recovery, 2 workers vs torch.load", f"<= {RECOVERY_LIMIT}x",
        judged("recovery_2_workers_vs_torch_load", lambda g: _x(g["value"])))
    row("  ms: 2 workers / 1 worker / torch.load", "", lambda s: " / ".join(
        _ms(sc(s, "recovery_s").get(k)) for k in ("workers_2", "workers_1", "torch_load")))
    row("replay 2-vs-1 / floor's 2-vs-1", f">= {SPEEDUP_SHARE}",
        judged("replay_speedup_vs_floor", lambda g: "-" if g["value"] is None else f"{g['value']:.2f}"))
    row("  2-vs-1: replay / floor", "", lambda s: " / ".join(
        _x(sc(s, "recovery_s").get(k)) for k in ("speedup_2_vs_1", "floor_speedup_2_vs_1")))
    for codec in ("predictive", "xor"):
        row(f"recorder memory, {codec} + snapshots", f"<= {MEMORY_LIMIT}x",
            judged(f"recorder_memory_{codec}", lambda g: _x(g["value"])))
        row(f"  after {MEMORY_COMMITS} commits", "", mem(codec, "rss_after_last"))
    row("clone() staging (DCP-style), peak", "", mem("clone"))
    row("snapshotter process, peak", f"<= {SNAPSHOTTER_LIMIT}x", judged("snapshotter_memory",
                                                                       lambda g: _x(g["value"])))
    row("recovery process (rewind recover), peak", f"<= {RECOVERY_PROCESS_LIMIT}x",
        judged("recovery_memory", lambda g: _x(g["value"])))
    row("  replay alone (2 workers), peak", "", rec_mem("peak_extra_bytes_workers_2"))
    row("trainer's restore(), peak", f"<= {RESTORE_LIMIT}x",
        judged("restore_memory", lambda g: _x(g["value"])))
    row("  optimizer not stepped yet (its moments allocated)", "", mem("restore-fresh"))
    row("torch.load process, peak", "", rec_mem("peak_extra_bytes_torch_load"))
    row("weights follower's first sync, peak (x bf16 model)", f"<= {FOLLOWER_LIMIT}x",
        judged("follower_memory", lambda g: _x(g["value"])))
    return t


def run(args: argparse.Namespace, console: Console, log: Callable[[str], None],
        save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every size of ``args.sizes`` in turn; prints the table and returns the JSON document.
    ``save`` gets the document after each size, so a run stopped later keeps the sizes done."""
    import time

    t0 = time.perf_counter()
    sizes = parse_sizes(args.sizes)
    results: dict[str, Any] = {"meta": {}, "sizes": {}}
    for size in sizes:
        results["sizes"][size] = run_size(size, args, log)
        results["meta"] = _meta(args, sizes, time.perf_counter() - t0)
        if save is not None:
            save(results)
    console.print(table(results))
    console.print("(ms): passed by its milliseconds (below "
                  f"{SMALL_PARAMS / 1e6:.0f}M params: commit < {COMMIT_ABSOLUTE_S * 1e3:.0f} ms, "
                  f"recovery < {RECOVERY_ABSOLUTE_S * 1e3:.0f} ms). Memory: x the state's tensor bytes.")
    console.print(f"wall time {results['meta']['wall_s']:.0f} s; load average at end "
                  f"{', '.join(f'{x:.2f}' for x in results['meta']['load_average'])}")
    return results


def _meta(args: argparse.Namespace, sizes: list[str], wall_s: float) -> dict[str, Any]:
    import platform
    from datetime import UTC, datetime

    return {
        "command": "python -m benchmarks " + " ".join(args.argv), "sizes": sizes,
        "scenarios": list(CORE), "memory_commits": MEMORY_COMMITS, "python": platform.python_version(),
        "cpus": os.cpu_count(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_s": wall_s, "load_average": os.getloadavg(),
        "small_params": SMALL_PARAMS, "commit_absolute_s": COMMIT_ABSOLUTE_S,
        "recovery_absolute_s": RECOVERY_ABSOLUTE_S,
    }
