"""``rewind verify`` covers every version a replay can reach, and retention reads as retention.

A damaged record below the oldest kept snapshot is found and named (version, shard, offset,
file); a snapshot that retention deleted is reported as deleted by retention, by verify and
by a replay that passes it over; ``rewind snapshot`` deletes nothing unless told to."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sqlite3
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from eventlog import RewindError, RunAddress, Target, serde
from eventlog.embedded.log import EmbeddedLog
from eventlog.errors import CorruptStoreError
from eventlog.events import Envelope
from eventlog.fold import engine
from eventlog.fold.engine import events, index_control
from eventlog.ports import CONTROL
from eventlog.settings import override
from replayer.replay import replay
from snapshotter.catalog import DELETED_BY_RETENTION
from snapshotter.policies import keep_last
from snapshotter.records import DamagedRecord
from snapshotter.store import SnapshotStore
from snapshotter.verify import FAIL, OK, verify_run

from .conftest import make_address
from .storage import index_loses_rows, unchecked
from .test_snapshotter import Trainer, _snapshotter


@pytest.fixture
def run(backend: str, tmp_path: Path) -> RunAddress:
    base = make_address(backend, tmp_path)
    return dataclasses.replace(base, snapshots_url=f"file://{tmp_path / 'snapshots'}")


def _cli(run: RunAddress, *args: str) -> list[str]:
    """The installed ``rewind`` command line for ``run``."""
    return ["rewind", *args, "--log", run.log_url, "--coord", run.coord_url, "--run", run.run_id,
            "--snapshots", run.snapshots_url or ""]


def _two_snapshots_one_deleted(run: RunAddress, trainer: Trainer) -> tuple[str, str]:
    """Versions 1..6, a snapshot of 3 that retention deletes when the one of 6 is taken,
    then versions 7..8; returns (deleted id, kept id)."""
    ids = []
    with _snapshotter(run, retention=keep_last(1)) as snap:
        for _ in range(2):
            trainer.train(3)
            result = snap.snapshot(force=True)
            assert result is not None
            ids.append(result.snapshot_id)
    trainer.train(2)
    return ids[0], ids[1]


def test_a_damaged_record_below_the_oldest_snapshot_is_named(tmp_path: Path) -> None:
    run = dataclasses.replace(make_address("embedded", tmp_path),
                              snapshots_url=f"file://{tmp_path / 'snapshots'}")
    trainer = Trainer(run)
    _, kept = _two_snapshots_one_deleted(run, trainer)
    trainer.rec.close()
    clean = verify_run(run)
    assert clean.ok and clean.covered == (1, 8) and not clean.damaged, clean.findings

    # A tensor chunk of version 2 (below the kept snapshot of version 6), in its segment file.
    with run.open_log() as log:
        offset = next(o for o, _, env in events(log, 0) if env.version == 2 and env.kind == "TensorDelta")
        where = Path(log.record_file(0, offset))
    with sqlite3.connect(tmp_path / "rewind.db") as conn:
        pos, length = conn.execute("SELECT pos, length FROM extents WHERE run=? AND partition=0 AND offset=?",
                                   (run.run_id, offset)).fetchone()
    assert where.suffix == ".seg"
    data = bytearray(where.read_bytes())
    data[pos + length - 8] ^= 0x5A  # in the payload (only the key id's one byte follows it)
    where.write_bytes(bytes(data))

    said = f"partition 0 offset {offset} (in {where}): the record's bytes do not make the checksum"
    with pytest.raises(RewindError, match=re.escape(said)):
        replay(run, Target("version", 2))
    assert replay(run, Target())[1].snapshot_id == kept  # the newest versions still replay

    for deep in (False, True):
        report = verify_run(run, deep=deep)
        assert not report.ok
        [named] = report.damaged
        assert (named.version, named.partition, named.offset, named.file) == (2, 0, offset, str(where))
        assert report.covered == (1, 8) and report.unreachable == [2, 3, 4, 5]
        failed = [f for f in report.findings if f.status == FAIL]
        assert any(f"offset {offset}" in f.subject and str(where) in f.detail for f in failed)

    # The installed command says the same, and exits 1 (a failed check).
    done = subprocess.run([*_cli(run, "verify"), "--json"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 1, done.stderr
    assert f"version 2, shard 0, offset {offset}" in done.stdout and str(where) in done.stdout


@pytest.mark.parametrize("field", ["shard digest", "state digest"])
def test_a_seal_damaged_in_its_digests_is_found_by_every_pass(
        tmp_path: Path, field: str, caplog: pytest.LogCaptureFixture) -> None:
    """A seal whose shard digest or state digest changed but still decodes: every pass of
    verify names the seal (its state digest is no longer the digest of its own digests).
    A damaged shard digest loses that version (a replay to it fails); a damaged state
    digest, the sum of the others, loses nothing: the replay's state verifies against the
    others, it reports the true digest and warns, and verify calls nothing unreachable."""
    run = _closed_run(tmp_path, 4)
    with run.open_log() as log:
        seal = index_control(log).seals[2]
    digest = seal.seal.shard_digests[1] if field == "shard digest" else seal.seal.state_digest
    _edit_record(run, tmp_path / "rewind.db", seal.offset, digest, bytes(16), partition=CONTROL)
    lost = [2] if field == "shard digest" else []
    if lost:
        with pytest.raises(RewindError, match="shard 1 rebuilt to version 2"):
            replay(run, Target("version", 2))
    else:
        assert replay(run, Target("version", 2))[1].state_digest == seal.seal.state_digest.hex()
        assert f"the seal of version 2 records state digest {bytes(16).hex()}" in caplog.text
    assert replay(run, Target("version", 3))[0].version == 3
    for named in _named_by_verify(run, lost):
        assert (named.version, named.partition, named.offset) == (2, CONTROL, seal.offset)
        recorded = seal.seal.state_digest if lost else bytes(16)
        assert named.error.startswith("the seal of version 2 is damaged: it records state digest "
                                      f"{recorded.hex()}"), named.error


def test_retention_is_reported_as_retention(run: RunAddress) -> None:
    trainer = Trainer(run)
    deleted, kept = _two_snapshots_one_deleted(run, trainer)
    store = SnapshotStore(run.snapshots_url or "")
    assert store.list(run.run_id) == [kept]

    # Version 4 lies past the deleted snapshot (version 3) and before the kept one.
    _, report = replay(run, Target("step", 3))
    assert report.version == 4 and report.snapshot is None
    [(sid, why)] = report.passed_over
    assert sid == deleted and why.startswith(DELETED_BY_RETENTION), why

    checked = verify_run(run)
    assert checked.ok and checked.covered == (1, 8), checked.findings
    [line] = [f for f in checked.findings if deleted in f.subject]
    assert line.status == OK and line.detail.startswith(DELETED_BY_RETENTION)
    trainer.rec.close()


def test_one_snapshot_now_deletes_nothing_unless_told(run: RunAddress) -> None:
    from rewind import cli

    trainer = Trainer(run)
    for _ in range(4):  # the old default kept 3; the command's own defaults, in this process
        trainer.train(1)
        assert cli.snapshot(log=run.log_url, coord=run.coord_url, run=run.run_id,
                            snapshots=run.snapshots_url) == 0
    store = SnapshotStore(run.snapshots_url or "")
    assert len(store.list(run.run_id)) == 4
    trainer.train(1)
    done = subprocess.run([*_cli(run, "snapshot"), "--keep-last", "2"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "deleted 3" in done.stdout, done.stdout + done.stderr
    assert len(store.list(run.run_id)) == 2
    report = verify_run(run)
    assert report.ok and sum(DELETED_BY_RETENTION in f.detail for f in report.findings) == 3
    # Nothing new since: the retention asked for still applies.
    done = subprocess.run([*_cli(run, "snapshot"), "--keep-last", "1", "--json"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["snapshot"] is None and len(said["deleted"]) == 1 and said["truncated_before"] is None, said
    [left] = store.list(run.run_id)
    assert left not in said["deleted"]
    trainer.rec.close()


def test_verify_of_a_truncated_log_starts_at_its_oldest_snapshot(run: RunAddress) -> None:
    trainer = Trainer(run)
    with _snapshotter(run, retention=keep_last(2), history="since-oldest-snapshot") as snap:
        for _ in range(4):
            trainer.train(3)
            snap.snapshot(force=True)
    trainer.train(1)
    report = verify_run(run, deep=True)
    assert report.ok and report.covered == (9, 13), report.findings
    assert "folded from snapshot v0000000009" in report.findings[-1].detail
    trainer.rec.close()


def _edit_record(run: RunAddress, db: Path, offset: int, old: bytes, new: bytes,
                 partition: int = 0) -> None:
    """Replace ``old`` (found once) by ``new`` of its length in the record at ``offset`` of
    ``partition``, in place, wherever the embedded log keeps it (SQLite or a segment file),
    and drop its checksum: the damage then reaches the checks behind the store's."""
    assert len(old) == len(new)
    with sqlite3.connect(db) as conn:
        key = (run.run_id, partition, offset)
        (value,) = conn.execute("SELECT value FROM records WHERE run=? AND partition=? AND offset=?",
                                key).fetchone()
        extent = conn.execute("SELECT file, pos, length FROM extents WHERE run=? AND partition=? "
                              "AND offset=?", key).fetchone()
        if extent is None:
            assert bytes(value).count(old) == 1
            conn.execute("UPDATE records SET value=? WHERE run=? AND partition=? AND offset=?",
                         (bytes(value).replace(old, new), *key))
    conn.close()
    if extent is not None:
        [segment] = Path(f"{db}.segments").rglob(extent[0])
        data = bytearray(segment.read_bytes())
        at = data.index(old, extent[1], extent[1] + extent[2])
        data[at:at + len(old)] = new
        segment.write_bytes(bytes(data))
    unchecked(db, run.run_id, partition, offset)


