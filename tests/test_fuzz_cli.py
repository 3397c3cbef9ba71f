"""Seeded damage to a recorded run's files: replay and verify tell the truth about it.

One embedded run is recorded once (a small model, 18 versions, snapshots of versions 6, 12
and 18 with the oldest deleted by retention); each case copies it, then flips bytes in,
truncates or zeroes a block of one file: the database, a segment file or a kept snapshot's
file (a third of the cases each). For every case:

* a replay either returns a state whose shard and small-state digests equal the recorded
  seal's of its version (digests computed here, not taken from the damaged log), or raises
  a ``RewindError``;
* ``verify`` reports damage, naming the damaged file, when something a replay reads or a
  kept snapshot was damaged, and reports ok when nothing was. What was damaged is decided
  from the copy: the bytes of the kept snapshots, and every record of every partition as
  the log reads it (with the partitions' start and end offsets). Where records differ
  and verify says ok, every version must still replay to its recorded digests; where it
  reports damage, a replay of the first version it calls unreachable must fail;
* no case runs longer than ``CASE_TIMEOUT_S``.

A few cases also run through the installed ``rewind`` command: a replay exits 0 with the
recorded digest or 2 with one line on stderr; verify exits 1 on damage and 0 without.
``REWIND_FUZZ_CLI_CASES`` changes the number of cases; ``REWIND_FUZZ_CLI_FIRST`` starts at a
later case (each case's damage depends only on its number), to run one again.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import pytest

from eventlog import RewindError, RunAddress, Target
from eventlog.digests import small_digest
from eventlog.events import CommitSealed
from eventlog.fold.engine import RebuiltState, index_control
from eventlog.ports import CONTROL
from eventlog.settings import override
from replayer.replay import replay
from snapshotter.policies import keep_last
from snapshotter.verify import FAIL, verify_run

from .test_snapshotter import Trainer, _snapshotter

# Its module-scoped fixture is built once: every test of the file on one xdist worker.
pytestmark = pytest.mark.xdist_group("test_fuzz_cli")

CASES = int(os.environ.get("REWIND_FUZZ_CLI_CASES", "300"))
FIRST = int(os.environ.get("REWIND_FUZZ_CLI_FIRST", "0"))
CASE_TIMEOUT_S = 30
KINDS = ("database", "segment", "snapshot")
#: Cases that also run through the installed command (a process each costs seconds).
CLI_CASES = {6, 7, 9, 11}
RUN = "fz"


@dataclass
class Recorded:
    """The run every case copies, and what it held before any damage."""

    root: Path
    seals: dict[int, CommitSealed]
    content: dict[int, tuple[int, int, list[tuple[int, bytes]]]]
    files: dict[str, list[Path]]  # by kind, relative to root
    snapshot_bytes: dict[Path, bytes]


def _address(root: Path, read_only: bool = True) -> RunAddress:
    """The run in ``root``; read only, as the CLI's read commands open it (nothing is
    written into a damaged copy)."""
    url = f"sqlite://{root / 'rewind.db'}"
    return RunAddress(url, url, RUN, f"file://{root / 'snapshots'}", read_only)


def _content(address: RunAddress) -> dict[int, tuple[int, int, list[tuple[int, bytes]]]]:
    """Every record of every partition as the log reads it, with the start and end offsets."""
    with address.open_log() as log:
        return {p: (log.start_offset(p), log.end_offset(p), [(r.offset, r.value) for r in log.read(p)])
                for p in log.partitions()}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    root = tmp_path_factory.mktemp("recorded")
    address = _address(root, read_only=False)
    trainer = Trainer(address)
    with _snapshotter(address, retention=keep_last(2)) as snap:
        for _ in range(3):
            trainer.train(6)
            assert snap.snapshot(force=True) is not None
    trainer.rec.close()
    with sqlite3.connect(root / "rewind.db") as conn:  # every page in the database file itself
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    for extra in ("rewind.db-wal", "rewind.db-shm"):
        (root / extra).unlink(missing_ok=True)
    with address.open_log() as log:
        seals = {v: s.seal for v, s in index_control(log).seals.items()}
    assert sorted(seals) == list(range(1, 19))
    files = {"database": [Path("rewind.db")],
             "segment": sorted(p.relative_to(root) for p in root.glob("rewind.db.segments/*/*.seg")),
             "snapshot": sorted(p.relative_to(root) for p in root.glob("snapshots/*/*/*"))}
    assert len(files["segment"]) == 2 and len(files["snapshot"]) == 8  # 2 kept snapshots x 4 files
    return Recorded(root, seals, _content(address), files,
                    {p: (root / p).read_bytes() for p in files["snapshot"]})


def _damage(rng: random.Random, path: Path) -> str:
    """Flip a few bytes, truncate, or zero a block of ``path``; says which."""
    data = bytearray(path.read_bytes())
    how = rng.choice(("flip", "flip", "truncate", "zero"))
    # Half the time aim at bytes that hold something (much of a database file is free space).
    live = [i for i in range(0, len(data), 7) if data[i]] if rng.random() < 0.5 else []
    at = rng.choice(live) if live else rng.randrange(len(data))
    if how == "flip":
        for i in {at, *(min(len(data) - 1, at + rng.randrange(64)) for _ in range(rng.randrange(4)))}:
            data[i] ^= rng.randrange(1, 256)
        text = f"flipped bytes at {at}"
    elif how == "truncate":
        data = data[:at]
        text = f"truncated to {at} bytes"
    else:
        n = rng.choice((16, 256, 4096))
        data[at:at + n] = bytes(len(data[at:at + n]))
        text = f"zeroed {n} bytes at {at}"
    path.write_bytes(bytes(data))
    return text


class CaseTimeout(Exception):
    """A case ran longer than ``CASE_TIMEOUT_S``."""


@contextmanager
def _time_limit(seconds: float, what: str) -> Iterator[None]:
    def expire(_sig: int, _frame: FrameType | None) -> None:
        raise CaseTimeout(f"{what} ran longer than {seconds} s")

    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def _matches(state: RebuiltState, seals: dict[int, CommitSealed]) -> bool:
    """Whether the rebuilt state is, bit for bit, the recorded state of its version."""
    seal = seals.get(state.version)
    layout = state.layout
    return seal is not None and small_digest(state.small.states) == seal.small_digest and \
        [s.digest(layout.tensors, layout.chunk_bytes) for s in state.shards] == list(seal.shard_digests)


def _index_damaged(db: Path) -> bool:
    """Whether SQLite finds the database damaged though every record reads as recorded (an
    index that lost rows: a read by one query path skips them, by another finds them)."""
    try:
        conn = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
        try:
            return conn.execute("PRAGMA integrity_check").fetchall() != [("ok",)]
        finally:
            conn.close()
    except sqlite3.Error:
        return True


def _changed(address: RunAddress, recorded: Recorded, partition: int, offset: int | None) -> bool:
    """Whether the record at ``offset`` (``None``: any record) of ``partition``, or for the
    control partition any record up to it (a small state that a later seal's digest
    covers), no longer reads as recorded."""
    start, end, records = recorded.content[partition]
    want = [(o, v) for o, v in records
            if offset is None or o == offset or (partition == CONTROL and o <= offset)]
    try:
        with address.open_log() as log:
            if (log.start_offset(partition), log.end_offset(partition)) != (start, end):
                return True
            got = [(r.offset, r.value) for o, _ in want
                   for r in log.read(partition, gt=o - 1, lte=o, limit=1)]
    except RewindError:
        return True
    return got != want


def _replays(address: RunAddress, target: Target, seals: dict[int, CommitSealed]) -> bool:
    """Replay to ``target``: True if it rebuilt the recorded state, False if it raised a
    ``RewindError``; anything else fails the test."""
    return _replay_error(address, target, seals) is None


def _replay_error(address: RunAddress, target: Target, seals: dict[int, CommitSealed]) -> str | None:
    """Replay to ``target``: None if it rebuilt the recorded state, else the ``RewindError``
    it raised; anything else fails the test."""
    try:
        state, _ = replay(address, target)
    except RewindError as exc:
        return f"{type(exc).__name__}: {exc}"
    assert _matches(state, seals), f"replay to {target} returned a state that no seal recorded"
    return None


@dataclass
class Outcome:
    """What one case found, for the summary."""

    seed: int
    kind: str
    damaged: bool
    verify_ok: bool | None
    replayed: bool
    notes: list[str] = field(default_factory=list)


def _case(recorded: Recorded, seed: int, base: Path) -> tuple[Outcome, RunAddress, Target]:
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    root = base / f"case-{seed}"
    shutil.copytree(recorded.root, root)
    rel = rng.choice(recorded.files[kind])
    how = _damage(rng, root / rel)
    label = f"case {seed}: {kind} {rel} {how}"
    address = _address(root)

    if kind == "snapshot":
        damaged = (root / rel).read_bytes() != recorded.snapshot_bytes[rel]
        records_differ = False
    else:
        try:
            records_differ = _content(address) != recorded.content
        except RewindError:
            records_differ = True  # a record that does not even read
        damaged = records_differ or (kind == "database" and _index_damaged(root / "rewind.db"))

    target = Target() if rng.random() < 0.3 else Target("version", rng.randint(1, 18))
    replayed = _replays(address, target, recorded.seals)
    if kind == "snapshot":
        assert replayed, f"{label}: a damaged snapshot must be passed over, not fail the replay"

    try:
        report = verify_run(address, deep=seed % 4 == 0)
    except RewindError as exc:  # too damaged to patrol at all (the run does not open)
        assert damaged, f"{label}: verify raised {exc!r} on an undamaged copy"
        assert not _replays(address, Target(), recorded.seals), f"{label}: verify raised, replays work"
        return Outcome(seed, kind, damaged, None, replayed, [str(exc)]), address, target

    if report.ok:
        if damaged and kind != "snapshot":
            # Records differ where nothing checks them (a time stamp, a writer name): every
            # version must then still replay to its recorded state.
            failed = {v: err for v in recorded.seals
                      if (err := _replay_error(address, Target("version", v), recorded.seals))}
            assert not failed, f"{label}: verify says ok, but versions do not replay: {failed}"
        else:
            assert not damaged, f"{label}: a kept snapshot was damaged and verify says ok"
    else:
        assert damaged, f"{label}: verify reports damage on an undamaged copy: {report.findings}"
        failures = [f for f in report.findings if f.status == FAIL]
        if kind == "snapshot":
            sid = rel.parent.name
            assert any(sid in f.subject for f in failures), f"{label}: {failures}"
        else:
            named = {d.file for d in report.damaged}
            # (a damaged database may name a segment file that does not exist)
            assert all(n == str(root / "rewind.db") or n.startswith(f"{root}/rewind.db.segments/")
                       for n in named), f"{label}: names {named}"
            if kind == "segment":
                assert str(root / rel) in named, f"{label}: names {named}, not the damaged file"
            for d in report.damaged:
                # A damaged database is named where a read of it broke (its index out of
                # order, or SQLite finding a damaged page on that query's path); the record
                # itself may still read as recorded through another path.
                assert _changed(address, recorded, d.partition, d.offset) or (
                    kind == "database" and ("lists offset" in d.error
                                            or d.error.startswith("CorruptStoreError:"))), \
                    f"{label}: verify names {d.where()}, which reads as recorded: {failures}"
            # A version it calls unreachable fails to replay (which one may depend on how a
            # damaged database is read: SQLite finds a damaged page on some query paths only);
            # where it names no record, the store itself is damaged: no replay works, or it
            # names the run's own row (a replay takes the shard count from the layout), or a
            # snapshot whose end marker no longer vouches for its files (replays pass over it),
            # or the database file's own damage, beyond the records (its tables and indexes).
            probes = [Target("version", v) for v in report.unreachable]
            named_other = any("reading the run's shard count" in f.detail or f.subject.startswith("snapshot ")
                              or f.subject == "database" for f in failures)
            if probes or not (report.damaged or named_other):
                assert any(not _replays(address, t, recorded.seals) for t in probes or [Target()]), \
                    f"{label}: verify calls {report.unreachable or 'every version'} unreachable, but " \
                    f"they replay: {failures}"
    return Outcome(seed, kind, damaged, report.ok, replayed), address, target


def _cli(address: RunAddress, *args: str) -> subprocess.Popen[str]:
    root = Path(address.log_url.removeprefix("sqlite://")).parent
    return subprocess.Popen(["rewind", *args, "--run-dir", str(root), "--run", RUN, "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "REWIND_SETTLE_S": "0"})


def _one_line(err: str, what: str) -> None:
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, f"{what}: stderr {err!r}"


def test_damaged_files_never_fool_replay_or_verify(recorded: Recorded, tmp_path: Path) -> None:
    t0 = time.monotonic()
    outcomes: list[Outcome] = []
    commands: list[tuple[str, Outcome, subprocess.Popen[str], subprocess.Popen[str]]] = []
    # A fold waits this long for records its seal counts to become visible; an embedded
    # log's commits are atomic, so a shortfall here is damage at once.
    with override(settle_s=0.0):
        for seed in range(FIRST, CASES):
            with _time_limit(CASE_TIMEOUT_S, f"case {seed}"):
                outcome, address, target = _case(recorded, seed, tmp_path)
            outcomes.append(outcome)
            if seed in CLI_CASES:
                label = f"case {seed} ({outcome.kind})"
                commands.append((label, outcome, _cli(address, "replay", "--to", str(target)),
                                 _cli(address, "verify")))
            else:
                shutil.rmtree(tmp_path / f"case-{seed}")
    for label, outcome, replayed, verified in commands:
        out, err = replayed.communicate(timeout=300)
        if replayed.returncode == 0:
            report = json.loads(out)
            got = report.get("report", report)
            assert bytes.fromhex(got["state_digest"]) == recorded.seals[got["version"]].state_digest, label
        else:
            assert replayed.returncode == 2, f"{label}: replay exited {replayed.returncode}: {err}"
            _one_line(err, label)
        out, err = verified.communicate(timeout=300)
        want = {True: 0, False: 1, None: 2}[outcome.verify_ok]
        assert verified.returncode == want, f"{label}: verify exited {verified.returncode}, not {want}: {err}"
        if want == 2:
            _one_line(err, label)
    elapsed = time.monotonic() - t0
    by_kind = {k: [o for o in outcomes if o.kind == k] for k in KINDS}
    summary = {k: (len(v), sum(o.damaged for o in v), sum(o.verify_ok is False for o in v),
                   sum(not o.replayed for o in v)) for k, v in by_kind.items()}
    print(f"\n{len(outcomes)} cases in {elapsed:.1f} s; per kind (cases, damaged, verify failed, "
          f"replay raised): {summary}")
    assert len(outcomes) == CASES - FIRST and all(len(v) >= (CASES - FIRST) // 3 for v in by_kind.values())
    # The damage must reach what is checked, or the campaign proves little.
    assert all(s[2] >= s[0] // 5 for s in summary.values()), summary
