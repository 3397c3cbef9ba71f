"""Replayer acceptance: exactly-once under injected faults, and exact time travel."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from eventlog import RunAddress, Target, TruncatedHistoryError, serde
from eventlog.capture import GlobalRng, load_into
from eventlog.fold.apply import ShardState
from eventlog.fold.engine import ControlIndex, events, fold_shard, index_control, rebuild
from eventlog.ports import EventLog
from replayer.replay import replay, state_dicts
from snapshotter.catalog import newest_valid
from snapshotter.policies import every_versions
from snapshotter.service import Snapshotter, SnapshotterConfig
from snapshotter.store import SnapshotStore

from .conftest import make_address
from .test_snapshotter import Trainer, _bit_equal


@pytest.fixture
def run(backend: str, tmp_path: Path) -> RunAddress:
    base = make_address(backend, tmp_path)
    return dataclasses.replace(base, snapshots_url=f"file://{tmp_path / 'snapshots'}")


def _records_of_version(address: RunAddress, partition: int, version: int) -> list[bytes]:
    with address.open_log() as log:
        return [r.value for r in log.read(partition)
                if serde.decode(r.value).version == version]


def test_exactly_once_under_injected_faults(run: RunAddress) -> None:
    trainer = Trainer(run)
    trainer.train(4)
    with Snapshotter(run, SnapshotStore(run.snapshots_url or ""),
                     SnapshotterConfig(trigger=every_versions(1))) as snap:
        snap.snapshot(force=True)  # snapshot of version 4
    trainer.train(2)

    with run.open_log() as log:
        injector = log.writer("fault-injector")
        # 1. A producer retry: two events of version 5 on shard 0, delivered twice.
        dupes = _records_of_version(run, 0, 5)[:2]
        with injector.transaction() as txn:
            for value in dupes:
                txn.append(0, value)
        # 2. An aborted transaction: never visible, never counted.
        with pytest.raises(RuntimeError), injector.transaction() as txn:
            for value in _records_of_version(run, 0, 6)[:3]:
                txn.append(0, value)
            raise RuntimeError("abort")
        # 3. A zombie's events of a version that was never sealed (version 0).
        zombie = serde.decode(dupes[0])
        for gsn in (10**9, 10**9 + 1):
            forged = dataclasses.replace(zombie, gsn=gsn, version=0)
            with injector.transaction() as txn:
                txn.append(0, serde.encode(forged))
        injector.close()
        # Versions 7 and 8 after them: a fold to the newest version reads through them.
        trainer.train(2)
        expected = trainer.states[trainer.step - 1]

        idx = index_control(log)
        plain = rebuild(log, Target(), idx=idx)
        assert plain.per_shard[0].skipped_duplicate == 2
        assert plain.per_shard[0].skipped_unsealed == 2
        assert plain.counts.skipped_duplicate == 2 and plain.counts.skipped_unsealed == 2
        assert _bit_equal(state_dicts(plain)["model"], expected)

        # 4. Redelivery after a consumer restart: a shard folded to version 5 is read
        # again from its start.
        shard = fold_shard(log, ShardState(1), idx, 5)
        before = shard.counts.skipped_duplicate
        redelivered = sum(1 for r in log.read(1) if serde.decode(r.value).version <= 5)
        fold_shard(log, shard, idx, plain.version)
        assert shard.counts.skipped_duplicate - before == redelivered
        assert shard.digest(plain.layout.tensors, plain.layout.chunk_bytes) == \
            plain.seal.seal.shard_digests[1]

        # 5. Snapshot overlap: the snapshot says it covers 3 records fewer than it does.
        start, passed = newest_valid(SnapshotStore(run.snapshots_url or ""), log, idx, plain.version)
        assert start is not None and not passed and start.version == 4
        covered = [r.offset for r in log.read(0) if 1 <= serde.decode(r.value).version <= 4]
        start.next_offsets[1] = covered[-3]
        from_snapshot = rebuild(log, Target(), idx=idx, start=start)
        assert from_snapshot.per_shard[0].skipped_by_snapshot == 3
        assert from_snapshot.counts.skipped_duplicate == 2
        assert _bit_equal(state_dicts(from_snapshot)["model"], expected)
    trainer.rec.close()


@pytest.mark.slow
def test_time_travel_to_every_tenth_step_is_exact(tmp_path: Path) -> None:
    from rewind.demo.ppo import PPOConfig, PPOTrainer

    updates = 200
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "rewind.demo.trainer", "--record", "--run-dir", str(run_dir),
           "--updates", str(updates), "--rollout-steps", "64", "--epochs", "2",
           "--snapshot-every", "50", "--digest-file", str(run_dir / "digests.jsonl"), "--quiet"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    live = {}
    for line in (run_dir / "digests.jsonl").read_text().splitlines():
        row = json.loads(line)
        live[row["step"]] = row["digest"]
    address = RunAddress.from_run_dir(run_dir)
    config = PPOConfig(updates=updates, rollout_steps=64, epochs=2)
    with address.open_log() as log:
        seals = index_control(log).seals
    # Two Adam steps per update: every version after the first is predictive.
    assert sum(s.seal.encoding.startswith("predictive/Adam x2") for s in seals.values()) == updates - 1
    for step in range(0, updates, 10):
        state, report = replay(address, Target("step", step))
        assert report.step == step
        trainer = PPOTrainer(config)
        load_into({**trainer.state_objects(), "rng": GlobalRng()}, state)
        assert trainer.state_digest() == live[step], f"state at step {step} differs"
        trainer.close()

    out = tmp_path / "export-120"
    cli = [sys.executable, "-c", "from rewind.cli import main; main()", "export", "--run-dir",
           str(run_dir), "--to", "step=120", "--format", "torch", "--out", str(out)]
    subprocess.run(cli, check=True, capture_output=True, timeout=300)
    exported = torch.load(out / "model.pt", weights_only=True)
    expected = state_dicts(replay(address, Target("step", 120))[0])["model"]
    assert _bit_equal(exported, expected)


class _StaleEnd:
    """An event log whose first end offset of shard 0 is ``behind`` records short, as when
    a shard's commit marker lands after the fold first asks (Kafka's partitions of one
    transaction become readable a moment apart)."""

    def __init__(self, log: object, behind: int, always: bool = False) -> None:
        self._log, self._behind, self._always = log, behind, always

    def end_offset(self, partition: int) -> int:
        end = self._log.end_offset(partition)  # type: ignore[attr-defined]
        if partition == 0 and self._behind:
            end = end - self._behind
            if not self._always:
                self._behind = 0
        return end

    def __getattr__(self, name: str) -> object:
        return getattr(self._log, name)


@contextlib.contextmanager
def _trained(run: RunAddress) -> Iterator[tuple[EventLog, ControlIndex, int]]:
    """Train 3 versions; the open log, its control index and the newest version."""
    trainer = Trainer(run)
    trainer.train(3)
    try:
        with run.open_log() as log:
            idx = index_control(log)
            yield log, idx, idx.latest_version()
    finally:
        trainer.rec.close()


def _fold_shard0(run: RunAddress, settle_s: float,
                 **stale: Any) -> tuple[ShardState, ControlIndex, int, int]:
    """Train 3 versions, then fold shard 0 to the newest through a ``_StaleEnd`` log:
    the state, the control index, the version and the events its seal counts on shard 0."""
    with _trained(run) as (log, idx, version):
        state = ShardState(0)
        fold_shard(_StaleEnd(log, **stale), state, idx, version, settle_s=settle_s)  # type: ignore[arg-type]
        return state, idx, version, idx.seals[version].seal.shard_counts[0]


class _TruncatedUnder:
    """An event log whose shard 0 is truncated past the fold's start when the fold begins
    reading it, as retention may do while a replay runs."""

    def __init__(self, log: object, below: int) -> None:
        self._log, self._below, self._done = log, below, False

    def scan_decoded(self, partition: int, *args: Any, **kwargs: Any) -> object:
        if partition == 0 and not self._done:
            self._done = True
            self._log.truncate_before(0, self._below)  # type: ignore[attr-defined]
        return self._log.scan_decoded(partition, *args, **kwargs)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._log, name)


def test_a_truncation_under_a_running_fold_is_named(run: RunAddress) -> None:
    """Records deleted while a fold reads them: the error says the log was truncated, and
    from where, not that records are missing."""
    with _trained(run) as (log, idx, version):
        offsets = [o for o, _, _ in events(log, 0)]
        cut = offsets[len(offsets) // 2]
        with pytest.raises(TruncatedHistoryError, match=(
                f"shard 0: the log was truncated below offset {cut} while version {version} "
                "was being rebuilt from offset 0")):
            fold_shard(_TruncatedUnder(log, cut), ShardState(0), idx, version, settle_s=0.5)  # type: ignore[arg-type]


def test_a_first_pass_longer_than_the_settle_time_still_waits_for_late_records(
        run: RunAddress) -> None:
    """The settle clock starts when a pass ends short: here every pass "takes longer" than
    the settle time (0 s), and the records missing from the first pass are still read."""
    state, idx, version, want = _fold_shard0(run, 0.0, behind=2)
    assert state.applied_per_version[version] == want
    assert state.counts.applied == sum(s.seal.shard_counts[0] for s in idx.seals.values())


class _BlindReads:
    """An event log whose reads of shard 0 past offset ``after`` come back empty until the
    fold asks it to forget what it cached (a reader that took a range for empty)."""

    def __init__(self, log: object, after: int) -> None:
        self._log, self._after, self.forgotten = log, after, 0

    def scan_decoded(self, partition: int, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for rec in self._log.scan_decoded(partition, *args, **kwargs):  # type: ignore[attr-defined]
            if partition == 0 and not self.forgotten and rec.offset > self._after:
                return
            yield rec

    def forget_reads(self, partition: int) -> None:
        self.forgotten += partition == 0
        self._log.forget_reads(partition)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._log, name)


def test_a_short_read_is_read_again_afresh_before_records_are_called_missing(
        run: RunAddress, caplog: pytest.LogCaptureFixture) -> None:
    """A read that comes up short for the settle time is repeated once with nothing cached;
    the records it then finds are applied, and the warning says what happened."""
    with _trained(run) as (log, idx, version), caplog.at_level("WARNING", logger="eventlog.fold.engine"):
        offsets = [o for o, _, _ in events(log, 0)]
        blind = _BlindReads(log, offsets[2])
        state = ShardState(0)
        fold_shard(blind, state, idx, version, settle_s=0.1)  # type: ignore[arg-type]
    assert blind.forgotten == 1
    assert state.counts.applied == len(offsets) and state.counts.skipped_duplicate == 0
    assert "reading the partition again afresh" in caplog.text


def test_records_still_missing_after_the_settle_time_are_reported(
        run: RunAddress, caplog: pytest.LogCaptureFixture) -> None:
    """When the end offset never covers the target's records, the fold gives up after
    ``settle_s`` without progress and says what it read; the seal check then fails."""
    with caplog.at_level("WARNING", logger="eventlog.fold.engine"):
        state, _, version, want = _fold_shard0(run, 0.1, behind=2, always=True)
    got = state.applied_per_version[version]
    assert got < want
    assert f"shard 0: {got} of the {want} events of version {version}" in caplog.text
    if run.log_url.startswith("kafka://"):  # and what the Kafka readers held
        assert "low watermark and last stable offset (" in caplog.text and "idle readers" in caplog.text
