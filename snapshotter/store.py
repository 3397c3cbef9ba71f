"""Snapshot files: written atomically with checksums, manifest last, verified before use.

Layout: ``<root>/<run>/<snapshot-id>/`` holding ``shard-<s>.safetensors`` (tensor bits),
``small.msgpack`` (small states) and ``manifest.json`` (written last). Every file is written
to a temporary name, fsynced and renamed; a snapshot directory is never modified after its
manifest exists. The manifest lists each file's size and xxh3-128, and the ``SnapshotEnd``
marker in the log holds the manifest's own digest, so any damage is detected before use.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
import xxhash

from eventlog import ConfigError, CorruptMessageError, DecodeError, RewindError, crypto, filemaps
from eventlog.durability import fsync_dir
from eventlog.fold.apply import ShardState
from eventlog.fold.bits import TensorBits
from eventlog.fold.engine import SmallStates
from eventlog.fold.sharing import WorkBoard, map_shared
from eventlog.tensorcodec import itemsize, nbytes_of
from snapshotter.pieces import digest_hex, read_and_hash

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


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def shard_file_parts(state: ShardState) -> list[memoryview]:
    """A shard's safetensors file (raw bits, every dtype kept exactly) as its pieces in
    order: the header, then each tensor's bits (the state's own buffers, not copies), so a
    writer can stream them. Widest dtypes first, and the header padded so that the data
    starts 64-byte aligned: every tensor is aligned for its dtype in a mapped file."""
    order = sorted(state.tensors.items(), key=lambda item: (-itemsize(item[1].dtype), item[0]))
    header: dict[str, Any] = {"__metadata__": {"shard": str(state.shard)}}
    pos = 0
    for name, t in order:
        code = _ST_CODES.get(t.dtype)
        if code is None:
            raise RewindError(f"shard {state.shard} tensor {name!r}: dtype {t.dtype} has no safetensors code")
        header[name] = {"dtype": code, "shape": list(t.shape), "data_offsets": [pos, pos + len(t.bits)]}
        pos += len(t.bits)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    head = memoryview(len(raw).to_bytes(8, "little") + raw)
    return [head, *(memoryview(t.bits) for _, t in order)]  # type: ignore[arg-type]


def shard_file_bytes(state: ShardState) -> bytes:
    """A shard's whole safetensors file in memory (``shard_file_parts`` joined)."""
    return b"".join(shard_file_parts(state))


def _stream_write(path: Path, parts: list[memoryview]) -> tuple[int, str]:
    """Write ``parts`` to ``path`` atomically (temporary name, fsync, rename), hashing them
    as they go; returns (bytes, xxh3-128 hex). No copy of the file is built in memory."""
    tmp = path.with_name(f".{path.name}.tmp")
    digest, size = xxhash.xxh3_128(), 0
    with open(tmp, "wb", buffering=0) as f:
        for part in parts:
            view = part.cast("B")
            for at in range(0, len(view), _STREAM_PIECE):
                piece = view[at:at + _STREAM_PIECE]
                digest.update(piece)
                done = 0
                while done < len(piece):  # a raw write may write less than asked
                    done += f.write(piece[done:])
            size += len(view)
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return size, digest.hexdigest()


#: safetensors dtype codes -> the dtype names Rewind records (every one ``shard_file_bytes``
#: can write; safetensors has no complex128).
_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
    "BOOL": "bool", "C64": "complex64",
}
#: Rewind dtype names -> safetensors dtype codes.
_ST_CODES = {name: code for code, name in _ST_DTYPES.items()}
#: Bytes hashed and written at a time by ``_stream_write``.
_STREAM_PIECE = 8 * 1024 * 1024
#: Largest safetensors header accepted (safetensors' own limit).
_MAX_HEADER = 100_000_000
#: Tensor data inside a loaded shard buffer starts on this boundary.
_ALIGN = 64


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate keys")
    return out


