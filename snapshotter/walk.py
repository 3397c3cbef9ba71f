"""The patrol's fold of each partition over the reachable history, record by record, with
every check a replay makes; after a damaged record, on from the oldest snapshot past it
(see ``snapshotter.verify``)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from eventlog import RewindError
from eventlog.errors import (
    ChunkDigestError,
    CorruptStoreError,
    DecodeError,
    DigestMismatchError,
    GsnOrderError,
    IntegrityError,
)
from eventlog.events import Envelope, OptimizerStep, RunStarted, TensorDelta
from eventlog.fold.apply import APPLIED, Placement, ShardState
from eventlog.fold.engine import (
    ControlIndex,
    FoldStart,
    SmallStates,
    events,
    fold_control,
    stray_version,
    verify_small,
)
from eventlog.ports import CONTROL, EventLog
from eventlog.settings import current
from eventlog.waits import warned_wait
from snapshotter.catalog import Marker, load_start
from snapshotter.records import DamagedRecord, MissingRecordsError, Records
from snapshotter.store import SnapshotStore

_logger = logging.getLogger(__name__)


class Starts:
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
class Walk:
    """What the fold of one partition found."""

    damaged: list[DamagedRecord] = field(default_factory=list)
    #: Versions that no replay reaches because of what this partition holds.
    bad: set[int] = field(default_factory=set)
    #: Events applied, by version: a stretch folded again from a newer start counts once.
    per_version: Counter[int] = field(default_factory=Counter)

    @property
    def applied(self) -> int:
        """The events applied, each once."""
        return sum(self.per_version.values())

    def count(self, applied: Mapping[int, int]) -> None:
        """Take a fold's applied events by version (of a version folded twice, the fuller fold's)."""
        for version, n in applied.items():
            self.per_version[version] = max(self.per_version[version], n)


def base_name(base: Marker | None) -> str:
    """Where the reachable history begins, as a reader says it."""
    return "the start of the log" if base is None else f"snapshot {base.snapshot_id} (version {base.version})"


def walk_control(log: EventLog, idx: ControlIndex, starts: Starts, base: Marker | None) -> Walk:
    """Fold the small states version by version, each checked against its seal (records
    that do not decode were found by ``index_control`` already); after a version whose
    control records cannot be read, on from the oldest snapshot past it."""
    walk = Walk()
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
        walk.count(small.applied_per_version)
        if lost is None:
            return walk
        point = starts.after(CONTROL, lost, idx.seals[lost].offset)
        resume = point.version if point is not None else versions[-1] + 1
        walk.bad.update(v for v in versions if lost <= v < resume)
        if point is None:
            return walk


def _small_at(starts: Starts, point: Marker | None) -> SmallStates:
    """A copy of the small states at a snapshot (the start of the log for ``None``), to fold on."""
    if point is None:
        return SmallStates()
    small = starts.load(point).small
    return SmallStates(dict(small.states), dict(small.kinds), small.applied_gsn,
                       next_offset=small.next_offset)


def _fold_small(log: EventLog, idx: ControlIndex, starts: Starts, version: int, small: SmallStates,
                walk: Walk) -> SmallStates | None:
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
    walk.count(small.applied_per_version)  # what the failed fold applied before it failed
    point = starts.before(version)
    if point is None and not starts.from_log_start:
        return None
    again = _small_at(starts, point)
    try:
        return fold_control(log, idx, version, again, again.folded_to)
    except (CorruptStoreError, DecodeError):
        return None


def walk_shard(log: EventLog, idx: ControlIndex, starts: Starts, base: Marker | None, shard: int,
                checkpoints: list[int]) -> Walk:
    """Fold one shard from ``base`` (``None``: the start of the log) to the newest version;
    after a damaged record, on from the oldest snapshot past it."""
    walk = Walk()
    versions = sorted(idx.seals)
    point: Marker | None = base
    while True:
        if point is None:
            state, gt, since, layout = ShardState(shard), None, 0, None
        else:
            start = starts.load(point)
            state, since, layout = start.shards[shard], point.version, start.layout
            gt = start.next_offsets[shard + 1] - 1
        named = len(walk.damaged)
        broken = _fold(log, idx, state, gt, since, layout, [c for c in checkpoints if c > since], walk,
                       starts)
        walk.count(state.applied_per_version)
        if broken is None:
            return walk
        version, offset = broken
        before = {(d.partition, d.offset) for d in walk.damaged[:named]}
        # Records met again when folding on from a newer start are named once.
        walk.damaged[named:] = [d for d in walk.damaged[named:] if (d.partition, d.offset) not in before]
        retry = starts.before(version)
        if retry is not None and (point is None or retry.version > point.version):
            # A damaged database can answer a replay's read (from the snapshot a replay to
            # ``version`` starts at) where it failed this one: go on from there first.
            point = retry
            continue
        point = starts.after(shard, version, offset)
        resume = point.version if point is not None else versions[-1] + 1
        walk.bad.update(v for v in versions if version <= v < resume)
        if point is None:
            return walk


def _fold(log: EventLog, idx: ControlIndex, state: ShardState, gt: int | None, since: int,
          base_layout: RunStarted | None, checkpoints: list[int],
          walk: Walk, starts: Starts) -> tuple[int, int | None] | None:
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


def _apply_or_leave_to_the_seal(state: ShardState, env: Envelope, sealed: Mapping[int, int], nbytes: int,
                                where: str, placement: Placement) -> RewindError | None:
    """Apply ``env``; returns the failed check that a replay's batched steps skip, if one failed:
    a step's digests of what it predicted, or a gradient chunk's digest (a damaged name or
    digest in the record, damaged bits, or a step that diverged). The residual chunks and the
    seal still check the state, here as there, so the record is applied all the same and the
    fold goes on."""
    try:
        state.apply(env, sealed, nbytes, where, placement=placement)
    except (DigestMismatchError, ChunkDigestError) as exc:
        if not _left_to_the_seal(env):
            raise
        if isinstance(exc, ChunkDigestError):
            state.apply(env, sealed, nbytes, where, placement=placement, chunk_digests=False)
        else:
            _count_applied(state, env, nbytes, where)
        return exc
    return None


def _fold_records(log: EventLog, idx: ControlIndex, state: ShardState, gt: int | None, since: int,
                  base_layout: RunStarted | None, checkpoints: list[int], walk: Walk,
                  steps: list[DamagedRecord], starts: Starts) -> tuple[int, int | None] | None:
    """``_fold``'s walk; each step it names for predicting differently also goes to ``steps``."""
    shard, seals, newest = state.shard, idx.seals, max(idx.seals)
    sealed = {v: s.gsn for v, s in seals.items()}
    records = Records(log, shard, gt)
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
                short = _short_of(state, idx, since, newest)
                damaged(short, offset, exc)
                # A replay stops reading the shard once it has applied every event its
                # seals count: it meets this record only for a version still short here.
                first = newest + 1 if short is None else short
                if not isinstance(exc, MissingRecordsError) and first - 1 > since \
                        and not _replay_reads(log, starts, shard, first - 1, offset):
                    # A damaged database fails some queries and answers others: the replay
                    # to the version before, reading as it does, failed too.
                    first = min(first, records.last_version or since)
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
                failed = _apply_or_leave_to_the_seal(state, env, sealed, nbytes, where, placement)
                if failed is not None:
                    # The steps after it, until a checkpoint's digests match again, ran on the
                    # state it left and differ for that reason alone: only the first is named.
                    if not diverged:
                        steps.append(record(env.version, offset, failed))
                        walk.damaged.append(steps[-1])
                    diverged = True
            except GsnOrderError as exc:  # the event applied last is the damaged one
                damaged(env.version, applied_at, exc)
                return env.version, applied_at
            except RewindError as exc:
                damaged(env.version, offset, exc)
                # Only a replay to a version still short here reads this record (its own
                # version may be damaged).
                short = _short_of(state, idx, since, newest)
                return (newest + 1 if short is None else short), offset
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


def _replay_reads(log: EventLog, starts: Starts, shard: int, version: int, failed: int | None) -> bool:
    """Whether a replay to ``version`` reads the shard's records without an error, reading
    them as it does: from the newest snapshot at or before it (or the log's start) up to the
    record before ``failed``, where it has every event its seals count. Their contents were
    checked already; only the store's answer is."""
    point = starts.before(version)
    if point is None and not starts.from_log_start:
        return False
    gt = None if point is None or point.end is None else point.end.next_offsets[shard + 1] - 1
    try:
        for offset, _, env in events(log, shard, gt=gt, lte=log.end_offset(shard) - 1):
            if env.version > version or (failed is not None and offset + 1 >= failed):
                break
    except RewindError:
        return False
    return True


def _settled(records: Records, settle_s: float) -> bool:
    """Wait up to ``settle_s`` for records the newest seal counts that are not visible yet;
    whether some came."""
    deadline = time.monotonic() + settle_s
    with warned_wait(lambda: f"records of shard {records.partition} that the newest seal counts "
                     f"(up to {settle_s:.0f} s)", _logger):
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
