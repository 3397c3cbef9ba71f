"""The benchmark's write floor writes what it says, bounded, and leaves nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import writefloor


def test_write_floor_times_both_files_and_removes_them(tmp_path: Path) -> None:
    got = writefloor.measure(tmp_path, per_version=3 * 65536 + 5, piece=65536, versions=4)
    assert got["versions"] == 4 and got["piece_bytes"] == 65536
    assert len(got["samples"]["append_s"]) == len(got["samples"]["rewrite_s"]) == 4
    assert got["append_s"] > 0 and got["rewrite_s"] > 0
    assert list(tmp_path.iterdir()) == []


def test_write_floor_stays_within_its_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writefloor, "BUDGET_BYTES", 1 << 20)
    got = writefloor.measure(tmp_path, per_version=300_000, piece=1 << 22, versions=20)
    assert got["versions"] == 3  # 1 MiB // 300 kB
    assert got["piece_bytes"] == 300_000  # never a write past the version's bytes
