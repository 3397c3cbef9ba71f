"""What the commands print: message lines, the ``--json`` object, and plain tables that fit
the terminal, wrapped at spaces only."""

from __future__ import annotations

import json
import math
import shutil
import sys
import textwrap
from collections.abc import Sequence
from typing import Any


def terminal_width() -> int:
    """The terminal's width (``COLUMNS``, else 80 when not a terminal)."""
    return max(40, shutil.get_terminal_size((80, 24)).columns)


def say(text: str, *, to_stderr: bool = False) -> None:
    """One message line, printed as is (no markup; long paths are not broken)."""
    print(text, file=sys.stderr if to_stderr else sys.stdout, flush=True)


def emit_json(command: str, ok: bool, **fields: Any) -> None:
    """The command's one JSON object on stdout (NaN and infinities become null)."""
    print(json.dumps(finite({"command": command, "ok": ok, **fields}), indent=2, allow_nan=False))


def finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def wrap_words(text: str, width: int) -> list[str]:
    """``text`` wrapped at spaces only: a name longer than ``width`` gets a line of its own."""
    return textwrap.wrap(text, max(1, width), break_long_words=False, break_on_hyphens=False) or [""]


def table_lines(headers: Sequence[str], rows: Sequence[Sequence[str]], *, flex: int,
                right: Sequence[int] = (), width: int | None = None) -> list[str]:
    """A plain table that fits ``width`` (default: the terminal): columns two spaces apart,
    each as wide as its widest cell, except column ``flex``, which takes the room that is
    left and wraps its cells at spaces, never inside a word. If a word of the last column
    does not fit there, that column's cells go on indented lines below their rows. A row
    with fewer cells than there are headers ends with a cell that spans the remaining
    columns (wrapped alike). A cell that fits under its header stays on its row."""
    width = width or terminal_width()
    n = len(headers)
    full = [r for r in rows if len(r) == n]
    widths = [max([len(headers[i]), *(len(r[i]) for r in full)]) for i in range(n)]
    room = width - sum(w for i, w in enumerate(widths) if i != flex) - 2 * (n - 1)
    longest_word = max([len(headers[flex]), *(len(w) for r in full for w in r[flex].split())])
    below = flex == n - 1 and longest_word > room
    widths[flex] = len(headers[flex]) if below else max(longest_word, min(widths[flex], room))

    def cells_of(cells: Sequence[str]) -> list[str]:
        return [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)]

    lines = ["  ".join(cells_of(headers)).rstrip()]
    for r in rows:
        if len(r) < n:  # the last cell spans to the end of the line
            head = "".join(f"{c}  " for c in cells_of(r[:-1]))
            for k, part in enumerate(wrap_words(r[-1], width - len(head))):
                lines.append((head if k == 0 else " " * len(head)) + part)
            continue
        if below and len(r[flex]) > widths[flex]:
            lines.append("  ".join(cells_of([*r[:-1], ""])).rstrip())
            lines += [f"    {part}" for part in wrap_words(r[flex], width - 4)]
            continue
        for k, part in enumerate(wrap_words(r[flex], widths[flex])):
            row = [part if i == flex else (c if k == 0 else "") for i, c in enumerate(r)]
            lines.append("  ".join(cells_of(row)).rstrip())
    return lines


def print_lines(lines: Sequence[str]) -> None:
    """Print ``lines``; one longer than the terminal (a title naming a long run id, say) is
    wrapped at spaces, never inside a word."""
    width = terminal_width()
    out = [part for ln in lines for part in (wrap_words(ln, width) if len(ln) > width else [ln])]
    sys.stdout.write("".join(f"{ln}\n" for ln in out))
    sys.stdout.flush()


def add_notes(lines: list[str], notes: dict[str, int]) -> None:
    """Numbered notes below a table (each long text once, not on every row)."""
    width = terminal_width()
    for text, k in notes.items():
        lines.extend(textwrap.wrap(f"[{k}] {text}", width, subsequent_indent="    ",
                                   break_long_words=False, break_on_hyphens=False))


def count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"
