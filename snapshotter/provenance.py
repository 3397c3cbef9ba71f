"""Reading and checking a run's provenance: the stamps each version's steps consumed
(``eventlog.provenance``).

``consumed`` reads them from the run's control partition: every rank's ``provenance`` small
state recorded by a sealed version. ``check_stamps`` (behind ``rewind verify``) checks each
stamp against the run it names: that run has sealed the version it names, before the version
that consumed it when it is the same run, with the digest it carries (a ``state`` stamp: the
seal's state digest; a ``weights/<dtype>`` stamp: the digest of the cast weights in that
version's weights-stream seal). A stamp whose version the log or the stream no longer holds
(truncated by retention) cannot be checked: a warning, not a failure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

from eventlog import RunAddress
from eventlog.errors import IntegrityError, RewindError, RunNotFoundError
from eventlog.events import CustomState
from eventlog.fold.engine import ControlIndex, events, index_control
from eventlog.ports import CONTROL, WEIGHTS, EventLog
from eventlog.provenance import STATE, Consumed, Stamp, is_provenance, read_consumed
from eventlog.weightstream import WeightsStream


def consumed(log: EventLog, idx: ControlIndex) -> dict[int, list[Consumed]]:
    """The stamps each sealed version's steps consumed (a record per rank), by version."""
    out: dict[int, list[Consumed]] = {}
    seen: set[tuple[int, str]] = set()
    for offset, _, env in events(log, CONTROL):
        body = env.body
        if not isinstance(body, CustomState) or not is_provenance(body.name) or env.version not in idx.seals:
            continue
        if (env.version, body.name) in seen:  # redelivered
            continue
        seen.add((env.version, body.name))
        where = f"run {log.run_id!r} control offset {offset}, small state {body.name!r}"
        record = read_consumed(body.state, where)
        if record.version != env.version:
            raise IntegrityError(f"{where}: records the stamps of version {record.version} in an "
                                 f"event of version {env.version}")
        out.setdefault(env.version, []).append(record)
    return out


def stamps_of(records: list[Consumed]) -> Iterator[tuple[Stamp, int]]:
    """Every stamp of a version's records, with its count."""
    for record in records:
        yield from record.stamps


@dataclass
class StampCheck:
    """What ``check_stamps`` found: ``(subject, detail)`` of each failure and each stamp it
    could not check, and a summary of what it checked ("": there are no stamps)."""

    failures: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[tuple[str, str]] = field(default_factory=list)
    summary: str = ""


@dataclass
class _Seals:
    """The digests one run's seals record: its log's, and its weights stream's by dtype."""

    idx: ControlIndex | None
    log: EventLog | None
    weights: dict[str, dict[int, bytes]] | None = None
    #: The oldest version the weights stream still holds (retention deletes older ones).
    weights_from: int = 0


def check_stamps(address: RunAddress, log: EventLog, idx: ControlIndex) -> StampCheck:
    """Check every stamp the run's versions consumed (see the module docstring)."""
    check = StampCheck()
    try:
        by_version = consumed(log, idx)
    except RewindError as exc:
        check.failures.append(("provenance", f"{type(exc).__name__}: {exc}"))
        return check
    runs: dict[str, _Seals] = {log.run_id: _Seals(idx, log)}
    stamps = 0
    try:
        for version, records in sorted(by_version.items()):
            for stamp, n in stamps_of(records):
                stamps += n
                seals = runs.get(stamp.run) or runs.setdefault(stamp.run, _open(address, stamp.run))
                problem, unchecked = _judge(stamp, version, log.run_id, seals)
                subject = f"provenance of version {version}"
                what = f"stamp ({stamp.run}, {stamp.version}, {stamp.kind} {stamp.digest}) x{n}"
                if problem:
                    check.failures.append((subject, f"{what}: {problem}"))
                elif unchecked:
                    check.warnings.append((subject, f"{what}: cannot be checked: {unchecked}"))
    finally:
        for other, seals in runs.items():
            if other != log.run_id and seals.log is not None:
                seals.log.close()
    if stamps:
        check.summary = (f"{stamps} stamps consumed by {len(by_version)} versions: "
                         f"{len(check.failures)} fail, {len(check.warnings)} cannot be checked")
    return check


def _open(address: RunAddress, run: str) -> _Seals:
    """Another run's seals, on the same backends (``idx`` ``None``: it has none)."""
    other = dataclasses.replace(address, run_id=run, read_only=True)
    try:
        log = other.open_log()
    except RewindError:
        return _Seals(None, None)
    try:
        return _Seals(index_control(log), log)
    except RunNotFoundError:
        return _Seals(None, log)


def _judge(stamp: Stamp, consumer: int, run_id: str, seals: _Seals) -> tuple[str, str]:
    """Why ``stamp`` (consumed by version ``consumer`` of run ``run_id``) fails, or why it
    cannot be checked ("" each: it names a sealed version with its digest)."""
    if seals.idx is None or not seals.idx.seals:
        return f"run {stamp.run!r} has no sealed version", ""
    if stamp.run == run_id and stamp.version >= consumer:
        return f"names version {stamp.version}, not sealed before version {consumer} consumed it", ""
    if stamp.kind == STATE:
        info = seals.idx.seals.get(stamp.version)
        if info is None:
            oldest = min(seals.idx.seals)
            if stamp.version < oldest:
                return "", f"the log of run {stamp.run!r} holds seals from version {oldest} on"
            return f"run {stamp.run!r} has no sealed version {stamp.version}", ""
        recorded = info.seal.state_digest
    else:
        digests = _weights(seals).get(stamp.kind.partition("/")[2], {})
        if stamp.version not in digests:
            if stamp.version < seals.weights_from and stamp.version in seals.idx.seals:
                return "", (f"the weights stream of run {stamp.run!r} holds versions from "
                            f"{seals.weights_from} on")
            return (f"the weights stream of run {stamp.run!r} has no sealed version {stamp.version} "
                    f"in {stamp.kind.partition('/')[2]}"), ""
        recorded = digests[stamp.version]
    if recorded.hex() != stamp.digest:
        return f"the seal of version {stamp.version} records {stamp.kind} digest {recorded.hex()}", ""
    return "", ""


def _weights(seals: _Seals) -> dict[str, dict[int, bytes]]:
    """The run's weights-stream digests by dtype and version (read once)."""
    if seals.weights is None:
        assert seals.log is not None
        seals.weights = {}
        try:
            published = WeightsStream(seals.log).index()
        except RewindError:  # no stream (never published): it holds no version
            return seals.weights
        for v in published:
            seals.weights.setdefault(v.dtype, {})[v.version] = v.digest
        held = [v.version for v in published] or [0]
        # What retention deleted is below the first version the stream holds.
        seals.weights_from = min(held) if seals.log.start_offset(WEIGHTS) > 0 else 0
    return seals.weights