def _rewrite_event(run: RunAddress, db: Path, offset: int, value: bytes, env: Envelope) -> None:
    """Shard 0's record at ``offset`` (its message ``value``) made to read as ``env``, which
    encodes to the same length, by changing only the bytes that differ (and 8 before them)."""
    damaged = serde.encode.with_bulk(env)[0]
    assert len(damaged) == len(value)
    span = [i for i, (a, b) in enumerate(zip(value, damaged, strict=True)) if a != b]
    start, end = span[0], span[-1] + 1
    _edit_record(run, db, offset, value[start - 8:end], damaged[start - 8:end])


def _closed_run(tmp_path: Path, versions: int) -> RunAddress:
    """An embedded run of ``versions`` versions, no snapshot; the trainer closed."""
    run = make_address("embedded", tmp_path)
    trainer = Trainer(run)
    trainer.train(versions)
    trainer.rec.close()
    return run


def _named_by_verify(run: RunAddress, unreachable: list[int]) -> list[DamagedRecord]:
    """The one record verify names, by its default pass and by its ``deep`` one, once each
    has failed and called exactly ``unreachable`` unreachable."""
    named = []
    for deep in (False, True):
        report = verify_run(run, deep=deep)
        assert not report.ok and report.unreachable == unreachable, report.findings
        [record] = report.damaged
        named.append(record)
    return named


