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

This module holds the report and the checks of the run as a whole; each partition's fold
is ``snapshotter.walk``, and reading its records so that a failure names one is
``snapshotter.records``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from eventlog import RewindError, RunAddress
from eventlog.backends import store_damage
from eventlog.digests import state_digest
from eventlog.errors import CorruptStoreError, RunNotFoundError
from eventlog.events import Resumed, RunStarted
from eventlog.fold.engine import ControlIndex, index_control
from eventlog.layout import intact
from eventlog.ports import CONTROL, EventLog
from snapshotter import provenance
from snapshotter.catalog import DELETED_BY_RETENTION, Marker, absence, load_start, markers, run_store
from snapshotter.records import DamagedRecord, Records
from snapshotter.store import SnapshotStore
from snapshotter.walk import Starts, base_name, walk_control, walk_shard

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Finding:
    """One line of the patrol's report."""

    subject: str
    status: str
    detail: str


@dataclass
class VerifyReport:
    """Everything the patrol checked; ``ok`` is False on any failure."""

    findings: list[Finding] = field(default_factory=list)
    damaged: list[DamagedRecord] = field(default_factory=list)
    #: The reachable history the patrol folded: ``(first, last)`` version (``None``: none).
    covered: tuple[int, int] | None = None
    #: Sealed versions that no replay can reach because of damage.
    unreachable: list[int] = field(default_factory=list)
    #: Kept snapshots whose files or end marker fail their checks (replays pass them over).
    failed_snapshots: list[str] = field(default_factory=list)
    deep: bool = False
    #: The events the fold of the reachable history applied, each once.
    applied: int = 0

    @property
    def ok(self) -> bool:
        """True when nothing failed (warnings allowed)."""
        return all(f.status != FAIL for f in self.findings)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return {"ok": self.ok, "deep": self.deep, "applied": self.applied,
                "covered": None if self.covered is None else
                {"first": self.covered[0], "last": self.covered[1]},
                "unreachable": _ranges(self.unreachable),
                "damaged": [asdict(d) for d in self.damaged],
                "failed_snapshots": list(self.failed_snapshots),
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
        check_store(report, address.log_url)
        return report
    with opened as log:
        try:
            _patrol(report, log, address, workers, deep)
        except CorruptStoreError as exc:  # the store failed a read the patrol cannot go on without
            report.findings.append(Finding("log", FAIL, f"{exc}; the patrol stopped there"))
    check_store(report, address.log_url)
    return report


def verify_store(log_url: str, error: CorruptStoreError) -> VerifyReport:
    """The report on a store in which no run can be named (``error``: its run ids do not
    read): that, and the damage the store holds (``check_store``)."""
    report = VerifyReport()
    report.findings.append(Finding("log", FAIL, f"{error}; no run can be patrolled"))
    check_store(report, log_url)
    return report


def check_store(report: VerifyReport, log_url: str) -> None:
    """Add the damage the log's store holds beyond its records (``eventlog.backends.store_damage``)."""
    report.findings += [Finding("database", FAIL, line) for line in store_damage(log_url)]


def _patrol(report: VerifyReport, log: EventLog, address: RunAddress, workers: int, deep: bool) -> None:
    """``verify_run``'s checks of the run's snapshots and log."""
    try:
        idx = index_control(log)
    except RewindError as exc:
        if not _control_damage(log, exc, report):
            raise  # no such run, or a server that does not answer: nothing to patrol
        report.findings.append(Finding("log", FAIL, "no version is reachable: every replay "
                                       "reads the whole control partition"))
        return
    store = run_store(address.snapshots_url, idx, log.run_id)
    valid = _check_snapshots(report, store, log, idx, workers)
    parts = _partitions(report, log, idx)
    _check_log(report, log, idx, Starts(store, log, idx, valid, workers, parts), workers, deep)
    _check_resumes(report, log, idx)
    _check_fencing(report, log, idx)
    _check_provenance(report, address, log, idx)


def _check_fencing(report: VerifyReport, log: EventLog, idx: ControlIndex) -> None:
    """Every writer that recorded sessions (a recorder names its events ``WRITER#SESSION``,
    and logs each session's environment) must hold an epoch in the store at least as high
    as their count: each session registered once, one epoch past the last. A lower one, or
    none, lets the next writer with that id register at an epoch a fenced one may hold."""
    try:
        epochs = log.writer_epochs()
    except CorruptStoreError as exc:
        report.findings.append(Finding("writers", FAIL, f"{exc}; no writer's fencing epoch can be checked"))
        return
    if epochs is None:
        return
    sessions: dict[str, set[str]] = {}
    named = [env.writer for _, env in idx.environment] + [info.writer for info in idx.seals.values()]
    for name in named:
        writer, sep, session = name.rpartition("#")
        if sep and writer:
            sessions.setdefault(writer, set()).add(session)
    for writer, seen in sorted(sessions.items()):
        held = epochs.get(writer)
        if held is None or held < len(seen):
            said = "no epoch" if held is None else f"epoch {held}"
            report.findings.append(Finding(f"writer {writer}", FAIL, (
                f"the log records {len(seen)} sessions of it, each registered at a new epoch, but the store "
                f"holds {said} for it: its row in the writers table is damaged, and the next writer with "
                f"that id would register at an epoch a fenced one may hold (in {log.record_file(CONTROL)})")))


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


def _check_provenance(report: VerifyReport, address: RunAddress, log: EventLog, idx: ControlIndex) -> None:
    """Every stamp a version consumed names a sealed version with its digest
    (``snapshotter.provenance``)."""
    check = provenance.check_stamps(address, log, idx)
    report.findings += [Finding(s, FAIL, d) for s, d in check.failures]
    report.findings += [Finding(s, WARN, d) for s, d in check.warnings]
    if check.summary:
        report.findings.append(Finding("provenance", FAIL if check.failures else OK, check.summary))


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
    records = Records(log, CONTROL, None)
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
                                           f"offset {marker.begin_offset} but no end marker (its "
                                           "snapshotter died or lost its lease while writing it); "
                                           f"files in {folder} are unused"))
            continue
        gone = absence(store, log.run_id, sid)
        if gone is not None:
            report.findings.append(Finding(subject, OK if gone.startswith(DELETED_BY_RETENTION) else WARN,
                                           gone))
            continue
        try:
            load_start(store, log, idx, marker, workers=workers)
        except RewindError as exc:  # (the files, or the end marker that vouches for them)
            at = marker.end_offset
            report.findings.append(Finding(subject, FAIL, f"{exc} (end marker at control offset {at}, "
                                           f"in {log.record_file(CONTROL, at)})"))
            report.failed_snapshots.append(sid)
            continue
        valid.append(marker)
        report.findings.append(Finding(subject, OK, f"files and digests verify ({folder})"))
    if store is not None:
        for sid in store.list(log.run_id):
            if sid not in known:
                report.findings.append(Finding(f"snapshot {sid}", WARN,
                                               "directory without any marker in the log (orphan)"))
    return valid


