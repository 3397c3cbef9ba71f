"""Snapshot files: written atomically with checksums, manifest last, verified before use.

Layout: ``<root>/<run>/<snapshot-id>/`` holding ``shard-<s>.safetensors`` (tensor bits),
``small.msgpack`` (small states) and ``manifest.json`` (written last). Every file is written
to a temporary name, fsynced and renamed; a snapshot directory is never modified after its
manifest exists. The manifest lists each file's size and xxh3-128, and the ``SnapshotEnd``
marker in the log holds the manifest's own digest, so any damage is detected before use.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import safetensors.torch
from safetensors.torch import load as load_safetensors
import torch
import xxhash

from eventlog import ConfigError, CorruptMessageError, RewindError, crypto, knobs
from eventlog.apply import ShardState, TensorBits
from eventlog.fold import SmallStates
from eventlog.tensorcodec import nbytes_of, torch_dtype

MANIFEST = "manifest.json"
FORMAT = 1


class SnapshotCorruptError(CorruptMessageError):
    """A snapshot's manifest or one of its files is missing, truncated or damaged."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a snapshot, as its manifest records it."""

    name: str
    bytes: int
    xxh3: str


@dataclass(frozen=True)
class Manifest:
    """Everything needed to trust and use a snapshot."""

    format: int
    run_id: str
    snapshot_id: str
    schema_version: int
    config_digest: str
    version: int
    step: int
    state_digest: str
    shard_digests: list[str]  # from the seal of ``version``: checked again on every load
    small_digest: str
    shard_count: int
    applied_gsns: list[int]  # control first, then each shard
    next_offsets: list[int]  # control first, then each shard
    files: list[FileEntry]
    created_ms: int
    fencing_token: int
    layout: str  # the run layout (a RunStarted message, base64): the log's may be truncated
    metrics: dict[str, float] = field(default_factory=dict)
    #: The key that encrypted the data files (``None``: plaintext).
    key_id: str | None = None

    def to_bytes(self) -> bytes:
        """The manifest file's exact bytes (sorted keys, so its digest is stable)."""
        return (json.dumps(asdict(self), sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        """Parse and type-check a manifest, or raise ``SnapshotCorruptError``."""
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise SnapshotCorruptError(f"{where}: manifest is not JSON ({exc})") from exc
        if not isinstance(raw, dict) or set(raw) - _FIELDS.keys() or \
                set(_FIELDS) - set(raw) - {"metrics", "key_id"}:
            raise SnapshotCorruptError(f"{where}: manifest fields are not the expected ones")
        for name, check in _FIELDS.items():
            if name in raw and not check(raw[name]):
                raise SnapshotCorruptError(f"{where}: manifest field {name!r} is invalid")
        m = cls(**{**raw, "files": [FileEntry(**f) for f in raw["files"]]})
        if len(m.applied_gsns) != m.shard_count + 1 or len(m.next_offsets) != m.shard_count + 1 \
                or len(m.shard_digests) != m.shard_count:
            raise SnapshotCorruptError(f"{where}: manifest offsets do not match {m.shard_count} shards")
        if m.format != FORMAT:
            raise SnapshotCorruptError(f"{where}: snapshot format {m.format} is not {FORMAT}")
        return m


def _count(v: object) -> bool:
    return type(v) is int and 0 <= v < 2**63


def _text(v: object) -> bool:
    return isinstance(v, str)


def _counts(v: object) -> bool:
    return isinstance(v, list) and all(_count(x) for x in v)


def _texts(v: object) -> bool:
    return isinstance(v, list) and all(_text(x) for x in v)


def _file(v: object) -> bool:
    return isinstance(v, dict) and set(v) == {"name", "bytes", "xxh3"} and _text(v["name"]) \
        and _count(v["bytes"]) and _text(v["xxh3"])


_FIELDS: dict[str, Any] = {
    "format": _count, "run_id": _text, "snapshot_id": _text, "schema_version": _count,
    "config_digest": _text, "version": _count, "step": _count, "state_digest": _text,
    "shard_digests": _texts, "small_digest": _text, "shard_count": _count,
    "applied_gsns": _counts, "next_offsets": _counts,
    "files": lambda v: isinstance(v, list) and all(_file(f) for f in v),
    "created_ms": _count, "fencing_token": _count, "layout": _text,
    "metrics": lambda v: isinstance(v, dict) and all(
        _text(k) and type(x) in (int, float) for k, x in v.items()),
    "key_id": lambda v: v is None or _text(v),
}


def digest_hex(data: bytes | memoryview) -> str:
    """xxh3-128 of bytes, hex."""
    return xxhash.xxh3_128_hexdigest(data)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard_file_bytes(state: ShardState) -> bytes:
    """A shard's tensors as safetensors bytes (raw bits, every dtype kept exactly)."""
    tensors = {}
    for name, t in state.tensors.items():
        flat = torch.from_numpy(t.bits).view(torch_dtype(t.dtype)) if len(t.bits) else \
            torch.empty(0, dtype=torch_dtype(t.dtype))
        tensors[name] = flat.reshape(t.shape)
    return bytes(safetensors.torch.save(tensors, metadata={"shard": str(state.shard)}))


def load_shard_file(data: bytes, shard: int, where: str) -> dict[str, TensorBits]:
    """Parse a verified safetensors shard file into raw tensor bits."""
    try:
        loaded = load_safetensors(data)  # safetensors' own format: no pickle
    except Exception as exc:  # safetensors raises its own error types on damage
        raise SnapshotCorruptError(f"{where}: not a valid safetensors file ({exc})") from exc
    out = {}
    for name, t in loaded.items():
        dtype = str(t.dtype).removeprefix("torch.")
        shape = tuple(t.shape)
        nbytes_of(dtype, shape, where)
        flat = t.contiguous().reshape(-1)
        bits = flat.view(torch.uint8).numpy().copy() if flat.numel() else np.empty(0, np.uint8)
        out[name] = TensorBits(dtype, shape, bits)
    return out


class SnapshotStore:
    """Snapshots of runs in a local directory (``file://<root>`` or a plain path)."""

    def __init__(self, url: str | os.PathLike[str]) -> None:
        text = str(url)
        if "://" in text:
            scheme, _, rest = text.partition("://")
            if scheme != "file":
                raise ConfigError(f"snapshot store {text!r}: only file:// (local) is supported")
            text = rest
        self.root = Path(text)
        self.url = f"file://{self.root.resolve()}"

    def directory(self, run_id: str, snapshot_id: str) -> Path:
        """Where one snapshot's files live."""
        return self.root / run_id / snapshot_id

    def write(
        self,
        manifest: Manifest,
        shards: list[ShardState],
        small: SmallStates,
        *,
        workers: int = 2,
        before_manifest: Any = None,
    ) -> tuple[str, bytes]:
        """Write a snapshot's files in parallel, then its manifest; returns (uri, manifest digest).

        ``before_manifest`` (a callable) runs after the data files and before the manifest:
        the snapshotter checks its lease there.
        """
        folder = self.directory(manifest.run_id, manifest.snapshot_id)
        if (folder / MANIFEST).exists():
            raise RewindError(f"snapshot {folder} already exists; snapshots are never overwritten")
        folder.mkdir(parents=True, exist_ok=True)

        keys = crypto.keyring()

        def seal(name: str, data: bytes) -> bytes:
            if keys is None:
                return data
            return keys.encrypt(data, _file_aad(manifest.run_id, manifest.snapshot_id, name))

        def write_shard(state: ShardState) -> FileEntry:
            name = f"shard-{state.shard}.safetensors"
            data = seal(name, shard_file_bytes(state))
            _atomic_write(folder / name, data)
            return FileEntry(name, len(data), digest_hex(data))

        small_bytes = seal("small.msgpack", msgpack.packb(
            {"states": small.states, "kinds": small.kinds, "applied_gsn": small.applied_gsn},
            use_bin_type=True,
        ))
        with ThreadPoolExecutor(max(1, workers)) as pool:
            entries = []
            for i, entry in enumerate(pool.map(write_shard, shards)):
                entries.append(entry)
                knobs.fault_point("snapshot", "files", i)
        _atomic_write(folder / "small.msgpack", small_bytes)
        entries.append(FileEntry("small.msgpack", len(small_bytes), digest_hex(small_bytes)))
        _fsync_dir(folder)
        if before_manifest is not None:
            before_manifest()
        knobs.fault_point("snapshot", "manifest")
        full = _with_files(manifest, entries, keys.active if keys else None)
        data = full.to_bytes()
        _atomic_write(folder / MANIFEST, data)
        _fsync_dir(folder)
        return f"{self.url}/{manifest.run_id}/{manifest.snapshot_id}", bytes.fromhex(digest_hex(data))

    def read_manifest(self, run_id: str, snapshot_id: str, expect_digest: bytes | None) -> Manifest:
        """Load a manifest and check it against the digest its end marker recorded."""
        path = self.directory(run_id, snapshot_id) / MANIFEST
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise SnapshotCorruptError(f"snapshot {snapshot_id}: manifest {path} is missing") from exc
        if expect_digest is not None and bytes.fromhex(digest_hex(data)) != expect_digest:
            raise SnapshotCorruptError(
                f"snapshot {snapshot_id}: manifest {path} does not match the digest in its end marker"
            )
        m = Manifest.from_bytes(data, str(path))
        if m.run_id != run_id or m.snapshot_id != snapshot_id:
            raise SnapshotCorruptError(f"{path}: manifest names {m.run_id}/{m.snapshot_id}")
        return m

    def read_file(
        self, run_id: str, snapshot_id: str, entry: FileEntry, key_id: str | None = None
    ) -> bytes:
        """One file's bytes, verified against its manifest entry (and decrypted)."""
        path = self.directory(run_id, snapshot_id) / entry.name
        if "/" in entry.name or entry.name.startswith("."):
            raise SnapshotCorruptError(f"snapshot {snapshot_id}: bad file name {entry.name!r}")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise SnapshotCorruptError(f"snapshot {snapshot_id}: {path} is missing") from exc
        if len(data) != entry.bytes:
            raise SnapshotCorruptError(
                f"snapshot {snapshot_id}: {path} has {len(data)} bytes, manifest says {entry.bytes} (truncated?)"
            )
        if digest_hex(data) != entry.xxh3:
            raise SnapshotCorruptError(f"snapshot {snapshot_id}: {path} fails its xxh3 checksum")
        if key_id is None:
            return data
        where = f"snapshot {snapshot_id} {entry.name}"
        return crypto.require(key_id, where).decrypt(
            key_id, data, _file_aad(run_id, snapshot_id, entry.name), where)

    def load(
        self, run_id: str, snapshot_id: str, expect_digest: bytes | None, *, workers: int = 2
    ) -> tuple[Manifest, list[ShardState], SmallStates]:
        """Verify and load a snapshot into shard states and small states."""
        m = self.read_manifest(run_id, snapshot_id, expect_digest)
        entries = {e.name: e for e in m.files}

        def load_shard(shard: int) -> ShardState:
            name = f"shard-{shard}.safetensors"
            if name not in entries:
                raise SnapshotCorruptError(f"snapshot {snapshot_id}: manifest lacks {name}")
            data = self.read_file(run_id, snapshot_id, entries[name], m.key_id)
            gsn = m.applied_gsns[shard + 1]
            tensors = load_shard_file(data, shard, f"snapshot {snapshot_id} {name}")
            return ShardState(shard, tensors, applied_gsn=gsn, snapshot_gsn=gsn, version=m.version)

        with ThreadPoolExecutor(max(1, workers)) as pool:
            shards = list(pool.map(load_shard, range(m.shard_count)))
        if "small.msgpack" not in entries:
            raise SnapshotCorruptError(f"snapshot {snapshot_id}: manifest lacks small.msgpack")
        raw = self.read_file(run_id, snapshot_id, entries["small.msgpack"], m.key_id)
        try:
            doc = msgpack.unpackb(raw, raw=False)
            small = SmallStates(dict(doc["states"]), dict(doc["kinds"]), int(doc["applied_gsn"]))
        except Exception as exc:
            raise SnapshotCorruptError(f"snapshot {snapshot_id}: small.msgpack is damaged ({exc})") from exc
        return m, shards, small

    def list(self, run_id: str) -> list[str]:
        """Snapshot ids present on disk for a run (complete or not)."""
        folder = self.root / run_id
        return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.exists() else []

    def delete(self, run_id: str, snapshot_id: str) -> None:
        """Remove a snapshot: the manifest first, so a half-deleted snapshot is never valid."""
        folder = self.directory(run_id, snapshot_id)
        (folder / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)


def _with_files(manifest: Manifest, files: list[FileEntry], key_id: str | None) -> Manifest:
    data = {k: getattr(manifest, k) for k in Manifest.__dataclass_fields__}
    data["files"], data["key_id"] = files, key_id
    return Manifest(**data)


def _file_aad(run_id: str, snapshot_id: str, name: str) -> bytes:
    """Binds an encrypted snapshot file to its run, snapshot and name."""
    return f"rewind-snapshot|{run_id}|{snapshot_id}|{name}".encode()


def metrics_of(values: Mapping[str, float] | None) -> dict[str, float]:
    """Metrics as plain floats for the manifest."""
    return {k: float(v) for k, v in (values or {}).items()}
