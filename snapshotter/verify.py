"""The health patrol behind ``rewind verify``: every version a replay can reach, and every
kept snapshot.

A version is reachable when a replay to it can succeed: the log holds its records from the
start of the log, or from a snapshot that verifies and that the log still reaches (after a
truncation, the oldest such snapshot is where the reachable history begins). The patrol
folds each partition once, from the oldest reachable version to the newest, record by
record, with every check a replay makes:

* every record is read from its store and decoded (its framing, its run id, its
  authentication when encrypted);
* every tensor chunk is decoded, and the digest of the bits it produces checked. For a
  predictive version that means: its gradient chunks' digests (a gradient chunk carries
  its own bits), its optimizer step replayed on the previous version's bits with the
  digests the recording predicted compared, then its residual chunks' digests on top;
* every version's event count per shard against its seal (a missing record), and its
  small states' digest against its seal;
* every seal against itself: its state digest must be the digest of its own shard and
  small-state digests, which finds damage to any of them in a seal that still decodes
  without hashing the state;
* every shard's digest against the newest seal; ``deep`` checks it against the seal of
  every version (it costs hashing the whole state once per version).

No cheaper pass finds a damaged payload of an XOR or predictive version: its XOR and
residual chunks carry only the digest of the bits they produce, so checking one needs the
bits it applies to, which only replaying the steps before it gives. So the default pass is
one step-by-step fold (no batched steps: each failure names its own record), each shard's
on its own thread, and what it costs grows with the reachable history.

A damaged record is named by version, shard (or control), offset and the file that holds
it (segment file or database). The fold of its partition then goes on from the oldest
kept snapshot past it; the versions in between are reported unreachable. An optimizer step
that computes other digests than it recorded (its hyperparameters damaged, yet decoding)
is named and folded on; once a seal's digests then fail to match, it breaks the fold the
same way, so the versions past the next snapshot, which a replay reaches from it, stay
reachable. Each snapshot the log announces is classified by the code recovery uses:
valid, deleted by retention (its tombstone says so), orphan (no end marker) or damaged.

Its length is the patrol's: the walk, the resumption past damage and the report are one
job whose parts share the per-partition cursor state.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from eventlog import RewindError, RunAddress
from eventlog.digests import state_digest
from eventlog.errors import (
    ChunkDigestError,
    CorruptStoreError,
    DecodeError,
    DigestMismatchError,
    GsnOrderError,
    IntegrityError,
    RunNotFoundError,
)
from eventlog.events import Envelope, OptimizerStep, Resumed, RunStarted, TensorDelta
from eventlog.fold.apply import APPLIED, Placement, ShardState
from eventlog.fold.engine import (
    ControlIndex,
    FoldStart,
    SmallStates,
    events,
    fold_control,
    index_control,
    stray_version,
    verify_small,
)
from eventlog.layout import intact
from eventlog.ports import CONTROL, EventLog
from eventlog.settings import current
from snapshotter.catalog import DELETED_BY_RETENTION, Marker, absence, load_start, markers, run_store
from snapshotter.store import SnapshotStore

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Finding:
    """One line of the patrol's report."""

    subject: str
    status: str
    detail: str


@dataclass(frozen=True)
class DamagedRecord:
    """A record a replay fails on (or, ``offset`` ``None``, records a seal counts that the
    log does not hold)."""

    #: The version it belongs to (``None``: it does not decode and no count says which).
    version: int | None
    #: ``eventlog.ports.CONTROL`` (-1), or a tensor shard.
    partition: int
    offset: int | None
    #: The file that holds it: a segment file, the database, or the log's address.
    file: str
    error: str

    def where(self) -> str:
        """``version V, shard S, offset O`` as a reader says it."""
        version = "version ?" if self.version is None else f"version {self.version}"
        part = "control" if self.partition == CONTROL else f"shard {self.partition}"
        at = "records missing" if self.offset is None else f"offset {self.offset}"
        return f"{version}, {part}, {at}"


