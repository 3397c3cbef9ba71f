"""``python -m benchmarks``: Rewind side by side with torch.save / torch.load and Kafka's tools.

    python -m benchmarks [--size 100M|25M|5M] [--json out.json] [--repeats N]
                         [--only scenario,...] [--kafka BOOTSTRAP --redis URL]
    python -m benchmarks --sizes 1M,5M,25M,100M [--json out.json]   # one column per size
    python -m benchmarks --only multirank [--size 25M] [--ranks 2,4]  # FSDP2 (torchrun) vs DCP

Prints a table of figures, ratios and the issue's targets (PASS/MISS), and writes every
figure to JSON under stable keys: ``meta``, one object per scenario
(``commit_blocking_s``, ``commit_throughput_mb_s``, ``bytes_per_commit_ratio``,
``recovery_s``, ``kafka_produce_mb_s``, ``follower_sync_s``) and ``targets``. With
``--sizes``, the core scenarios and the recorder's memory at each size (``benchmarks.sizes``).
Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from . import multirank, sizes, weights
from .fmt import fmt
from .model import parse_size
from .scenarios import RECOVERY_LIMIT, SCENARIOS, Config, run_all

#: (key, scenario, figure path, comparison, limit, text)
TARGETS = [
    ("commit_blocking_vs_torch_save", "commit_blocking_s", "ratio_vs_torch_save", "<=", 0.15,
     "blocking <= 0.15 x torch.save"),
    ("commit_blocking_vs_memcpy", "commit_blocking_s", "ratio_vs_memcpy", "<=", 1.5,
     "blocking <= 1.5 x memcpy"),
    ("first_commits_vs_median", "commit_blocking_s", "first_commits_ratio", "<=", 2.0,
     "worst of first 3 <= 2 x median"),
    ("throughput_embedded_vs_torch_save_fsync", "commit_throughput_mb_s", "ratio_embedded", ">=",
     0.75, "embedded >= 0.75 x torch.save+fsync"),
    ("bytes_ratio_fp32", "bytes_per_commit_ratio", "fp32", "<=", 0.75,
     "fp32 Adam bytes/raw <= 0.75"),
    ("recovery_2_workers_vs_torch_load", "recovery_s", "ratio_2_workers_vs_torch_load", "<=", RECOVERY_LIMIT,
     "2 workers <= 1.5 x torch.load"),
    ("replay_speedup_2_vs_1", "recovery_s", "speedup_2_vs_1", ">=", 1.6,
     "2 workers >= 1.6x faster than 1"),
    ("kafka_vs_producer_performance", "kafka_produce_mb_s", "ratio", ">=", 0.7,
     "kafka >= 0.7 x ProducerPerformance"),
    ("predictive_bytes_ratio", "codec_compare", "predictive_bytes_per_commit_ratio", "<=", 0.35,
     "predictive bytes/raw <= 0.35"),
    ("predictive_encode_speedup", "codec_compare", "encode_speedup", ">=", 1.5,
     "predictive encode >= 1.5x XOR"),
]


def evaluate(results: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, scenario, path, op, limit, text in TARGETS:
        value = results.get(scenario, {}).get(path)
        if value is None:
            out[key] = {"value": None, "limit": limit, "op": op, "pass": None, "text": text}
            continue
        ok = value <= limit if op == "<=" else value >= limit
        out[key] = {"value": value, "limit": limit, "op": op, "pass": ok, "text": text}
    return out


def table(results: dict[str, Any]) -> Table:
    t = Table(title="Rewind benchmarks (medians)", show_lines=False)
    for col in ("scenario", "figure", "Rewind", "baseline", "ratio", "target", "result"):
        t.add_column(col, justify="right" if col in ("Rewind", "baseline", "ratio") else "left")
    targets = results.get("targets", {})

    def verdict(key: str) -> tuple[str, str]:
        tg = targets.get(key)
        if not tg:
            return "", ""
        text = f"{tg['op']} {tg['limit']}"
        if tg["pass"] is None:
            return text, "[yellow]not run[/]"
        return text, "[green]PASS[/]" if tg["pass"] else "[red]MISS[/]"

    def skipped(name: str) -> bool:
        r = results.get(name)
        if r is None:
            return True
        if "skipped" in r:
            t.add_row(name, "skipped", "", "", "", "", f"[yellow]{r['skipped']}[/]")
            return True
        return False

    if not skipped("commit_blocking_s"):
        r = results["commit_blocking_s"]
        t.add_row("commit_blocking_s", "commit() vs torch.save", fmt(r["rewind"], "ms"),
                  fmt(r["torch_save"], "ms"), fmt(r["ratio_vs_torch_save"], "x"),
                  *verdict("commit_blocking_vs_torch_save"))
        t.add_row("", "commit() vs memcpy", fmt(r["rewind"], "ms"), fmt(r["memcpy"], "ms"),
                  fmt(r["ratio_vs_memcpy"], "x", 2), *verdict("commit_blocking_vs_memcpy"))
        t.add_row("", "worst of first 3 commits vs the median",
                  fmt(r["rewind_allocating_commits_max"], "ms"), fmt(r["rewind"], "ms"),
                  fmt(r.get("first_commits_ratio"), "x", 2), *verdict("first_commits_vs_median"))
        t.add_row("", "training step: recording vs alone", fmt(r.get("train_step"), "ms"),
                  fmt(r.get("train_step_alone"), "ms"), fmt(r.get("train_step_ratio"), "x", 2), "", "")
    if not skipped("commit_throughput_mb_s"):
        r = results["commit_throughput_mb_s"]
        t.add_row("commit_throughput_mb_s", "embedded vs save+fsync", fmt(r["embedded"], "MB/s"),
                  fmt(r["torch_save_fsync"], "MB/s"), fmt(r["ratio_embedded"], "x"),
                  *verdict("throughput_embedded_vs_torch_save_fsync"))
        if r.get("kafka") is not None:
            t.add_row("", "kafka vs save+fsync", fmt(r["kafka"], "MB/s"),
                      fmt(r["torch_save_fsync"], "MB/s"), fmt(r["ratio_kafka"], "x"), "", "")
        t.add_row("", "median durable commit", fmt(r["embedded_median_durable_s"], "s"), "", "",
                  "", "")
        floor = r.get("write_floor")
        if floor:
            t.add_row("", "its bytes appended to a growing file (floor)", fmt(floor["append_s"], "s"),
                      fmt(floor["rewrite_s"], "s"), fmt(floor["append_s"] / floor["rewrite_s"], "x"),
                      "", "rewritten in a truncated file")
    if not skipped("bytes_per_commit_ratio"):
        r = results["bytes_per_commit_ratio"]
        t.add_row("bytes_per_commit_ratio", f"fp32 after {r.get('fp32_after_steps')} steps",
                  fmt(r.get("fp32")), "1.000", fmt(r.get("fp32")), *verdict("bytes_ratio_fp32"))
        t.add_row("", f"bf16 after {r.get('bf16_after_steps')} steps", fmt(r.get("bf16")),
                  "1.000", fmt(r.get("bf16")), "", "")
        t.add_row("", "first (FULL) commit fp32", fmt(r.get("fp32_full_commit")), "1.000", "", "", "")
    if not skipped("recovery_s"):
        _recovery_rows(t, results["recovery_s"], verdict)
    if not skipped("kafka_produce_mb_s"):
        r = results["kafka_produce_mb_s"]
        t.add_row("kafka_produce_mb_s", f"{r['record_bytes']} B records, acks=all",
                  fmt(r["rewind"], "MB/s"), fmt(r.get("producer_performance"), "MB/s"),
                  fmt(r.get("ratio"), "x", 2), *verdict("kafka_vs_producer_performance"))
    if not skipped("codec_compare"):
        r = results["codec_compare"]
        what = f"{r['params'] / 1e6:.0f}M Adam, {r['steps']} steps"
        target, status = verdict("predictive_bytes_ratio")
        t.add_row("codec_compare", f"bytes/commit vs raw, predictive vs XOR ({what})",
                  fmt(r["predictive_bytes_per_commit_ratio"]), fmt(r["xor_bytes_per_commit_ratio"]),
                  fmt(_div(r["predictive_bytes_per_commit_ratio"], r["xor_bytes_per_commit_ratio"]), "x", 2),
                  f"predictive {target}" if target else "", status)
        t.add_row("", "encode throughput predictive vs XOR", fmt(r["predictive_encode_mb_s"], "MB/s"),
                  fmt(r["xor_encode_mb_s"], "MB/s"), fmt(r["encode_speedup"], "x", 2),
                  *verdict("predictive_encode_speedup"))
        t.add_row("", "decode throughput predictive vs XOR", fmt(r["predictive_decode_mb_s"], "MB/s"),
                  fmt(r["xor_decode_mb_s"], "MB/s"), fmt(r["decode_speedup"], "x", 2), "", "")
    if not skipped("follower_sync_s"):
        r = results["follower_sync_s"]
        t.add_row("follower_sync_s", "one version / full sync", fmt(r["incremental"], "s"),
                  fmt(r["full_sync"], "s"), "", "", "")
    return t


def _recovery_rows(t: Table, r: dict[str, Any], verdict: Callable[[str], tuple[str, str]]) -> None:
    """The recovery scenario's rows: a replay against ``torch.load``, its floor and bounds."""
    tail = f"snap + {r['tail_versions']} versions"
    t.add_row("recovery_s", f"{tail}, 1 worker", fmt(r["workers_1"], "s"),
              fmt(r["torch_load"], "s"), fmt(_div(r["workers_1"], r["torch_load"]), "x", 2),
              "", "")
    t.add_row("", f"{tail}, 2 workers", fmt(r["workers_2"], "s"), fmt(r["torch_load"], "s"),
              fmt(r["ratio_2_workers_vs_torch_load"], "x", 2),
              *verdict("recovery_2_workers_vs_torch_load"))
    t.add_row("", "speedup 2 vs 1 workers", fmt(r["speedup_2_vs_1"], "x", 2), "", "",
              *verdict("replay_speedup_2_vs_1"))
    if r.get("speedup_2_vs_1_torch_1_thread") is not None:
        t.add_row("", f"{tail}, 1 worker, torch on 1 thread", fmt(r["workers_1_torch_1_thread"], "s"),
                  fmt(r["torch_load"], "s"),
                  fmt(_div(r["workers_1_torch_1_thread"], r["torch_load"]), "x", 2),
                  "", "")
        t.add_row("", "speedup 2 workers vs that", fmt(r["speedup_2_vs_1_torch_1_thread"], "x", 2),
                  "", "", "", "")
    if r.get("floor_2_workers") is not None:
        _recovery_floor_rows(t, r)
    if r.get("bus_speedup_2_vs_1") is not None:
        t.add_row("", "memory copy, 2 threads vs 1 (the bus)", fmt(r["bus_speedup_2_vs_1"], "x", 2),
                  "", "", "", "")
    if r.get("adam_tiles_speedup_2_vs_1") is not None:
        t.add_row("", "tiled fused Adam alone, 2 threads vs 1",
                  fmt(r["adam_tiles_speedup_2_vs_1"], "x", 2),
                  "", "", "", "")
    if r.get("snapshot_only_2_workers") is not None:
        t.add_row("", "snapshot alone (no tail, read), 2 workers", fmt(r["snapshot_only_2_workers"], "s"),
                  fmt(r["torch_load"], "s"), fmt(r["ratio_snapshot_only_vs_torch_load"], "x", 2),
                  "", "")
        t.add_row("", "each tail version, 2 workers", fmt(r["per_tail_version_2_workers"], "s"),
                  "", "", "", f"tail within target: {r['max_tail_versions_within_target']}")
    if r.get("floor_ratio_vs_torch_load") is not None:
        floor = r["torch_load"] + r["tail_versions"] * r["optimizer_step_s"]
        t.add_row("", f"estimate: torch.load + {r['tail_versions']} x optimizer.step() "
                  f"({fmt(r['optimizer_step_s'], 's')})", fmt(floor, "s"), fmt(r["torch_load"], "s"),
                  fmt(r["floor_ratio_vs_torch_load"], "x", 2), "", "")


