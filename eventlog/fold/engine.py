"""Folding a run's log into state: the control partition, then each shard, to a target.

The control partition is indexed first (its seals say which versions exist and at which
step), the target is resolved to a version, then every shard is folded from its start
offset up to that version under the exactly-once rule, and verified against the seal.
Shards fold in parallel threads: decompression, XOR and hashing release the GIL.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from eventlog import crypto, serde
from eventlog.digests import small_digest, state_digest
from eventlog.errors import (
    DigestMismatchError,
    IntegrityError,
    RunNotFoundError,
    TargetNotFoundError,
    TruncatedHistoryError,
    WrongRunError,
)
from eventlog.events import SMALL_STATE_TYPES, CommitSealed, Envelope, Metrics, RunStarted
from eventlog.fold.apply import APPLIED, ApplyCounts, Placement, ShardState, classify, verify_shard
from eventlog.fold.gaps import skipped
from eventlog.fold.sharing import WorkBoard, map_shared
from eventlog.layout import intact
from eventlog.ports import CONTROL, EventLog, MessageStream
from eventlog.settings import current
from eventlog.target import LATEST, Target
from eventlog.waits import warned_wait

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SealInfo:
    """Where and what a version's seal is."""

    version: int
    step: int
    gsn: int
    offset: int
    time_ms: int
    writer: str
    seal: CommitSealed


@dataclass
class ControlIndex:
    """What one scan of the control partition learned: layouts, seals, snapshot markers."""

    run_started: list[tuple[int, Envelope]] = field(default_factory=list)  # (offset, event)
    seals: dict[int, SealInfo] = field(default_factory=dict)
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    markers: list[tuple[int, Envelope]] = field(default_factory=list)
    #: v4: environment fingerprints and resume proofs, ``(offset, event)`` in log order.
    environment: list[tuple[int, Envelope]] = field(default_factory=list)
    start_offset: int = 0
    end_offset: int = 0
    #: The highest gsn of any control event: a seal names its version's highest gsn.
    end_gsn: int = 0

    def latest_version(self) -> int:
        """The newest sealed version (0: none)."""
        return max(self.seals, default=0)

    def layout_at(self, version: int, fallback: RunStarted | None = None) -> RunStarted:
        """The run layout in force at ``version`` (``fallback``: the layout a snapshot
        recorded, for logs whose older part was truncated)."""
        chosen = fallback
        for _, env in self.run_started:
            if env.version <= version and isinstance(env.body, RunStarted):
                chosen = env.body
        if chosen is None:
            raise RunNotFoundError("the log has no RunStarted event")
        assert isinstance(chosen, RunStarted)
        return chosen

    def damaged_layout(self, version: int, layout: RunStarted) -> IntegrityError | None:
        """The error for ``layout`` (the one in force at ``version``) if it fails its own
        config digest, naming its record."""
        if intact(layout):
            return None
        at = next((f" (control offset {o})" for o, env in self.run_started if env.body is layout), "")
        return IntegrityError(
            f"the layout in force at version {version}{at} is damaged: its tensors and small "
            f"states do not make its own config digest {layout.config_digest}")

    def resolve(self, target: Target) -> int:
        """The version a target names; a clear error if there is none."""
        if not self.seals:
            raise RunNotFoundError("the run has no sealed version yet")
        infos = sorted(self.seals.values(), key=lambda i: i.version)
        oldest = infos[0]
        if target.kind == "latest":
            return infos[-1].version
        newest = (f"newest: version {infos[-1].version}, step {infos[-1].step}, gsn {infos[-1].gsn}, "
                  f"control offset {infos[-1].offset}")
        if target.kind == "offset" and (target.value or 0) >= self.end_offset:
            raise TargetNotFoundError(f"{target} is past the end of the control partition (its end "
                                      f"offset is {self.end_offset}); {newest}")
        if target.kind == "gsn" and (target.value or 0) > self.end_gsn:
            raise TargetNotFoundError(f"{target} is past the newest gsn the control partition records "
                                      f"({self.end_gsn}); {newest}")
        if target.kind == "version":
            if target.value in self.seals:
                return int(target.value)
            found = None
        else:
            key: Callable[[SealInfo], int] = {
                "step": lambda i: i.step, "gsn": lambda i: i.gsn, "offset": lambda i: i.offset,
            }[target.kind]
            eligible = [i for i in infos if key(i) <= (target.value or 0)]
            found = eligible[-1].version if eligible else None
        if found is not None:
            return found
        reachable = (
            f"oldest reachable: version {oldest.version}, step {oldest.step}, gsn {oldest.gsn},"
            f" control offset {oldest.offset}; newest: version {infos[-1].version}, step {infos[-1].step}"
        )
        if self.start_offset > 0:
            raise TruncatedHistoryError(f"{target} lies in truncated history; {reachable}")
        raise TargetNotFoundError(f"no sealed version at {target}; {reachable}")


