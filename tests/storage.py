"""Test support: reach into an embedded log's files the way the damage tests need."""

from __future__ import annotations

import shutil
from pathlib import Path

from eventlog import embedded


def inline_segments(db: Path) -> int:
    """Move every message that the embedded log keeps in a segment file into SQLite (the
    layout of logs written before segments existed, which stays readable), so that a test
    can read or damage any message with SQL; the segment files go. Returns the number moved."""
    moved = embedded.inline_segments(db)
    shutil.rmtree(f"{db}.segments", ignore_errors=True)
    return moved
