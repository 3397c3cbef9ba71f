"""Torch work on background threads that does not slow the training thread down.

With torch's OpenMP backend, each thread that runs a parallel torch op gets an OpenMP team
of its own, and keeps it for as long as it lives. Once a long-lived background thread owns
one, the process manages more OpenMP threads than there are cores, and libgomp stops
spinning idle workers: from then on, every parallel op of the training thread (forward,
backward, the optimizer step, a commit's copy) waits for its workers to be woken. Rewind's
background threads already run side by side with each other, so each of them runs its torch
work on itself alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

_RUNTIMES = ("libgomp", "libiomp", "libomp")


def serial_torch() -> None:
    """Run the calling thread's torch ops on that thread alone, without an OpenMP team.

    Call it first in a long-lived background thread. Other threads keep their setting; a
    torch without the OpenMP backend is left alone (its intra-op pool is shared, not one
    per thread)."""
    setter = _omp_set_num_threads()
    if setter is None:
        return
    # Torch sets a thread's OpenMP thread count lazily, at its first parallel op: made to
    # happen now, so that it does not undo the setting below.
    torch.get_num_threads()
    setter(1)


@functools.cache
def openmp_backend() -> bool:
    """True when torch runs its intra-op parallelism on OpenMP (a team per calling thread)."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


@functools.cache
def _omp_set_num_threads() -> Callable[[int], Any] | None:
    """The OpenMP runtime's ``omp_set_num_threads`` that torch uses, or None."""
    if not openmp_backend():
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if any(r in line for r in _RUNTIMES)}
    except OSError:
        paths = set()
    # torch's own runtime first: another library may have loaded a second copy of one.
    home = os.path.dirname(torch.__file__)
    libraries: list[Any] = []
    for path in sorted(paths, key=lambda p: not p.startswith(home)):
        with contextlib.suppress(OSError):
            libraries.append(ctypes.CDLL(path))
    with contextlib.suppress(OSError):
        libraries.append(ctypes.CDLL(None))  # where there is no /proc: the global namespace
    for lib in libraries:
        fn = getattr(lib, "omp_set_num_threads", None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], None
            return fn  # type: ignore[no-any-return]
    return None
