"""The recovery job's malloc tuning (``rewind.allocator``), observed through glibc itself."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# In a fresh process: tune (or not), then allocate one 8 MiB object and report whether
# glibc served it with a fresh mmap (mallinfo2's count of mmapped blocks goes up).
PROBE = """
import ctypes
from rewind.allocator import tune_for_replay
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
info = ctypes.CDLL(None).mallinfo2
info.restype = Info
took = tune_for_replay()
before = info().hblks
payload = bytes(8 << 20)
print(took, info().hblks - before)
"""


def _probe(threshold: str | None, **extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "REWIND_MALLOC_MMAP_THRESHOLD"
           and not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    if threshold is not None:
        env["REWIND_MALLOC_MMAP_THRESHOLD"] = threshold
    env.update(extra)
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or not hasattr(ctypes.CDLL(None), "mallinfo2"),
                    reason="glibc >= 2.33 (mallinfo2)")
def test_replaying_processes_keep_chunk_sized_payloads_in_the_heap() -> None:
    # glibc's own fixed threshold of 128 KiB where tuning is off, so that a large block
    # freed while importing torch cannot raise its adaptive one above 8 MiB.
    glibc_default = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    assert _probe(None) == "True 0"  # the default: served from the heap, no fresh mapping
    assert _probe("0", **glibc_default) == "False 1"  # turned off: a fresh 8 MiB mapping
    assert _probe(None, **glibc_default) == "False 1"  # the user's own setting stands
