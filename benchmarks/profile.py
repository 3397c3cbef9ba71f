"""Where the time goes in Rewind's commit and replay paths: ``python -m benchmarks.profile``.

Three parts, on the benchmark's model (``--size``, default 25M) after real Adam steps:

1. ``commit``: records ``--versions`` one-step versions through ``Recorder`` on the embedded
   backend with timers wrapped around the package's functions (nothing in the package is
   changed; the wrappers are installed in this process only): the training thread's
   capture and copy-out, encode per chunk, Avro serialization, SQLite appends and commit,
   coordinator round trips.
2. ``replay``: replays a snapshot + tail with 1 and 2 workers under the same kind of timers:
   snapshot read/verify/parse, SQLite reads, Avro decode, decompress, XOR, digests.
3. ``primitives``: each primitive alone on real chunks, with 1 and 2 threads, to show
   whether threads run in parallel (the GIL): wall time with 2 threads vs 1 over the same
   work (2.0x = perfect, 1.0x = serialised).

Sums of per-thread timers can exceed wall time when threads overlap.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sqlite3
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import blosc2
import numpy as np
import xxhash
from rich.console import Console
from rich.table import Table

import eventlog.embedded as embedded_mod
import eventlog.embedded.writer as embedded_writer
import eventlog.fold.apply as apply_mod
import eventlog.fold.engine as fold_mod
import eventlog.optimstep as optimstep_mod
import eventlog.serde as serde_mod
import eventlog.tensorcodec as tc
import snapshotter.store as store_mod
from eventlog import RunAddress, Target
from eventlog.commit.pipeline import CommitPipeline
from eventlog.events import Envelope, TensorDelta
from eventlog.ports import message_size
from rewind.recorder import Recorder
from snapshotter.service import Snapshotter, SnapshotterConfig
from snapshotter.store import SnapshotStore

from .model import Workload, parse_size

MB = 1e6


class Timers:
    """Seconds and calls per label, summed over threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.s: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def add(self, label: str, dt: float, nbytes: int = 0) -> None:
        with self.lock:
            self.s[label] += dt
            self.n[label] += 1
            self.bytes[label] += nbytes

    def reset(self) -> None:
        self.s.clear()
        self.n.clear()
        self.bytes.clear()


T = Timers()
_patches: list[tuple[Any, str, Any]] = []


def wrap(owner: Any, name: str, label: str, size: Callable[..., int] | None = None) -> None:
    """Time every call of ``owner.name`` under ``label``."""
    orig = getattr(owner, name)

    @functools.wraps(orig)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig(*args, **kwargs)
        finally:
            T.add(label, time.perf_counter() - t0, size(*args, **kwargs) if size else 0)

    _patches.append((owner, name, orig))
    setattr(owner, name, timed)


def wrap_cm(owner: Any, name: str, label: str) -> None:
    """Time the exit (the commit) of a context manager method ``owner.name``."""
    orig = getattr(owner, name)

    @functools.wraps(orig)
    @contextmanager
    def timed(*args: Any, **kwargs: Any) -> Any:
        cm = orig(*args, **kwargs)
        value = cm.__enter__()
        try:
            yield value
        except BaseException as exc:
            if not cm.__exit__(type(exc), exc, exc.__traceback__):
                raise
        else:
            t0 = time.perf_counter()
            cm.__exit__(None, None, None)
            T.add(label, time.perf_counter() - t0)

    _patches.append((owner, name, orig))
    setattr(owner, name, timed)


def unpatch() -> None:
    while _patches:
        owner, name, orig = _patches.pop()
        setattr(owner, name, orig)


def _nbytes(x: Any) -> int:
    return len(x) if isinstance(x, bytes | bytearray | memoryview) else getattr(x, "nbytes", 0)


