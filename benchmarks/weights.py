"""``python -m benchmarks --only weights``: the bf16 weights stream beside its baselines.

    python -m benchmarks --only weights [--size 25M,100M] [--kafka HOST:PORT --redis URL]

Per size (fp32 parameters; default 25M), a Linear stack trained with fp32 Adam, served in bf16:

- bytes per version against a full bf16 push, at lr 1e-6, 1e-4 and 3e-4, with the fraction
  of elements whose bf16 bits changed (the floor of any patch): the publisher's codec
  (``encode_version``) on the cast weights after each Adam step;
- a follower process's peak memory above a bare process holding the same model, as a
  multiple of the bf16 model's bytes: the weights follower on the embedded log and on Kafka,
  today's full-state follower (an fp32 model, synced from the log) beside them;
- a first sync from a keyframe against ``torch.load`` of the same bf16 weights (fresh processes);
- on Kafka: latency from a version's seal to "applied" at 1, 4 and 8 follower processes, p50
  and p99, the publisher's CPU seconds per version, and the floor (one follower's apply time x
  followers / cores);
- the trainer's step time (a step plus ``commit()``) with the recorder publishing the stream
  itself (``Recorder(weights=...)``), and with ``rewind publish --follow`` running, against
  recording alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.table import Table

from .fmt import fmt
from .model import Workload, parse_size

SCENARIO = "weights"
DEFAULT_SIZE = "25M"
LRS = (1e-6, 1e-4, 3e-4)
FOLLOWER_COUNTS = (1, 4, 8)
#: Versions measured per learning rate, per follower count, per trainer phase.
VERSIONS = 4
#: Adam steps before the bytes are measured (past Adam's first, outsized steps).
WARMUP_STEPS = 10

#: A weights follower's peak above its bare model, as a multiple of the model's bytes.
FOLLOWER_LIMIT = 1.25
#: (key, figure, comparison, limit, text): the issue's targets, judged per size.
TARGETS = [
    ("bytes_lr_1e-06", "bytes_ratio_lr_1e-06", "<=", 0.05, "bytes/version at lr 1e-6 <= 0.05 x bf16 push"),
    ("peak_embedded", "peak_ratio_embedded", "<=", FOLLOWER_LIMIT,
     f"follower peak (embedded) <= {FOLLOWER_LIMIT} x model"),
    ("peak_kafka", "peak_ratio_kafka", "<=", FOLLOWER_LIMIT,
     f"follower peak (Kafka) <= {FOLLOWER_LIMIT} x model"),
    ("trainer_step", "trainer_step_ratio", "<=", 1.05, "trainer step, publishing on <= 1.05 x off"),
]

Log = Callable[[str], None]
ROOT = Path(__file__).resolve().parent.parent


def _child(*args: str, timeout: float = 900) -> dict[str, Any]:
    """Run ``benchmarks._weights_actor`` in a fresh process; its JSON line."""
    out = subprocess.run([sys.executable, "-m", "benchmarks._weights_actor", *args], capture_output=True,
                         text=True, timeout=timeout, cwd=ROOT, env=_env())
    if out.returncode != 0:
        raise RuntimeError(f"actor {args[0]} failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                                        if p)}


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


# ---------------------------------------------------------------------------- bytes
def bytes_per_version(params: int, lr: float, log: Log) -> dict[str, Any]:
    """Patch bytes per version against the full bf16 weights, and the changed-bits floor."""
    from eventlog.weightcodec import WeightsConfig, cast_weights, encode_version

    work = Workload.build(params, lr=lr)
    work.step(WARMUP_STEPS)
    chunk = WeightsConfig().chunk_bytes

    def cast() -> dict[str, Any]:
        return cast_weights(work.model.state_dict(), "bfloat16")

    prev = cast()
    full = sum(len(t.bits) for t in prev.values())
    ratios, changed = [], []
    for _ in range(VERSIONS):
        work.step()
        new = cast()
        payload = sum(len(c.payload) for c in encode_version(new, prev, 1, chunk))
        flips = sum(int(np.count_nonzero(new[k].bits.view(np.uint16) != prev[k].bits.view(np.uint16)))
                    for k in new)
        ratios.append(payload / full)
        changed.append(flips / (full // 2))
        prev = new
    log(f"  lr {lr:g}: {statistics.median(ratios):.4f} x bf16 push, {statistics.median(changed):.4f} "
        f"of elements changed")
    return {"bf16_bytes": full, "ratio": statistics.median(ratios), "changed": statistics.median(changed)}


# ---------------------------------------------------------------------------- runs
def record(rec: Any, work: Workload, versions: int) -> None:
    """Record ``versions`` versions of ``work``, one Adam step each, durable."""
    for _ in range(versions):
        work.step()
        rec.commit(work.steps_done, wait=True).result()


def sync_figures(address: Any, params: int, log: Log, kinds: tuple[str, ...]) -> dict[str, Any]:
    """The first sync of each follower kind, in a fresh process: peak memory and seconds."""
    out = {}
    for kind in kinds:
        r = _child("sync", address.log_url, address.coord_url, address.run_id, str(params),
                   kind.split("-")[0])
        log(f"  {kind}: peak {r['peak_bytes'] / 1e6:.0f} MB above the bare model "
            f"({r['model_bytes'] / 1e6:.0f} MB), sync {r['seconds']:.3f} s")
        out[kind] = r
    return out


def follower_memory(params: int) -> dict[str, Any]:
    """A weights follower's first sync on an embedded log, in a fresh process: a recorder
    that publishes the bf16 stream itself records two versions, then ``sync_figures``'s
    child syncs them. Adds ``peak_ratio``: the peak above the bare model, x its bytes."""
    from eventlog import RunAddress
    from rewind.recorder import Recorder

    with tempfile.TemporaryDirectory(prefix="rewind-follower-") as tmp:
        url = f"sqlite://{Path(tmp) / 'rewind.db'}"
        work = Workload.build(params)
        with Recorder(RunAddress(url, url, "follower"), work.model, work.optimizer, rng=False,
                      weights=torch.bfloat16) as rec:
            record(rec, work, 2)
        del work, rec
        r = _child("sync", url, url, "follower", str(params), "weights")
    return {**r, "peak_ratio": r["peak_bytes"] / r["model_bytes"]}


def torch_load_s(params: int, root: Path, repeats: int = 2) -> float:
    """``torch.load`` of the bf16 weights the stream serves (fresh processes, best of ``repeats``)."""
    from benchmarks._weights_actor import actor_model

    path = root / "bf16.pt"
    torch.save(actor_model(params, torch.bfloat16).state_dict(), path)
    return min(float(_child("load", str(path))["seconds"]) for _ in range(repeats))


class TimedSeals:
    """Wraps a publisher's stream writes: the wall time each version's transaction committed."""

    def __init__(self, pub: Any) -> None:
        self.at: dict[int, float] = {}
        stream = pub._out.stream
        inner = stream.publish

        def publish(writer: Any, version: int, *args: Any, **kw: Any) -> Any:
            out = inner(writer, version, *args, **kw)
            self.at[version] = time.time()
            return out

        stream.publish = publish


def latency(rec: Any, work: Workload, params: int, followers: int, log: Log) -> dict[str, Any]:
    """Seal-to-applied latency with ``followers`` processes, and the publisher's CPU per version."""
    from replayer.publisher import Publisher

    address = rec.address
    with Publisher(address) as pub:
        seals = TimedSeals(pub)
        pub.publish()
        first, last = pub.version + 1, pub.version + VERSIONS
        procs = [subprocess.Popen([sys.executable, "-m", "benchmarks._weights_actor", "follow",
                                   address.log_url, address.coord_url, address.run_id, str(params),
                                   str(last)], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env())
                 for _ in range(followers)]
        try:
            for p in procs:
                assert p.stdout is not None
                if p.stdout.readline().strip() != "ready":
                    raise RuntimeError("a follower process did not sync")
            cpu = []
            for _ in range(first, last + 1):
                record(rec, work, 1)
                c0 = time.process_time()
                pub.publish()
                cpu.append(time.process_time() - c0)
            outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    lat = [a["at"] - seals.at[a["version"]] for o in outs for a in o["applied"] if a["version"] in seals.at]
    one = [a["seconds"] / a["versions"] for o in outs for a in o["applied"]]
    fig = {"p50_s": _pct(lat, 50), "p99_s": _pct(lat, 99), "writer_cpu_s": statistics.median(cpu),
           "apply_s": statistics.median(one) if one else None, "samples": len(lat)}
    log(f"  {followers} followers: p50 {fig['p50_s']:.3f} s, p99 {fig['p99_s']:.3f} s, writer CPU "
        f"{fig['writer_cpu_s']:.3f} s/version")
    return fig


