"""What memory tests' child processes read of themselves (``/proc/self/status``)."""

from __future__ import annotations


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` figure in KiB: ``VmRSS`` (resident now), ``VmHWM`` (its peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")
