"""glibc malloc tuning for the processes that replay a log (the ``rewind`` CLI's jobs), and
the recorder's ``trim`` after each commit.

A replay reads thousands of tensor-chunk payloads of 4 MiB, each a new ``bytes`` object,
freed once its optimizer step or delta has run. With glibc's default, whose mmap threshold
adapts as large blocks are freed, replays run slower than with the threshold fixed at
32 MiB (all payloads served from the heap, none by ``mmap``; figures: docs/performance.md).
The likely cause is payloads landing in fresh pages that the kernel must fault in and zero
again, which is much slower than copying into memory already touched.

The cost: memory freed by the process may go back to the kernel later. So only processes that Rewind owns
call this (the CLI), and not when the user set glibc's malloc tunables; a trainer that
restores in-process keeps its allocator as it was.
"""

from __future__ import annotations

import ctypes
import platform
from typing import Any

from eventlog.settings import Settings, current, host_variable

#: ``mallopt`` parameter number of ``M_MMAP_THRESHOLD`` (glibc's malloc.h).
_M_MMAP_THRESHOLD = -3


def tune_for_replay(settings: Settings | None = None) -> bool:
    """Fix glibc's mmap threshold at ``settings.malloc_mmap_threshold`` (0: leave malloc
    alone). Returns whether the setting took; a no-op on other C libraries, and where the
    environment sets glibc's malloc thresholds itself."""
    threshold = (settings or current()).malloc_mmap_threshold
    if threshold <= 0 or platform.libc_ver()[0] != "glibc" or _user_tuned():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


def _user_tuned() -> bool:
    """Whether the environment already sets glibc's malloc thresholds (then theirs stand)."""
    thresholds = (host_variable(f"MALLOC_{name}_") for name in ("MMAP_THRESHOLD", "TRIM_THRESHOLD"))
    return any(value is not None for value in thresholds) \
        or "glibc.malloc." in (host_variable("GLIBC_TUNABLES") or "")


_TRIM: list[Any] = []  # glibc's malloc_trim (or None), looked up once


def trim() -> bool:
    """Give free malloc pages back to the kernel (glibc's ``malloc_trim(0)``); returns
    whether any were. The recorder calls it after each commit: the chunks its codec threads
    allocate and free while encoding a version stay resident in those threads' arenas
    otherwise, and the next version reuses at most part of them. glibc returns the free
    chunks of every arena and the main arena's free top, but not a thread arena's free top
    (that shrinks only past the trim threshold, which large frees raise): each codec thread
    keeps up to a few chunks' worth. A no-op on other C libraries."""
    if not _TRIM:
        fn = None
        if platform.libc_ver()[0] == "glibc":
            try:
                fn = ctypes.CDLL(None).malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):
                fn = None
        _TRIM.append(fn)
    fn = _TRIM[0]
    return bool(fn(0)) if fn is not None else False
