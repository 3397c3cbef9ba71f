"""Append-only segment files that hold the embedded log's tensor chunks out of line.

A tensor chunk message (4 MiB) kept in SQLite is read back by copying it out of the
database's pages: a 100M-param replay copies 4 GB that way, and that copy was the part of
the fold that two cores did not speed up. Kept in a segment file, a chunk is read through a
read-only memory map instead: its payload is a view of the page cache, handed to the
optimizer without any copy.

Layout: ``<database>.segments/<run>/p<partition>-<first offset>.seg``. SQLite stays the
source of truth: a record's row names its file, position and length, and it commits only
after the bytes are written and flushed (``Appender.flush``). Bytes that no committed row
names (a transaction rolled back, or a writer killed mid-way) are never read, and the next
append goes after them. Files are only appended to and deleted whole (``remove_below``):
a mapped file that shrank would kill the reader with SIGBUS, so nothing here ever
truncates one.

Each message is placed so that its bulk field (the payload, ``bulk_at`` bytes in) starts on
a 64-byte boundary, where vector loads of its elements run at full speed; and a message
whose bulk field and the few bytes after it come to 2 MiB or more (a 4 MiB tensor chunk),
so that the field starts on a 2 MiB boundary (``HUGE_ALIGN``). Linux, on file systems with
large folios (XFS; ext4 since 6.16), then keeps each whole 2 MiB of the payload in one
page cache folio, when it finds a free 2 MiB block as the bytes are written, and a map of
the file maps such a folio with one page fault, where 4 KiB pages take one fault per 16
(fault-around). A replay reads gigabytes of gradients through maps, so those faults are a
visible part of its time (figures: docs/performance.md). The gap before such a payload is
never written, so it is a hole where the file system has them: it costs file size
(address space), not disk blocks; a 4 MiB chunk takes 6 MiB of file. A copy that does not
keep holes (``cp --sparse=never``, ``rsync`` without ``-S``) makes the gaps real.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import threading
from collections import OrderedDict
from pathlib import Path

import xxhash

from eventlog import filemaps
from eventlog.durability import fsync_dir
from eventlog.errors import CorruptStoreError, EventLogError
from eventlog.ports import MessageBytes, message_size

_log = logging.getLogger(__name__)

#: Alignment of a message's bulk field within its segment file (a cache line).
ALIGN = 64
#: Alignment of a bulk field of at least this many bytes (one huge page on x86-64 and
#: arm64 with 4 KiB pages), so that its page cache can be mapped a huge page at a time.
HUGE_ALIGN = 2 * 1024 * 1024
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

    #: Files kept open at once; past it, the oldest is flushed and closed (a commit to
    #: thousands of shards must not run out of file descriptors).
    MAX_OPEN = 64

    def __init__(self, root: Path, roll_bytes: int) -> None:
        self._root, self._roll = root, roll_bytes
        self._fds: dict[str, int] = {}
        self._opened_new = False  # a file no committed row named yet: its entry needs a sync

    def append(self, current: str | None, partition: int, offset: int, value: MessageBytes,
               bulk_at: int) -> tuple[str, int]:
        """Write ``value`` to the partition's segment ``current`` (the file its newest
        committed record names), or to a new one when there is none or it is full; returns
        ``(file name, position)`` for the record's row."""
        size = message_size(value)
        align = HUGE_ALIGN if size - bulk_at >= HUGE_ALIGN else ALIGN
        name = current
        if name is not None:
            pos = _place(self._size(name, existing=True), bulk_at, align)
            if pos + size > self._roll:
                name = None
        if name is None:  # a new file takes the message whatever its size (and gap)
            name = file_name(partition, offset)
            pos = _place(self._size(name, existing=False), bulk_at, align)
        self._write(name, value, pos)
        return name, pos

    def _write(self, name: str, value: MessageBytes, pos: int) -> None:
        parts = [memoryview(p) for p in ((value,) if isinstance(value, bytes) else value) if p]
        total, done = sum(len(p) for p in parts), 0
        try:
            while parts:  # pwritev may write less than asked; ENOSPC then raises
                wrote = os.pwritev(self._fds[name], parts, pos + done)
                done += wrote
                while parts and wrote >= len(parts[0]):
                    wrote -= len(parts.pop(0))
                if parts:
                    parts[0] = parts[0][wrote:]
        except OSError as exc:
            raise EventLogError(f"segment file {self._root / name}: cannot write "
                                f"{total} bytes at {pos}: {exc}") from exc

    def _size(self, name: str, existing: bool) -> int:
        """The file's size, opening it first. A file that committed rows name must exist:
        creating it again would put new messages where those rows point."""
        fd = self._fds.get(name)
        path = self._root / name
        if fd is None:
            try:
                if existing:
                    fd = os.open(path, os.O_RDWR)
                else:
                    _make_dirs(self._root)
                    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                    self._opened_new = True
            except FileNotFoundError as exc:
                raise CorruptStoreError(f"segment file {path}, which the log's newest records "
                                        "name, is missing") from exc
            except OSError as exc:
                raise EventLogError(f"segment file {path}: cannot open: {exc}") from exc
            self._fds[name] = fd
            while len(self._fds) > self.MAX_OPEN:
                self._retire(next(iter(self._fds)))
        return os.fstat(fd).st_size

    def _retire(self, name: str) -> None:
        """Flush one file's bytes now (as ``flush`` would at commit) and close it."""
        fd = self._fds.pop(name)
        try:
            os.fdatasync(fd)
        except OSError as exc:
            raise EventLogError(f"segment file {self._root / name}: cannot flush: {exc}") from exc
        finally:
            os.close(fd)

    def flush(self) -> None:
        """Make every byte written so far durable, and the entries of the files it went to
        (before the rows naming them commit)."""
        try:
            for fd in self._fds.values():
                os.fdatasync(fd)
            if self._opened_new:
                fsync_dir(self._root)
                self._opened_new = False
        except OSError as exc:
            raise EventLogError(f"segment files in {self._root}: cannot flush: {exc}") from exc

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _place(size: int, bulk_at: int, align: int) -> int:
    """The first position at or after ``size`` where a message's bulk field, ``bulk_at``
    bytes in, starts on an ``align`` boundary."""
    return size + (-(size + bulk_at) % align)