def _check_log(report: VerifyReport, log: EventLog, idx: ControlIndex, starts: Starts,
               workers: int, deep: bool) -> None:
    """Fold every partition over the reachable history (see the module docstring)."""
    versions = sorted(idx.seals)
    _scan_control(report, log)  # (records missing from the index may be every seal)
    if not versions:
        report.findings.append(Finding("log", WARN, "no sealed version to check"))
        return
    # A multi-rank job that restarts after a crash skips the version number of the part the
    # crash left: the next seal names the version it was built on.
    skipped = {v for info in idx.seals.values() for v in range(info.seal.base_version + 1, info.version)}
    missing = sorted(set(range(versions[0], versions[-1] + 1)) - set(versions) - skipped)
    for v in missing[:10]:
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
                                    f"no longer holds their records (it starts at {base_name(base)})"))
    report.covered = (first, versions[-1])
    # A damaged seal's version is checked against its shard digests whatever the pass: a
    # replay checks those and the small-state digest, not the sum of them, so the version
    # is reachable when only that sum was damaged.
    looked_at = set(versions if deep else versions[-1:]) | {r.version for r in bad_seals}
    checkpoints = sorted(v for v in looked_at - layout_lost if v is not None and v > since)
    named = {r.offset for r in bad_seals}
    shards = len(starts.parts) - 1
    walks = [walk_control(log, idx, starts, base)]
    with ThreadPoolExecutor(max(1, min(workers, shards))) as pool:
        walks += list(pool.map(lambda s: walk_shard(log, idx, starts, base, s, checkpoints), range(shards)))
    bad: set[int] = set()
    for walk in walks:
        for record in walk.damaged:
            if record.partition != CONTROL and _past_a_missing_seal(record.version, missing, starts):
                continue  # its version's fold skipped a lost seal's events: the seal is named
            if record.partition != CONTROL or record.offset not in named:  # (named once)
                report.damage(record)
        bad |= walk.bad
    bad |= layout_lost
    report.unreachable = sorted(v for v in bad | set(below) if v in idx.seals)
    report.applied = sum(w.applied for w in walks)
    source = base_name(base)
    checked = "every version's" if deep else "the newest version's"
    summary = (f"versions {first}..{versions[-1]} folded from {source}: "
               f"{report.applied} events applied, every event count and small-state "
               f"digest and {checked} shard digests checked against the seals")
    if report.unreachable:
        report.findings.append(Finding("log", FAIL, f"{summary}; unreachable because of damage: "
                                       f"versions {', '.join(_ranges(report.unreachable))}"))
    else:
        report.findings.append(Finding("log", OK, summary))


def _past_a_missing_seal(version: int | None, missing: list[int], starts: Starts) -> bool:
    """Whether a replay to ``version`` folds past a version whose seal is missing: it skips
    that version's events as unsealed, so the fold fails on a later record however intact."""
    if version is None:
        return False
    start = starts.before(version)
    since = start.version if start is not None else 0
    return any(since < m < version for m in missing)


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


def _ranges(versions: list[int]) -> list[str]:
    """``[1, 2, 3, 7]`` as ``["1..3", "7"]``."""
    out: list[str] = []
    for v in sorted(versions):
        if out and int(out[-1].rpartition(".")[2]) == v - 1:
            out[-1] = f"{out[-1].partition('..')[0]}..{v}"
        else:
            out.append(str(v))
    return out
