"""The crash tests' kill switch, kept out of the product (see ``sitecustomize`` here)."""

from __future__ import annotations

import os
from pathlib import Path

HERE = Path(__file__).resolve().parent


def killing_at(point: str) -> dict[str, str]:
    """The environment of a child process that SIGKILLs itself at ``point``."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "REWIND_TEST_FAULT_KILL": point}