def events(
    log: EventLog, partition: int, *, gt: int | None = None, lte: int | None = None,
) -> Iterator[tuple[int, int, Envelope]]:
    """``(offset, message bytes, event)`` of a partition, checking each event's run id."""
    where_p = "control" if partition == CONTROL else f"shard {partition}"

    def decode(stream: MessageStream, size: int, offset: int) -> Envelope:
        where = f"run {log.run_id!r} {where_p} offset {offset}"
        env = serde.decode.from_stream(stream, size, where)
        if env.run_id != log.run_id:
            raise WrongRunError(f"{where}: event belongs to run {env.run_id!r}")
        return crypto.decrypt_event(env, where)

    for rec in log.scan_decoded(partition, decode, gt=gt, lte=lte, batch=log.scan_batch(partition)):
        yield rec.offset, rec.size, rec.value


def index_control(log: EventLog, idx: ControlIndex | None = None) -> ControlIndex:
    """Scan the control partition: seals, layouts, metrics and snapshot markers.

    Given an earlier ``idx``, only the records after its ``end_offset`` are read.
    """
    gt = None if idx is None else idx.end_offset - 1
    idx = idx or ControlIndex()
    idx.start_offset, idx.end_offset = log.start_offset(CONTROL), log.end_offset(CONTROL)
    seen = 0
    for offset, _, env in events(log, CONTROL, gt=gt, lte=idx.end_offset - 1):
        seen += 1
        idx.end_gsn = max(idx.end_gsn, env.gsn)
        body = env.body
        if isinstance(body, RunStarted):
            idx.run_started.append((offset, env))
        elif isinstance(body, CommitSealed):
            if env.version not in idx.seals:  # a duplicate seal is redelivery, not news
                idx.seals[env.version] = SealInfo(
                    env.version, env.step, env.gsn, offset, env.time_ms, env.writer, body
                )
        elif isinstance(body, Metrics):
            idx.metrics.setdefault(env.version, dict(body.values))
        elif env.kind in ("SnapshotBegin", "SnapshotEnd"):
            idx.markers.append((offset, env))
        elif env.kind in ("EnvironmentFingerprint", "Resumed"):
            idx.environment.append((offset, env))
    if not idx.run_started and idx.start_offset == 0 and gt is None:
        if seen == 0 and log.dense_offsets and idx.end_offset > 0:
            # Every offset holds a record there: the read skipped them all.
            raise skipped(log, CONTROL, 0, idx.end_offset)
        if seen == 0:  # nothing committed (aborted transactions may still use offsets)
            raise RunNotFoundError(f"run {log.run_id!r} has no events in {log.url}")
        # Records without a layout is damage, never a fresh run: refuse to start over.
        raise IntegrityError(f"run {log.run_id!r}: the control partition has {seen} records "
                             "but no RunStarted")
    return idx


@dataclass
class SmallStates:
    """Small states (msgpack bytes by name) folded from the control partition."""

    states: dict[str, bytes] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    applied_gsn: int = 0
    counts: ApplyCounts = field(default_factory=ApplyCounts)
    #: The control offset after the last record folded.
    next_offset: int = 0
    #: The events this fold applied, by version.
    applied_per_version: Counter[int] = field(default_factory=Counter)

    @property
    def folded_to(self) -> int | None:
        """The control offset of the last record folded (``None``: none yet), where a fold
        on from here starts after."""
        return self.next_offset - 1 if self.next_offset else None


