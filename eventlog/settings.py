"""Rewind's settings, and the one module that reads the process environment.

``Settings`` holds the tuning: one frozen object, read from the environment once. Every
field has a documented default and an environment override ``REWIND_<FIELD>`` (upper
case), read the first time ``current()`` is called, never at import. The entry points take
them explicitly (``Recorder(..., settings=...)``, ``replay(..., settings=...)``); internals
read ``current()``. Tests change them with ``override(...)``, a context manager, never by
patching modules. The two process-wide fields (``malloc_mmap_threshold``,
``replay_torch_threads``) take effect only in the ``rewind`` CLI's own process.

``Deployment`` holds where runs live and which keys protect them (``REWIND_LOG``,
``REWIND_KEYS``, ...), read at each use (``deployment()``). ``host_variable`` reads another
program's variable that Rewind records or defers to. No other module reads the environment
(``tests/test_layers.py``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from eventlog.errors import ConfigError

_MiB = 1024 * 1024
_GiB = 1024 * _MiB


@dataclass(frozen=True)
class Settings:
    """Tuning settings. Defaults suit a trainer on one machine; each is ``REWIND_<NAME>``."""

    #: Raw bytes of tensor bits per chunk; a chunk is one log message. A multiple of 16 so
    #: that every dtype's elements stay whole inside a chunk.
    chunk_bytes: int = 4 * _MiB
    #: Compression level of blosc2's zstd for XOR deltas.
    zstd_level: int = 1
    #: Compression of logged gradients: ``none``, ``blosc2-lz4`` or ``blosc2-zstd``. Raw
    #: gradients are handed to the replayed optimizer as views of their message.
    grad_compression: str = "none"
    #: Threads that encode and decode chunks (0: one per core).
    codec_threads: int = 0
    #: Commits that may be queued behind the one being written before ``commit()`` blocks.
    max_inflight: int = 1
    #: Tensor shards of a new run.
    shards: int = 2
    #: Records fetched per read call while folding a Kafka partition.
    read_batch: int = 16
    #: Rows found per read transaction while folding an embedded shard partition.
    embedded_read_batch: int = 16
    #: Most optimizer steps a version may hold and still be encoded predictively (beyond
    #: two, XOR deltas are smaller than the logged gradients).
    predict_max_steps: int = 2
    #: Seconds a fold keeps polling a shard whose sealed version is not all visible yet
    #: (the partitions of one Kafka transaction become readable a moment apart).
    settle_s: float = 30.0
    #: Whether the ``rewind`` CLI's parallel replays share torch's intra-op threads among
    #: their workers (process-wide; a library call never changes torch's thread count).
    replay_torch_threads: bool = True
    #: Tensor chunks of at least this many bytes are kept in the embedded log's segment
    #: files (read through memory maps); smaller ones stay in SQLite. 0: every chunk.
    embedded_segment_min_bytes: int = 0
    #: Size at which the embedded log starts a new segment file for a partition.
    embedded_segment_bytes: int = _GiB
    #: Whether a replay to a snapshot's own version maps the snapshot's files.
    snapshot_map: bool = True
    #: Whether folds batch consecutive optimizer steps and run them tile by tile.
    replay_defer_steps: bool = True
    #: Compressed gradient bytes a shard's fold may hold for batched steps.
    replay_defer_bytes: int = 256 * _MiB
    #: Bytes of mapped segment-file views a shard's fold may hold for batched steps.
    replay_defer_mapped_bytes: int = 16 * _GiB
    #: Gradient bytes per tile of a batched replay (a cache-sized piece of the state).
    replay_tile_bytes: int = 4 * _MiB
    #: glibc's mmap threshold in the ``rewind`` CLI's own process (0: leave malloc alone).
    malloc_mmap_threshold: int = 32 * _MiB
    #: Seconds a committed version may wait in the embedded log's WAL before it is
    #: checkpointed into the database.
    checkpoint_idle_s: float = 5.0
    #: Upper bound on any decoded tensor (bytes); a forged shape above it is rejected.
    max_tensor_bytes: int = 64 * _GiB
    #: Upper bound on one msgpack small state (bytes).
    max_small_state_bytes: int = 256 * _MiB

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), type(f.default)
            if kind is float and type(value) is int:
                value = float(value)
                object.__setattr__(self, f.name, value)  # frozen: the one place it is set
            if type(value) is not kind:
                raise ConfigError(f"setting {f.name} (REWIND_{f.name.upper()}) must be "
                                  f"{_KIND_WORDS[kind]}, got {value!r}")
            if kind is bool:
                continue
            if isinstance(value, float) and not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"setting {f.name} (REWIND_{f.name.upper()}) must be a "
                                  f"finite number >= 0, got {value}")
            least = 1 if f.name in _AT_LEAST_ONE else 0
            if isinstance(value, int) and value < least:
                raise ConfigError(f"setting {f.name} (REWIND_{f.name.upper()}) must be >= {least}, "
                                  f"got {value}")
        if self.chunk_bytes < 16 or self.chunk_bytes % 16:
            raise ConfigError(f"setting chunk_bytes (REWIND_CHUNK_BYTES) must be a positive "
                              f"multiple of 16, got {self.chunk_bytes}")
        if self.grad_compression not in ("none", "blosc2-lz4", "blosc2-zstd"):
            raise ConfigError("setting grad_compression (REWIND_GRAD_COMPRESSION) must be none, "
                              f"blosc2-lz4 or blosc2-zstd, got {self.grad_compression!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """The defaults, with every ``REWIND_<NAME>`` set in ``env`` (``os.environ``)."""
        env = os.environ if env is None else env
        changes: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f"REWIND_{f.name.upper()}")
            if not raw:
                continue
            kind: type[Any] = type(f.default)
            try:
                if kind is bool:
                    changes[f.name] = _parse_bool(raw)
                else:
                    changes[f.name] = kind(raw)
            except ValueError:
                raise ConfigError(f"REWIND_{f.name.upper()}={raw!r} is not a valid "
                                  f"{kind.__name__}") from None
        return cls(**changes)  # type: ignore[arg-type]

    def with_changes(self, **changes: object) -> Settings:
        """A copy with ``changes`` applied (checked like any other)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(f"no setting named {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def resolved_codec_threads(self) -> int:
        """Threads for chunk encode/decode: the setting, or one per core."""
        return self.codec_threads or (os.cpu_count() or 1)


_KIND_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
#: Counts that zero would make meaningless (no shard, no read, no room in the queue).
_AT_LEAST_ONE = frozenset({"shards", "max_inflight", "read_batch", "embedded_read_batch",
                           "replay_tile_bytes", "embedded_segment_bytes"})


def _parse_bool(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


_KAFKA_CONF = "REWIND_KAFKA_CONF_"


@dataclass(frozen=True)
class Deployment:
    """Where runs live and which keys protect them. Read from the environment at each use
    (``deployment()``), not once like ``Settings``: a process may address another run, or
    rotate its keys, while it lives."""

    #: ``REWIND_LOG``: the log URL (``None``: unset; the embedded ``./rewind.db``).
    log: str | None = None
    #: ``REWIND_COORD``: the coordinator URL (``None``: unset; the log's URL).
    coord: str | None = None
    #: ``REWIND_SNAPSHOTS``: the snapshot store, ``file://DIR`` (empty: none).
    snapshots: str = ""
    #: ``REWIND_KEY_FILE``: a file of ``key-id = key`` lines (empty: none).
    key_file: str = ""
    #: ``REWIND_KEYS``: ``id=key,id=key`` (empty: none).
    keys: str = ""
    #: ``REWIND_ACTIVE_KEY``: the key id new data is encrypted with (empty: the last listed).
    active_key: str = ""
    #: ``REWIND_KAFKA_CONF_<KEY>``: librdkafka settings a ``kafka://`` URL does not set, by
    #: key (``REWIND_KAFKA_CONF_SASL_MECHANISM`` is ``sasl.mechanism``).
    kafka_conf: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Deployment:
        """The variables set in ``env`` (``os.environ``)."""
        env = os.environ if env is None else env
        conf = {name[len(_KAFKA_CONF):].lower().replace("_", "."): value
                for name, value in env.items() if name.startswith(_KAFKA_CONF) and name != _KAFKA_CONF}
        return cls(env.get("REWIND_LOG"), env.get("REWIND_COORD"), env.get("REWIND_SNAPSHOTS", ""),
                   env.get("REWIND_KEY_FILE", ""), env.get("REWIND_KEYS", ""),
                   env.get("REWIND_ACTIVE_KEY", ""), conf)


def deployment() -> Deployment:
    """Where runs live and which keys protect them, as the environment says now."""
    return Deployment.from_env()


def host_variable(name: str) -> str | None:
    """Another program's environment variable (cuBLAS's, glibc's), which Rewind records or
    defers to and never sets; ``None`` when unset."""
    return os.environ.get(name)


_lock = threading.Lock()
_current: Settings | None = None


def current() -> Settings:
    """The process's settings: read from the environment on first use, or overridden."""
    global _current
    found = _current  # the common case, without the lock: a global's read is atomic
    if found is not None:
        return found
    with _lock:
        if _current is None:
            _current = Settings.from_env()
        return _current


@contextmanager
def override(**changes: object) -> Iterator[Settings]:
    """Process-wide settings with ``changes`` applied, for the ``with`` block (tests)."""
    global _current
    before = current()
    changed = before.with_changes(**changes)
    with _lock:
        _current = changed
    try:
        yield changed
    finally:
        with _lock:
            _current = before
