"""The benchmark scenarios, each measured side by side with the tool a user would use instead.

One fp32 recording run feeds four scenarios: after the warm-up steps, version 1 (FULL) is
committed, then ``versions`` versions of one real Adam step each. For every version the
training thread's blocked time in ``commit()``, the time until it is durable, and its
raw/encoded bytes are recorded; the same state is then ``torch.save``d (timed to the page
cache, then the fsync) and memory-copied into preallocated buffers. A snapshot is
written ``tail`` versions before the end (10 by default, at most ``versions/2``), so the
run ends as "newest snapshot + a ``tail``-version tail", which the
recovery scenario replays with 1 and 2 workers against ``torch.load`` of the newest
checkpoint. Every figure is a median over versions (commit scenarios) or repeats.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import inspect
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eventlog import RunAddress
from eventlog.settings import current
from rewind.recorder import Recorder

from . import writefloor
from .model import AdamScaling, BusScaling, MemcpyFloor, Workload, save_checkpoint

MB = 1e6  # every MB/s figure is 10^6 bytes per second

SCENARIOS = (
    "commit_blocking_s",
    "commit_throughput_mb_s",
    "bytes_per_commit_ratio",
    "recovery_s",
    "kafka_produce_mb_s",
    "follower_sync_s",
    "codec_compare",
)
#: The codec comparison trains at most this many parameters (the issue asks for >= 25M).
CODEC_MAX_PARAMS = 25_000_000
#: The bf16 ratio is measured on at most this many parameters (it does not depend on size).
BF16_MAX_PARAMS = 25_000_000
#: At most this many torch.save baselines (each about 2 s at 100M): a long log for the
#: recovery scenario (``--versions 49``) need not repeat them 49 times.
BASELINE_REPEATS = 20
#: Scenarios that need the fp32 recording run.
RECORDING = {"commit_blocking_s", "commit_throughput_mb_s", "bytes_per_commit_ratio", "recovery_s"}


@dataclass
class Config:
    params: int
    repeats: int = 3
    versions: int = 20
    tail: int = 10  # versions after the snapshot (at most versions // 2)
    warmup_steps: int = 100
    bf16_warmup_steps: int = 20
    bf16_versions: int = 5
    codec_steps: int = 100
    workdir: str | None = None
    keep: bool = False
    kafka: str | None = None
    redis: str | None = None
    kafka_home: str | None = None
    only: set[str] = field(default_factory=lambda: set(SCENARIOS))
    log: Callable[[str], None] = print


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


#: Issue 6's recovery target: 2 workers at most this many times ``torch.load``.
RECOVERY_LIMIT = 1.5


def _joint_ceiling(floor_1: float | None, floor_2: float | None, load: float | None) -> float | None:
    """An estimate of the highest 2-vs-1 speedup a replay can have while its 2-worker time
    meets the recovery target (<= ``RECOVERY_LIMIT`` x ``torch.load``), given the floors
    (``benchmarks.floor``). A model, not a proof: it assumes a second worker at best halves
    the replay's overhead (the time above the floor); ``docs/performance.md`` gives the
    measured ratio of the two overheads.

    With ``o2`` the 2-worker overhead and ``o1 <= 2 x o2``, the speedup is at most
    ``(floor_1 + 2 x o2) / (floor_2 + o2)``. The target caps ``o2`` at
    ``RECOVERY_LIMIT x load - floor_2``; the bound grows with ``o2`` while
    ``floor_1 < 2 x floor_2`` and shrinks otherwise, so it is the larger of its values at
    the two ends. ``None``: no figures, or the floor itself misses the target (then no
    replay meets it).
    """
    if floor_1 is None or floor_2 is None or not load or RECOVERY_LIMIT * load < floor_2 or floor_2 <= 0:
        return None
    o2 = RECOVERY_LIMIT * load - floor_2
    return max(floor_1 / floor_2, (floor_1 + 2 * o2) / (floor_2 + o2))


def _floor_steps(base: list[str], repeats: int, tail: int,
                 state_bytes: int) -> tuple[dict[str, Any] | None, str | None]:
    """The floor's steps and checks (``benchmarks.floor.measure_steps``, in a fresh
    process), or why not: a failure there costs the floor rows, not the replay figures.
    Not started when it would not fit in the memory available now: it holds the state
    twice and the tail's gradients once (Adam: a third of the state per version)."""
    need = int(state_bytes * (2 + tail / 3))
    available = _available_bytes()
    if available is not None and need > 0.9 * available:
        return None, (f"the floor's steps need about {need / MB:.0f} MB, and {available / MB:.0f} MB "
                      "is available")
    try:
        floor = _timed(["steps", *base, str(repeats)])
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
        return None, str(exc)[-500:]
    if floor["tail_versions"] != tail:
        return None, f"the floor folded a {floor['tail_versions']}-version tail, the replays {tail}"
    return floor, None


def _available_bytes() -> int | None:
    """``MemAvailable`` from ``/proc/meminfo``, or ``None`` where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _sum(*xs: float | None) -> float | None:
    """The sum, or ``None`` if any term is missing."""
    known = [x for x in xs if x is not None]
    return sum(known) if len(known) == len(xs) else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def kafka_url(bootstrap: str, prefix: str = "rewindbench") -> str:
    """A ``kafka://`` log URL from a bootstrap list or URL."""
    if bootstrap.startswith("kafka://"):
        return bootstrap if "prefix=" in bootstrap else (
            bootstrap + ("&" if "?" in bootstrap else "?") + f"prefix={prefix}")
    return f"kafka://{bootstrap}?prefix={prefix}"


def bootstrap_of(kafka: str) -> str:
    return kafka.removeprefix("kafka://").split("?")[0]


