"""Followers: incremental commits within max_lag, full sync from a snapshot beyond it, no
torn reads while a trainer commits, and the followers table. Runs on every backend."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash

from eventlog import ConfigError, RunAddress, StateMismatchError
from eventlog.embedded import path_from_url
from eventlog.fold.engine import events
from replayer.follower import Follower, followers_table, forget_silent_followers
from rewind.recorder import Recorder
from snapshotter.service import Snapshotter, SnapshotterConfig
from snapshotter.store import SnapshotStore

from .conftest import make_address
from .storage import plain_records


@pytest.fixture
def run(backend: str, tmp_path: Path) -> RunAddress:
    base = make_address(backend, tmp_path)
    return dataclasses.replace(base, snapshots_url=f"file://{tmp_path / 'snapshots'}")


def _net(seed: int) -> torch.nn.Module:
    """A small model with parameters and buffers (float running stats, an int64 counter)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                               torch.nn.Linear(32, 3))


class Trainer:
    """Trains ``_net(0)`` with Adam, committing each step; remembers the model at each version."""

    def __init__(self, address: RunAddress) -> None:
        self.model = _net(0)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.rec = Recorder(address, self.model, self.opt, rng=False, chunk_bytes=1024)
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.version = 0

    def commit(self, versions: int = 1) -> None:
        for _ in range(versions):
            self.model(torch.randn(8, 16)).pow(2).sum().backward()
            self.opt.step()
            self.opt.zero_grad()
            self.version = self.rec.commit(self.version, wait=True).result().version
            self.states[self.version] = {k: v.clone() for k, v in self.model.state_dict().items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _bit_equal(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    live = model.state_dict()
    return live.keys() == state.keys() and all(torch.equal(_bits(live[k]), _bits(state[k])) for k in state)


def _hash(state: dict[str, torch.Tensor]) -> int:
    h = xxhash.xxh3_64()
    for name, t in state.items():
        h.update(name.encode())
        h.update(_bits(t).numpy().tobytes())
    return h.intdigest()


def test_incremental_commits_within_max_lag_are_bit_exact(run: RunAddress) -> None:
    trainer = Trainer(run)
    trainer.commit(1)
    with Follower(run, _net(1), max_lag=4, name="actor-0") as follower:
        first = follower.poll()
        assert (first.mode, first.reason, first.version_after) == ("full", "first sync", 1)
        for lag in (1, 3, 4, 2):
            trainer.commit(lag)
            result = follower.poll()
            assert result.mode == "incremental", result.reason
            assert result.version_after == follower.version == trainer.version
            assert result.versions_applied == lag and result.events_applied > 0
            assert _bit_equal(follower.model, trainer.states[trainer.version])
            row = {r["name"]: r for r in followers_table(run)}["actor-0"]
            assert (row["version"], row["latest_version"], row["lag"]) == (trainer.version,) * 2 + (0,)
        assert follower.poll().mode == "noop"
    trainer.rec.close()


def test_lag_beyond_max_lag_forces_a_full_sync_from_a_snapshot(run: RunAddress) -> None:
    k = 3
    trainer = Trainer(run)
    trainer.commit(2)
    with Follower(run, _net(1), max_lag=k) as follower:
        follower.poll()
        trainer.commit(k + 3)  # the follower does not poll meanwhile
        assert run.snapshots_url
        with Snapshotter(run, SnapshotStore(run.snapshots_url), SnapshotterConfig()) as snap:
            taken = snap.snapshot(force=True)
        assert taken is not None
        trainer.commit(1)  # a tail after the snapshot
        result = follower.poll()
        assert result.mode == "full" and f"lag {k + 4} > max_lag {k}" in result.reason
        assert result.snapshot is not None and taken.snapshot_id in result.snapshot
        assert result.version_before == 2 and result.version_after == trainer.version == 2 + k + 4
        assert _bit_equal(follower.model, trainer.states[trainer.version])
        trainer.commit(1)  # and back to deltas from the synced state
        assert follower.poll().mode == "incremental"
        assert _bit_equal(follower.model, trainer.states[trainer.version])
    trainer.rec.close()


def test_readers_only_ever_see_whole_sealed_versions(run: RunAddress) -> None:
    trainer = Trainer(run)
    trainer.commit(1)
    follower = Follower(run, _net(1), max_lag=4, name="actor-live")
    follower.poll()
    stop = threading.Event()
    seen: list[tuple[int, int]] = []  # (version, hash of the model) as a reader saw them
    errors: list[BaseException] = []

    def read() -> None:
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            with follower.reading() as model:
                seen.append((follower.version, _hash(model.state_dict())))
            time.sleep(0.0002)  # let the follower take the lock

    def follow() -> None:
        try:
            follower.follow(stop, interval_s=0.002)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=read, daemon=True), threading.Thread(target=follow, daemon=True)]
    for t in threads:
        t.start()
    try:
        trainer.commit(30)
        deadline = time.monotonic() + 30
        while follower.version < trainer.version and time.monotonic() < deadline and not errors:
            time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    sealed = {v: _hash(s) for v, s in trainer.states.items()}
    assert {h for _, h in seen} <= set(sealed.values())  # never a mix of versions
    assert all(sealed[v] == h for v, h in seen)  # and ``version`` names the one it is
    assert len({v for v, _ in seen}) > 2 and follower.version == trainer.version == 31
    follower.close()
    trainer.rec.close()


