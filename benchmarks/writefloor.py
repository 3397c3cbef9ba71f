"""The write floor of a durable version: the bare disk work any log must do for its bytes.

A log only grows: every version's bytes go to page-cache pages the file never had. A
``torch.save`` to one path truncates and rewrites the same file, so each save can take the
pages the previous one just freed. Where the kernel (or a hypervisor under it) charges more
for pages it has not handed out recently, the two differ for the same bytes, and no log
can write faster than its own append. ``measure`` times both, interleaved, with no Rewind
code: ``per_version`` bytes in ``piece``-sized writes, then ``fdatasync``, per version.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

#: At most this many bytes per file written (large states time fewer versions).
BUDGET_BYTES = 1 << 30


def measure(directory: Path, per_version: int, piece: int, versions: int) -> dict[str, Any]:
    """Median seconds per version of appending to a growing file and of rewriting a
    truncated one, each ``per_version`` bytes, interleaved version by version."""
    piece = max(1, min(piece, per_version))
    n = max(2, min(versions, BUDGET_BYTES // max(1, per_version)))
    data = memoryview(os.urandom(piece))
    grow_path, save_path = directory / "append-floor.log", directory / "append-floor.pt"
    grow_s: list[float] = []
    rewrite_s: list[float] = []
    grow = os.open(grow_path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        end = 0
        for _ in range(n):
            t0 = time.perf_counter()
            end = _write_version(grow, end, per_version, data)
            grow_s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            fd = os.open(save_path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            try:
                _write_version(fd, 0, per_version, data)
            finally:
                os.close(fd)
            rewrite_s.append(time.perf_counter() - t0)
    finally:
        os.close(grow)
        grow_path.unlink(missing_ok=True)
        save_path.unlink(missing_ok=True)
    return {"append_s": statistics.median(grow_s), "rewrite_s": statistics.median(rewrite_s),
            "bytes_per_version": per_version, "piece_bytes": piece, "versions": n,
            "samples": {"append_s": grow_s, "rewrite_s": rewrite_s}}


def _write_version(fd: int, at: int, nbytes: int, data: memoryview) -> int:
    """``nbytes`` from ``at`` in writes of ``len(data)``, then ``fdatasync``; the new end."""
    end = at + nbytes
    while at < end:
        at += os.pwrite(fd, data[: min(len(data), end - at)], at)
    os.fdatasync(fd)
    return end
