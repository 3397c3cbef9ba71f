"""The value formatter of the benchmarks' tables (``python -m benchmarks``)."""

from __future__ import annotations

from typing import Any

#: The benchmarks' megabyte: 10^6 bytes.
MB = 1e6


def fmt(v: Any, unit: str = "", digits: int = 3) -> str:
    """``v`` as a table cell: ``-`` for None; a number in ``unit`` (``ms`` and ``s`` from
    seconds, ``MB`` from bytes, ``MB/s``, ``x`` with ``digits`` decimals); a float without a
    unit with ``digits`` decimals; anything else as ``str``."""
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if unit == "ms":
        return f"{v * 1e3:.1f} ms"
    if unit == "s":
        return f"{v:.3f} s" if v < 10 else f"{v:.1f} s"
    if unit == "MB":
        return f"{v / MB:.1f} MB"
    if unit == "MB/s":
        return f"{v:.0f} MB/s"
    if unit == "x":
        return f"{v:.{digits}f}x"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)