def fold_control(
    log: EventLog,
    idx: ControlIndex,
    version: int,
    start: SmallStates | None = None,
    gt_offset: int | None = None,
) -> SmallStates:
    """Apply the small-state events of every sealed version up to ``version``."""
    state = start or SmallStates()
    seal_offset = idx.seals[version].offset
    sealed = {v for v in idx.seals if v <= version}
    t0 = time.perf_counter()
    for _, nbytes, env in events(log, CONTROL, gt=gt_offset, lte=seal_offset):
        if not isinstance(env.body, SMALL_STATE_TYPES):
            continue
        outcome = classify(env, state.applied_gsn, 0, sealed)
        if outcome == APPLIED:
            state.states[env.body.name] = env.body.state
            state.kinds[env.body.name] = env.kind
            state.applied_gsn = env.gsn
            state.applied_per_version[env.version] += 1
        state.counts.add(outcome, nbytes)
    state.next_offset = seal_offset + 1
    state.counts.seconds = time.perf_counter() - t0
    return state


def fold_shard(
    log: EventLog,
    state: ShardState,
    idx: ControlIndex,
    version: int,
    gt_offset: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
    settle_s: float | None = None,
    since_version: int = 0,
    defer_steps: bool | None = None,
    grad_digests: bool = True,
    board: WorkBoard | None = None,
    base_layout: RunStarted | None = None,
) -> ShardState:
    """Apply shard ``state.shard``'s events up to ``version``; stops once every event the
    seals of the versions it folds count on this shard is applied, or at the first newer one.

    Partitions of one transaction may become visible a moment apart (each gets its own
    commit marker), so while the target's seal counts more events than were seen, the
    end offset is polled again, until a pass finds nothing new for ``settle_s`` seconds
    (the clock starts when a pass ends short, not when the fold starts: a first pass over
    a big shard may itself take longer than ``settle_s``). Versions up to ``since_version``
    are already in ``state`` (a snapshot, or an earlier fold). With ``defer_steps``,
    consecutive optimizer steps run as one tiled batch (``eventlog.fold.deferred``);
    ``grad_digests=False`` leaves that batch's gradient digests to the seal check, for a
    caller that folds again with them on a mismatch (``replayer.replay``). ``board``: where
    the batch's tiles are posted for other workers of a parallel fold to share.
    ``base_layout``: the layout of the snapshot ``state`` came from (for a log truncated
    past its own layouts); each chunk must name a tensor its version's layout places on
    the shard. ``settle_s`` and ``defer_steps`` default to the settings' (``eventlog.settings``).
    """
    t0 = time.perf_counter()
    settings = current()
    settle_s = settings.settle_s if settle_s is None else settle_s
    defer_steps = settings.replay_defer_steps if defer_steps is None else defer_steps
    state.deferred.check_grads = grad_digests
    state.deferred.board = board
    try:
        try:
            placement = Placement(lambda v: idx.layout_at(v, base_layout), state.shard)
            past = _read_to(log, state, idx, version, gt_offset, on_bytes, settle_s, since_version,
                            defer_steps, placement)
        except IntegrityError as exc:
            # A step without its params, a chunk without its base...: if retention deleted
            # records under this fold, that is the error to report.
            _fail_if_truncated_under(log, state.shard, gt_offset, version, exc)
            raise
        if version > since_version and _short(state, idx, version):
            _fail_if_truncated_under(log, state.shard, gt_offset, version)
            if past is not None and (stray := stray_version(log, idx, state.shard, *past)) is not None:
                raise stray
        state.run_deferred()
    finally:
        state.deferred.check_grads = True  # a later fold of this state checks unless told
        state.deferred.board = None
    state.counts.seconds = time.perf_counter() - t0
    return state