def _header(buf: np.ndarray, where: str) -> tuple[dict[str, tuple[str, tuple[int, ...], int, int]], int]:
    """Parse and validate a safetensors header: ``({name: (dtype, shape, begin, end)}, data
    start)``. Offsets are relative to the data start; the tensors must tile the data exactly
    (in range, no overlap, no gap), each as long as its dtype and shape say."""
    size = len(buf)
    if size < 8:
        raise SnapshotCorruptError(f"{where}: not a valid safetensors file ({size} bytes)")
    hlen = int.from_bytes(buf[:8].tobytes(), "little")
    if hlen > _MAX_HEADER or 8 + hlen > size:
        raise SnapshotCorruptError(
            f"{where}: not a valid safetensors file (header of {hlen} bytes in a {size}-byte file)")
    try:
        raw = json.loads(buf[8 : 8 + hlen].tobytes(), object_pairs_hook=_no_duplicates)
    except (ValueError, UnicodeDecodeError) as exc:
        raise SnapshotCorruptError(f"{where}: not a valid safetensors file (header: {exc})") from exc
    if not isinstance(raw, dict):
        raise SnapshotCorruptError(f"{where}: not a valid safetensors file (header is not an object)")
    meta = raw.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SnapshotCorruptError(f"{where}: safetensors metadata is not a map of strings")
    data_len = size - 8 - hlen
    out = {}
    for name, info in raw.items():
        bad = f"{where}: safetensors entry {name!r} is invalid"
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise SnapshotCorruptError(bad)
        dtype = _ST_DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        shape, offs = info["shape"], info["data_offsets"]
        if dtype is None:
            raise SnapshotCorruptError(f"{bad}: dtype {info['dtype']!r} is not supported")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise SnapshotCorruptError(f"{bad}: shape {shape!r}")
        if not isinstance(offs, list) or len(offs) != 2 or \
                not all(type(o) is int and 0 <= o <= data_len for o in offs) or offs[0] > offs[1]:
            raise SnapshotCorruptError(f"{bad}: data offsets {offs!r} outside [0, {data_len}]")
        try:
            nbytes = nbytes_of(dtype, tuple(shape), where)
        except DecodeError as exc:
            raise SnapshotCorruptError(str(exc)) from exc
        if offs[1] - offs[0] != nbytes:
            raise SnapshotCorruptError(
                f"{bad}: {offs[1] - offs[0]} bytes for {dtype}{shape}, which needs {nbytes}")
        out[name] = (dtype, tuple(shape), offs[0], offs[1])
    pos = 0
    for _, _, begin, end in sorted(out.values(), key=lambda e: (e[2], e[3])):
        if begin != pos:
            raise SnapshotCorruptError(
                f"{where}: safetensors tensors {'overlap' if begin < pos else 'leave a gap'} "
                f"at data offset {min(begin, pos)}")
        pos = end
    if pos != data_len:
        raise SnapshotCorruptError(f"{where}: safetensors data is {data_len} bytes, tensors cover {pos}")
    return out, 8 + hlen


def _writable_buffer(size: int, data_start: int = 0) -> np.ndarray:
    """A writable uint8 buffer of ``size`` bytes whose byte ``data_start`` is ``_ALIGN``-aligned.

    torch's allocator gives large buffers huge pages (fewer first-touch faults than numpy's).
    """
    raw = torch.empty(size + _ALIGN, dtype=torch.uint8).numpy()
    shift = -(raw.ctypes.data + data_start) % _ALIGN
    return raw[shift : shift + size]


#: A check of one loaded shard, run by the worker that loaded it (``SnapshotStore.load``).
ShardCheck = Callable[[ShardState, WorkBoard | None], None]