def _six_versions_with_a_snapshot_of_4(tmp_path: Path) -> RunAddress:
    """An embedded run of versions 1..6 with one snapshot, of version 4; the trainer closed."""
    run = dataclasses.replace(make_address("embedded", tmp_path),
                              snapshots_url=f"file://{tmp_path / 'snapshots'}")
    trainer = Trainer(run)
    trainer.train(4)
    with _snapshotter(run, retention=keep_last(1)) as snap:
        assert snap.snapshot(force=True) is not None  # of version 4
    trainer.train(2)
    trainer.rec.close()
    return run


def test_a_snapshot_whose_end_marker_is_damaged_is_failed_naming_the_marker(tmp_path: Path) -> None:
    """The end marker of the snapshot of 4 with its manifest digest damaged (the record still
    decodes): replays pass the snapshot over and rebuild every version from the log, and
    verify fails the snapshot, naming where its end marker is, and calls no version
    unreachable."""
    run = _six_versions_with_a_snapshot_of_4(tmp_path)
    with run.open_log() as log:
        [(offset, env)] = [(o, e) for o, e in index_control(log).markers if e.kind == "SnapshotEnd"]
    digest = env.body.manifest_digest
    _edit_record(run, tmp_path / "rewind.db", offset, digest, bytes(b ^ 0xFF for b in digest),
                 partition=CONTROL)
    state, replayed = replay(run, Target("version", 6))
    assert replayed.snapshot is None and [sid for sid, _ in replayed.passed_over] == [env.body.snapshot_id]
    report = verify_run(run)
    assert not report.ok and report.unreachable == [] and report.damaged == [], report.findings
    assert report.to_json()["failed_snapshots"] == [env.body.snapshot_id]
    [failed] = [f for f in report.findings if f.status == FAIL]
    assert failed.subject == f"snapshot {env.body.snapshot_id} (version 4)"
    assert failed.detail.endswith(f"does not match the digest in its end marker (end marker at control "
                                  f"offset {offset}, in {tmp_path / 'rewind.db'})"), failed.detail


