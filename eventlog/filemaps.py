"""Pages of mapped log files that a fold has read and will not read again.

An embedded log hands out its records as read-only views of private maps of its segment
files (``eventlog.embedded.segments``): a fold reads a gradient or a ``FULL`` chunk without
copying it. Every page it touches stays mapped, and counted in the process's resident
memory, until the map is unmapped: a replay of a ten-version tail held every gradient of
the tail, three times the state of an Adam run. ``release`` gives a chunk's pages back as
soon as the fold has applied it. They stay in the kernel's page cache, so a later read maps
them again without a disk read; the state the fold builds is unaffected, since nothing is
ever written through these maps.

Snapshot files a replay maps are tracked too, so that a caller can tell their bits from its
own (``of_file``). Only maps registered with ``track`` are released: ``MADV_DONTNEED`` would zero the pages of
an anonymous map, so a view of any other buffer is left alone.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref

import numpy as np

from eventlog import tensorcodec

_PAGE = mmap.PAGESIZE
#: id of a tracked map -> (a weak reference to it, the address it starts at). A view keeps
#: its map alive, so the id of a view's map names that map while the view exists.
_maps: dict[int, tuple[weakref.ref[mmap.mmap], int]] = {}
_lock = threading.Lock()


def track(m: mmap.mmap) -> None:
    """Register a private, never-written map of a file, whose pages ``release`` may drop."""
    if len(m) == 0 or not hasattr(mmap, "MADV_DONTNEED"):
        return
    base = np.frombuffer(m, dtype=np.uint8).ctypes.data  # (a temporary export)
    key = id(m)
    with _lock:
        _maps[key] = (weakref.ref(m, lambda _ref: _forget(key, _ref)), base)


def _forget(key: int, ref: weakref.ref[mmap.mmap]) -> None:
    with _lock:
        if key in _maps and _maps[key][0] is ref:
            del _maps[key]


def of_file(bits: np.ndarray) -> bool:
    """Whether ``bits`` are a view of a tracked map of a file (not memory of their own)."""
    owner: object = bits
    while isinstance(owner, np.ndarray | memoryview):
        owner = owner.base if isinstance(owner, np.ndarray) else owner.obj
    with _lock:
        entry = _maps.get(id(owner))
    return entry is not None and entry[0]() is owner


def owned(bits: np.ndarray, into: np.ndarray | None = None) -> np.ndarray:
    """``bits``, or a copy of them in memory of their own where they are a view of a file's
    map: in ``into`` (a buffer of as many bytes), else in a new host buffer (a large copy is
    kept across commits as a base)."""
    if not of_file(bits):
        return bits
    buf = tensorcodec.host_buffer(bits.nbytes) if into is None else into
    out = buf.view(bits.dtype).reshape(bits.shape)
    np.copyto(out, bits)
    return out


def release(view: object) -> None:
    """Drop the whole pages under ``view`` (a memoryview of a tracked map) from this process;
    anything else is left alone. The bytes read the same afterwards."""
    if not isinstance(view, memoryview) or not view.nbytes:
        return
    owner = view.obj
    with _lock:
        entry = _maps.get(id(owner))
    if entry is None or entry[0]() is not owner or not isinstance(owner, mmap.mmap):
        return
    at = np.frombuffer(view, dtype=np.uint8).ctypes.data - entry[1]
    start = -(-at // _PAGE) * _PAGE  # whole pages only: a neighbour's bytes stay mapped
    stop = (at + view.nbytes) // _PAGE * _PAGE
    if stop > start:
        with contextlib.suppress(OSError, ValueError):  # refused: the pages stay, as before
            owner.madvise(mmap.MADV_DONTNEED, start, stop - start)