def test_followers_table_lists_each_followers_version_and_lag(run: RunAddress) -> None:
    trainer = Trainer(run)
    trainer.commit(2)
    with Follower(run, _net(1), name="actor-a") as a, Follower(run, _net(2), name="actor-b") as b:
        a.poll()
        trainer.commit(3)
        b.poll()
        rows = followers_table(run)
    assert [r["name"] for r in rows] == ["actor-a", "actor-b"]
    assert [(r["version"], r["latest_version"], r["lag"]) for r in rows] == [(2, 5, 3), (5, 5, 0)]
    assert all(0 <= r["seconds_since_report"] < 60 for r in rows)
    trainer.rec.close()


def test_a_damaged_tail_covered_by_a_snapshot_is_resynced(tmp_path: Path) -> None:
    # Damages a record in place, which only the embedded database allows.
    run = dataclasses.replace(make_address("embedded", tmp_path),
                              snapshots_url=f"file://{tmp_path / 'snapshots'}")
    trainer = Trainer(run)
    trainer.commit(1)
    with Follower(run, _net(1), max_lag=8) as follower:
        follower.poll()
        trainer.commit(2)
        assert run.snapshots_url
        with Snapshotter(run, SnapshotStore(run.snapshots_url), SnapshotterConfig()) as snap:
            assert snap.snapshot(force=True) is not None
        with run.open_log() as log:
            offset = next(o for o, _, env in events(log, 0) if env.version == 2)
        plain_records(path_from_url(run.log_url))
        with sqlite3.connect(path_from_url(run.log_url)) as db:  # flip a payload byte
            (value,) = db.execute("SELECT value FROM records WHERE run=? AND partition=0 AND "
                                  "offset=?", (run.run_id, offset)).fetchone()
            value = value[:-3] + bytes([value[-3] ^ 0x20]) + value[-2:]
            db.execute("UPDATE records SET value=? WHERE run=? AND partition=0 AND offset=?",
                       (value, run.run_id, offset))
        result = follower.poll()
        assert result.mode == "full" and "failed verification" in result.reason
        assert f"offset {offset}" in result.reason and result.snapshot is not None
        assert _bit_equal(follower.model, trainer.states[3])
    trainer.rec.close()


def test_before_the_first_commit_and_with_the_wrong_model(run: RunAddress) -> None:
    with Follower(run, _net(1), name="early") as early:
        result = early.poll()
        assert (result.mode, early.version) == ("noop", 0)
        assert [(r["name"], r["version"]) for r in followers_table(run)] == [("early", 0)]
        trainer = Trainer(run)
        trainer.commit(1)
        assert early.poll().mode == "full"
        assert _bit_equal(early.model, trainer.states[1])
    wrong = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 3))
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with Follower(run, wrong) as follower:
        with pytest.raises(StateMismatchError, match="missing in the model: model/1.running_mean"):
            follower.poll()
        assert follower.version == 0 and _bit_equal(wrong, before)  # nothing half loaded
    trainer.rec.close()


def test_a_closed_follower_drops_its_report(run: RunAddress) -> None:
    trainer = Trainer(run)
    trainer.commit(1)
    with Follower(run, _net(1), name="leaving") as follower:
        follower.poll()
        assert [r["name"] for r in followers_table(run)] == ["leaving"]
    assert followers_table(run) == []
    trainer.rec.close()


def test_followers_silent_too_long_can_be_forgotten(run: RunAddress) -> None:
    """A crashed actor never drops its report: ``forget_silent_followers`` (the CLI's
    ``rewind followers --forget-silent-for S``) drops those older than S seconds only."""
    with run.open_coordinator() as coord:
        coord.report_follower(run.run_id, "crashed", 3)
        time.sleep(1.2)
        coord.report_follower(run.run_id, "alive", 4)
    assert forget_silent_followers(run, 1.0) == ["crashed"]
    assert [(r["name"], r["version"]) for r in followers_table(run)] == [("alive", 4)]
    assert forget_silent_followers(run, 1.0) == []
    with pytest.raises(ConfigError, match="silent for -1"):
        forget_silent_followers(run, -1)


def test_a_follower_takes_a_run_id_and_finds_its_backends_in_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    trainer = Trainer(RunAddress(url, url, "by-id"))
    trainer.commit(2)
    monkeypatch.setenv("REWIND_LOG", url)
    with Follower("by-id", _net(1)) as follower:
        assert follower.address == RunAddress(url, url, "by-id")
        assert follower.poll().version_after == 2
        assert _bit_equal(follower.model, trainer.states[2])
    trainer.rec.close()