def test_a_step_that_replays_differently_loses_only_the_versions_before_the_next_snapshot(
        tmp_path: Path) -> None:
    """An optimizer step whose hyperparameters changed but still decode: its own digest check
    names it, every version from it to the snapshot past it fails to replay, and the versions
    after that snapshot replay from it, so verify does not call them unreachable."""
    run = _six_versions_with_a_snapshot_of_4(tmp_path)
    with run.open_log() as log:
        offset = next(o for o, _, env in events(log, 0)
                      if env.version == 2 and env.kind == "OptimizerStep")
    lr = b"\xcb" + struct.pack(">d", 1e-2)  # msgpack's float64 of Adam's lr
    _edit_record(run, tmp_path / "rewind.db", offset, lr, b"\xcb" + struct.pack(">d", 2e-2))
    for lost in (2, 3):
        with pytest.raises(RewindError):
            replay(run, Target("version", lost))
    assert replay(run, Target())[0].version == 6  # from the snapshot of version 4
    for named in _named_by_verify(run, [2, 3]):
        assert (named.version, named.partition, named.offset) == (2, 0, offset)
        assert "predicted" in named.error and "differently" in named.error, named.error


def test_a_chunk_renamed_in_place_is_named_at_its_own_record(tmp_path: Path) -> None:
    """A gradient chunk whose tensor name changed but still decodes: the layout places no such
    tensor on its shard, so the chunk itself is named (not the step that would miss its
    gradient), by replays and by verify; the versions past the next snapshot replay."""
    run = _six_versions_with_a_snapshot_of_4(tmp_path)
    with run.open_log() as log:
        offset, name = next((o, env.body.name) for o, _, env in events(log, 0)
                            if env.version == 2 and env.kind == "TensorDelta"
                            and env.body.encoding == "GRAD")
    renamed = name[:-1] + "\x0b"
    _edit_record(run, tmp_path / "rewind.db", offset, name.encode(), renamed.encode())
    said = f"shard 0 offset {offset} (version 2): a chunk of tensor {renamed!r}, which the layout " \
           "of version 2 does not place on shard 0"
    for lost in (2, 3):
        with pytest.raises(RewindError, match=re.escape(said)):
            replay(run, Target("version", lost))
    assert replay(run, Target())[0].version == 6  # from the snapshot of version 4
    for named in _named_by_verify(run, [2, 3]):
        assert (named.version, named.partition, named.offset) == (2, 0, offset)
        assert said in named.error, named.error


def test_a_gradient_chunk_with_a_damaged_digest_is_named_and_loses_no_version(tmp_path: Path) -> None:
    """A gradient chunk whose recorded digest changed, its bits intact: a replay's batched
    steps leave that digest to the seal, so every version still replays; verify names the
    chunk and, its bits confirmed by the seals after it, calls no version unreachable."""
    run = _closed_run(tmp_path, 4)
    with run.open_log() as log:
        offset, digest = next((o, env.body.digest) for o, _, env in events(log, 0)
                              if env.version == 2 and env.kind == "TensorDelta"
                              and env.body.encoding == "GRAD")
    _edit_record(run, tmp_path / "rewind.db", offset, digest, bytes(len(digest)))
    for version in range(1, 5):
        assert replay(run, Target("version", version))[0].version == version
    for named in _named_by_verify(run, []):
        assert (named.version, named.partition, named.offset) == (2, 0, offset)
        assert named.error.startswith("ChunkDigestError:") and bytes(len(digest)).hex() in named.error


