"""Work shared between replay workers (``eventlog.fold.sharing``): every unit runs exactly once,
an idle worker takes a busy one's units, errors reach the worker that posted them, and a
replay whose tiles, digests and snapshot pieces were shared rebuilds the exact state."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from eventlog import Target
from eventlog.fold import deferred as deferred_module
from eventlog.fold import engine as fold_module
from eventlog.fold.sharing import WorkBoard, map_shared
from eventlog.settings import Settings
from replayer.replay import replay, state_dicts
from snapshotter import pieces as pieces_module
from snapshotter.service import Snapshotter, SnapshotterConfig
from snapshotter.store import SnapshotStore

from .conftest import make_address
from .test_snapshotter import Trainer


def _post(board: WorkBoard | None, units: list[int], seconds: float, ran: Counter[int],
          threads: dict[int, str]) -> None:
    def work(unit: int) -> None:
        time.sleep(seconds)
        ran[unit] += 1
        threads[unit] = threading.current_thread().name

    assert board is not None
    board.run(units, work)


def test_an_idle_worker_takes_a_busy_workers_units_and_each_runs_once() -> None:
    ran: Counter[int] = Counter()
    threads: dict[int, str] = {}
    jobs = {0: [0], 1: list(range(1, 21))}  # one unit against twenty

    def item(key: int, board: WorkBoard | None) -> int:
        _post(board, jobs[key], 0.01, ran, threads)
        return key * 10

    assert map_shared(2, [0, 1], item) == [0, 10]
    assert ran == Counter(range(21))  # every unit once
    busy = {threads[u] for u in jobs[1]}
    assert len(busy) == 2  # the worker done with item 0 ran some of item 1's units


def test_a_helper_waits_for_a_worker_that_posts_late() -> None:
    ran: Counter[int] = Counter()
    threads: dict[int, str] = {}

    def item(key: int, board: WorkBoard | None) -> None:
        if key == 1:
            time.sleep(0.2)  # still reading its records when the other worker is done
            _post(board, list(range(10)), 0.02, ran, threads)

    map_shared(2, [0, 1], item)
    assert ran == Counter(range(10))
    assert len(set(threads.values())) == 2


def test_one_worker_runs_everything_itself() -> None:
    boards: list[WorkBoard | None] = []
    assert map_shared(1, [1, 2, 3], lambda x, board: boards.append(board) or x) == [1, 2, 3]
    assert boards == [None, None, None]
    assert map_shared(2, [7], lambda x, board: (x, board)) == [(7, None)]


def test_a_units_error_reaches_its_poster_and_stops_its_job() -> None:
    started: list[int] = []
    caught: list[BaseException] = []

    def item(key: int, board: WorkBoard | None) -> None:
        if key == 0:
            return

        def work(unit: int) -> None:
            started.append(unit)
            time.sleep(0.01)
            if unit == 3:
                raise ValueError("unit 3 is damaged")

        assert board is not None
        try:
            board.run(list(range(40)), work)
        except ValueError as exc:
            caught.append(exc)  # raised here, in the poster, whichever thread ran unit 3
            raise

    with pytest.raises(ValueError, match="unit 3 is damaged"):
        map_shared(2, [0, 1], item)
    assert [str(e) for e in caught] == ["unit 3 is damaged"]
    assert sorted(started) == sorted(set(started))  # none twice
    assert len(started) < 10  # no unit starts once the error is known (two may be in flight)


def test_of_two_failed_units_the_first_in_order_is_raised() -> None:
    """As a loop over the units would: unit 1 fails first (on the helper), unit 0 later."""
    unit_1_failed = threading.Event()
    threads: dict[int, str] = {}

    def item(key: int, board: WorkBoard | None) -> None:
        if key == 0:
            return

        def work(unit: int) -> None:
            threads[unit] = threading.current_thread().name
            if unit == 0:
                assert unit_1_failed.wait(5), "no helper took unit 1"
                raise ValueError("unit 0 is damaged")
            if unit == 1:
                unit_1_failed.set()
                raise ValueError("unit 1 is damaged")

        assert board is not None
        board.run([0, 1, 2, 3], work)

    with pytest.raises(ValueError, match="unit 0 is damaged"):
        map_shared(2, [0, 1], item)
    assert threads.keys() == {0, 1} and threads[0] != threads[1]  # 2 and 3 never started


def _flat_optimizer(tree: dict) -> dict[str, torch.Tensor]:  # type: ignore[type-arg]
    return {f"{i}.{k}": v for i, s in tree["state"].items() for k, v in s.items()}


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def test_a_replay_with_shared_tiles_digests_and_pieces_is_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, configure: Callable[..., Settings]) -> None:
    """Units small enough to share (one tile each, files in 512-byte pieces); one param's
    tiles run slowly, so the worker of the other shard takes some. The rebuilt params, moments and
    step counters are the live trainer's bits."""
    address = dataclasses.replace(make_address("embedded", tmp_path),
                                  snapshots_url=f"file://{tmp_path / 'snapshots'}")
    trainer = Trainer(address, sizes=(32, 64, 8))
    trainer.train(3)
    store = SnapshotStore(address.snapshots_url or "")
    with Snapshotter(address, store, SnapshotterConfig()) as snap:
        snap.snapshot(force=True)
    trainer.train(4)
    want = {"model": trainer.states[trainer.step - 1], "optimizer": trainer.optimizer_state()}

    configure(replay_tile_bytes=1024)
    monkeypatch.setattr(pieces_module, "PIECE", 512)
    slow_threads: set[str] = set()  # that ran tiles of the biggest param
    one_shard_verified = threading.Event()
    run_unit, verify = deferred_module._run_unit, fold_module.verify_shard

    def spy(unit, steps, *rest):  # type: ignore[no-untyped-def]
        if any(t.param == "model/0.weight" for t in unit):  # 8 tiles
            # Slow until the other shard is done, so that its worker comes to help.
            one_shard_verified.wait(5)
            time.sleep(0.02)
            slow_threads.add(threading.current_thread().name)
        return run_unit(unit, steps, *rest)

    def verified(*args, **kwargs):  # type: ignore[no-untyped-def]
        verify(*args, **kwargs)
        one_shard_verified.set()

    monkeypatch.setattr(fold_module, "verify_shard", verified)
    monkeypatch.setattr(deferred_module, "_run_unit", spy)
    pieces: Counter[int] = Counter()
    pread = pieces_module._pread_full

    def count(fd: int, view: object, offset: int) -> int:
        pieces[offset] += 1
        return pread(fd, view, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(pieces_module, "_pread_full", count)

    state, report = replay(address, Target(), workers=2)
    assert report.snapshot is not None and report.tail_versions == 4
    assert pieces[512] == 2 and len(pieces) > 10  # both shard files were read in pieces
    assert len(slow_threads) == 2  # the other worker took some of its shard's tiles
    trees = state_dicts(state)
    got = {"model": trees["model"], "optimizer": _flat_optimizer(trees["optimizer"])}
    for role, tensors in want.items():
        assert got[role].keys() == tensors.keys()
        for name, t in tensors.items():
            assert _bits(got[role][name]) == _bits(t), (role, name)
    trainer.rec.close()


def test_a_file_hashed_as_its_pieces_fill_in_any_order_has_the_files_xxh3() -> None:
    import random

    import numpy as np
    import xxhash

    buf = np.frombuffer(random.Random(5).randbytes(10_000), dtype=np.uint8).copy()
    for piece in (1000, 999, 4096, 10_000, 20_000):
        starts = list(range(0, len(buf), piece))
        random.Random(piece).shuffle(starts)
        digest = pieces_module._InOrderHash(buf, piece)
        threads = [threading.Thread(target=lambda part, h=digest: [h.filled(s) for s in part],
                                    args=(starts[i::3],)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert digest.hexdigest() == xxhash.xxh3_128_hexdigest(buf.tobytes()), piece


def test_a_damaged_snapshot_file_read_in_pieces_is_named_and_passed_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    address = dataclasses.replace(make_address("embedded", tmp_path),
                                  snapshots_url=f"file://{tmp_path / 'snapshots'}")
    trainer = Trainer(address, sizes=(32, 64, 8))
    ids = []
    store = SnapshotStore(address.snapshots_url or "")
    with Snapshotter(address, store, SnapshotterConfig()) as snap:
        for _ in range(2):
            trainer.train(2)
            ids.append(snap.snapshot(force=True).snapshot_id)  # type: ignore[union-attr]
    want = trainer.states[trainer.step - 1]
    path = tmp_path / "snapshots" / address.run_id / ids[1] / "shard-1.safetensors"
    data = bytearray(path.read_bytes())
    data[-700] ^= 0x10  # in the file's second-to-last 512-byte piece
    path.write_bytes(bytes(data))
    monkeypatch.setattr(pieces_module, "PIECE", 512)

    state, report = replay(address, Target(), workers=2)
    reasons = dict(report.passed_over)
    assert list(reasons) == [ids[1]]
    assert f"{path} fails its xxh3 checksum" in reasons[ids[1]]
    assert report.snapshot is not None and ids[0] in report.snapshot
    got = state_dicts(state)["model"]
    assert all(_bits(got[k]) == _bits(v) for k, v in want.items())
    trainer.rec.close()