# ---------------------------------------------------------------------------- recording
@dataclass
class Recording:
    """Per-version samples of one recording run (index 0 is the FULL version 1)."""

    raw_state_bytes: int = 0
    blocking: list[float] = field(default_factory=list)
    durable: list[float] = field(default_factory=list)
    raw: list[int] = field(default_factory=list)
    encoded: list[int] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    save_s: list[float] = field(default_factory=list)
    fsync_s: list[float] = field(default_factory=list)
    memcpy_s: list[float] = field(default_factory=list)
    #: A training step's wall time with no recorder open, and with one recording each step.
    step_alone_s: list[float] = field(default_factory=list)
    step_recording_s: list[float] = field(default_factory=list)
    snapshot_s: float | None = None
    snapshot_version: int | None = None
    #: The snapshotter process's peak resident memory above its own baseline.
    snapshot_peak_extra_bytes: int | None = None
    last_checkpoint: str | None = None

    def deltas(self, xs: list[Any]) -> list[Any]:
        return xs[1:]


def baselines(cfg: Config, work: Workload, path: Path, n: int, r: Recording) -> None:
    """``n`` times: one training step, then the memory copy of the state, then ``torch.save``
    of it (timed to the page cache, then to the end of its fsync). The copy is timed where a
    commit's is, right after a step: repeated back to back, a state that fits in the cache
    would be copied from and into cached memory, which no commit after a step meets. Run with
    no recorder open, so no background work of Rewind's (encode, WAL checkpoint) competes
    with the baselines."""
    floor = MemcpyFloor(work)
    for _ in range(min(n, BASELINE_REPEATS)):
        r.step_alone_s.append(_timed_step(work))
        gc.collect()
        r.memcpy_s.append(floor())
        t0 = time.perf_counter()
        tree = work.checkpoint()
        with open(path, "wb") as f:
            torch.save(tree, f)
            t1 = time.perf_counter()
            f.flush()
            os.fsync(f.fileno())
        t2 = time.perf_counter()
        del tree
        r.save_s.append(t1 - t0)
        r.fsync_s.append(t2 - t0)
    cfg.log(f"  torch.save {med(r.save_s):.3f} s, +fsync {med(r.fsync_s):.3f} s, "
            f"memcpy {statistics.median(r.memcpy_s) * 1e3:.1f} ms (medians of {n})")
    path.unlink(missing_ok=True)


def record(
    cfg: Config, work: Workload, address: RunAddress, *, versions: int,
    snapshot_at: int | None, label: str,
    before_close: Callable[[Recorder, Recording], None] | None = None,
    recording: Recording | None = None, restorer: Any = None,
) -> Recording:
    """Commit version 1 (FULL) then ``versions`` one-step versions; see the module doc."""
    rec_out = recording or Recording()
    rec_out.raw_state_bytes = work.raw_bytes()
    with Recorder(address, work.model, work.optimizer, work.scheduler, rng=True,
                  restorer=restorer) as rec:
        # As every trainer starts (README): a fresh run's restore() finds nothing to load and
        # allocates the staging buffers its first commits copy into.
        rec.restore()
        for i in range(versions + 1):
            if i:
                rec_out.step_recording_s.append(_timed_step(work))
            gc.collect()
            t0 = time.perf_counter()
            fut = rec.commit(work.steps_done, {"i": float(i)})
            t1 = time.perf_counter()
            res = fut.result()
            t2 = time.perf_counter()
            rec_out.blocking.append(t1 - t0)
            rec_out.durable.append(t2 - t0)
            rec_out.raw.append(res.raw_bytes)
            rec_out.encoded.append(res.encoded_bytes)
            rec_out.events.append(res.events)
            cfg.log(f"  {label} v{res.version}: blocked {rec_out.blocking[-1] * 1e3:.1f} ms, "
                    f"durable {rec_out.durable[-1]:.2f} s, "
                    f"{res.encoded_bytes / max(1, res.raw_bytes):.3f} of {res.raw_bytes / MB:.0f} MB")
            if snapshot_at is not None and res.version == snapshot_at:
                # A snapshotter process folds the log, as a deployment runs one: in this
                # process its state would be one more full copy beside the trainer's.
                got = _timed(["snapshot", *_address_args(address)])
                rec_out.snapshot_s = got["seconds"]
                rec_out.snapshot_version = got["version"]
                rec_out.snapshot_peak_extra_bytes = got["peak_extra_bytes"]
                cfg.log(f"  snapshot of v{rec_out.snapshot_version} in {rec_out.snapshot_s:.2f} s "
                        f"(snapshotter process: {got['peak_extra_bytes'] / MB:.0f} MB peak)")
        if before_close is not None:
            before_close(rec, rec_out)
    return rec_out


def _timed_step(work: Workload) -> float:
    """Seconds of one training step (forward, backward, optimizer, scheduler)."""
    t0 = time.perf_counter()
    work.step()
    return time.perf_counter() - t0


def blocking_figures(r: Recording) -> dict[str, Any]:
    rewind = med(r.deltas(r.blocking))
    save = med(r.save_s)
    memcpy = med(r.memcpy_s)
    return {
        "rewind": rewind,
        "rewind_first_commit": r.blocking[0] if r.blocking else None,
        # Staging buffers are allocated at restore(): the first commits copy like the rest.
        "rewind_allocating_commits_max": max(r.blocking[:3]) if r.blocking else None,
        "first_commits_ratio": _ratio(max(r.blocking[:3]), rewind) if r.blocking else None,
        "torch_save": save,
        "torch_save_fsync": med(r.fsync_s),
        "memcpy": memcpy,
        "ratio_vs_torch_save": _ratio(rewind, save),
        "ratio_vs_memcpy": _ratio(rewind, memcpy),
        # What the recorder's background work costs the training loop itself.
        "train_step": med(r.step_recording_s),
        "train_step_alone": med(r.step_alone_s),
        "train_step_ratio": _ratio(med(r.step_recording_s), med(r.step_alone_s)),
        "versions": len(r.deltas(r.blocking)),
        "samples": {"rewind": r.blocking, "torch_save": r.save_s, "memcpy": r.memcpy_s,
                    "train_step": r.step_recording_s, "train_step_alone": r.step_alone_s},
    }