def trainer_step(address: Any, work: Workload, log: Log, steps: int = 2 * VERSIONS) -> dict[str, Any]:
    """A training step plus ``commit()``, in alternating phases: recording alone; with the
    recorder publishing the stream itself (``Recorder(weights=...)``, on a run of its own);
    and with ``rewind publish --follow`` serving the run. Seconds per step, each phase's
    commits flushed and its stream caught up before the next; medians of the phases."""
    from eventlog.weightcodec import WeightsConfig
    from rewind.recorder import Recorder

    cpu: dict[str, list[float]] = {"off": [], "recorder": []}
    behind: dict[str, list[float]] = {"recorder": [], "service": []}  # the stream's lag at a phase's end

    def caught_up(kind: str, address: Any, version: int) -> None:
        t0 = time.perf_counter()
        _wait_published(address, version)
        behind[kind].append(time.perf_counter() - t0)

    def phase(rec: Any, kind: str = "") -> float:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            work.step()
            rec.commit(work.steps_done)
        rec.flush()
        wall = (time.perf_counter() - t0) / steps
        if kind == "recorder":
            caught_up(kind, inproc, rec.version)  # its CPU counted, its wall time not
        if kind:
            cpu[kind].append((time.process_time() - c0) / steps)
        return wall

    inproc = dataclasses.replace(address, run_id=f"{address.run_id}-w")
    times: dict[str, list[float]] = {"off": [], "recorder": [], "service": []}
    with Recorder(address, work.model, work.optimizer, rng=False) as plain, \
            Recorder(inproc, work.model, work.optimizer, rng=False, weights=WeightsConfig()) as publishing:
        for rec in (plain, publishing):  # past the first commits, which allocate their buffers
            phase(rec)
        _wait_published(inproc, publishing.version)
        for _ in range(2):
            times["off"].append(phase(plain, "off"))
            times["recorder"].append(phase(publishing, "recorder"))
        times["off"].append(phase(plain, "off"))
        service = subprocess.Popen([sys.executable, "-m", "rewind.cli", "publish", "--follow", "--interval",
                                    "0.2", "--log", address.log_url, "--coord", address.coord_url,
                                    "--run", address.run_id], cwd=ROOT, env=_env(),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _wait_published(address, plain.version)
            times["service"].append(phase(plain))
            caught_up("service", address, plain.version)
        finally:
            service.terminate()
            service.wait(timeout=60)
        times["off"].append(phase(plain))
    off, rec_s, service_s = (statistics.median(times[k]) for k in ("off", "recorder", "service"))
    # The floor on this machine: the publishing CPU per step, spread over every core while
    # the trainer's step keeps them all busy.
    extra_cpu = statistics.median(cpu["recorder"]) - statistics.median(cpu["off"])
    floor = 1 + max(0.0, extra_cpu) / ((os.cpu_count() or 1) * off)
    lag = {k: statistics.median(v) for k, v in behind.items()}
    fig: dict[str, Any] = {"off_s": off, "on_s": rec_s, "ratio": rec_s / off, "service_on_s": service_s,
                           "service_ratio": service_s / off, "phases": times, "publish_cpu_s": extra_cpu,
                           "floor": floor, "behind_s": lag}
    log(f"  trainer step: {rec_s:.3f} s with the recorder publishing ({fig['ratio']:.2f}x; floor "
        f"{floor:.2f}x, {extra_cpu:.3f} CPU s/version), {service_s:.3f} s with rewind publish "
        f"({fig['service_ratio']:.2f}x), {off:.3f} s not; the stream's lag at a phase's end: "
        f"{lag['recorder']:.2f} s recorder, {lag['service']:.2f} s rewind publish "
        f"(phases: {json.dumps({k: [round(x, 3) for x in v] for k, v in times.items()})})")
    return fig


def _wait_published(address: Any, version: int, timeout: float = 600) -> None:
    from eventlog.weightstream import WeightsStream

    deadline = time.monotonic() + timeout
    with address.open_log() as log:
        while time.monotonic() < deadline:
            try:
                index = WeightsStream(log).index()
            except Exception:  # noqa: BLE001 - the stream's partition may not exist yet
                index = []
            if index and index[-1].version >= version:
                return
            time.sleep(0.2)
    raise RuntimeError(f"the publisher did not reach version {version}")


# ---------------------------------------------------------------------------- one size
def run_size(params: int, kafka: str | None, redis: str | None, root: Path, log: Log) -> dict[str, Any]:
    """Every figure at one size."""
    from eventlog import RunAddress
    from replayer.publisher import Publisher
    from rewind.recorder import Recorder

    from .scenarios import _delete_topics, kafka_url, run_topics

    fig: dict[str, Any] = {"params": params}
    log(f"weights stream at {params / 1e6:.0f}M parameters")
    for lr in LRS:
        fig[f"lr_{lr:g}"] = bytes_per_version(params, lr, log)
    tag = uuid.uuid4().hex[:6]
    backends = {"embedded": (f"sqlite://{root / 'rewind.db'}",) * 2}
    if kafka:
        backends["kafka"] = (kafka_url(kafka), redis or f"sqlite://{root / 'coord.db'}")
    work = Workload.build(params)
    work.step(WARMUP_STEPS)
    fig["torch_load_s"] = torch_load_s(params, root)
    for name, (url, coord) in backends.items():
        address = RunAddress(url, coord, f"weights-{tag}")
        with Recorder(address, work.model, work.optimizer, rng=False) as rec:
            record(rec, work, 1)
            with Publisher(address) as pub:
                pub.publish()  # version 1: a keyframe
            kinds = ("weights", "full") if name == "embedded" else ("weights",)
            fig[name] = sync_figures(address, params, log, kinds)
            if name == "kafka":
                fig["latency"] = {str(n): latency(rec, work, params, n, log) for n in FOLLOWER_COUNTS}
                _floors(fig["latency"])
        if name == "kafka":
            fig["trainer"] = trainer_step(RunAddress(url, coord, f"trainer-{tag}"), work, log)
    if "trainer" not in fig:
        address = RunAddress(*backends["embedded"], f"trainer-{tag}")
        fig["trainer"] = trainer_step(address, work, log)
    if kafka:  # the runs' topics, as the other Kafka scenarios leave none
        runs = (f"weights-{tag}", f"trainer-{tag}", f"trainer-{tag}-w")
        _delete_topics(kafka, [t for run in runs for t in run_topics(kafka, run)])
    return fig


def _floors(latency: dict[str, dict[str, Any]]) -> None:
    """Each follower count's floor: one follower's apply time (the 1-follower run's) x
    followers / cores, as if followers shared the cores perfectly and nothing else ran."""
    one = latency[str(FOLLOWER_COUNTS[0])]["apply_s"]
    cores = os.cpu_count() or 1
    for n, fig in latency.items():
        fig["floor_s"] = None if one is None else one * int(n) / cores


def figures(fig: dict[str, Any]) -> dict[str, float | None]:
    """The figures the targets judge."""
    out: dict[str, float | None] = {f"bytes_ratio_lr_{lr:g}": fig[f"lr_{lr:g}"]["ratio"] for lr in LRS}
    for name in ("embedded", "kafka"):
        r = fig.get(name, {}).get("weights")
        out[f"peak_ratio_{name}"] = None if r is None else r["peak_bytes"] / r["model_bytes"]
    out["trainer_step_ratio"] = fig["trainer"]["ratio"]
    return out


def run(sizes: list[int], kafka: str | None, redis: str | None, workdir: str | None,
        log: Log) -> dict[str, Any]:
    """Every size's figures and targets."""
    doc: dict[str, Any] = {"meta": {"cores": os.cpu_count(), "load_average": os.getloadavg(),
                                    "torch": torch.__version__}, SCENARIO: {}, "targets": {}}
    for params in sizes:
        with tempfile.TemporaryDirectory(prefix="rewind-weights-", dir=workdir) as tmp:
            fig = run_size(params, kafka, redis, Path(tmp), log)
        size = f"{params / 1e6:.0f}M"
        doc[SCENARIO][size] = fig
        judged = figures(fig)
        for key, name, op, limit, text in TARGETS:
            value = judged.get(name)
            ok = None if value is None else value <= limit if op == "<=" else value >= limit
            doc["targets"][f"{SCENARIO}_{size}_{key}"] = {"value": value, "limit": limit, "op": op,
                                                           "pass": ok, "text": text}
    doc["meta"]["load_average_end"] = os.getloadavg()
    return doc


def run_from_args(args: Any, log: Log) -> dict[str, Any]:
    """``run`` with ``python -m benchmarks``'s options (``--size`` takes a comma list here)."""
    sizes = [parse_size(s) for s in (args.size or DEFAULT_SIZE).split(",") if s.strip()]
    kafka = args.kafka or os.environ.get("REWIND_TEST_KAFKA")
    redis = args.redis or (os.environ.get("REWIND_TEST_REDIS") if kafka else None)
    return run(sizes, kafka, redis, args.workdir, log)


def table(doc: dict[str, Any]) -> Table:
    """Every size's rows: Rewind, its baseline, the ratio, the target and the floor."""
    t = Table(title=f"Weights stream: fp32 Adam served in bf16 ({doc['meta']['cores']} cores), medians")
    for col in ("size", "figure", "Rewind", "baseline", "ratio", "target", "floor / note"):
        t.add_column(col, justify="right" if col in ("Rewind", "baseline", "ratio") else "left")
    for size, fig in doc[SCENARIO].items():
        _rows(t, size, fig, doc["targets"])
    return t


def _verdict(targets: dict[str, Any], size: str, key: str) -> str:
    tg = targets.get(f"{SCENARIO}_{size}_{key}")
    if not tg:
        return ""
    state = "n/a" if tg["pass"] is None else "PASS" if tg["pass"] else "MISS"
    return f"{tg['op']} {tg['limit']} {state}"


def _rows(t: Table, size: str, fig: dict[str, Any], targets: dict[str, Any]) -> None:
    for lr in LRS:
        r = fig[f"lr_{lr:g}"]
        t.add_row(size if lr == LRS[0] else "", f"bytes/version vs bf16 push, lr {lr:g}",
                  fmt(r["ratio"] * r["bf16_bytes"], "MB"), fmt(r["bf16_bytes"], "MB"),
                  fmt(r["ratio"], "x", 4),
                  _verdict(targets, size, "bytes_lr_1e-06") if lr == 1e-6 else "",
                  f"{r['changed']:.4f} of elements changed")
    bf16, load = fig["lr_1e-06"]["bf16_bytes"], fig["torch_load_s"]
    for name in ("embedded", "kafka"):
        for kind, r in fig.get(name, {}).items():
            weights = kind == "weights"
            label = "weights follower" if weights else "full-state follower (fp32 model)"
            t.add_row("", f"peak above bare model, {label}, {name}", fmt(r["peak_bytes"], "MB"),
                      fmt(bf16, "MB"), fmt(r["peak_bytes"] / bf16, "x", 2),
                      _verdict(targets, size, f"peak_{name}") if weights else "",
                      "" if weights else f"{r['peak_bytes'] / r['model_bytes']:.2f}x its fp32 model")
            if weights:
                t.add_row("", f"full sync from a keyframe vs torch.load, {name}", fmt(r["seconds"], "s"),
                          fmt(load, "s"), fmt(r["seconds"] / load, "x", 2), "", "")
    for n, r in fig.get("latency", {}).items():
        t.add_row("", f"seal to applied, {n} followers, p50 / p99 (Kafka)", fmt(r["p50_s"], "s"),
                  fmt(r["p99_s"], "s"), "", "", f"floor {fmt(r['floor_s'], 's')}; writer CPU "
                  f"{fmt(r['writer_cpu_s'], 's')}/version")
    r = fig["trainer"]
    t.add_row("", "trainer step + commit, the recorder publishing vs recording alone", fmt(r["on_s"], "s"),
              fmt(r["off_s"], "s"), fmt(r["ratio"], "x", 3), _verdict(targets, size, "trainer_step"),
              f"floor {fmt(r['floor'], 'x', 2)}: {fmt(r['publish_cpu_s'], 's')} CPU/version, "
              f"{os.cpu_count()} cores")
    t.add_row("", "the same, `rewind publish --follow` beside the trainer", fmt(r["service_on_s"], "s"),
              fmt(r["off_s"], "s"), fmt(r["service_ratio"], "x", 3), "",
              f"stream behind at the end: {fmt(r['behind_s']['service'], 's')}, recorder's "
              f"{fmt(r['behind_s']['recorder'], 's')}")