def _recovery_floor_rows(t: Table, r: dict[str, Any]) -> None:
    """The recovery scenario's floor: what a replay with no overhead would take, and how
    far above it the replay runs."""
    load = r["torch_load"]

    def against_load(label: str, seconds: float | None, note: str = "") -> None:
        t.add_row("", label, fmt(seconds, "s"), fmt(load, "s"), fmt(_div(seconds, load), "x", 2), "",
                  note)

    parts = " + ".join(fmt(r[k], "s") for k in ("floor_read_2", "floor_steps_2", "floor_checks_2"))
    against_load("floor, 1 worker: read + steps + checks", r["floor_1_worker"])
    against_load("floor, 2 workers: read + steps + checks", r["floor_2_workers"], parts)
    against_load("floor, 2 workers, without the checks", r["floor_unchecked_2_workers"])
    t.add_row("", "floor speedup 2 vs 1 (a replay with no overhead)",
              fmt(r["floor_speedup_2_vs_1"], "x", 2), "", "", "", "")
    t.add_row("", "2 workers' time above the floor: replay / allowed",
              fmt(r["overhead_2_workers_s"], "s"), fmt(r["overhead_allowed_2_workers_s"], "s"),
              "", "",
              f"allowed: {RECOVERY_LIMIT} x load - floor")
    ceiling = r["max_speedup_2_vs_1_within_recovery_target"]
    speedup_limit = next(limit for key, *_, limit, _text in TARGETS if key == "replay_speedup_2_vs_1")
    t.add_row("", f"most 2 vs 1 with 2 workers <= {RECOVERY_LIMIT} x load (estimate)",
              fmt(ceiling, "x", 2), "", "", "",
              f"the floor misses {RECOVERY_LIMIT} x load" if ceiling is None
              else "both targets at once" if ceiling >= speedup_limit else "not both targets at once")


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def write_json(path: str, results: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=2, sort_keys=False)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    ap.add_argument("--size", help="fp32 parameters (100M, 25M, 5M, ...; default 100M)")
    ap.add_argument("--sizes", help="comma-separated sizes (e.g. 1M,5M,25M,100M): the core scenarios "
                    "and the recorder's memory at each, one column per size")
    ap.add_argument("--json", help="write every figure to this JSON file")
    ap.add_argument("--repeats", type=int, default=None,
                    help="repeats of replays, loads, produce runs and follower polls "
                         "(default 3, or 2 from 50M parameters up to stay under 10 minutes)")
    ap.add_argument("--versions", type=int, default=None,
                    help="versions committed after the FULL one (commit medians are over them)")
    ap.add_argument("--tail", type=int, default=None,
                    help="versions after the snapshot that recovery replays (default 10; at most "
                         "half of --versions). E.g. --versions 49 --tail 10: a 50-version log")
    ap.add_argument("--warmup-steps", type=int, default=None,
                    help="Adam steps before the first commit (the bytes target is after 100)")
    ap.add_argument("--codec-steps", type=int, default=100,
                    help="Adam steps of the predictive vs XOR comparison (default 100)")
    ap.add_argument("--only", help=f"comma-separated scenarios: {','.join(SCENARIOS)}; and "
                    f"{multirank.SCENARIO} (FSDP2 under torchrun vs DCP, only when named; default 25M); "
                    f"{weights.SCENARIO} (the bf16 weights stream; --size 25M,100M; only when named)")
    ap.add_argument("--ranks", help="world sizes of the multirank scenario (default 2,4)")
    ap.add_argument("--kafka", help="Kafka bootstrap (host:port) or kafka:// URL")
    ap.add_argument("--redis", help="Redis URL for the Kafka run's coordinator")
    ap.add_argument("--kafka-home", help="dir with Kafka's jars (default $REWIND_KAFKA_HOME)")
    ap.add_argument("--workdir", help="parent dir for the run's files (default: system tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the run's files")
    ap.add_argument("--quiet", action="store_true", help="only the table")
    args = ap.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if args.sizes and (args.size or args.only):
        ap.error("--sizes runs the core scenarios at each size: leave out --size and --only")
    if args.sizes:
        try:
            sizes.parse_sizes(args.sizes)
        except ValueError as exc:
            ap.error(str(exc))

    only = set(SCENARIOS)
    if args.only:
        only = {s.strip() for s in args.only.split(",") if s.strip()}
        unknown = only - set(SCENARIOS) - {multirank.SCENARIO, weights.SCENARIO}
        if unknown:
            ap.error(f"unknown scenario(s) {', '.join(sorted(unknown))}; known: "
                     f"{', '.join((*SCENARIOS, multirank.SCENARIO, weights.SCENARIO))}")
    console = Console(stderr=False)
    if not console.is_terminal:
        console = Console(stderr=False, width=150)
    log = (lambda _m: None) if args.quiet else (lambda m: console.print(m, markup=False,
                                                                          highlight=False))
    if args.sizes:
        results = sizes.run(args, console, log,
                            save=(lambda doc: write_json(args.json, doc)) if args.json else None)
        if args.json:
            console.print(f"figures written to {args.json}")
        return 0
    multi: dict[str, Any] | None = None
    if multirank.SCENARIO in only:
        only.discard(multirank.SCENARIO)
        try:
            multi = multirank.run_from_args(args, log)
        except ValueError as exc:
            ap.error(str(exc))
        console.print(multirank.table(multi))
        if not only:
            if args.json:
                write_json(args.json, multi)
                console.print(f"figures written to {args.json}")
            return 0
    if weights.SCENARIO in only:
        only.discard(weights.SCENARIO)
        stream = weights.run_from_args(args, log)
        console.print(weights.table(stream))
        if args.json:
            write_json(args.json, stream)
            console.print(f"figures written to {args.json}")
        if not only:
            return 0
    args.size = args.size or "100M"
    params = parse_size(args.size)
    repeats = args.repeats if args.repeats is not None else (3 if params < 50_000_000 else 2)
    cfg = Config(
        params=params, repeats=max(1, repeats), versions=_or(args.versions, 20), tail=_or(args.tail, 10),
        warmup_steps=_or(args.warmup_steps, 100), workdir=args.workdir, keep=args.keep,
        kafka=args.kafka, redis=args.redis, kafka_home=args.kafka_home, only=only, log=log,
        codec_steps=args.codec_steps,
    )
    t0 = time.perf_counter()
    results = run_all(cfg)
    meta = results.setdefault("meta", {})
    meta.update(
        command="python -m benchmarks " + " ".join(sys.argv[1:] if argv is None else argv),
        size=args.size, repeats=cfg.repeats, scenarios=sorted(only),
        torch=torch.__version__, python=platform.python_version(), cpus=os.cpu_count(),
        torch_threads=torch.get_num_threads(), machine=platform.machine(),
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        wall_s=time.perf_counter() - t0, mb="10^6 bytes",
        load_average=os.getloadavg(),
    )
    results["targets"] = evaluate(results)
    if multi is not None:
        results[multirank.SCENARIO] = multi[multirank.SCENARIO]
        results["targets"].update(multi["targets"])
        meta[multirank.SCENARIO] = multi["meta"]
    ordered = {k: results[k] for k in ("meta", *SCENARIOS, multirank.SCENARIO, "targets") if k in results}
    console.print(table(ordered))
    console.print(f"wall time {meta['wall_s']:.0f} s; load average at end "
                  f"{', '.join(f'{x:.2f}' for x in meta['load_average'])}")
    if args.json:
        write_json(args.json, ordered)
        console.print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