def throughput_of(r: Recording) -> dict[str, Any]:
    raw = r.deltas(r.raw)
    dur = r.deltas(r.durable)
    return {
        "mb_s": sum(raw) / sum(dur) / MB if dur else None,
        "median_version_mb_s": med([b / t / MB for b, t in zip(raw, dur, strict=True)]),
        "median_durable_s": med(dur),
        "full_commit_s": r.durable[0] if r.durable else None,
        "versions": len(dur),
    }


def torch_save_fsync_mb_s(r: Recording) -> float | None:
    if not r.fsync_s:
        return None
    return r.raw_state_bytes * len(r.fsync_s) / sum(r.fsync_s) / MB


def bytes_ratio_of(r: Recording) -> dict[str, Any]:
    raw, enc = r.deltas(r.raw), r.deltas(r.encoded)
    return {
        "ratio": med([e / b for e, b in zip(enc, raw, strict=True)]) if raw else None,
        "aggregate": sum(enc) / sum(raw) if raw else None,
        "full_commit": r.encoded[0] / r.raw[0] if r.raw else None,
        "raw_state_bytes": r.raw_state_bytes,
        "versions": len(raw),
    }


# ---------------------------------------------------------------------------- recovery
def _address_args(address: RunAddress) -> list[str]:
    """``benchmarks._timed``'s log, coordinator, run and snapshot arguments."""
    return [address.log_url, address.coord_url, address.run_id, address.snapshots_url or ""]