def _read_to(log: EventLog, state: ShardState, idx: ControlIndex, version: int, gt: int | None,
             on_bytes: Callable[[int], None] | None, settle_s: float, since_version: int,
             defer_steps: bool, placement: Placement) -> tuple[int, Envelope] | None:
    """``fold_shard``'s reading: apply the shard's events after offset ``gt`` up to
    ``version``, polling the end offset again while the seal counts more (see there).
    Returns the first event past ``version`` and its offset, where it stopped at one."""
    with contextlib.ExitStack() as short:
        return _read_until(log, state, idx, version, gt, on_bytes, settle_s, since_version,
                           defer_steps, placement, short)


def _read_until(log: EventLog, state: ShardState, idx: ControlIndex, version: int, gt: int | None,
                on_bytes: Callable[[int], None] | None, settle_s: float, since_version: int,
                defer_steps: bool, placement: Placement,
                short: contextlib.ExitStack) -> tuple[int, Envelope] | None:
    """``_read_to``, which enters the warning of a wait for events the seal counts on ``short``."""
    sealed = {v: s.gsn for v, s in idx.seals.items() if v <= version}
    # The events the seals of the versions to fold count on this shard and the fold has not
    # applied: once none is owed, it stops, without reading the record after them (which
    # may be damaged, and belongs to a later version).
    counts = {v: s.seal.shard_counts[state.shard] for v, s in idx.seals.items()
              if since_version < v <= version and state.shard < len(s.seal.shard_counts)}
    owed = sum(max(0, n - state.applied_per_version.get(v, 0)) for v, n in counts.items())
    if version > since_version and owed == 0:
        return None
    deadline: float | None = None
    afresh = False
    while True:
        end = log.end_offset(state.shard) - 1
        done = False
        start_gt = gt
        past = None
        for offset, nbytes, env in events(log, state.shard, gt=gt, lte=end):
            if env.version > version:
                done = True  # one writer per partition: versions never go back after this
                past = offset, env
                break
            if log.dense_offsets and gt is not None and offset != gt + 1:
                error = skipped(log, state.shard, gt + 1, offset)
                raise type(error)(f"shard {state.shard}: the read after offset {gt} returned offset "
                                  f"{offset}: {error}")
            where = f"run {log.run_id!r} shard {state.shard} offset {offset} (version {env.version})"
            outcome = state.apply(env, sealed, nbytes, where, defer=defer_steps, placement=placement)
            state.next_offset = offset + 1
            gt = offset
            if on_bytes is not None:
                on_bytes(nbytes)
            if outcome == APPLIED and state.applied_per_version[env.version] <= counts.get(env.version, 0):
                owed -= 1
                if owed == 0:
                    return None
        if done or version <= since_version or not _short(state, idx, version):
            return past
        now = time.monotonic()
        if deadline is None and not afresh:  # short, the first time: a wait that may be long
            short.enter_context(warned_wait(
                f"events of version {version} that its seal counts on shard {state.shard} of run "
                f"{log.run_id!r} to become readable (read again while they come, given up after "
                f"{settle_s:.0f} s without any)", _log))
        if deadline is None or gt != start_gt:  # short: wait settle_s from the last progress
            deadline = now + settle_s
        elif now > deadline:
            seal = idx.seals[version].seal
            said = (f"run {log.run_id!r} shard {state.shard}: {state.applied_per_version.get(version, 0)} "
                    f"of the {seal.shard_counts[state.shard]} events of version {version} the seal "
                    f"counts were read after {settle_s:.0f} s without progress; the last offset read "
                    f"is {gt}, the end offset {end + 1}{_reads_of(log, state.shard)}")
            if not afresh:
                # Once, before calling records missing: read again with nothing the backend
                # cached about this partition (a positioned reader, a range taken for empty).
                _log.warning("%s; reading the partition again afresh", said)
                log.forget_reads(state.shard)
                afresh, deadline = True, None
                continue
            _log.warning("%s", said)  # the seal check will fail: what the fold saw, for debugging
            return None
        time.sleep(0.02)