def _make_dirs(root: Path) -> None:
    """Create the run's directory (and the segments directory), each made durable in its
    parent: a committed row must never name a file whose directory a crash forgets."""
    for d in (root.parent, root):
        if not d.is_dir():
            d.mkdir(exist_ok=True)
            fsync_dir(d.parent)


class Reader:
    """Maps of a run's segment files, a few at a time. A view keeps its map alive after
    the map leaves this cache; a map whose file was deleted (its partition truncated)
    leaves the cache at its next use, so that its disk space can be given back."""

    KEEP = 8

    def __init__(self, root: Path) -> None:
        self._root = root
        self._maps: OrderedDict[str, tuple[memoryview, int]] = OrderedDict()  # name -> (map, fd)
        self._lock = threading.Lock()

    def view(self, name: str, pos: int, length: int, where: str) -> memoryview:
        """``length`` bytes at ``pos`` of segment file ``name``, read-only, without a copy.
        The row that says where they are is checked first: a bad name or range is an error
        naming it. A missing file raises ``FileNotFoundError`` (the caller knows whether
        its partition was truncated meanwhile)."""
        if _NAME.fullmatch(name) is None:
            raise CorruptStoreError(f"{where}: bad segment file name {name!r}")
        if pos < 0 or length < 0:
            raise CorruptStoreError(f"{where}: bad segment range {pos}+{length} in {name}")
        if length == 0:
            return memoryview(b"")
        with self._lock:
            cached = self._maps.get(name)
            if cached is None or pos + length > len(cached[0]):
                cached = self._map(name, pos + length, where)
            mapped, fd = cached
            if os.fstat(fd).st_nlink == 0:
                self._drop(name)  # deleted: serve this read, then let it go
            else:
                self._maps.move_to_end(name)
            return mapped[pos:pos + length]

    def _map(self, name: str, need: int, where: str) -> tuple[memoryview, int]:
        path = self._root / name
        self._drop(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise CorruptStoreError(f"{where}: segment file {path} cannot be read: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if need > size:
                raise CorruptStoreError(
                    f"{where}: segment file {path} holds {size} bytes, the record ends at "
                    f"byte {need} (truncated?)")
            # Private and writable underneath, read-only on top: a stray write into a view
            # then lands in a private copy of its page, not in a fault that kills the process.
            region = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
            filemaps.track(region)  # a fold gives back the pages of each chunk it applied
            mapped = memoryview(region).toreadonly()
        except BaseException:
            os.close(fd)
            raise
        self._maps[name] = (mapped, fd)
        while len(self._maps) > self.KEEP:
            self._drop(next(iter(self._maps)))
        return mapped, fd

    def _drop(self, name: str) -> None:
        cached = self._maps.pop(name, None)
        if cached is not None:
            os.close(cached[1])

    def release_deleted(self) -> None:
        """Let go of the maps of deleted files (views handed out keep theirs)."""
        with self._lock:
            for name, (_, fd) in list(self._maps.items()):
                if os.fstat(fd).st_nlink == 0:
                    self._drop(name)

    def close(self) -> None:
        """Let go of every map. Unmapping is left to a background thread: a map whose pages
        a replay touched takes the kernel a while to tear down, and the caller's result is
        ready before that.
        The reader's own descriptors are closed here; each map holds a descriptor of its own
        until it is unmapped, and a view handed out keeps its map (and that descriptor)."""
        with self._lock:
            maps, self._maps = self._maps, OrderedDict()
        for _, fd in maps.values():
            os.close(fd)
        if maps:
            threading.Thread(target=maps.clear, name="rewind-segment-unmap", daemon=True).start()


def remove_below(root: Path, partition: int, start: int, referenced: set[str]) -> list[str]:
    """Delete the partition's segment files that lie wholly below offset ``start``: named
    below it and holding no committed record. (A file being written is named at or above
    the partition's end, so it is never one of them.) Returns the names deleted. A file
    that cannot be deleted is logged and left for the next truncation."""
    gone: list[str] = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return gone
    except OSError as exc:
        _log.warning("segment files in %s cannot be listed (%s); none deleted", root, exc)
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
        except OSError as exc:
            _log.warning("segment file %s lies below the start of partition %d but cannot be "
                         "deleted (%s); the next truncation tries again", root / name, partition, exc)
    return gone