def show(console: Console, title: str, wall: float, raw_bytes: int, order: list[str]) -> None:
    t = Table(title=f"{title}: wall {wall:.3f} s, {raw_bytes / MB:.0f} MB raw "
                    f"({raw_bytes / wall / MB:.0f} MB/s)")
    for c in ("phase", "calls", "seconds (sum over threads)", "% of wall", "MB/s (of its bytes)"):
        t.add_column(c, justify="left" if c == "phase" else "right")
    for label in order + sorted(set(T.s) - set(order)):
        if label not in T.s:
            continue
        s = T.s[label]
        b = T.bytes[label]
        t.add_row(label, str(T.n[label]), f"{s:.3f}", f"{100 * s / wall:.0f}%",
                  f"{b / s / MB:.0f}" if b and s else "")
    console.print(t)


# ---------------------------------------------------------------------------- commit
COMMIT_ORDER = [
    "commit() [training thread]", "  capture (state_dict + msgpack)",
    "_write [committer]", "  encode (wall, parallel)", "    encode_chunk [codec threads]",
    "      array_equal", "      xor", "      compress (blosc2)", "      xxh3 digest",
    "  CAS version (sqlite txn)", "  allocate gsns (sqlite txn)",
    "  avro serialize", "  avro serialize (chunk heads)", "  sqlite INSERT (append)",
    "  sqlite COMMIT (+fsync, checkpoint)",
]


def install_commit_timers() -> None:
    wrap(Recorder, "commit", "commit() [training thread]")
    wrap(Recorder, "_capture", "  capture (state_dict + msgpack)")
    wrap(Recorder, "_write", "_write [committer]")
    wrap(CommitPipeline, "encode", "  encode (wall, parallel)")
    wrap(tc, "encode_chunk", "    encode_chunk [codec threads]", lambda new, *a, **k: new.nbytes)
    wrap(tc, "_compress", "      compress (blosc2)", lambda d, *a, **k: d.nbytes)
    wrap(tc, "digest", "      xxh3 digest", lambda b, *a, **k: _nbytes(b))
    wrap(np, "array_equal", "      array_equal", lambda a, b, *x, **k: a.nbytes)
    wrap(np, "bitwise_xor", "      xor", lambda a, b, *x, **k: a.nbytes)
    wrap(serde_mod.EnvelopeSerializer, "__call__", "  avro serialize")
    wrap(serde_mod.EnvelopeSerializer, "in_parts", "  avro serialize (chunk heads)")
    wrap(embedded_writer.EmbeddedTransaction, "append", "  sqlite INSERT (append)",
         lambda self, p, v, **_: message_size(v))
    wrap_cm(embedded_writer.EmbeddedWriter, "transaction", "  sqlite COMMIT (+fsync, checkpoint)")
    wrap(embedded_mod.EmbeddedCoordinator, "compare_and_set_version", "  CAS version (sqlite txn)")
    wrap(embedded_mod.EmbeddedCoordinator, "allocate_gsns", "  allocate gsns (sqlite txn)")


# ---------------------------------------------------------------------------- replay
REPLAY_ORDER = [
    "replay (wall)", "index_control", "snapshot: newest_valid (wall)",
    "  read_buffer (read + xxh3)", "  read_file (read + xxh3)",
    "  load_shard_file (safetensors header + views)", "  shard digest (xxh3 of all bits)",
    "rebuild (wall)", "  fold_shard [workers]", "    log read + decode (read_decoded)",
    "      avro decode + payload read (from_stream)", "    apply (decode_chunk)",
    "      decompress (blosc2)", "      xxh3 digest", "    optimizer steps (run_step)",
    "  verify_shard [workers]",
]