def _timed(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``benchmarks._timed`` in a fresh process (``env``: added to this one's);
    returns its JSON line."""
    out = subprocess.run([sys.executable, "-m", "benchmarks._timed", *args], check=False,
                         capture_output=True, text=True, timeout=1800,
                         cwd=str(Path(__file__).resolve().parent.parent),
                         env={**os.environ, **env} if env else None)
    if out.returncode:
        raise RuntimeError(f"benchmarks._timed {args[0]} failed: {out.stderr[-2000:]}")
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _give_back_freed_memory(cfg: Config) -> None:
    """Return the heap memory this process freed to the kernel, so that the work that
    comes next (the recorder, the recovery's processes) meets the memory a fresh process
    would, not this one's leftovers: glibc keeps freed buffers of a few MB in its heap, and
    with them the floor's first process once ran the machine down to 0.2 GB free and
    evicted page cache before the replays were timed. Logs the resident size before and
    after."""
    try:
        before = _resident_bytes()
        ctypes.CDLL(None).malloc_trim(0)
        after = _resident_bytes()
    except (OSError, AttributeError):  # no /proc, or not glibc
        return
    cfg.log(f"  this process: {before / MB:.0f} MB resident, {after / MB:.0f} MB after giving "
            "back what it freed")


def recovery(cfg: Config, address: RunAddress, r: Recording, step_s: float | None) -> dict[str, Any]:
    """Replay (1 and 2 workers) and ``torch.load``, each timed in a fresh process as after a
    crash; the replayed bits are checked once, in another, against the checkpoint of the
    live state (``r.last_checkpoint``). ``step_s``: the trainer's ``optimizer.step()``."""
    if not r.last_checkpoint:
        raise ValueError("recovery needs the checkpoint of the live state (Recording.last_checkpoint)")
    _give_back_freed_memory(cfg)
    base = _address_args(address)
    check = _timed(["check", *base, r.last_checkpoint])
    tail, snapshot_version = check["tail_versions"], check["snapshot_version"]
    cfg.log(f"  replayed state is bit-identical to the live state (v{check['version']}: "
            f"snapshot v{snapshot_version} + {tail} versions, {check['tensors']} tensors)")
    with tempfile.TemporaryDirectory(prefix="rewind-recover-", dir=os.path.dirname(r.last_checkpoint)) as out:
        recover = _timed(["recover", *base, out])  # ``rewind recover``: replay, then write it out
    cfg.log(f"  recover (replay + checkpoint written): {recover['seconds']:.2f} s, "
            f"{recover['peak_extra_bytes'] / MB:.0f} MB peak")
    # The floor (``benchmarks.floor``): the tail's optimizer steps and the state's checks
    # alone, bare, in one fresh process; then (in the loop below, interleaved with the
    # replays) the snapshot's files alone read into fresh memory, each in a fresh process.
    repeats = max(5, cfg.repeats)
    floor, floor_error = _floor_steps(base, repeats, tail, r.raw_state_bytes) if snapshot_version \
        else (None, "no snapshot")
    if floor:
        cfg.log(f"  floor: the tail's optimizer steps alone, 1 thread {floor['steps_1']:.2f} s, "
                f"2 threads {floor['steps_2']:.2f} s; the checks alone {floor['checks_1']:.2f} s, "
                f"{floor['checks_2']:.2f} s")
    else:
        cfg.log(f"  floor: not measured ({floor_error})")
    files: list[str] = floor["files"] if floor else []
    reads: dict[int, list[float]] = {1: [], 2: []}
    times: dict[int, list[float]] = {1: [], 2: []}
    # One worker with torch's intra-op threads cut to one: a 1-worker replay otherwise runs
    # each Adam step on every core torch has, so "1 worker" is not "1 core".
    one_thread: list[float] = []
    loads: list[float] = []
    # Each fresh process's peak resident memory above its own baseline, bytes.
    peaks: dict[str, list[int]] = {"torch_load": [], "workers_1": [], "workers_2": []}
    # At least 5 repeats, torch.load interleaved with the replays: on this shared VM one
    # process can take 30% longer than the next, for minutes (a median of 2 is just their
    # mean, and loads timed in a block after the replays met another spell than they did).
    for _ in range(repeats):
        if r.last_checkpoint:
            got = _timed(["load", r.last_checkpoint])
            loads.append(got["seconds"])
            peaks["torch_load"].append(got["peak_extra_bytes"])
            cfg.log(f"  torch.load(weights_only=True): {loads[-1]:.2f} s")
        for workers in (1, 2):
            got = _timed(["replay", *base, str(workers), "latest"])
            times[workers].append(got["seconds"])
            peaks[f"workers_{workers}"].append(got["peak_extra_bytes"])
            cfg.log(f"  replay, {workers} worker(s): {got['seconds']:.2f} s "
                    f"(snapshot v{got['snapshot_version']}, tail {got['tail_versions']})")
        one_thread.append(_timed(["replay", *base, "1", "latest"], env={"OMP_NUM_THREADS": "1"})["seconds"])
        cfg.log(f"  replay, 1 worker, torch on 1 thread: {one_thread[-1]:.2f} s")
        for threads in (1, 2) if files else ():
            reads[threads].append(_timed(["read", str(threads), *files])["seconds"])
        if files:
            cfg.log(f"  floor: the snapshot's files read alone, 1 thread {reads[1][-1]:.2f} s, "
                    f"2 threads {reads[2][-1]:.2f} s")
    # The snapshot alone (replay to the snapshot's own version: no tail): what one tail
    # version costs, and how long a tail still meets the target, follow from it. Read as a
    # replay with a tail reads it (such a replay would otherwise map the files instead).
    snap_only: list[float] = []
    if snapshot_version:
        for _ in range(repeats):
            got = _timed(["replay", *base, "2", f"version={snapshot_version}"],
                         env={"REWIND_SNAPSHOT_MAP": "0"})
            snap_only.append(got["seconds"])
        cfg.log(f"  replay to the snapshot's version (tail 0, files read), 2 workers: {med(snap_only):.2f} s")
    bus = BusScaling()
    bus_speedups = [bus() for _ in range(repeats)]
    del bus
    cfg.log(f"  memory copy, 2 threads vs 1: {med(bus_speedups):.2f}x")
    adam = AdamScaling(steps=tail or 10)
    adam_speedups = [adam() for _ in range(repeats)]
    del adam
    cfg.log(f"  tiled fused Adam alone, 2 threads vs 1: {med(adam_speedups):.2f}x")
    w1, w2, load = med(times[1]), med(times[2]), med(loads)
    floor = floor or dict.fromkeys(("steps_1", "steps_2", "checks_1", "checks_2", "samples",
                                    "peak_extra_bytes"))
    floor_1 = _sum(med(reads[1]), floor["steps_1"], floor["checks_1"])
    floor_2 = _sum(med(reads[2]), floor["steps_2"], floor["checks_2"])
    unchecked_2 = _sum(med(reads[2]), floor["steps_2"])
    s0 = med(snap_only)
    per_version = (w2 - s0) / tail if w2 is not None and s0 is not None and tail else None
    budget = None
    if per_version and load is not None and s0 is not None:
        allowed = RECOVERY_LIMIT * load
        budget = max(0, int((allowed - s0) // per_version)) if allowed >= s0 else -1
    return {
        "workers_1": w1,
        "workers_2": w2,
        "torch_load": load,
        "ratio_2_workers_vs_torch_load": _ratio(w2, load),
        "speedup_2_vs_1": _ratio(w1, w2),
        "workers_1_torch_1_thread": med(one_thread),
        "speedup_2_vs_1_torch_1_thread": _ratio(med(one_thread), w2),
        "tail_versions": tail,
        "snapshot_version": snapshot_version,
        "snapshot_write_s": r.snapshot_s,
        "snapshot_only_2_workers": s0,
        "ratio_snapshot_only_vs_torch_load": _ratio(s0, load),
        "per_tail_version_2_workers": per_version,
        # Longest tail that still meets "<= 1.5 x torch.load" (-1: not even the snapshot).
        "max_tail_versions_within_target": budget,
        # An estimate, not a floor (the key keeps its old name): torch.load of the same bytes
        # plus the optimizer step the trainer ran, per tail version. A replay's snapshot load
        # is faster than torch.load (2 workers), and its steps run tile by tile.
        "optimizer_step_s": step_s,
        "floor_ratio_vs_torch_load": _ratio(load + tail * step_s, load) if load and step_s else None,
        # The floor of a verified replay of this design (``benchmarks.floor``): the snapshot's
        # files read into fresh memory, the tail's optimizer steps on that state, and the
        # state's three hash passes, each timed bare; and without the hashes.
        "floor_read_1": med(reads[1]),
        "floor_read_2": med(reads[2]),
        "floor_steps_1": floor["steps_1"],
        "floor_steps_2": floor["steps_2"],
        "floor_checks_1": floor["checks_1"],
        "floor_checks_2": floor["checks_2"],
        "floor_1_worker": floor_1,
        "floor_2_workers": floor_2,
        "floor_2_workers_vs_torch_load": _ratio(floor_2, load),
        "floor_speedup_2_vs_1": _ratio(floor_1, floor_2),
        "floor_unchecked_2_workers": unchecked_2,
        "floor_unchecked_2_workers_vs_torch_load": _ratio(unchecked_2, load),
        "floor_error": floor_error,
        # The replay's time above its floor, and the most the recovery target leaves for it.
        "overhead_2_workers_s": None if w2 is None or floor_2 is None else w2 - floor_2,
        "overhead_allowed_2_workers_s": None if load is None or floor_2 is None
        else RECOVERY_LIMIT * load - floor_2,
        "max_speedup_2_vs_1_within_recovery_target": _joint_ceiling(floor_1, floor_2, load),
        # The memory bus's own 2-thread speedup, measured in the same run: the ceiling of
        # the replay's memory-bound part (reading records, hashing, streaming the state).
        "bus_speedup_2_vs_1": med(bus_speedups),
        # torch's fused Adam run tile by tile as the replay runs it, no Rewind code: the
        # ceiling of the replay's arithmetic on this machine.
        "adam_tiles_speedup_2_vs_1": med(adam_speedups),
        # Peak resident memory above each fresh process's baseline (the largest of the
        # repeats), bytes: the recoveries, torch.load, the snapshotter, and the floor's steps.
        "peak_extra_bytes_workers_2": max(peaks["workers_2"], default=None),
        "peak_extra_bytes_workers_1": max(peaks["workers_1"], default=None),
        "peak_extra_bytes_torch_load": max(peaks["torch_load"], default=None),
        "peak_extra_bytes_check": check["peak_extra_bytes"],
        "peak_extra_bytes_recover": recover["peak_extra_bytes"],
        "peak_extra_bytes_snapshotter": r.snapshot_peak_extra_bytes,
        "peak_extra_bytes_floor_steps": floor.get("peak_extra_bytes"),
        "raw_state_bytes": r.raw_state_bytes,
        "fresh_process": True,
        "bit_exact": True,
        "repeats": repeats,
        "samples": {"workers_1": times[1], "workers_2": times[2], "torch_load": loads,
                    "workers_1_torch_1_thread": one_thread,
                    "snapshot_only_2_workers": snap_only, "bus_speedup_2_vs_1": bus_speedups,
                    "adam_tiles_speedup_2_vs_1": adam_speedups, "floor_read_1": reads[1],
                    "floor_read_2": reads[2], "floor_steps_and_checks": floor["samples"],
                    "peak_extra_bytes": peaks},
    }


# ---------------------------------------------------------------------------- kafka
def kafka_available() -> str | None:
    """``None`` if the Kafka backend imports, else why not."""
    try:
        importlib.import_module("eventlog.kafka")
    except Exception as exc:  # noqa: BLE001 - any failure means "not run"
        return f"eventlog.kafka is not importable ({type(exc).__name__}: {exc})"
    return None


def kafka_produce(cfg: Config, record_bytes: int, total_bytes: int) -> dict[str, Any]:
    """Rewind's Kafka writer (one transaction, records spread over the shard partitions)
    against ``ProducerPerformance`` with the same record size and count, acks=all."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    from eventlog.backends import open_log

    assert cfg.kafka
    url = kafka_url(cfg.kafka)
    n = max(8, total_bytes // record_bytes)
    shards = 2
    payloads = [os.urandom(record_bytes) for _ in range(4)]
    rewind: list[float] = []
    run = f"produce-{uuid.uuid4().hex[:8]}"
    log = open_log(url, run)
    topics: list[str] = []
    try:
        log.create(shards)
        writer = log.writer("bench")
        try:
            for rep in range(cfg.repeats + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                with writer.transaction() as txn:
                    for i in range(n):
                        txn.append(i % shards, payloads[i % len(payloads)])
                dt = time.perf_counter() - t0
                if rep:
                    rewind.append(n * record_bytes / dt / MB)
                cfg.log(f"  rewind kafka writer: {n} x {record_bytes} B in {dt:.2f} s "
                        f"({n * record_bytes / dt / MB:.0f} MB/s){' (warm-up)' if not rep else ''}")
        finally:
            writer.close()
    finally:
        log.close()
    out: dict[str, Any] = {
        "rewind": med(rewind), "record_bytes": record_bytes, "records": n,
        "repeats": cfg.repeats,
    }
    home = cfg.kafka_home or os.environ.get("REWIND_KAFKA_HOME")
    if not home or not Path(home).is_dir():
        out["producer_performance"] = None
        out["producer_performance_skipped"] = "REWIND_KAFKA_HOME (Kafka's jars) is not set"
    else:
        bootstrap = bootstrap_of(cfg.kafka)
        admin = AdminClient({"bootstrap.servers": bootstrap})
        topic = f"rewindbench.pp.{uuid.uuid4().hex[:8]}"
        limit = str(max(record_bytes * 2, 16 * 1024 * 1024 + 256 * 1024))
        admin.create_topics([NewTopic(topic, shards, 1, config={"max.message.bytes": limit})]
                            )[topic].result(30)
        topics.append(topic)
        time.sleep(1.0)
        for key, one_txn in (("producer_performance", False), ("producer_performance_txn", True)):
            pp = []
            for rep in range(cfg.repeats + (0 if one_txn else 1)):
                mb_s = _producer_performance(home, bootstrap, topic, n, record_bytes, limit,
                                             transactional=one_txn)
                if rep or one_txn:
                    pp.append(mb_s)
                cfg.log(f"  ProducerPerformance{' (one transaction)' if one_txn else ''}: "
                        f"{mb_s:.0f} MB/s{' (warm-up)' if not (rep or one_txn) else ''}")
            out[key] = med(pp)
            out[f"samples_{key}"] = pp
        out["samples_rewind"] = rewind
        out["ratio"] = _ratio(out["rewind"], out["producer_performance"])
        out["ratio_vs_txn"] = _ratio(out["rewind"], out["producer_performance_txn"])
    _delete_topics(cfg.kafka, topics + run_topics(cfg.kafka, run))
    return out


def _producer_performance(home: str, bootstrap: str, topic: str, n: int, size: int,
                          limit: str, *, transactional: bool = False) -> float:
    """MB/s of Kafka's ``ProducerPerformance`` with its default producer settings except
    acks=all and a max.request.size that fits the records (batch.size or linger.ms tuned for
    big records measured no faster here); ``transactional``: one transaction over the whole
    run, as Rewind commits one per version."""
    cmd = [
        "java", "-Xmx1g", "-cp", f"{home}/*", "org.apache.kafka.tools.ProducerPerformance",
        "--topic", topic, "--num-records", str(n), "--record-size", str(size),
        "--throughput", "-1", "--producer-props", f"bootstrap.servers={bootstrap}", "acks=all",
        f"max.request.size={limit}", f"buffer.memory={max(32 << 20, 8 * size)}",
    ]
    if transactional:
        cmd += ["--transactional-id", f"{topic}.pp.{uuid.uuid4().hex[:6]}",
                "--transaction-duration-ms", "600000"]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"ProducerPerformance failed: {out.stderr[-2000:]}")
    # "<n> records sent, <r> records/sec (<x> MB/sec), ..." (the last such line is the total)
    found = re.findall(r"records sent, ([0-9.]+) records/sec", out.stdout)
    if not found:
        raise RuntimeError(f"cannot parse ProducerPerformance output: {out.stdout[-1000:]}")
    return float(found[-1]) * size / MB


def _delete_topics(kafka: str, topics: list[str]) -> None:
    """Best-effort cleanup of the benchmark's topics (a failure is printed, not raised)."""
    if not topics:
        return
    from confluent_kafka.admin import AdminClient

    try:
        admin = AdminClient({"bootstrap.servers": bootstrap_of(kafka)})
        for topic, f in admin.delete_topics(topics).items():
            try:
                f.result(30)
            except Exception as exc:  # noqa: BLE001 - cleanup only
                print(f"could not delete topic {topic}: {exc}")
    except Exception as exc:  # noqa: BLE001
        print(f"could not delete topics {topics}: {exc}")


def run_topics(kafka: str, run_id: str) -> list[str]:
    """The topics a Kafka run of ``run_id`` uses (for cleanup)."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap_of(kafka)})
    md = admin.list_topics(timeout=10)
    return [t for t in md.topics if f".{run_id}." in t]


# ---------------------------------------------------------------------------- follower
def follower_available() -> str | None:
    try:
        mod = importlib.import_module("replayer.follower")
    except ModuleNotFoundError:
        return "replayer/follower.py does not exist yet"
    except Exception as exc:  # noqa: BLE001
        return f"replayer.follower does not import ({type(exc).__name__}: {exc})"
    if not inspect.isclass(getattr(mod, "Follower", None)):
        return "replayer.follower has no Follower class"
    return None


def follower_sync(cfg: Config, address: RunAddress, work: Workload,
                  recorder: Recorder) -> dict[str, Any]:
    """A fresh ``Follower``'s first poll (a full sync: newest snapshot + tail, into its model),
    then one new version per poll (incremental), timed around ``poll()``."""
    from replayer.follower import Follower

    shadow = Workload.build(work.params, dtype=work.dtype, seed=1).model
    full: list[float] = []
    incr: list[float] = []
    modes: list[str] = []
    fol = None
    # A full sync is a replay (measured by recovery_s with repeats) plus the copy into the
    # model: one is enough here.
    for _ in range(1):
        if fol is not None:
            fol.close()
        gc.collect()
        fol = Follower(address, shadow, workers=2)
        t0 = time.perf_counter()
        res = fol.poll()
        full.append(time.perf_counter() - t0)
        modes.append(res.mode)
        cfg.log(f"  follower full sync ({res.mode}): {full[-1]:.2f} s to v{res.version_after}")
    assert fol is not None
    try:
        # At least 5: one incremental poll took 0.83 s in a run where the others took 0.24-0.27 s.
        repeats = max(5, cfg.repeats)
        for _ in range(repeats):
            work.step()
            recorder.commit(work.steps_done, wait=True)
            t0 = time.perf_counter()
            res = fol.poll()
            incr.append(time.perf_counter() - t0)
            modes.append(res.mode)
            cfg.log(f"  follower one version ({res.mode}): {incr[-1]:.2f} s to v{res.version_after}")
        live = work.model.state_dict()
        def bits(t: torch.Tensor) -> torch.Tensor:
            return t.view(torch.uint8) if t.dtype != torch.bool else t

        same = all(torch.equal(bits(live[k]), bits(v))
                   for k, v in shadow.state_dict().items())
    finally:
        fol.close()
    return {"incremental": med(incr), "full_sync": med(full), "modes": modes,
            "bit_exact": same, "repeats": repeats, "samples": {"incremental": incr, "full_sync": full}}


# ---------------------------------------------------------------------------- the run
def workdir(cfg: Config) -> Path:
    """A fresh directory for the run's files, under ``--workdir`` (created if missing)."""
    if cfg.workdir:
        Path(cfg.workdir).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="rewind-bench-", dir=cfg.workdir))


def run_all(cfg: Config) -> dict[str, Any]:
    """Run the selected scenarios; returns the JSON document (see ``__main__``)."""
    results: dict[str, Any] = {}
    root = workdir(cfg)
    cfg.log(f"work directory: {root}")
    try:
        _run(cfg, root, results)
    finally:
        if not cfg.keep:
            shutil.rmtree(root, ignore_errors=True)
    return results


def _kafka_recording(cfg: Config, work: Workload, root: Path, versions: int) -> dict[str, Any]:
    """The same recording on Kafka (``cfg.redis`` or an embedded coordinator); its
    throughput figures (``throughput_of``). The run's topics are deleted after."""
    assert cfg.kafka
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    url = kafka_url(cfg.kafka)
    coord = cfg.redis or f"sqlite://{root / 'kafka-coord.db'}"
    cfg.log(f"recording (kafka {bootstrap_of(cfg.kafka)}, coordinator "
            f"{'redis' if cfg.redis else 'embedded'}): v1 FULL + {versions} versions")
    try:
        kr = record(cfg, work, RunAddress(url, coord, run_id), versions=versions, snapshot_at=None,
                    label="kafka")
        return throughput_of(kr)
    finally:
        _delete_topics(cfg.kafka, run_topics(cfg.kafka, run_id))


def _kafka_produce_scenario(cfg: Config, kafka_why: str | None, rec: Recording | None,
                            meta: dict[str, Any]) -> dict[str, Any]:
    """The broker's produce throughput, with records of the recording's mean event size; or
    why it was skipped."""
    if not cfg.kafka:
        return {"skipped": "no --kafka broker given"}
    if kafka_why is not None:
        return {"skipped": kafka_why}
    size = 3 * 1024 * 1024
    if rec is not None:
        enc = rec.deltas(rec.encoded)
        ev = rec.deltas(rec.events)
        if sum(ev):
            size = max(64 * 1024, int(sum(enc) / sum(ev)))
    total = min(max(meta.get("raw_state_bytes", 0), 256 * 1024**2), 1024**3)
    cfg.log(f"kafka produce: {size} B records, {total / MB:.0f} MB per repeat")
    return kafka_produce(cfg, size, total)


def _throughput_results(rec: Recording, kafka_tp: dict[str, Any] | None,
                        write_floor: dict[str, Any] | None) -> dict[str, Any]:
    """The commit throughput scenario's figures: the embedded log's (and Kafka's) against
    ``torch.save`` with fsync, and the floor of appending a version's bytes."""
    tp = throughput_of(rec)
    save = torch_save_fsync_mb_s(rec)
    kafka = kafka_tp or {}
    return {
        "embedded": tp["mb_s"],
        "embedded_median_version": tp["median_version_mb_s"],
        "embedded_median_durable_s": tp["median_durable_s"],
        "embedded_full_commit_s": tp["full_commit_s"],
        "torch_save_fsync": save,
        "ratio_embedded": _ratio(tp["mb_s"], save),
        "kafka": kafka.get("mb_s"),
        "kafka_median_version": kafka.get("median_version_mb_s"),
        "kafka_full_commit_s": kafka.get("full_commit_s"),
        "ratio_kafka": _ratio(kafka.get("mb_s"), save),
        "versions": tp["versions"],
        # The bare append of a version's bytes, and the same bytes rewritten into a
        # truncated file as torch.save to one path does (benchmarks/writefloor.py).
        "write_floor": write_floor,
        "samples": {"embedded_durable_s": rec.durable, "raw_bytes": rec.raw,
                    "torch_save_fsync_s": rec.fsync_s},
    }


def _follower_scenario(cfg: Config, emb: RunAddress, work: Workload) -> dict[str, Any]:
    """A follower's full sync (a fresh follower), then one version per poll, as a new writer
    session continues the recorded run; or why it was skipped."""
    why = follower_available()
    if why is not None:
        return {"skipped": why}
    cfg.log("follower: full sync (fresh follower), then one version per poll")
    out: dict[str, Any] = {}
    try:
        from replayer.replay import restorer

        def follow(recorder: Recorder, _r: Recording) -> None:
            out.update(follower_sync(cfg, emb, work, recorder))

        # A new writer session: restore (snapshot + tail) to continue the run.
        record(cfg, work, emb, versions=-1, snapshot_at=None, label="follower",
               before_close=follow, restorer=restorer(emb))
    except Exception as exc:  # noqa: BLE001 - reported, not fatal to the run
        return {"skipped": f"failed: {type(exc).__name__}: {exc}"}
    return out or {"skipped": "the follower did not run"}


def _run(cfg: Config, root: Path, results: dict[str, Any]) -> None:
    only = cfg.only
    meta = results.setdefault("meta", {})
    work: Workload | None = None
    emb: RunAddress | None = None
    rec: Recording | None = None
    versions = max(2, cfg.versions)
    kafka_why = kafka_available() if cfg.kafka else None
    kafka_tp: dict[str, Any] | None = None
    if only & (RECORDING | {"follower_sync_s"}) or (cfg.kafka and "commit_throughput_mb_s" in only):
        t0 = time.perf_counter()
        work = Workload.build(cfg.params)
        cfg.log(f"model: {work.layers} x Linear({work.width}, {work.width}), "
                f"{work.params / 1e6:.1f}M fp32 params + Adam; {cfg.warmup_steps} warm-up steps")
        work.step(cfg.warmup_steps)
        meta.update(params=work.params, width=work.width, layers=work.layers,
                    raw_state_bytes=work.raw_bytes(), warmup_steps=cfg.warmup_steps,
                    warmup_s=time.perf_counter() - t0, versions=versions)
        cfg.log(f"  warm-up done in {time.perf_counter() - t0:.1f} s; "
                f"state {work.raw_bytes() / MB:.0f} MB")

    if work is not None and only & (RECORDING | {"follower_sync_s"}):
        d = root / "embedded"
        d.mkdir()
        db = f"sqlite://{d / 'rewind.db'}"
        emb = RunAddress(db, db, "bench", f"file://{d / 'snapshots'}")
        tail = max(1, min(cfg.tail, versions // 2))
        rec = Recording()
        if only & {"commit_blocking_s", "commit_throughput_mb_s"}:
            cfg.log("baselines: torch.save (+fsync) and memcpy of the state, "
                    f"{min(versions, BASELINE_REPEATS)} times")
            baselines(cfg, work, root / "baseline.pt", versions, rec)
            _give_back_freed_memory(cfg)  # the memcpy floor's copy of the state
        need_snapshot = bool(only & {"recovery_s", "follower_sync_s"})
        cfg.log(f"recording (embedded): v1 FULL + {versions} versions"
                + (f", snapshot at v{1 + versions - tail}" if need_snapshot else ""))
        t0 = time.perf_counter()
        record(cfg, work, emb, versions=versions,
               snapshot_at=(1 + versions - tail) if need_snapshot else None,
               label="embedded", recording=rec)
        meta["recording_s"] = time.perf_counter() - t0
        # Disk blocks, not file sizes: a segment file leaves a hole before each payload it
        # puts on a 2 MiB boundary (eventlog/embedded/segments.py), which no block backs.
        files = [p for p in d.glob("rewind.db*") if p.is_file()] + list(d.glob("rewind.db.segments/*/*.seg"))
        meta["log_file_bytes"] = sum(p.stat().st_blocks * 512 for p in files)
        write_floor = None
        if "commit_throughput_mb_s" in only and rec.deltas(rec.encoded):
            # Beside the recording, on the same disk: its median version's bytes, in chunks.
            write_floor = writefloor.measure(root, int(statistics.median(rec.deltas(rec.encoded))),
                                             current().chunk_bytes, versions)
            cfg.log(f"  write floor of {write_floor['bytes_per_version'] / MB:.0f} MB per version: "
                    f"append {write_floor['append_s'] * 1e3:.1f} ms, "
                    f"rewrite {write_floor['rewrite_s'] * 1e3:.1f} ms")
        # The checkpoint torch.load reads: the newest version's state, written in this run.
        rec.last_checkpoint = str(root / "checkpoint.pt")
        save_checkpoint(work, rec.last_checkpoint, fsync=True)
        if cfg.kafka and kafka_why is None and "commit_throughput_mb_s" in only:
            kafka_tp = _kafka_recording(cfg, work, root, versions)
        step_s = med(work.optimizer_step_s[-20:])
        if "follower_sync_s" not in only:
            # Nothing later needs the live state: freed before the recovery's processes
            # start, so that they and this process do not hold it at once.
            work = None
            gc.collect()
        if "recovery_s" in only:
            cfg.log("recovery: snapshot + tail replay vs torch.load, each in a fresh process")
            results["recovery_s"] = recovery(cfg, emb, rec, step_s)
        if "follower_sync_s" in only:
            assert work is not None
            results["follower_sync_s"] = _follower_scenario(cfg, emb, work)
        if "commit_blocking_s" in only:
            results["commit_blocking_s"] = blocking_figures(rec)
        if "commit_throughput_mb_s" in only:
            results["commit_throughput_mb_s"] = _throughput_results(rec, kafka_tp, write_floor)
        if "bytes_per_commit_ratio" in only:
            b = bytes_ratio_of(rec)
            results["bytes_per_commit_ratio"] = {
                "fp32": b["ratio"], "fp32_aggregate": b["aggregate"],
                "fp32_full_commit": b["full_commit"], "fp32_after_steps": cfg.warmup_steps,
                "samples": {"fp32_encoded_bytes": rec.encoded, "fp32_raw_bytes": rec.raw},
            }

    if emb is not None and not cfg.keep:
        # Nothing later reads the recording's files: at 300M they are tens of GB, which the
        # codec comparison's runs would otherwise need beside them.
        shutil.rmtree(root / "embedded", ignore_errors=True)
        (root / "checkpoint.pt").unlink(missing_ok=True)

    if "bytes_per_commit_ratio" in only:
        cfg.log(f"bf16: {cfg.bf16_warmup_steps} warm-up steps, v1 FULL + {cfg.bf16_versions} versions")
        wb = Workload.build(min(cfg.params, BF16_MAX_PARAMS), dtype=torch.bfloat16)
        wb.step(cfg.bf16_warmup_steps)
        d = root / "bf16"
        d.mkdir()
        db = f"sqlite://{d / 'rewind.db'}"
        rb = record(cfg, wb, RunAddress(db, db, "bench-bf16"), versions=cfg.bf16_versions,
                    snapshot_at=None, label="bf16")
        b = bytes_ratio_of(rb)
        out = results.setdefault("bytes_per_commit_ratio", {})
        out.update(bf16=b["ratio"], bf16_aggregate=b["aggregate"],
                   bf16_full_commit=b["full_commit"], bf16_after_steps=cfg.bf16_warmup_steps,
                   bf16_params=wb.params)
        del wb
        shutil.rmtree(d, ignore_errors=True)

    if "kafka_produce_mb_s" in only or (cfg.kafka and kafka_why is not None):
        results["kafka_produce_mb_s"] = _kafka_produce_scenario(cfg, kafka_why, rec, meta)

    if "codec_compare" in only:
        from .codecs import compare

        params = min(cfg.params, CODEC_MAX_PARAMS)
        res = compare(params, max(cfg.codec_steps, 12), root / "codecs", cfg.log)
        results["codec_compare"] = {
            "params": res["predictive"]["params"], "steps": cfg.codec_steps,
            "predictive_bytes_per_commit_ratio": res["predictive"]["bytes_per_commit_ratio"],
            "xor_bytes_per_commit_ratio": res["xor"]["bytes_per_commit_ratio"],
            "predictive_encode_mb_s": res["predictive"]["encode_mb_s"],
            "xor_encode_mb_s": res["xor"]["encode_mb_s"],
            "encode_speedup": res["encode_speedup"],
            "predictive_decode_mb_s": res["predictive"]["decode_mb_s"],
            "xor_decode_mb_s": res["xor"]["decode_mb_s"],
            "decode_speedup": res["decode_speedup"],
            "predictive_versions": res["predictive"]["predictive_versions"],
            "versions": res["predictive"]["versions"],
        }
        shutil.rmtree(root / "codecs", ignore_errors=True)

    if "follower_sync_s" in only and "follower_sync_s" not in results:
        results["follower_sync_s"] = {"skipped": "needs the embedded recording run"}