@dataclass
class VerifyReport:
    """Everything the patrol checked; ``ok`` is False on any failure."""

    findings: list[Finding] = field(default_factory=list)
    damaged: list[DamagedRecord] = field(default_factory=list)
    #: The reachable history the patrol folded: ``(first, last)`` version (``None``: none).
    covered: tuple[int, int] | None = None
    #: Sealed versions that no replay can reach because of damage.
    unreachable: list[int] = field(default_factory=list)
    deep: bool = False

    @property
    def ok(self) -> bool:
        """True when nothing failed (warnings allowed)."""
        return all(f.status != FAIL for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return {"ok": self.ok, "deep": self.deep,
                "covered": None if self.covered is None else
                {"first": self.covered[0], "last": self.covered[1]},
                "unreachable": _ranges(self.unreachable),
                "damaged": [asdict(d) for d in self.damaged],
                "findings": [asdict(f) for f in self.findings]}

    def damage(self, record: DamagedRecord) -> None:
        """Add a damaged record, and the failure line that names it."""
        self.damaged.append(record)
        self.findings.append(Finding(f"record {record.where()}", FAIL, f"{record.error} (in {record.file})"))


def verify_run(address: RunAddress, *, workers: int = 2, deep: bool = False) -> VerifyReport:
    """Check every kept snapshot of a run, and every version a replay can reach (see the
    module docstring; ``deep``: every version's shard digests against its seal too)."""
    report = VerifyReport(deep=deep)
    try:
        opened = address.open_log()
    except CorruptStoreError as exc:
        report.findings.append(Finding("log", FAIL, f"{exc}; no version is reachable"))
        return report
    with opened as log:
        try:
            idx = index_control(log)
        except RewindError as exc:
            if not _control_damage(log, exc, report):
                raise  # no such run, or a server that does not answer: nothing to patrol
            report.findings.append(Finding("log", FAIL, "no version is reachable: every replay "
                                           "reads the whole control partition"))
            return report
        store = run_store(address.snapshots_url, idx, log.run_id)
        valid = _check_snapshots(report, store, log, idx, workers)
        parts = _partitions(report, log, idx)
        _check_log(report, log, idx, _Starts(store, log, idx, valid, workers, parts), workers, deep)
        _check_resumes(report, log, idx)
    return report


def _partitions(report: VerifyReport, log: EventLog, idx: ControlIndex) -> list[int]:
    """Control and every tensor shard; where the store cannot say how many shards the run
    has, that is named and the layouts' count stands (a replay takes it from the layout)."""
    try:
        return log.partitions()
    except CorruptStoreError as exc:
        shards = max((env.body.shard_count for _, env in idx.run_started
                      if isinstance(env.body, RunStarted)), default=0)
        report.findings.append(Finding("log", FAIL, f"{exc} (reading the run's shard count; "
                                       f"the layout's, {shards}, is used)"))
        return [CONTROL, *range(shards)]


def _check_resumes(report: VerifyReport, log: EventLog, idx: ControlIndex) -> None:
    """Every ``Resumed`` event (schema v4): the state digest it restored and checked must be
    the seal's of the version it names."""
    for offset, env in idx.environment:
        body = env.body
        if not isinstance(body, Resumed):
            continue
        subject = f"resume at control offset {offset} (version {body.restored_version})"
        info = idx.seals.get(body.restored_version)
        source = ("the start of the log" if body.snapshot_id is None
                  else f"snapshot {body.snapshot_id} (version {body.snapshot_version})")
        if info is None:
            report.findings.append(Finding(subject, FAIL, f"by {env.writer}: version "
                                           f"{body.restored_version} has no seal in the log"))
        elif info.seal.state_digest != body.state_digest:
            report.findings.append(Finding(
                subject, FAIL, f"by {env.writer}: restored state digest {body.state_digest.hex()}, but "
                f"the seal of version {body.restored_version} records {info.seal.state_digest.hex()} "
                f"(in {log.record_file(CONTROL, offset)})"))
        else:
            report.findings.append(Finding(
                subject, OK, f"by {env.writer}: from {source} + {body.tail_versions} versions of log "
                f"tail; state digest {body.state_digest.hex()} equals the seal's"))


def _control_damage(log: EventLog, exc: RewindError, report: VerifyReport) -> bool:
    """Name the control record ``index_control`` failed on; False if every record reads
    (the error is about the run or the store, not a record)."""
    damaged = _unreadable_control(log)
    if damaged is not None:
        report.damage(damaged)
        return True
    if log.start_offset(CONTROL) == 0 and log.end_offset(CONTROL) > 0:
        report.findings.append(Finding("log", FAIL, f"{type(exc).__name__}: {exc}"))
        return True
    return False


def _unreadable_control(log: EventLog) -> DamagedRecord | None:
    """The first control record that does not read or decode, or is missing."""
    records = _Records(log, CONTROL, None)
    try:
        while records.peek() is not None:
            records.take()
    except RewindError as exc:
        offset = records.failed_at
        return DamagedRecord(None, CONTROL, offset, log.record_file(CONTROL, offset),
                             f"{type(exc).__name__}: {exc}")
    return None


def _check_snapshots(report: VerifyReport, store: SnapshotStore | None, log: EventLog,
                     idx: ControlIndex, workers: int) -> list[Marker]:
    """Classify every snapshot the log announces (and directories it does not); returns
    the ones that verify, oldest first."""
    known = markers(idx)
    valid: list[Marker] = []
    for sid, marker in sorted(known.items(), key=lambda kv: kv[1].version):
        subject = f"snapshot {sid} (version {marker.version})"
        if store is None:
            report.findings.append(Finding(subject, WARN, "no snapshot store configured"))
            continue
        folder = store.directory(log.run_id, sid)
        if marker.end is None:
            report.findings.append(Finding(subject, WARN, f"orphan: begin marker at control "
                                           f"offset {marker.begin_offset} but no end marker; "
                                           f"files in {folder} are unused"))
            continue
        gone = absence(store, log.run_id, sid)
        if gone is not None:
            report.findings.append(Finding(subject, OK if gone.startswith(DELETED_BY_RETENTION) else WARN,
                                           gone))
            continue
        try:
            load_start(store, log, idx, marker, workers=workers)
        except RewindError as exc:
            report.findings.append(Finding(subject, FAIL, str(exc)))
            continue
        valid.append(marker)
        report.findings.append(Finding(subject, OK, f"files and digests verify ({folder})"))
    if store is not None:
        for sid in store.list(log.run_id):
            if sid not in known:
                report.findings.append(Finding(f"snapshot {sid}", WARN,
                                               "directory without any marker in the log (orphan)"))
    return valid


class _Starts:
    """Where a fold can start: the start of the log (unless it was truncated) and every
    valid snapshot that the log still reaches, each loaded (once) when a fold needs it."""

    def __init__(self, store: SnapshotStore | None, log: EventLog, idx: ControlIndex,
                 valid: list[Marker], workers: int, parts: list[int]) -> None:
        self._store, self._log, self._idx, self._workers = store, log, idx, workers
        self.parts = parts
        firsts = [log.start_offset(p) for p in parts]
        self.from_log_start = all(f == 0 for f in firsts)
        #: Valid snapshots the log reaches (every partition still holds their tails).
        self.snapshots = [m for m in valid if m.end is not None and len(m.end.next_offsets) == len(parts)
                          and all(f <= n for f, n in zip(firsts, m.end.next_offsets, strict=True))]
        self._loaded: dict[str, FoldStart] = {}
        self._lock = threading.Lock()

    def first(self) -> Marker | None:
        """The oldest snapshot to start from, when the log's start is gone."""
        return None if self.from_log_start or not self.snapshots else self.snapshots[0]

    def after(self, partition: int, version: int, offset: int | None) -> Marker | None:
        """The oldest snapshot at or after ``version`` whose tail on ``partition`` begins
        after ``offset`` (a damaged record there is then behind it)."""
        for m in self.snapshots:
            assert m.end is not None
            if m.version >= version and (offset is None or m.end.next_offsets[partition + 1] > offset):
                return m
        return None

    def before(self, version: int) -> Marker | None:
        """The newest snapshot at or before ``version``: where a replay to it starts."""
        at = [m for m in self.snapshots if m.version <= version]
        return at[-1] if at else None

    def load(self, marker: Marker) -> FoldStart:
        """The snapshot's state (each partition's fold takes its own part of it)."""
        assert self._store is not None
        with self._lock:
            start = self._loaded.get(marker.snapshot_id)
            if start is None:
                start = load_start(self._store, self._log, self._idx, marker, workers=self._workers)
                self._loaded[marker.snapshot_id] = start
            return start


@dataclass
class _Walk:
    """What the fold of one partition found."""

    damaged: list[DamagedRecord] = field(default_factory=list)
    #: Versions that no replay reaches because of what this partition holds.
    bad: set[int] = field(default_factory=set)
    applied: int = 0


def _check_log(report: VerifyReport, log: EventLog, idx: ControlIndex, starts: _Starts,
               workers: int, deep: bool) -> None:
    """Fold every partition over the reachable history (see the module docstring)."""
    versions = sorted(idx.seals)
    _scan_control(report, log)  # (records missing from the index may be every seal)
    if not versions:
        report.findings.append(Finding("log", WARN, "no sealed version to check"))
        return
    for v in sorted(set(range(versions[0], versions[-1] + 1)) - set(versions))[:10]:
        report.damage(DamagedRecord(v, CONTROL, None, log.record_file(CONTROL),
                                    f"version {v} has no seal, between sealed versions"))
    bad_seals = _damaged_seals(log, idx)
    bad_layouts, layout_lost = _damaged_layouts(log, idx)
    for record in bad_seals + bad_layouts:
        report.damage(record)
    base = starts.first()
    if not starts.from_log_start and base is None:
        report.unreachable = versions
        report.findings.append(Finding("log", FAIL, "no version is reachable: the log was "
                                       "truncated, and no snapshot that verifies holds its start"))
        return
    since = base.version if base is not None else 0
    first = min(v for v in versions if v >= since)
    below = [v for v in versions if v < since]
    if below:  # sealed, but their records are truncated: retention never leaves that
        report.damage(DamagedRecord(below[0], CONTROL, None, log.record_file(CONTROL),
                                    f"versions {', '.join(_ranges(below))} are sealed, but the log "
                                    f"no longer holds their records (it starts at {_base_name(base)})"))
    report.covered = (first, versions[-1])
    # A damaged seal's version is checked against its shard digests whatever the pass: a
    # replay checks those and the small-state digest, not the sum of them, so the version
    # is reachable when only that sum was damaged.
    looked_at = set(versions if deep else versions[-1:]) | {r.version for r in bad_seals}
    checkpoints = sorted(v for v in looked_at - layout_lost if v is not None and v > since)
    named = {r.offset for r in bad_seals}
    shards = len(starts.parts) - 1
    walks = [_walk_control(log, idx, starts, base)]
    with ThreadPoolExecutor(max(1, min(workers, shards))) as pool:
        walks += list(pool.map(lambda s: _walk_shard(log, idx, starts, base, s, checkpoints), range(shards)))
    bad: set[int] = set()
    for walk in walks:
        for record in walk.damaged:
            if record.partition != CONTROL or record.offset not in named:  # (named once)
                report.damage(record)
        bad |= walk.bad
    bad |= layout_lost
    report.unreachable = sorted(v for v in bad | set(below) if v in idx.seals)
    source = _base_name(base)
    checked = "every version's" if deep else "the newest version's"
    summary = (f"versions {first}..{versions[-1]} folded from {source}: "
               f"{sum(w.applied for w in walks)} events applied, every event count and small-state "
               f"digest and {checked} shard digests checked against the seals")
    if report.unreachable:
        report.findings.append(Finding("log", FAIL, f"{summary}; unreachable because of damage: "
                                       f"versions {', '.join(_ranges(report.unreachable))}"))
    else:
        report.findings.append(Finding("log", OK, summary))


def _damaged_seals(log: EventLog, idx: ControlIndex) -> list[DamagedRecord]:
    """Seals whose state digest is not the digest of their own shard and small-state
    digests: which of them is damaged, the fold's checks at that version say."""
    found = []
    for version, info in sorted(idx.seals.items()):
        seal = info.seal
        own = state_digest(seal.shard_digests, seal.small_digest)
        if own != seal.state_digest:
            found.append(DamagedRecord(
                version, CONTROL, info.offset, log.record_file(CONTROL, info.offset),
                f"the seal of version {version} is damaged: it records state digest "
                f"{seal.state_digest.hex()}, but its own shard and small-state digests make {own.hex()}"))
    return found


def _damaged_layouts(log: EventLog, idx: ControlIndex) -> tuple[list[DamagedRecord], set[int]]:
    """Layout records that fail their own config digest, and the sealed versions one of them
    is in force at: a replay to those refuses it."""
    found = []
    for offset, env in idx.run_started:
        body = env.body
        error = idx.damaged_layout(env.version, body) if isinstance(body, RunStarted) else None
        if error is not None:
            found.append(DamagedRecord(env.version, CONTROL, offset, log.record_file(CONTROL, offset),
                                       f"{type(error).__name__}: {error}"))

    def in_force(version: int) -> RunStarted | None:
        try:
            return idx.layout_at(version)
        except RunNotFoundError:  # truncated past its layouts: a snapshot's is used
            return None

    lost = {v for v in idx.seals if (layout := in_force(v)) is not None and not intact(layout)}
    return found, lost


def _scan_control(report: VerifyReport, log: EventLog) -> None:
    """Read every control record again, one fold's way: ``index_control`` read them all,
    but in a log with dense offsets only this scan sees records that are missing."""
    damaged = _unreadable_control(log) if log.dense_offsets else None
    if damaged is not None:
        report.damage(damaged)


def _base_name(base: Marker | None) -> str:
    """Where the reachable history begins, as a reader says it."""
    return "the start of the log" if base is None else f"snapshot {base.snapshot_id} (version {base.version})"


def _walk_control(log: EventLog, idx: ControlIndex, starts: _Starts, base: Marker | None) -> _Walk:
    """Fold the small states version by version, each checked against its seal (records
    that do not decode were found by ``index_control`` already); after a version whose
    control records cannot be read, on from the oldest snapshot past it."""
    walk = _Walk()
    versions = sorted(idx.seals)
    point: Marker | None = base
    while True:
        small = _small_at(starts, point)
        since = point.version if point is not None else 0
        lost = None
        for v in (x for x in versions if x > since):
            folded = _fold_small(log, idx, starts, v, small, walk)
            if folded is None:
                lost = v
                break
            small = folded
            try:
                verify_small(small, idx.seals[v])
            except DigestMismatchError as exc:
                walk.bad.add(v)
                if v - 1 not in walk.bad:  # one damaged state fails every version until replaced
                    seal = idx.seals[v]
                    walk.damaged.append(DamagedRecord(
                        v, CONTROL, seal.offset, log.record_file(CONTROL, seal.offset),
                        f"{exc}: the seal of version {v}, or a small-state record of it or before it, "
                        "is damaged"))
        walk.applied += small.counts.applied
        if lost is None:
            return walk
        point = starts.after(CONTROL, lost, idx.seals[lost].offset)
        resume = point.version if point is not None else versions[-1] + 1
        walk.bad.update(v for v in versions if lost <= v < resume)
        if point is None:
            return walk


def _small_at(starts: _Starts, point: Marker | None) -> SmallStates:
    """A copy of the small states at a snapshot (the start of the log for ``None``), to fold on."""
    if point is None:
        return SmallStates()
    small = starts.load(point).small
    return SmallStates(dict(small.states), dict(small.kinds), small.applied_gsn,
                       next_offset=small.next_offset)


def _fold_small(log: EventLog, idx: ControlIndex, starts: _Starts, version: int, small: SmallStates,
                walk: _Walk) -> SmallStates | None:
    """``small`` folded on to ``version``; ``None`` if the store cannot read its records.

    A damaged database can fail one query and answer another (SQLite meets a damaged index
    page on some query paths only), so a failed read is named and then tried again the way a
    replay to ``version`` reads: from the newest snapshot at or before it, or the log's start."""
    gt = small.folded_to
    try:
        return fold_control(log, idx, version, small, gt)
    except (CorruptStoreError, DecodeError) as exc:
        offset = gt + 1 if gt is not None else log.start_offset(CONTROL)
        walk.damaged.append(DamagedRecord(
            version, CONTROL, offset, log.record_file(CONTROL, offset),
            f"{type(exc).__name__}: {exc} (reading control offsets {offset}..{idx.seals[version].offset}, "
            f"the records of version {version})"))
    point = starts.before(version)
    if point is None and not starts.from_log_start:
        return None
    again = _small_at(starts, point)
    try:
        return fold_control(log, idx, version, again, again.folded_to)
    except (CorruptStoreError, DecodeError):
        return None


class MissingRecordsError(IntegrityError):
    """Records a log with dense offsets should hold are not found (no read failed)."""


class _Records:
    """A partition's records after an offset, with a look at the next one before it is taken.

    A read fetches several records at once; after one fails, they are read one at a time,
    so that ``failed_at`` names the very record that does not read or decode."""

    def __init__(self, log: EventLog, partition: int, gt: int | None) -> None:
        self.log, self.partition = log, partition
        #: The offset and version of the last record taken.
        self.last_offset: int | None = gt
        self.last_version: int | None = None
        #: The offset of the record that did not read or decode (after ``peek`` raised).
        self.failed_at: int | None = None
        self._end = log.end_offset(partition)
        self._it = events(log, partition, gt=gt, lte=self._end - 1)
        self._next: tuple[int, int, Envelope] | None = None
        self._one_by_one = False

    def peek(self) -> tuple[int, int, Envelope] | None:
        """The next record, or ``None`` at the end (raises if it does not read or decode,
        or if records before it, or at the end, are missing from a log with dense offsets)."""
        if self._next is not None:
            return self._next
        if not self._one_by_one:
            try:
                self._next = next(self._it, None)
            except RewindError:
                self._one_by_one = True
        if self._one_by_one:
            self._next = self._single()
        if self.log.dense_offsets:
            want = self.log.start_offset(self.partition) if self.last_offset is None else self.last_offset + 1
            found = self._end if self._next is None else self._next[0]
            if found > want and not self._one_by_one and \
                    self.log.read(self.partition, gt=want - 1, lte=want, limit=1):
                # A damaged index can hide records from a scan (a replay's read) that a
                # lookup finds.
                self._next, self.failed_at = None, want
                raise CorruptStoreError(f"run {self.log.run_id!r} partition {self.partition}: a scan "
                                        f"skips offsets {want}..{found - 1}, which a lookup of offset "
                                        f"{want} finds: the database's index is damaged")
            if found > want:
                # A damaged index can hide records from a scan without any error.
                self._next, self.failed_at = None, want
                raise MissingRecordsError(f"run {self.log.run_id!r} partition {self.partition}: records at "
                                      f"offsets {want}..{found - 1} are missing (the partition ends at "
                                      f"{self._end})")
        return self._next

    def _single(self) -> tuple[int, int, Envelope] | None:
        gt = self.last_offset
        want = self.log.start_offset(self.partition) if gt is None else gt + 1
        self.failed_at = want
        found = []
        if self.log.dense_offsets:  # the very offset first: a range can fail where a lookup works
            found = self.log.read(self.partition, gt=want - 1, lte=want, limit=1)
        if not found:  # (Kafka's offsets have gaps where its transaction markers are)
            found = self.log.read(self.partition, gt=gt, lte=self._end - 1, limit=1)
        if not found:
            self.failed_at = None
            return None
        self.failed_at = found[0].offset
        record = next(events(self.log, self.partition, gt=found[0].offset - 1, lte=found[0].offset), None)
        self.failed_at = None
        return record

    def take(self) -> None:
        assert self._next is not None
        self.last_offset, self.last_version = self._next[0], self._next[2].version
        self._next = None

    def newer(self) -> bool:
        """Whether records were committed since the scan began (a log being written, or a
        transaction whose partitions become visible a moment apart); scan them too."""
        end = self.log.end_offset(self.partition)
        if end <= self._end:
            return False
        self._it = events(self.log, self.partition, gt=self.last_offset, lte=end - 1)
        self._end = end
        return True


def _walk_shard(log: EventLog, idx: ControlIndex, starts: _Starts, base: Marker | None, shard: int,
                checkpoints: list[int]) -> _Walk:
    """Fold one shard from ``base`` (``None``: the start of the log) to the newest version;
    after a damaged record, on from the oldest snapshot past it."""
    walk = _Walk()
    versions = sorted(idx.seals)
    point: Marker | None = base
    while True:
        if point is None:
            state, gt, since, layout = ShardState(shard), None, 0, None
        else:
            start = starts.load(point)
            state, since, layout = start.shards[shard], point.version, start.layout
            gt = start.next_offsets[shard + 1] - 1
        broken = _fold(log, idx, state, gt, since, layout, [c for c in checkpoints if c > since], walk,
                       starts)
        walk.applied += state.counts.applied
        if broken is None:
            return walk
        version, offset = broken
        point = starts.after(shard, version, offset)
        resume = point.version if point is not None else versions[-1] + 1
        walk.bad.update(v for v in versions if version <= v < resume)
        if point is None:
            return walk


def _fold(log: EventLog, idx: ControlIndex, state: ShardState, gt: int | None, since: int,
          base_layout: RunStarted | None, checkpoints: list[int],
          walk: _Walk, starts: _Starts) -> tuple[int, int | None] | None:
    """Apply the shard's records after offset ``gt`` and check each checkpoint version.
    Returns ``None`` when the newest version was reached, else ``(first version a replay
    cannot reach, offset of the damaged record or None)`` after adding it to ``walk``."""
    steps: list[DamagedRecord] = []
    broken = _fold_records(log, idx, state, gt, since, base_layout, checkpoints, walk, steps, starts)
    if broken is not None:
        # A step that predicted differently at or after the break ran on a state the missing
        # or damaged records had already changed: only the steps before it stay named.
        # (The step that is the break itself stays named.)
        late = {id(d) for d in steps if d.version is not None and d.version >= broken[0]
                and (d.version, d.offset) != broken}
        walk.damaged[:] = [d for d in walk.damaged if id(d) not in late]
    return broken


def _left_to_the_seal(env: Envelope) -> bool:
    """Whether a replay's batched fold leaves this record's own digest check to the seal:
    an optimizer step's digests of what it predicted, a gradient chunk's digest."""
    body = env.body
    return isinstance(body, OptimizerStep) or (
        isinstance(body, TensorDelta) and body.encoding == TensorDelta.GRAD)


def _fold_records(log: EventLog, idx: ControlIndex, state: ShardState, gt: int | None, since: int,
                  base_layout: RunStarted | None, checkpoints: list[int], walk: _Walk,
                  steps: list[DamagedRecord], starts: _Starts) -> tuple[int, int | None] | None:
    """``_fold``'s walk; each step it names for predicting differently also goes to ``steps``."""
    shard, seals, newest = state.shard, idx.seals, max(idx.seals)
    sealed = {v: s.gsn for v, s in seals.items()}
    records = _Records(log, shard, gt)
    placement = Placement(lambda v: idx.layout_at(v, base_layout), shard)
    diverged = False  # a step predicted differently since the last checkpoint that matched
    applied_at: int | None = None  # the offset of the record applied last
    settle = current().settle_s

    def record(version: int | None, offset: int | None, exc: RewindError) -> DamagedRecord:
        return DamagedRecord(version, shard, offset, log.record_file(shard, offset),
                             f"{type(exc).__name__}: {exc}")

    def damaged(version: int | None, offset: int | None, exc: RewindError) -> None:
        walk.damaged.append(record(version, offset, exc))

    for target in checkpoints:
        while True:
            try:
                rec = records.peek()
            except RewindError as exc:
                offset = records.failed_at
                # Every replay that reads it fails, those of the version before it too:
                # a fold reads the first record past its target to see where it stops.
                first = records.last_version if records.last_version is not None else since
                damaged(_short_of(state, idx, since, newest), offset, exc)
                whole = _short_of(state, idx, since, first) is None
                if isinstance(exc, MissingRecordsError) and whole:
                    # Nothing failed to read: a replay to the last version read whole meets
                    # the record after the gap, or none, and stops there.
                    first += 1
                elif whole and records.last_version is not None and _replay_reads(log, starts, shard, first):
                    # A damaged database fails some queries and answers others: the replay
                    # to the last version read whole, reading as it does, met no failure.
                    first += 1
                return max(first, since), offset
            if rec is None:
                if target == newest and _short_of(state, idx, since, newest) is not None \
                        and _settled(records, settle):
                    continue
                break
            offset, nbytes, env = rec
            if env.version > target:
                break
            where = f"run {log.run_id!r} shard {shard} offset {offset} (version {env.version})"
            try:
                try:
                    state.apply(env, sealed, nbytes, where, placement=placement)
                except (DigestMismatchError, ChunkDigestError) as exc:
                    if not _left_to_the_seal(env):
                        raise
                    # Only a check that a replay's batched steps skip failed: a step's
                    # digests of what it predicted, or a gradient chunk's digest (a damaged
                    # name or digest in the record, damaged bits, or a step that diverged).
                    # The residual chunks and the seal still check the state, here as there.
                    # So it is named, and the fold goes on; the steps after it, until a
                    # checkpoint's digests match again, ran on the state it left and differ
                    # for that reason alone.
                    if not diverged:
                        steps.append(record(env.version, offset, exc))
                        walk.damaged.append(steps[-1])
                    diverged = True
                    if isinstance(exc, ChunkDigestError):
                        state.apply(env, sealed, nbytes, where, placement=placement, chunk_digests=False)
                    else:
                        _count_applied(state, env, nbytes, where)
            except GsnOrderError as exc:  # the event applied last is the damaged one
                damaged(env.version, applied_at, exc)
                return env.version, applied_at
            except RewindError as exc:
                damaged(env.version, offset, exc)
                # A replay reaches this record only past the versions of those before it
                # (a damaged version may be lower than theirs).
                first = max(env.version, records.last_version or 0)
                short = _short_of(state, idx, since, first - 1)
                return (first if short is None else short), offset
            if state.applied_gsn == env.gsn:
                applied_at = offset
            records.take()
        short = _short_of(state, idx, since, target)
        stray = None if short is None or rec is None else stray_version(log, idx, shard, rec[0], rec[2])
        if short is not None and stray is not None and rec is not None:
            damaged(short, rec[0], stray)  # (the events it cut off are the short version's)
            return short, rec[0]
        if short is not None and _miscounted(state, idx, since, target, base_layout):
            info = seals[short]
            walk.damaged.append(DamagedRecord(
                short, CONTROL, info.offset, log.record_file(CONTROL, info.offset),
                f"IntegrityError: the seal of version {short} counts {info.seal.shard_counts[shard]} "
                f"events on shard {shard}, which holds {state.applied_per_version.get(short, 0)} of them; "
                f"every other version holds its count and the shard rebuilt to version {target} holds "
                "its sealed state: the seal's count is damaged"))
            return short, None
        if short is not None:
            want = seals[short].seal.shard_counts[shard]
            walk.damaged.append(DamagedRecord(
                short, shard, None, log.record_file(shard),
                f"IntegrityError: shard {shard}, version {short}: applied "
                f"{state.applied_per_version.get(short, 0)} of the {want} events its seal counts"))
            return short, None
        seal = seals[target]
        layout = idx.layout_at(target, base_layout)
        mismatch = _digest_mismatch(state, layout, seal.seal.shard_digests, target)
        if mismatch is not None and diverged:
            # The step named since the last match left a state no seal after it holds: a
            # replay through it fails, one from a snapshot past it need not. So it breaks
            # the fold like a damaged record, which goes on from the snapshot past it.
            return steps[-1].version or since, steps[-1].offset
        if mismatch is not None:
            why = f"the seal of version {target} is damaged, or a record whose own checks passed"
            walk.damaged.append(DamagedRecord(
                target, CONTROL, seal.offset, log.record_file(CONTROL, seal.offset),
                f"{mismatch}: {why}"))
            walk.bad.add(target)  # the state is what the records say: later versions may match
        diverged = False
        since = target
    return None


def _replay_reads(log: EventLog, starts: _Starts, shard: int, version: int) -> bool:
    """Whether a replay to ``version`` reads the shard's records without an error, reading
    them as it does: from the newest snapshot at or before it (or the log's start) up to the
    first record past it. Its contents were checked already; only the store's answer is."""
    point = starts.before(version)
    if point is None and not starts.from_log_start:
        return False
    gt = None if point is None or point.end is None else point.end.next_offsets[shard + 1] - 1
    try:
        for _, _, env in events(log, shard, gt=gt, lte=log.end_offset(shard) - 1):
            if env.version > version:
                break
    except RewindError:
        return False
    return True


def _settled(records: _Records, settle_s: float) -> bool:
    """Wait up to ``settle_s`` for records the newest seal counts that are not visible yet;
    whether some came."""
    deadline = time.monotonic() + settle_s
    while True:
        if records.newer():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _count_applied(state: ShardState, env: Envelope, nbytes: int, where: str) -> None:
    """Count an event as applied, as ``ShardState.apply`` does once its body applied."""
    state.last_applied = (state.applied_gsn, env.version, where)
    state.applied_gsn = env.gsn
    state.version = max(state.version, env.version)
    state.applied_per_version[env.version] += 1
    state.counts.add(APPLIED, nbytes)


def _short_of(state: ShardState, idx: ControlIndex, since: int, upto: int) -> int | None:
    """The first version in ``(since, upto]`` whose events on this shard differ in number
    from what its seal counts."""
    for v in sorted(x for x in idx.seals if since < x <= upto):
        counts = idx.seals[v].seal.shard_counts
        if state.shard < len(counts) and state.applied_per_version.get(v, 0) != counts[state.shard]:
            return v
    return None


def _miscounted(state: ShardState, idx: ControlIndex, since: int, target: int,
                base_layout: RunStarted | None) -> bool:
    """Whether the one version in ``(since, target]`` whose count differs has a damaged count in
    its seal, not damaged records: a record moved to another version leaves two counts wrong,
    and one missing or skipped leaves a state its seal does not hold."""
    counts = {v: s.seal.shard_counts for v, s in idx.seals.items() if since < v <= target}
    off = [v for v, c in counts.items() if state.shard < len(c)
           and state.applied_per_version.get(v, 0) != c[state.shard]]
    if len(off) != 1:
        return False
    layout = idx.layout_at(target, base_layout)
    return _digest_mismatch(state, layout, idx.seals[target].seal.shard_digests, target) is None


def _digest_mismatch(state: ShardState, layout: RunStarted, digests: tuple[bytes, ...],
                     version: int) -> str | None:
    """Why the shard's state is not the sealed state of ``version``, or ``None``."""
    if state.shard >= len(digests):
        return None
    state.conform(layout.tensors)
    try:
        got = state.digest(layout.tensors, layout.chunk_bytes)
    except IntegrityError as exc:
        return f"{type(exc).__name__}: {exc}"
    if got != digests[state.shard]:
        return (f"DigestMismatchError: shard {state.shard} rebuilt to version {version} has digest "
                f"{got.hex()}, its seal records {digests[state.shard].hex()}")
    return None


def _ranges(versions: list[int]) -> list[str]:
    """``[1, 2, 3, 7]`` as ``["1..3", "7"]``."""
    out: list[str] = []
    for v in sorted(versions):
        if out and int(out[-1].rpartition(".")[2]) == v - 1:
            out[-1] = f"{out[-1].partition('..')[0]}..{v}"
        else:
            out.append(str(v))
    return out
