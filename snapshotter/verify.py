"""The health patrol behind ``rewind verify``: every snapshot and the log after it.

Each snapshot is classified (valid, orphan, deleted by retention, damaged) by the same code
recovery uses; then the log from the oldest valid snapshot (or its start) to its end is
folded and verified: every version sealed, no version missing, every event count and
digest matching its seal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eventlog import RewindError, RunAddress, Target
from eventlog.fold.engine import FoldStart, index_control, rebuild
from snapshotter.catalog import load_start, markers
from snapshotter.store import SnapshotStore

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

    @property
    def ok(self) -> bool:
        """True when nothing failed (warnings allowed)."""
        return all(f.status != FAIL for f in self.findings)


def verify_run(address: RunAddress, *, workers: int = 2) -> VerifyReport:
    """Check every snapshot of a run and the log from the oldest good one to the end."""
    report = VerifyReport()
    store = SnapshotStore(address.snapshots_url) if address.snapshots_url else None
    with address.open_log() as log:
        idx = index_control(log)
        known = markers(idx)
        valid: list[FoldStart] = []
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
            if not folder.exists():
                report.findings.append(Finding(subject, OK, "deleted by retention"))
                continue
            try:
                valid.append(load_start(store, log, idx, marker, workers=workers))
                report.findings.append(Finding(subject, OK, f"files and digests verify ({folder})"))
            except RewindError as exc:
                report.findings.append(Finding(subject, FAIL, str(exc)))
        if store is not None:
            for sid in store.list(log.run_id):
                if sid not in known:
                    report.findings.append(Finding(f"snapshot {sid}", WARN,
                                                   "directory without any marker in the log (orphan)"))
        start = min(valid, key=lambda s: s.version) if valid else None
        since = start.version if start else 0
        versions = sorted(v for v in idx.seals if v > since)
        missing = sorted(set(range(since + 1, versions[-1] + 1)) - set(versions)) if versions else []
        if missing:
            report.findings.append(Finding("log", FAIL, f"versions {missing[:10]} have no seal"))
        try:
            state = rebuild(log, Target(), workers=workers, idx=idx, start=start)
            report.findings.append(Finding(
                "log", OK, f"versions {since + 1}..{state.version} from "
                f"{start.source if start else 'the start of the log'}: {state.counts.applied} events "
                "applied, every count and digest matches its seal"))
        except RewindError as exc:
            report.findings.append(Finding("log", FAIL, f"{type(exc).__name__}: {exc}"))
    return report
