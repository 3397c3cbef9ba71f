"""Giving back a fold's mapped log pages (``eventlog.filemaps``): only tracked file maps are
touched, and the bytes read the same afterwards."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from eventlog import filemaps

SIZE = 64 * mmap.PAGESIZE


def _file_map(tmp_path: Path) -> tuple[mmap.mmap, bytes]:
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path = tmp_path / "segment"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        region = mmap.mmap(fd, SIZE, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    return region, data


def _resident_pages(region: mmap.mmap) -> int:
    """Pages of ``region`` mapped into this process (``/proc/self/smaps``' Rss of its range)."""
    start = np.frombuffer(region, dtype=np.uint8).ctypes.data
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and int(head.split("-")[0], 16) == start:
            rss = next(x for x in lines[i + 1:] if x.startswith("Rss:"))
            return int(rss.split()[1]) * 1024 // mmap.PAGESIZE
    raise AssertionError("the map is not in /proc/self/smaps")


@pytest.mark.skipif(not hasattr(mmap, "MADV_DONTNEED") or not Path("/proc/self/smaps").exists(),
                    reason="needs madvise and /proc/self/smaps")
def test_a_tracked_file_maps_pages_are_given_back_and_read_the_same(tmp_path: Path) -> None:
    region, data = _file_map(tmp_path)
    filemaps.track(region)
    view = memoryview(region).toreadonly()
    assert bytes(view) == data  # every page touched
    before = _resident_pages(region)
    filemaps.release(view[100:SIZE - 100])  # whole pages inside only
    after = _resident_pages(region)
    assert before == SIZE // mmap.PAGESIZE and after == 2  # the two partly covered pages stay
    assert bytes(view) == data


def test_an_anonymous_map_or_an_untracked_file_map_is_left_alone(tmp_path: Path) -> None:
    anonymous = mmap.mmap(-1, SIZE)
    anonymous[:] = b"\x07" * SIZE
    filemaps.release(memoryview(anonymous))  # MADV_DONTNEED would have zeroed it
    assert anonymous[:] == b"\x07" * SIZE
    untracked, data = _file_map(tmp_path)
    filemaps.release(memoryview(untracked).toreadonly())
    assert untracked[:] == data
    filemaps.release(memoryview(b"not a map"))


def test_bits_of_a_file_map_are_told_apart_and_copied(tmp_path: Path) -> None:
    region, data = _file_map(tmp_path)
    filemaps.track(region)
    bits = np.frombuffer(region, dtype=np.uint8)[mmap.PAGESIZE:2 * mmap.PAGESIZE]
    own = np.zeros(16, dtype=np.uint8)
    anonymous = np.frombuffer(mmap.mmap(-1, SIZE), dtype=np.uint8)
    assert filemaps.of_file(bits) and not filemaps.of_file(own) and not filemaps.of_file(anonymous)
    copied = filemaps.owned(bits)
    assert copied is not bits and not filemaps.of_file(copied)
    assert copied.tobytes() == data[mmap.PAGESIZE:2 * mmap.PAGESIZE]
    assert filemaps.owned(own) is own and filemaps.owned(anonymous) is anonymous