def test_a_damaged_layout_is_named_and_no_version_under_it_is_called_reachable(tmp_path: Path) -> None:
    """The run's layout record with a tensor's name changed in place: it no longer makes its
    own config digest, so every replay under it refuses it, naming it, and verify names that
    record and calls every version under it unreachable."""
    run = _closed_run(tmp_path, 3)
    with run.open_log() as log:
        [(offset, started)] = index_control(log).run_started
    name = started.body.tensors[0].name
    _edit_record(run, tmp_path / "rewind.db", offset, name.encode(), (name[:-1] + "\x13").encode(),
                 partition=CONTROL)
    said = f"the layout in force at version 2 (control offset {offset}) is damaged: its tensors and " \
           f"small states do not make its own config digest {started.body.config_digest}"
    with pytest.raises(RewindError, match=re.escape(said)):
        replay(run, Target("version", 2))
    for named in _named_by_verify(run, [1, 2, 3]):
        assert (named.version, named.partition, named.offset) == (1, CONTROL, offset)
        assert "the layout in force at version 1" in named.error, named.error


@pytest.mark.parametrize("field", ["gsn", "gsn within", "gsn down", "version", "version up"])
def test_an_event_whose_gsn_or_version_is_damaged_is_named(tmp_path: Path, field: str) -> None:
    """A gradient chunk whose gsn was damaged upward (past its seal's, or past the next events
    of its version) or down to an applied one's, or its version to a negative one or to one
    that does not exist: it would make the events after it read as duplicates, be skipped
    as unsealed or as a duplicate, or end its version's events early (the count then falls
    short, or the step misses its gradient, naming another record or none). No event of a
    version comes after its seal, no version or gsn is negative, no version past the next
    one has events, no event of a version has a gsn between the last two applied, and no
    redelivered event is of a version newer than every applied one, so the chunk itself is
    named, by replays and by verify."""
    run = _closed_run(tmp_path, 4)
    with run.open_log() as log:
        seal_gsn = index_control(log).seals[2].gsn
        (offset, env), _, (_, later) = [(o, env) for o, _, env in events(log, 0) if env.version == 2][:3]
        [record] = log.read(0, gt=offset - 1, lte=offset)
    assert env.kind == "TensorDelta"
    change = {"gsn": {"gsn": seal_gsn + 1}, "gsn within": {"gsn": later.gsn}, "gsn down": {"gsn": 1},
              "version": {"version": -1}, "version up": {"version": 60}}[field]
    _rewrite_event(run, tmp_path / "rewind.db", offset, record.value, dataclasses.replace(env, **change))
    said = f"shard 0 offset {offset}" + {
        "gsn": f" (version 2): gsn {seal_gsn + 1} is past the seal of its version (gsn {seal_gsn})",
        "gsn within": f" (version 2): gsn {later.gsn} is past gsn {env.gsn + 1} of a later event of "
                      f"its version (run {run.run_id!r} shard 0 offset {offset + 1} (version 2))",
        "gsn down": " (version 2): gsn 1 is at or below gsn",
        "version": ": version -1, gsn",
        "version up": ": the fold stopped at an event of version 60, which has no seal"}[field]
    lost = [2, 3, 4]
    for version in lost[:2]:
        with pytest.raises(RewindError, match=re.escape(said)):
            replay(run, Target("version", version))
    # A replay to version 1 stops before the record: it has every event version 1's seal counts.
    assert replay(run, Target("version", 1))[0].version == 1
    for named in _named_by_verify(run, lost):
        assert (named.partition, named.offset) == (0, offset)
        assert said in named.error, named.error


def test_records_missing_at_the_end_lose_no_version_that_replays(tmp_path: Path) -> None:
    """The last version's records gone from the database's index (its seal with them), the
    partitions still ending past them: verify names the gap in each partition, and calls no
    version unreachable, since a replay to the newest version left meets no record past it."""
    run = _closed_run(tmp_path, 4)
    with run.open_log() as log:
        gone = {p: min(o for o, _, env in events(log, p) if env.version == 4) for p in (CONTROL, 0)}
    with sqlite3.connect(tmp_path / "rewind.db") as conn:
        for table in ("records", "extents"):
            for p, first in gone.items():
                conn.execute(f"DELETE FROM {table} WHERE run=? AND partition=? AND offset>=?",
                             (run.run_id, p, first))
    conn.close()
    assert replay(run, Target())[0].version == 3
    for deep in (False, True):
        report = verify_run(run, deep=deep)
        assert not report.ok and report.unreachable == [], report.findings
        assert sorted((d.partition, d.offset) for d in report.damaged) == sorted(gone.items())
        assert all("are missing" in d.error for d in report.damaged), report.damaged