def stray_version(log: EventLog, idx: ControlIndex, partition: int, offset: int,
                  env: Envelope) -> IntegrityError | None:
    """Where a fold that came up short stopped at ``env``, the first event past its target:
    an error naming it if its version is none that exists, neither sealed nor the next to
    be (the control records committed since ``idx`` was read are looked at first, for a log
    that is still being written). Its version is damaged then, and the events it cut off
    are the target's."""
    def exists(seals: Mapping[int, SealInfo], newest: int) -> bool:
        return env.version in seals or env.version <= newest + 1

    newest = idx.latest_version()
    if exists(idx.seals, newest):
        return None
    since = ControlIndex(end_offset=idx.end_offset)  # (``idx`` is shared: it is not updated)
    index_control(log, since)
    newest = max(newest, since.latest_version())
    if exists(since.seals, newest):
        return None
    return IntegrityError(
        f"run {log.run_id!r} shard {partition} offset {offset}: the fold stopped at an event of "
        f"version {env.version}, which has no seal and no commit could have written yet (the "
        f"newest version is {newest}): its version is damaged")


def _fail_if_truncated_under(log: EventLog, partition: int, gt_offset: int | None, version: int,
                             cause: BaseException | None = None) -> None:
    """A fold that came up short, on a partition now truncated past where it began: the
    records it lacks were most likely deleted while it read (retention ran meanwhile). Say
    that, instead of leaving the seal check to report "missing records"."""
    start = log.start_offset(partition)
    began = 0 if gt_offset is None else gt_offset + 1
    if start > began:
        raise TruncatedHistoryError(
            f"run {log.run_id!r} shard {partition}: the log was truncated below offset {start} "
            f"while version {version} was being rebuilt from offset {began}; replay again, from "
            "a snapshot at or after the truncation point") from cause


def _reads_of(log: EventLog, partition: int) -> str:
    """``; <what the log's readers hold>`` for a diagnostic, or nothing (never raises: it
    only adds to a warning)."""
    try:
        told = log.describe_reads(partition)
    except Exception as exc:  # noqa: BLE001
        told = f"(the readers could not be described: {exc})"
    return f"; {told}" if told else ""


def _short(state: ShardState, idx: ControlIndex, version: int) -> bool:
    """Whether the target version's seal counts more events on this shard than were applied."""
    info = idx.seals.get(version)
    if info is None or state.shard >= len(info.seal.shard_counts):
        return False
    return state.applied_per_version.get(version, 0) < info.seal.shard_counts[state.shard]


@dataclass
class RebuiltState:
    """A run's state at one version, verified against that version's seal."""

    run_id: str
    version: int
    step: int
    layout: RunStarted
    shards: list[ShardState]
    small: SmallStates
    seal: SealInfo
    counts: ApplyCounts
    per_shard: dict[int, ApplyCounts]
    index: ControlIndex
    #: Where the fold started: a snapshot, or the start of the log.
    source: str = "the start of the log"

    def tensors(self) -> Mapping[str, object]:
        """Every tensor's rebuilt bits by name."""
        return {n: t for s in self.shards for n, t in s.tensors.items()}

    def state_digest(self) -> bytes:
        """The state's digest: that of the shard and small-state digests it was verified
        against (the seal's own copy of it may be damaged where they are not)."""
        seal = self.seal.seal
        return state_digest(seal.shard_digests, seal.small_digest)


def verify_small(small: SmallStates, seal: SealInfo) -> None:
    """Fail unless the folded small states match the seal's digest."""
    got = small_digest(small.states)
    if got != seal.seal.small_digest:
        raise DigestMismatchError(
            f"small states rebuilt to version {seal.version} have digest {got.hex()}, but the "
            f"seal records {seal.seal.small_digest.hex()}"
        )


@dataclass
class FoldStart:
    """State to fold on from, instead of an empty state: a verified snapshot."""

    version: int
    shards: list[ShardState]
    small: SmallStates
    next_offsets: list[int]  # control first, then each shard
    layout: RunStarted
    source: str
    #: The snapshot's id (``None``: a start that is not a published snapshot).
    snapshot_id: str | None = None


