"""Append-only segment files that hold the embedded log's tensor chunks out of line.

A tensor chunk message (4 MiB) kept in SQLite is read back by copying it out of the
database's pages: a 100M-param replay copies 4 GB that way, and that copy was the part of
the fold that two cores did not speed up. Kept in a segment file, a chunk is read through a
read-only memory map instead: its payload is a view of the page cache, handed to the
optimizer without any copy. The replay of the benchmark's log took 1.3x less time.

Layout: ``<database>.segments/<run>/p<partition>-<first offset>.seg``. SQLite stays the
source of truth: a record's row names its file, position and length, and it commits only
after the bytes are written and flushed (``Appender.flush``). Bytes that no committed row
names (a transaction rolled back, or a writer killed mid-way) are never read, and the next
append goes after them. Files are only appended to and deleted whole (``remove_below``):
a mapped file that shrank would kill the reader with SIGBUS, so nothing here ever
truncates one.

Each message is placed so that its bulk field (the payload, ``bulk_at`` bytes in) starts on
a 64-byte boundary, where vector loads of its elements run at full speed.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path

import xxhash

from .errors import CorruptStoreError, EventLogError

#: Alignment of a message's bulk field within its segment file (a cache line).
ALIGN = 64
_NAME = re.compile(r"p(-?\d+)-(\d{20})\.seg")
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def directory(database: Path, run_id: str) -> Path:
    """The directory of a run's segment files, beside its database file. The run id is
    made safe for a file name, and a hash of it keeps two ids that map alike apart."""
    safe = _SAFE.sub("_", run_id)[:48]
    return Path(f"{database}.segments") / f"{safe}-{xxhash.xxh64_hexdigest(run_id.encode())[:8]}"


def file_name(partition: int, first_offset: int) -> str:
    """The name of a segment file whose first message has ``first_offset``."""
    return f"p{partition}-{first_offset:020d}.seg"


def _first_offset(name: str, partition: int) -> int | None:
    m = _NAME.fullmatch(name)
    return int(m.group(2)) if m and int(m.group(1)) == partition else None


class Appender:
    """Writes one transaction's out-of-line messages (used under SQLite's write lock, so
    appenders of several processes never interleave)."""

    def __init__(self, root: Path, roll_bytes: int) -> None:
        self._root, self._roll = root, roll_bytes
        self._fds: dict[str, int] = {}
        self._new_file = False

    def append(self, current: str | None, partition: int, offset: int, value: bytes,
               bulk_at: int) -> tuple[str, int]:
        """Write ``value`` to the partition's segment ``current`` (or a new one, when there is
        none or it is full); returns ``(file name, position)`` for the record's row."""
        name = current
        if name is not None:
            size = self._size(name)
            if size is None or size + len(value) + ALIGN > self._roll:
                name = None
        if name is None:
            name = file_name(partition, offset)
            size = self._size(name)
        assert size is not None
        pos = size + (-(size + bulk_at) % ALIGN)
        fd = self._fds[name]
        try:
            written = os.pwrite(fd, value, pos)
        except OSError as exc:
            raise EventLogError(f"segment file {self._root / name}: cannot write: {exc}") from exc
        if written != len(value):
            raise EventLogError(f"segment file {self._root / name}: short write ({written} of {len(value)} bytes)")
        return name, pos

    def _size(self, name: str) -> int | None:
        """The file's size, opening (or creating) it first; ``None`` if it was deleted
        (its partition was truncated past it)."""
        fd = self._fds.get(name)
        path = self._root / name
        if fd is None:
            try:
                self._root.mkdir(parents=True, exist_ok=True)
                existed = path.exists()
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise EventLogError(f"segment file {path}: cannot open: {exc}") from exc
            self._fds[name] = fd
            self._new_file |= not existed
        st = os.fstat(fd)
        return None if st.st_nlink == 0 else st.st_size

    def flush(self) -> None:
        """Make every byte written so far durable (before the rows naming it commit)."""
        try:
            for fd in self._fds.values():
                os.fdatasync(fd)
            if self._new_file:
                dfd = os.open(self._root, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
                self._new_file = False
        except OSError as exc:
            raise EventLogError(f"segment files in {self._root}: cannot flush: {exc}") from exc

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class Reader:
    """Read-only maps of a run's segment files, a few at a time. A view keeps its map
    alive after the map leaves this cache (or its file is deleted)."""

    KEEP = 8

    def __init__(self, root: Path) -> None:
        self._root = root
        self._maps: OrderedDict[str, memoryview] = OrderedDict()
        self._lock = threading.Lock()

    def view(self, name: str, pos: int, length: int, where: str) -> memoryview:
        """``length`` bytes at ``pos`` of segment file ``name``, without a copy. The row that
        says where they are is checked first: a bad name or range is an error naming it."""
        if _NAME.fullmatch(name) is None:
            raise CorruptStoreError(f"{where}: bad segment file name {name!r}")
        if pos < 0 or length < 0:
            raise CorruptStoreError(f"{where}: bad segment range {pos}+{length} in {name}")
        if length == 0:
            return memoryview(b"")
        with self._lock:
            mapped = self._maps.get(name)
            if mapped is None or pos + length > len(mapped):
                mapped = self._map(name, pos + length, where)
            self._maps.move_to_end(name)
            return mapped[pos:pos + length]

    def _map(self, name: str, need: int, where: str) -> memoryview:
        path = self._root / name
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if need > size:
                    raise CorruptStoreError(
                        f"{where}: segment file {path} holds {size} bytes, the record ends at "
                        f"byte {need} (truncated?)")
                mapped = memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ))
        except FileNotFoundError as exc:
            raise CorruptStoreError(f"{where}: segment file {path} is missing") from exc
        except OSError as exc:
            raise CorruptStoreError(f"{where}: segment file {path} cannot be read: {exc}") from exc
        self._maps[name] = mapped
        while len(self._maps) > self.KEEP:
            self._maps.popitem(last=False)
        return mapped

    def close(self) -> None:
        with self._lock:
            self._maps.clear()


def remove_below(root: Path, partition: int, start: int, referenced: set[str]) -> list[str]:
    """Delete the partition's segment files that lie wholly below offset ``start``: named
    below it and holding no committed record. (A file being written is named at or above
    the partition's end, so it is never one of them.) Returns the names deleted."""
    gone: list[str] = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return gone
    for name in sorted(names):
        first = _first_offset(name, partition)
        if first is None or first >= start or name in referenced:
            continue
        try:
            os.unlink(root / name)
            gone.append(name)
        except FileNotFoundError:
            pass
    return gone
