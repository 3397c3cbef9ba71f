"""Tuning constants in one place, each overridable from the environment (``REWIND_<NAME>``)."""

from __future__ import annotations

import os
import signal


def _int(name: str, default: int) -> int:
    raw = os.environ.get(f"REWIND_{name}")
    return int(raw) if raw else default


#: Raw bytes of tensor bits per chunk; a chunk is one log message. A multiple of 16 so that
#: every dtype's elements stay whole inside a chunk.
CHUNK_BYTES = _int("CHUNK_BYTES", 4 * 1024 * 1024)
#: Compression level for blosc2's zstd (chosen by ``benchmarks/codec_choice``).
ZSTD_LEVEL = _int("ZSTD_LEVEL", 1)
#: Compression of logged gradients: ``none`` (default), ``blosc2-lz4`` or ``blosc2-zstd``.
#: Gradients are mostly noisy mantissas: lz4 saves 5% of their bytes and zstd 15%, but
#: every replayed version must then decompress a whole gradient, while a raw one is handed
#: to the optimizer as a view of its message (README, "Tensor codec and the compressor
#: measurement").
GRAD_COMPRESSION = os.environ.get("REWIND_GRAD_COMPRESSION") or "none"
#: Threads that encode and decode chunks (0: one per core).
CODEC_THREADS = _int("CODEC_THREADS", 0)
#: Commits that may be queued behind the one being written before ``commit()`` blocks.
MAX_INFLIGHT = _int("MAX_INFLIGHT", 1)
#: Default number of tensor shards of a new run.
SHARDS = _int("SHARDS", 2)
#: Records fetched per read call while folding a Kafka partition (16 x 4 MiB chunks: a
#: fold that stops at its target version reads little past it; each call asks the broker
#: for the partition's offsets first).
READ_BATCH = _int("READ_BATCH", 16)
#: Rows found per read transaction while folding an embedded shard partition. Each record is
#: still decoded when the fold reaches it, a segment file's from a view of its map, and a
#: large record kept in SQLite read then, on its own (one 4 MiB copy alive at a time, which
#: the allocator reuses: 620K page faults instead of 746K when such records were read in
#: batches). One transaction per 4 MiB record had cost a fifth of a fold's reading.
EMBEDDED_READ_BATCH = _int("EMBEDDED_READ_BATCH", 16)
#: Most optimizer steps a version may hold and still be encoded predictively (each step logs
#: its gradients, ~0.28 of the fp32 Adam state; beyond two, XOR deltas are smaller).
PREDICT_MAX_STEPS = _int("PREDICT_MAX_STEPS", 2)
#: Seconds a fold keeps polling a shard whose sealed version is not all visible yet (the
#: partitions of one Kafka transaction become readable a moment apart; on a loaded broker,
#: a 4 MiB record was seen to take over 5 s). Only spent when records are missing.
SETTLE_S = float(os.environ.get("REWIND_SETTLE_S") or 30.0)
#: Whether parallel replays share torch's intra-op threads among their workers (1) or let
#: every worker's optimizer step use all of them (0).
REPLAY_TORCH_THREADS = _int("REPLAY_TORCH_THREADS", 1)
#: Tensor chunk messages of at least this many bytes are kept out of line in the embedded
#: log, in segment files read through memory maps (``eventlog.segments``); smaller ones
#: stay in SQLite. 0: every tensor chunk.
EMBEDDED_SEGMENT_MIN_BYTES = _int("EMBEDDED_SEGMENT_MIN_BYTES", 0)
#: Size at which the embedded log starts a new segment file for a partition (a file holds
#: at least one message, whatever its size).
EMBEDDED_SEGMENT_BYTES = _int("EMBEDDED_SEGMENT_BYTES", 1024**3)
#: Whether a replay to a snapshot's own version maps the snapshot's files (1) instead of
#: reading them into fresh memory (0), as a replay with a tail always does.
SNAPSHOT_MAP = _int("SNAPSHOT_MAP", 1)
#: Whether folds batch consecutive optimizer steps and run them tile by tile (1), or run
#: each step over the whole shard and check its predicted digests at once (0).
REPLAY_DEFER_STEPS = _int("REPLAY_DEFER_STEPS", 1)
#: Compressed gradient bytes a shard's fold may hold in memory for batched steps before
#: running them (views of mapped segment files do not count).
REPLAY_DEFER_BYTES = _int("REPLAY_DEFER_BYTES", 256 * 1024**2)
#: Bytes of mapped segment-file views a shard's fold may hold for batched steps. They hold no
#: memory, but each file they lie in stays mapped and open until the batch runs: 16 GiB is
#: about 25 files of 1 GiB per shard (a 4 MiB chunk takes 6 MiB of file, see
#: ``segments``), far from any limit on open files.
REPLAY_DEFER_MAPPED_BYTES = _int("REPLAY_DEFER_MAPPED_BYTES", 16 * 1024**3)
#: Gradient bytes per tile unit of a batched replay (a cache-sized piece of the state that
#: every batched step runs on before the next piece).
REPLAY_TILE_BYTES = _int("REPLAY_TILE_BYTES", 4 * 1024 * 1024)
#: glibc's mmap threshold in the processes that replay (the CLI; ``rewind.allocator``):
#: chunk payloads of 4 MiB then reuse freed heap memory instead of fresh pages. 0: leave
#: malloc alone. glibc refuses more than 32 MiB on 64-bit systems.
MALLOC_MMAP_THRESHOLD = _int("MALLOC_MMAP_THRESHOLD", 32 * 1024**2)
#: Seconds a committed version may wait in the embedded log's WAL for the next commit()'s
#: maintenance window before it is checkpointed into the database anyway.
CHECKPOINT_IDLE_S = float(os.environ.get("REWIND_CHECKPOINT_IDLE_S") or 5.0)
#: Upper bound on any single decoded tensor (bytes); a forged shape above it is rejected.
MAX_TENSOR_BYTES = _int("MAX_TENSOR_BYTES", 64 * 1024**3)
#: Upper bound on one msgpack small state (bytes).
MAX_SMALL_STATE_BYTES = _int("MAX_SMALL_STATE_BYTES", 256 * 1024**2)


def codec_threads() -> int:
    """Threads for chunk encode/decode: the knob, or one per core."""
    return CODEC_THREADS or (os.cpu_count() or 1)


#: Fault injection for crash tests: ``REWIND_FAULT_KILL=<point>`` makes the process SIGKILL
#: itself when it reaches that point, e.g. ``commit:7:12`` (inside the log transaction of
#: version 7, after 12 events) or ``snapshot:files:1`` (after a snapshot's second file).
#: Unset in production; read once at import.
_FAULT_KILL = os.environ.get("REWIND_FAULT_KILL", "")


def fault_point(*where: object) -> None:
    """SIGKILL this process if ``REWIND_FAULT_KILL`` names this point."""
    if _FAULT_KILL and ":".join(map(str, where)) == _FAULT_KILL:
        os.kill(os.getpid(), signal.SIGKILL)