def install_replay_timers() -> None:
    import replayer.replay as replay_mod
    import snapshotter.catalog as catalog_mod

    wrap(replay_mod, "replay", "replay (wall)")
    wrap(replay_mod, "index_control", "index_control")
    wrap(replay_mod, "newest_valid", "snapshot: newest_valid (wall)")
    wrap(store_mod.SnapshotStore, "read_buffer", "  read_buffer (read + xxh3)",
         lambda *a, **k: a[3].bytes)
    wrap(store_mod.SnapshotStore, "read_file", "  read_file (read + xxh3)",
         lambda *a, **k: a[3].bytes)
    wrap(store_mod, "load_shard_file", "  load_shard_file (safetensors header + views)",
         lambda d, *a: len(d))
    wrap(apply_mod.ShardState, "digest", "  shard digest (xxh3 of all bits)")
    wrap(replay_mod, "rebuild", "rebuild (wall)")
    wrap(fold_mod, "fold_shard", "  fold_shard [workers]")
    wrap(embedded_mod.EmbeddedLog, "read_decoded", "    log read + decode (read_decoded)")
    wrap(serde_mod.EnvelopeDeserializer, "from_stream", "      avro decode + payload read (from_stream)",
         lambda self, s, n, *a: n)
    wrap(optimstep_mod, "run_step", "    optimizer steps (run_step)")
    wrap(tc, "decode_chunk", "    apply (decode_chunk)",
         lambda d, *a: d.byte_length)
    wrap(tc, "_decompress", "      decompress (blosc2)", lambda p, n, w, **k: n)
    wrap(tc, "digest", "      xxh3 digest", lambda b, *a, **k: _nbytes(b))
    wrap(fold_mod, "verify_shard", "  verify_shard [workers]")
    del catalog_mod


def profile_replays(console: Console, addr: RunAddress) -> None:
    """Timed replays (1 and 2 workers, then to the newest snapshot's version) of a run."""
    import replayer.replay as replay_mod

    install_replay_timers()
    snap_version, raw = 0, 0
    for workers in (1, 2):
        T.reset()
        t0 = time.perf_counter()
        state, report = replay_mod.replay(addr, Target(), workers=workers, share_torch_threads=True)
        wall = time.perf_counter() - t0
        snap_version = report.snapshot_version
        raw = sum(t.bits.nbytes for s in state.shards for t in s.tensors.values())
        del state
        show(console, f"replay v{report.version} (snapshot v{snap_version} + "
             f"{report.tail_versions} versions), {workers} worker(s)", wall,
             raw * report.tail_versions, REPLAY_ORDER)
    if snap_version:
        T.reset()
        t0 = time.perf_counter()
        replay_mod.replay(addr, Target("version", snap_version), workers=2, share_torch_threads=True)
        wall = time.perf_counter() - t0
        show(console, "replay to the snapshot's own version (no tail), 2 workers", wall, raw,
             REPLAY_ORDER)
    unpatch()


# ---------------------------------------------------------------------------- primitives
def scaling(fn: Callable[[Any], Any], items: list[Any], reps: int = 2) -> tuple[float, float]:
    """(1-thread seconds, 2-thread seconds) to run ``fn`` over ``items``."""
    def once(threads: int) -> float:
        best = []
        for _ in range(reps):
            t0 = time.perf_counter()
            if threads == 1:
                for it in items:
                    fn(it)
            else:
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(fn, items))
            best.append(time.perf_counter() - t0)
        return min(best)

    return once(1), once(2)