def load_shard_file(data: bytes | np.ndarray, shard: int, where: str) -> dict[str, TensorBits]:
    """Parse a verified safetensors shard file into raw tensor bits.

    Given a writable uint8 array (``SnapshotStore.read_buffer``), the tensors' bits are
    views into it, not copies; given bytes, they are copied into one new buffer first. The
    header is validated before any view is made: offsets in range, tiling the data exactly,
    dtypes known, each length equal to shape x itemsize.
    """
    if isinstance(data, np.ndarray) and data.dtype == np.uint8 and data.ndim == 1 \
            and data.flags.writeable and data.flags.c_contiguous:
        buf = data
        header, start = _header(buf, where)
    else:
        src = np.frombuffer(data, dtype=np.uint8)
        header, start = _header(src, where)
        buf = _writable_buffer(len(src), start)
        buf[:] = src
    out = {}
    for name, (dtype, shape, begin, end) in header.items():
        bits = buf[start + begin : start + end]
        if bits.ctypes.data % itemsize(dtype):  # a foreign file's unaligned tensor: own copy
            bits = bits.copy()
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
            if keys is None:  # streamed from the state's buffers: no copy of the file in memory
                size, digest = _stream_write(folder / name, shard_file_parts(state))
                return FileEntry(name, size, digest)
            data = seal(name, shard_file_bytes(state))
            _atomic_write(folder / name, data)
            return FileEntry(name, len(data), digest_hex(data))

        small_bytes = seal("small.msgpack", msgpack.packb(
            {"states": small.states, "kinds": small.kinds, "applied_gsn": small.applied_gsn},
            use_bin_type=True,
        ))
        with ThreadPoolExecutor(max(1, workers)) as pool:
            entries = list(pool.map(write_shard, shards))
        _atomic_write(folder / "small.msgpack", small_bytes)
        entries.append(FileEntry("small.msgpack", len(small_bytes), digest_hex(small_bytes)))
        fsync_dir(folder)
        if before_manifest is not None:
            before_manifest()
        full = _with_files(manifest, entries, keys.active if keys else None)
        data = full.to_bytes()
        _atomic_write(folder / MANIFEST, data)
        fsync_dir(folder)
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
        return self.read_buffer(run_id, snapshot_id, entry, key_id).tobytes()

    def read_buffer(
        self, run_id: str, snapshot_id: str, entry: FileEntry, key_id: str | None = None,
        *, mapped: bool = False, board: WorkBoard | None = None, checked: bool = True,
    ) -> np.ndarray:
        """One file's bytes as a writable uint8 array, verified against its manifest entry
        (and decrypted), like ``read_file``: read straight into one buffer (no copies), whose
        safetensors data start is aligned for any dtype.

        ``mapped``: a private map of the (plaintext) file instead. Its pages stay the page
        cache's until written, so a state that is only read costs no copy and no fresh
        pages; each page written later is copied then, one fault at a time, which makes a
        replay that steps through a tail slower than reading the file (figures:
        docs/performance.md). Snapshot files are never rewritten
        in place, so the map cannot shrink under the state.

        ``checked=False`` skips the xxh3 checksum, for a caller that checks what it builds
        from the bits against a seal, and reads the file again checked on a mismatch
        (``replayer.replay``). The length is still checked, and an encrypted file is still
        authenticated by its decryption."""
        path = self.directory(run_id, snapshot_id) / entry.name
        if "/" in entry.name or entry.name.startswith("."):
            raise SnapshotCorruptError(f"snapshot {snapshot_id}: bad file name {entry.name!r}")
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size != entry.bytes:
                    raise SnapshotCorruptError(
                        f"snapshot {snapshot_id}: {path} has {size} bytes, manifest says "
                        f"{entry.bytes} (truncated?)"
                    )
                if mapped and key_id is None and size:
                    region = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
                    filemaps.track(region)  # (its bits are the file's: ``filemaps.of_file``)
                    buf = np.frombuffer(region, dtype=np.uint8)
                    return self._verified(buf, snapshot_id, path, entry) if checked else buf
                head = os.pread(f.fileno(), 8, 0)
                hlen = int.from_bytes(head, "little") if len(head) == 8 and key_id is None else 0
                buf = _writable_buffer(size, 8 + hlen if hlen <= size else 0)
                got, digest = read_and_hash(f.fileno(), buf, board, hashed=checked)
        except OSError as exc:
            raise SnapshotCorruptError(f"snapshot {snapshot_id}: {path} is missing") from exc
        if got != size:
            raise SnapshotCorruptError(
                f"snapshot {snapshot_id}: {path} has {got} bytes, manifest says {entry.bytes} (truncated?)"
            )
        if checked:
            self._verified(buf, snapshot_id, path, entry, digest)
        if key_id is None:
            return buf
        where = f"snapshot {snapshot_id} {entry.name}"
        plain = crypto.require(key_id, where).decrypt(
            key_id, buf.data, _file_aad(run_id, snapshot_id, entry.name), where)  # type: ignore[arg-type]
        src = np.frombuffer(plain, dtype=np.uint8)
        hlen = int.from_bytes(plain[:8], "little") if len(plain) >= 8 else 0
        out = _writable_buffer(len(src), 8 + hlen if 8 + hlen <= len(src) else 0)
        out[:] = src
        return out

    @staticmethod
    def _verified(buf: np.ndarray, snapshot_id: str, path: Path, entry: FileEntry,
                  digest: str | None = None) -> np.ndarray:
        """``buf``, unless its xxh3 (``digest``, when already computed) is not the manifest's."""
        if (digest or digest_hex(buf)) != entry.xxh3:
            raise SnapshotCorruptError(f"snapshot {snapshot_id}: {path} fails its xxh3 checksum")
        return buf

    def load(
        self, run_id: str, snapshot_id: str, expect_digest: bytes | None, *, workers: int = 2,
        mapped: bool = False, checker: Callable[[Manifest], ShardCheck] | None = None,
        checked: bool = True,
    ) -> tuple[Manifest, list[ShardState], SmallStates]:
        """Verify and load a snapshot into shard states and small states (``mapped``: shard
        files mapped privately, for a state that will mostly be read; see ``read_buffer``).

        ``checker``: given the manifest before any shard file is read, returns a check
        that each loaded shard must pass; it runs on the worker that loaded the shard, as
        soon as it is loaded. ``checked=False``: the shard files' checksums are skipped (see
        ``read_buffer``); the manifest and the small states are always checked."""
        m = self.read_manifest(run_id, snapshot_id, expect_digest)
        entries = {e.name: e for e in m.files}
        check = checker(m) if checker else None

        def load_shard(shard: int, board: WorkBoard | None) -> ShardState:
            name = f"shard-{shard}.safetensors"
            if name not in entries:
                raise SnapshotCorruptError(f"snapshot {snapshot_id}: manifest lacks {name}")
            data = self.read_buffer(run_id, snapshot_id, entries[name], m.key_id, mapped=mapped,
                                    board=board, checked=checked)
            gsn = m.applied_gsns[shard + 1]
            tensors = load_shard_file(data, shard, f"snapshot {snapshot_id} {name}")
            state = ShardState(shard, tensors, applied_gsn=gsn, snapshot_gsn=gsn, version=m.version)
            if check is not None:
                check(state, board)
            return state

        # Workers share the files' pieces (and the checks' tensors): one whose shards are
        # done helps the others.
        shards = map_shared(workers, range(m.shard_count), load_shard)
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