def rebuild(
    log: EventLog,
    target: Target = LATEST,
    *,
    workers: int = 2,
    on_bytes: Callable[[int], None] | None = None,
    idx: ControlIndex | None = None,
    start: FoldStart | None = None,
    defer_steps: bool | None = None,
    grad_digests: bool = True,
    share_torch_threads: bool = False,
    shards: Callable[[RunStarted, SmallStates], Collection[int]] | None = None,
) -> RebuiltState:
    """Rebuild and verify the state at ``target``: from ``start`` (a snapshot) or the whole log.

    Shards fold on ``workers`` threads, which share their optimizer tiles and digest
    tensors (``eventlog.fold.sharing``). ``defer_steps``: batch consecutive optimizer steps
    (``None``: ``Settings.replay_defer_steps``);
    ``grad_digests``: check each batched gradient chunk's digest (see ``fold_shard``).
    ``share_torch_threads``: divide torch's intra-op threads among the workers while they
    fold (process-wide, restored after; for a process that owns torch, like the CLI's).
    ``shards``: given the layout and the verified small states, the tensor shards to fold
    and verify (``None``: all); the state then holds only those (one rank's part of a
    multi-rank run, say)."""
    idx = idx or index_control(log)
    version = idx.resolve(target)
    layout = idx.layout_at(version, start.layout if start else None)
    if (damaged := idx.damaged_layout(version, layout)) is not None:
        raise IntegrityError(f"run {log.run_id!r}: {damaged}")
    if start is not None and start.version > version:
        raise TargetNotFoundError(f"{start.source} is newer than the target {target}")
    _check_reachable(log, layout.shard_count, start)
    info = idx.seals[version]
    control_gt = start.next_offsets[0] - 1 if start else None
    small = fold_control(log, idx, version, start.small if start else None, control_gt)
    verify_small(small, info)
    chosen = range(layout.shard_count) if shards is None else sorted(set(shards(layout, small)))
    if any(not 0 <= s < layout.shard_count for s in chosen):
        raise IntegrityError(f"run {log.run_id!r}: asked to fold shards {list(chosen)} of a layout of "
                             f"{layout.shard_count}")
    seals = {v: s.seal for v, s in idx.seals.items()}

    def one(shard: int, board: WorkBoard | None) -> ShardState:
        state = start.shards[shard] if start else ShardState(shard)
        gt = start.next_offsets[shard + 1] - 1 if start else None
        fold_shard(log, state, idx, version, gt_offset=gt, on_bytes=on_bytes,
                   since_version=start.version if start else 0, defer_steps=defer_steps,
                   grad_digests=grad_digests, board=board, base_layout=start.layout if start else None)
        state.conform(layout.tensors)
        verify_shard(state, version, info.seal, layout.tensors, layout.chunk_bytes, seals,
                     start.version if start else 0, board)
        return state

    # Workers share the optimizer steps' tiles and the digests' tensors: one whose shards
    # are done helps the others.
    with _torch_threads_per_worker(workers if share_torch_threads else 1):
        folded = map_shared(workers, chosen, one)
    total = small.counts
    per_shard = {}
    for s in folded:
        per_shard[s.shard] = s.counts
        total = total.merged(s.counts)
    if len(info.seal.shard_counts) != layout.shard_count:
        raise IntegrityError(f"seal of version {version} counts {len(info.seal.shard_counts)} shards")
    return RebuiltState(
        log.run_id, version, info.step, layout, folded, small, info, total, per_shard, idx,
        start.source if start else "the start of the log",
    )


@contextlib.contextmanager
def _torch_threads_per_worker(workers: int) -> Iterator[None]:
    """Share torch's intra-op threads among the workers while they replay optimizer steps:
    each worker's step runs on its own core instead of all of them contending for every
    core (process-wide, so restored on exit; one worker leaves torch alone)."""
    before = torch.get_num_threads()
    share = max(1, before // max(1, workers))
    if workers > 1 and share < before:
        torch.set_num_threads(share)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def _check_reachable(log: EventLog, shards: int, start: FoldStart | None) -> None:
    """Fail clearly when the records a fold needs were truncated away."""
    for p in [CONTROL, *range(shards)]:
        first = log.start_offset(p)
        need = start.next_offsets[p + 1] if start else 0
        if first > need:
            where = start.source if start else "the start of the log"
            raise TruncatedHistoryError(
                f"run {log.run_id!r}: partition {'control' if p == CONTROL else p} was truncated "
                f"below offset {first}, but rebuilding from {where} needs offset {need}"
            )
