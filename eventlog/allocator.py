"""glibc malloc tuning for the processes that replay a log (the ``rewind`` CLI's jobs).

A replay reads thousands of tensor-chunk payloads of 4 MiB, each a new ``bytes`` object,
freed once its optimizer step or delta has run. glibc serves an allocation above its mmap
threshold with a fresh ``mmap`` and gives it back on ``free``; its threshold adapts upwards,
but the heap it then uses is trimmed as soon as a batch of payloads is freed. Either way the
next payloads land in pages the kernel must fault in and zero again (about 1 GB/s on the
VM the benchmarks ran on, against 6 GB/s for a copy into memory already touched). A fixed
threshold of 32 MiB keeps these allocations in the heap, where freed memory is reused.

A 100M-parameter replay (snapshot + 10 versions) took 3.0-3.2 s instead of 3.6-4.2 s on one
worker, and 2.2-2.3 s instead of 2.4-2.7 s on two. The cost: memory freed by the process
is returned to the kernel later. So only processes that Rewind owns call this (the CLI);
a trainer that restores in-process keeps its allocator as it was.
"""

from __future__ import annotations

import ctypes
import platform

from . import knobs

#: ``mallopt`` parameter number of ``M_MMAP_THRESHOLD`` (glibc's malloc.h).
_M_MMAP_THRESHOLD = -3


def tune_for_replay() -> bool:
    """Fix glibc's mmap threshold at ``knobs.MALLOC_MMAP_THRESHOLD`` (0: leave malloc
    alone). Returns whether the setting took; a no-op on other C libraries."""
    threshold = knobs.MALLOC_MMAP_THRESHOLD
    if threshold <= 0 or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))