def primitives(console: Console, work: Workload, prev: dict[str, np.ndarray],
               new: dict[str, np.ndarray], tmp: Path) -> dict[str, Any]:
    chunk = 4 * 1024 * 1024
    pairs = []
    for name, n in new.items():
        p = prev[name]
        for off in range(0, len(n), chunk):
            pairs.append((n[off:off + chunk], p[off:off + chunk], name))
    pairs = pairs[:48]  # ~200 MB of work per measurement
    total = sum(a.nbytes for a, _, _ in pairs)
    xors = [np.bitwise_xor(a, b) for a, b, _ in pairs]
    comp = [tc._compress(x, 4) for x in xors]
    ser = serde_mod.EnvelopeSerializer()
    deltas = [TensorDelta("t", "float32", (a.nbytes // 4,), 0, 1, 0, a.nbytes, "XOR",
                          "blosc2-zstd", 1, tc.digest(a), c)
              for (a, _, _), c in zip(pairs, comp, strict=True)]
    msgs = [ser(Envelope("run", i + 1, 2, 2, 0, "w", 0, d)) for i, d in enumerate(deltas)]
    outbuf = [np.empty(a.nbytes, np.uint8) for a, _, _ in pairs]

    rows: list[tuple[str, Callable[[Any], Any], list[Any], int]] = [
        ("array_equal", lambda ab: np.array_equal(ab[0], ab[1]), pairs, total),
        ("xor (np.bitwise_xor)", lambda ab: np.bitwise_xor(ab[0], ab[1]), pairs, total),
        ("compress blosc2 shuffle+zstd-1", lambda x: tc._compress(x, 4), xors, total),
        ("xxh3-128", lambda ab: xxhash.xxh3_128_digest(ab[0]), pairs, total),
        ("encode_chunk (all of it)", lambda ab: tc.encode_chunk(
            ab[0], ab[1], typesize=4, base_version=1, index=0, count=1, offset=0), pairs, total),
        ("avro serialize (fastavro)", lambda d: ser(Envelope("run", 1, 2, 2, 0, "w", 0, d)),
         deltas, sum(len(c) for c in comp)),
        ("avro decode (fastavro)", lambda m: serde_mod.decode(m), msgs, sum(len(m) for m in msgs)),
        ("decompress blosc2", lambda c: blosc2.decompress2(c), comp, total),
        ("decode_chunk (all of it, + a memcpy)", lambda i: tc.decode_chunk(
            deltas[i], _bits_for(pairs[i], outbuf[i]), "x"), list(range(len(deltas))), total),
    ]
    out: dict[str, Any] = {}
    t = Table(title=f"Primitives on {len(pairs)} real 4 MiB chunks ({total / MB:.0f} MB raw): "
                    "1 vs 2 threads (same work)")
    for c in ("primitive", "1 thread MB/s", "2 threads MB/s", "2-thread speedup"):
        t.add_column(c, justify="left" if c == "primitive" else "right")
    for label, fn, items, nbytes in rows:
        one, two = scaling(fn, items)
        out[label] = {"mb_s_1": nbytes / one / MB, "mb_s_2": nbytes / two / MB,
                      "speedup": one / two}
        t.add_row(label, f"{nbytes / one / MB:.0f}", f"{nbytes / two / MB:.0f}", f"{one / two:.2f}x")
    # SQLite: the backend's own schema and pragmas vs 64 KiB pages + a rowid table.
    for label, page, rowid in (("sqlite insert+commit (current schema)", None, False),
                               ("sqlite insert+commit (64K pages, rowid table)", 65536, True)):
        w, r = _sqlite_rate(tmp, msgs, page, rowid)
        out[label] = {"write_mb_s": w, "read_mb_s": r}
        t.add_row(label, f"w {w:.0f} / r {r:.0f}", "", "")
    console.print(t)
    return out


def _bits_for(pair: tuple[np.ndarray, np.ndarray, str], buf: np.ndarray) -> np.ndarray:
    buf[:] = pair[1]  # the previous bits: the XOR delta applies to them
    return buf


def _sqlite_rate(tmp: Path, msgs: list[bytes], page: int | None, rowid: bool) -> tuple[float, float]:
    d = Path(tempfile.mkdtemp(dir=tmp))
    c = sqlite3.connect(d / "x.db", isolation_level=None)
    if page:
        c.execute(f"PRAGMA page_size={page}")
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("PRAGMA synchronous=FULL")
    c.execute("CREATE TABLE records (run TEXT, partition INTEGER, offset INTEGER, value BLOB "
              "NOT NULL, PRIMARY KEY (run, partition, offset))" + ("" if rowid else " WITHOUT ROWID"))
    per = 12
    t0 = time.perf_counter()
    for start in range(0, len(msgs), per):
        c.execute("BEGIN IMMEDIATE")
        for i in range(start, min(len(msgs), start + per)):
            c.execute("INSERT INTO records VALUES (?,?,?,?)", ("r", i % 2, i, msgs[i]))
        c.execute("COMMIT")
    wt = time.perf_counter() - t0
    t0 = time.perf_counter()
    n = 0
    for p in (0, 1):
        for (v,) in c.execute("SELECT value FROM records WHERE run='r' AND partition=? "
                              "ORDER BY offset", (p,)):
            n += len(v)
    rt = time.perf_counter() - t0
    c.close()
    shutil.rmtree(d, ignore_errors=True)
    total = sum(len(m) for m in msgs)
    return total / wt / MB, n / rt / MB


def per_kind_ratio(prev: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> dict[str, float]:
    """Encoded/raw of one real step, by kind of tensor (param, exp_avg, exp_avg_sq)."""
    raw: dict[str, int] = defaultdict(int)
    enc: dict[str, int] = defaultdict(int)
    for name, n in new.items():
        kind = name.rsplit("/", 1)[-1] if name.startswith("optimizer/") else "param"
        if kind == "step":
            continue
        chunks = tc.encode_tensor(n, prev[name], typesize=4, base_version=1)
        raw[kind] += n.nbytes
        enc[kind] += sum(len(c.payload) for c in chunks)
    return {k: enc[k] / raw[k] for k in raw}


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile")
    ap.add_argument("--size", default="25M")
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--warmup-steps", type=int, default=30)
    ap.add_argument("--parts", default="commit,replay,primitives")
    ap.add_argument("--workdir")
    ap.add_argument("--replay-run", nargs=3, metavar=("LOG_URL", "RUN_ID", "SNAPSHOTS_URL"),
                    help="only profile replays of an existing run (e.g. one kept by "
                         "python -m benchmarks --keep: LOG_URL is its embedded/rewind.db)")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    console = Console(width=150)
    if args.replay_run:
        log_url, run_id, snaps = args.replay_run
        profile_replays(console, RunAddress(log_url, log_url, run_id, snaps or None))
        return 0
    work = Workload.build(parse_size(args.size))
    work.step(args.warmup_steps)
    raw = work.raw_bytes()
    console.print(f"{work.params / 1e6:.1f}M params, {raw / MB:.0f} MB state, "
                  f"{args.warmup_steps} warm-up steps; load average {os.getloadavg()}")
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="rewind-prof-", dir=args.workdir))
    try:
        db = f"sqlite://{root / 'rewind.db'}"
        addr = RunAddress(db, db, "prof", f"file://{root / 'snapshots'}")
        with Recorder(addr, work.model, work.optimizer, work.scheduler, rng=True) as rec:
            rec.commit(work.steps_done, wait=True)  # FULL, untimed
            work.step()
            rec.commit(work.steps_done, wait=True)  # allocates the second buffer set
            if "commit" in parts:
                install_commit_timers()
            T.reset()
            t0 = time.perf_counter()
            for _ in range(args.versions):
                work.step()
                wall0 = time.perf_counter()
                rec.commit(work.steps_done, wait=True)
                T.add("(durable commits, wall)", time.perf_counter() - wall0)
            unpatch()
            if "commit" in parts:
                show(console, f"commit x{args.versions}", T.s["(durable commits, wall)"],
                     raw * args.versions, COMMIT_ORDER)
            del t0
            # The replay target: a snapshot now, then a tail of ``versions`` versions.
            with Snapshotter(addr, SnapshotStore(addr.snapshots_url or ""),
                             SnapshotterConfig(workers=2)) as snap:
                snap.snapshot(force=True)
            prev = {n: tc.tensor_bits(t).copy() for n, t in work.tensors().items()}
            for _ in range(args.versions):
                work.step()
                rec.commit(work.steps_done, wait=True)
            new = {n: tc.tensor_bits(t).copy() for n, t in work.tensors().items()}
        if "replay" in parts:
            profile_replays(console, addr)
        if "primitives" in parts:
            # prev/new are the state ``versions`` steps apart; use one step apart for realism.
            work.step()
            one_before = {n: tc.tensor_bits(t).copy() for n, t in work.tensors().items()}
            work.step()
            now = {n: tc.tensor_bits(t).copy() for n, t in work.tensors().items()}
            primitives(console, work, one_before, now, root)
            ratios = per_kind_ratio(one_before, now)
            console.print("encoded/raw of one real step by kind: "
                          + ", ".join(f"{k} {v:.3f}" for k, v in sorted(ratios.items())))
            del prev, new
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