@pytest.mark.parametrize("path", ["one query", "every query"])
def test_control_records_the_store_fails_to_read_are_named_and_lose_only_what_replays_lose(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """A damaged database page can fail the read of version 3's control records on one query
    path only (verify's, from version 2's seal), or on every path (every read ending at version
    3's seal). Verify names the failed read in both; it calls version 3 unreachable only when
    a replay to it fails too, and the versions from the snapshot of 4 on stay reachable."""
    run = _six_versions_with_a_snapshot_of_4(tmp_path)
    with run.open_log() as log:
        seals = index_control(log).seals
    after_2, at_3 = seals[2].offset, seals[3].offset
    real = engine.events

    def failing(log: Any, partition: int, *, gt: int | None = None, lte: int | None = None) -> Any:
        if partition == CONTROL and (gt == after_2 if path == "one query" else lte == at_3):
            raise CorruptStoreError(f"embedded database {tmp_path / 'rewind.db'} is damaged: "
                                    "database disk image is malformed")
        return real(log, partition, gt=gt, lte=lte)

    monkeypatch.setattr(engine, "events", failing)
    lost = [3] if path == "every query" else []
    for v in range(1, 7):
        if v in lost:
            with pytest.raises(CorruptStoreError):
                replay(run, Target("version", v))
        else:
            assert replay(run, Target("version", v))[0].version == v
    for named in _named_by_verify(run, lost):
        assert (named.version, named.partition, named.offset) == (3, CONTROL, after_2 + 1)
        assert named.error.startswith("CorruptStoreError: ") and \
            f"reading control offsets {after_2 + 1}..{at_3}, the records of version 3" in named.error


def test_a_seal_damaged_in_its_event_count_is_named_not_the_records(tmp_path: Path) -> None:
    """A seal whose count of a shard's events changed but still decodes: a replay through
    that version fails on the count, and verify names the seal (the shard's records hold
    every other version's count and the sealed state), not records missing from the shard."""
    run = _closed_run(tmp_path, 4)
    with run.open_log() as log:
        seal = index_control(log).seals[2]
    counts = seal.seal.shard_counts

    def avro_ints(values: tuple[int, ...]) -> bytes:  # an Avro array block of small ints
        return bytes([2 * len(values), *(2 * c for c in values), 0])

    forged = (counts[0], counts[1] + 5)
    _edit_record(run, tmp_path / "rewind.db", seal.offset, avro_ints(counts), avro_ints(forged),
                 partition=CONTROL)
    assert replay(run, Target("version", 1))[0].version == 1
    # (an embedded log's commits are atomic: no need to wait for the counted records to show)
    with override(settle_s=0.0):
        for v in (2, 3, 4):
            with pytest.raises(RewindError, match=f"of the {forged[1]} events"):
                replay(run, Target("version", v))
        for named in _named_by_verify(run, [2, 3, 4]):
            assert (named.version, named.partition, named.offset) == (2, CONTROL, seal.offset), named
            assert named.error.endswith("the seal's count is damaged"), named.error


def test_every_seal_missing_from_the_index_is_damage_not_an_empty_run(tmp_path: Path) -> None:
    """The control records after the layout gone from the database's index, the partition
    still ending past them: no replay finds a sealed version, and verify names the gap
    instead of passing a run with nothing to check."""
    run = _closed_run(tmp_path, 3)
    with run.open_log() as log:
        first = min(o for o, _, env in events(log, CONTROL) if env.kind == "CommitSealed")
        end = log.end_offset(CONTROL)
    with sqlite3.connect(tmp_path / "rewind.db") as conn:
        for table in ("records", "extents"):
            conn.execute(f"DELETE FROM {table} WHERE run=? AND partition=? AND offset>=?",
                         (run.run_id, CONTROL, first))
    conn.close()
    with pytest.raises(RewindError, match="no sealed version"):
        replay(run, Target())
    report = verify_run(run)
    assert not report.ok
    [named] = report.damaged
    assert (named.partition, named.offset) == (CONTROL, first)
    assert f"records at offsets {first}..{end - 1} are missing" in named.error, named.error


def test_a_version_damaged_downward_loses_only_the_versions_whose_replays_reach_it(
        tmp_path: Path) -> None:
    """Version 4's last record on shard 0 damaged to read as version 2: its gsn is then past
    version 2's seal, and it is named. Replays to 2 and 3 stop at version 4's first record,
    before reaching it, and the snapshot of 4 lies past it: no version is unreachable."""
    run = _six_versions_with_a_snapshot_of_4(tmp_path)
    with run.open_log() as log:
        offset, env = [(o, env) for o, _, env in events(log, 0) if env.version == 4][-1]
        [record] = log.read(0, gt=offset - 1, lte=offset)
    _rewrite_event(run, tmp_path / "rewind.db", offset, record.value, dataclasses.replace(env, version=2))
    for v in range(1, 7):
        assert replay(run, Target("version", v))[0].version == v
    for named in _named_by_verify(run, []):
        assert (named.partition, named.offset) == (0, offset)
        assert "past the seal of its version" in named.error, named.error


@pytest.mark.parametrize("damage", ["page zeroed", "schema"])
def test_a_damaged_run_row_is_named_and_the_layouts_shard_count_is_used(tmp_path: Path, damage: str) -> None:
    """The database page that holds the run's row (its shard count) zeroed, or the schema's
    text of the runs table damaged so that its ``run`` column is gone: replays take the shard
    count from the layout and work; verify says that row does not read, and checks every
    version with the layout's count instead of stopping there."""
    run = _closed_run(tmp_path, 3)
    db = tmp_path / "rewind.db"
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name='runs'").fetchone()
    conn.close()
    data = bytearray(db.read_bytes())
    if damage == "page zeroed":
        data[(root - 1) * page_size:root * page_size] = bytes(page_size)
    else:
        at = data.index(b"CREATE TABLE runs")
        at = data.index(b"run ", at + len(b"CREATE TABLE runs"))
        data[at:at + 3] = b"rux"
    db.write_bytes(bytes(data))
    assert replay(run, Target())[0].version == 3
    report = verify_run(run)
    assert not report.ok and report.unreachable == [] and report.covered == (1, 3), report.findings
    [failed] = [f for f in report.findings if f.status == FAIL and f.subject == "log"]
    assert failed.detail.startswith(f"embedded database {db} is damaged") and \
        failed.detail.endswith("(reading the run's shard count; the layout's, 2, is used)"), failed.detail
    store = [f.detail for f in report.findings if f.subject == "database"]
    assert store and all(f.status == FAIL for f in report.findings if f.subject == "database")
    assert f"embedded database {db} is damaged: its tables runs do not read" in "\n".join(store), store


def test_a_record_the_store_fails_on_one_query_path_loses_no_version_a_replay_reads_past(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Version 6's first record on shard 0 read through every query but the one a replay
    makes (from the snapshot of 4) fails, as a damaged database page can: verify names the
    record, and calls no version unreachable, since replays to 5 and 6 read past it: after
    its own read failed, verify reads on the way a replay to 6 does."""
    run = _six_versions_with_a_snapshot_of_4(tmp_path)
    with run.open_log() as log:
        offset = next(o for o, _, env in events(log, 0) if env.version == 6)
        # (the snapshot of 4 holds shard 0 up to version 5's first record)
        replays_gt = next(o for o, _, env in events(log, 0) if env.version == 5) - 1
    broken = CorruptStoreError(f"embedded database {tmp_path / 'rewind.db'} is damaged: "
                               "database disk image is malformed")
    scan, read = EmbeddedLog.scan_decoded, EmbeddedLog.read

    def failing_scan(self: EmbeddedLog, partition: int, decode: Any, *, gt: int | None = None,
                     lte: int | None = None, batch: int = 256) -> Any:
        for rec in scan(self, partition, decode, gt=gt, lte=lte, batch=batch):
            if partition == 0 and rec.offset == offset and gt != replays_gt:
                raise broken
            yield rec

    def failing_read(self: EmbeddedLog, partition: int, *, gt: int | None = None, lte: int | None = None,
                     limit: int | None = None) -> Any:
        got = read(self, partition, gt=gt, lte=lte, limit=limit)
        if partition == 0 and gt != replays_gt and any(r.offset == offset for r in got):
            raise broken
        return got

    every = replay(run, Target("version", 6), use_snapshots=False)[1].applied
    assert verify_run(run).applied == every
    monkeypatch.setattr(EmbeddedLog, "scan_decoded", failing_scan)
    monkeypatch.setattr(EmbeddedLog, "read", failing_read)
    assert replay(run, Target("version", 5))[0].version == 5
    assert replay(run, Target("version", 6))[0].version == 6
    report = verify_run(run)
    assert not report.ok and report.unreachable == [], report.findings
    [named] = report.damaged
    assert (named.version, named.partition, named.offset) == (6, 0, offset), named
    # Version 5's events, folded again from the snapshot of 4 after the failed read, count once.
    assert report.applied == every, report.findings


def test_a_record_a_scan_skips_but_a_lookup_finds_is_named_as_a_damaged_index(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Version 3's first record on shard 0 skipped by every scan of the partition (a replay's
    read) but found by a lookup of its offset, as a damaged index page can do: replays through
    version 3 come up short, and verify names that record and the index, not missing records."""
    run = _closed_run(tmp_path, 4)
    with run.open_log() as log:
        offset = next(o for o, _, env in events(log, 0) if env.version == 3)
    scan = EmbeddedLog.scan_decoded

    def skipping_scan(self: EmbeddedLog, partition: int, decode: Any, *, gt: int | None = None,
                      lte: int | None = None, batch: int = 256) -> Any:
        return (rec for rec in scan(self, partition, decode, gt=gt, lte=lte, batch=batch)
                if partition != 0 or rec.offset != offset)

    monkeypatch.setattr(EmbeddedLog, "scan_decoded", skipping_scan)
    with override(settle_s=0.0):
        assert replay(run, Target("version", 2))[0].version == 2
        for v in (3, 4):
            with pytest.raises(RewindError):
                replay(run, Target("version", v))
        report = verify_run(run)
    assert not report.ok and report.unreachable == [3, 4], report.findings
    [named] = report.damaged
    assert (named.partition, named.offset) == (0, offset)
    assert f"a scan skips offsets {offset}..{offset}, which a lookup of offset {offset} finds: the " \
        "database's index is damaged" in named.error, named.error


def test_a_record_its_index_lost_is_named_as_a_damaged_index_not_as_missing(tmp_path: Path) -> None:
    """The database's index page with version 3's first record of shard 0 taken out, the
    table's row left (what ``PRAGMA integrity_check`` calls a row missing from its index):
    scans and lookups both skip it, and replays through version 3 fail. Verify names that
    record and the index; it does not say the record is missing."""
    run = _closed_run(tmp_path, 4)
    with run.open_log() as log:
        offset = next(o for o, _, env in events(log, 0) if env.version == 3)
    db = tmp_path / "rewind.db"
    index_loses_rows(db, "records", "partition=0 AND offset=?", (offset,))
    with sqlite3.connect(db) as conn:
        assert "missing from index" in conn.execute("PRAGMA integrity_check").fetchone()[0]
    conn.close()
    with override(settle_s=0.0):
        assert replay(run, Target("version", 2))[0].version == 2
        with pytest.raises(CorruptStoreError, match=re.escape(
                f"shard 0: the read after offset {offset - 1} returned offset {offset + 1}: run "
                f"{run.run_id!r} partition 0: reads skip offsets {offset}..{offset}, which the database "
                "holds: its index is damaged")):
            replay(run, Target("version", 3))
        report = verify_run(run)
    assert not report.ok and report.unreachable == [3, 4], report.findings
    [named] = report.damaged
    assert (named.version, named.partition, named.offset) == (3, 0, offset)
    assert named.error == f"CorruptStoreError: run {run.run_id!r} partition 0: reads skip offsets " \
        f"{offset}..{offset}, which the database holds: its index is damaged", named.error


def test_a_lost_seal_is_named_not_the_intact_records_a_fold_past_it_fails_on(tmp_path: Path) -> None:
    """Version 3's seal deleted from the database: replays past it skip version 3's events
    as unsealed and fail on version 4's records, which are as recorded. Verify names the
    lost seal (and the gap it leaves in the control partition), no shard record."""
    run = _closed_run(tmp_path, 5)
    with run.open_log() as log:
        offset = index_control(log).seals[3].offset
    with sqlite3.connect(tmp_path / "rewind.db") as conn:
        conn.execute("DELETE FROM records WHERE partition=? AND offset=?", (CONTROL, offset))
    conn.close()
    with override(settle_s=0.0):
        assert replay(run, Target("version", 2))[0].version == 2
        with pytest.raises(RewindError):
            replay(run, Target("version", 4))
        report = verify_run(run)
    assert not report.ok and report.unreachable == [4, 5], report.findings
    assert {d.partition for d in report.damaged} == {CONTROL}, report.findings
    assert "version 3 has no seal, between sealed versions" in [d.error for d in report.damaged]
