"""A copy of a kept benchmark run in the embedded log's older format:
``python -m benchmarks.inline_copy RUN COPY``.

Every message of the copy's log lives in SQLite, as versions before segment files wrote
it, so that ``benchmarks.compare --before-run COPY`` can time an older version on the same
bits. The snapshots and the checkpoint are copied as they are.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from eventlog.embedded import inline_segments


def inline_copy(run: Path, copy: Path) -> int:
    """Copy ``run`` to ``copy`` with every segment-file message moved into SQLite; returns
    the number moved."""
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("*.segments"))
    return inline_segments(copy / "embedded" / "rewind.db", run / "embedded" / "rewind.db")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(f"{inline_copy(Path(sys.argv[1]), Path(sys.argv[2]))} messages moved into SQLite")
