"""The snapshotter: follows a run's log, keeps its state folded, and writes snapshots.

It folds sealed versions with the same apply rule and verification as the replayer
(``eventlog.fold.engine``), and writes a snapshot when its trigger says so:
``SnapshotBegin`` in the log, the files (in parallel, atomic, checksummed), the manifest,
then ``SnapshotEnd``. Only the holder of the snapshotter lease writes; its fencing token is
checked again before the manifest and before the end marker, so a fenced snapshotter can
never publish one. After each snapshot, retention deletes old snapshots and the log below
the oldest one kept may be truncated.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from eventlog import (
    ConfigError,
    CoordinationError,
    EventLogError,
    FencedError,
    RewindError,
    RunAddress,
    RunNotFoundError,
    intraop,
)
from eventlog.commit.append import append_control
from eventlog.events import Body, RunStarted, SnapshotBegin, SnapshotEnd
from eventlog.fold.apply import ShardState, verify_shard
from eventlog.fold.engine import (
    ControlIndex,
    FoldStart,
    SmallStates,
    fold_control,
    fold_shard,
    index_control,
    verify_small,
)
from eventlog.ports import CONTROL, LogWriter
from eventlog.waits import IDLE_REPEAT_S, Idle
from schemas import SCHEMA_VERSION
from snapshotter.catalog import encode_layout, markers, newest_valid, try_delete
from snapshotter.policies import (
    Progress,
    Retention,
    SnapshotInfo,
    Trigger,
    every_seconds,
    every_versions,
    keep_last,
)
from snapshotter.store import FORMAT, Manifest, SnapshotStore

_log = logging.getLogger(__name__)

#: After the log or the coordinator was unreachable, snapshots are tried again this much later.
RETRY_AFTER_S = 30.0


def unreachable(exc: BaseException) -> bool:
    """An outage (brokers or Redis down, a request timed out) that a later attempt may not
    meet, as opposed to a failure that would recur (damage, a bad setting)."""
    return type(exc) in (EventLogError, CoordinationError)


@dataclass(frozen=True)
class SnapshotterConfig:
    """How often to snapshot, what to keep, and how much log history to keep."""

    trigger: Trigger = field(default_factory=lambda: every_versions(100) | every_seconds(600))
    retention: Retention = field(default_factory=lambda: keep_last(3))
    #: ``keep-all``, ``since-oldest-snapshot``, or a number of steps of log to keep.
    history: str = "keep-all"
    lease_ttl_s: float = 30.0
    poll_interval_s: float = 0.5
    workers: int = 2

    def __post_init__(self) -> None:
        if self.history not in ("keep-all", "since-oldest-snapshot") and not self.history.isdigit():
            raise ConfigError(f"snapshotter history {self.history!r}: use keep-all, "
                              "since-oldest-snapshot or a number of steps")
        if not (math.isfinite(self.lease_ttl_s) and self.lease_ttl_s > 0):
            raise ConfigError(f"snapshotter lease_ttl_s must be a finite number of seconds > 0, "
                              f"got {self.lease_ttl_s!r}")
        if not (math.isfinite(self.poll_interval_s) and self.poll_interval_s >= 0):
            raise ConfigError(f"snapshotter poll_interval_s must be a finite number of seconds >= 0, "
                              f"got {self.poll_interval_s!r}")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"snapshotter workers must be a whole number >= 1, got {self.workers!r}")


@dataclass(frozen=True)
class SnapshotResult:
    """A snapshot that was published (its end marker is in the log)."""

    snapshot_id: str
    version: int
    step: int
    uri: str
    seconds: float
    deleted: list[str]
    truncated_before: list[int] | None


@dataclass(frozen=True)
class SnapshotSource:
    """The whole state of one sealed version, as a snapshot is written from it: a
    snapshotter's folded state, or the recorder's copy of the version it just committed."""

    version: int
    #: Each shard's tensors, the gsn applied to it and the partition offset after the
    #: version (``Manifest.applied_gsns`` and ``next_offsets``).
    shards: list[ShardState]
    small: SmallStates
    layout: RunStarted


class Snapshotter:
    """Folds one run's log and snapshots it; use ``run()`` as a service or call ``snapshot()``."""

    def __init__(
        self,
        address: RunAddress,
        store: SnapshotStore,
        config: SnapshotterConfig | None = None,
        *,
        holder: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.address, self.store = address, store
        self.config = config or SnapshotterConfig()
        self.holder = holder or f"snapshotter-{uuid.uuid4().hex[:8]}"
        self._clock, self._sleep = clock, sleep
        self._say = on_event or (lambda _m: None)
        self._log = address.open_log()
        self._coord = address.open_coordinator()
        self._lease = f"rewind:{address.run_id}:snapshotter"
        self._token: int | None = None
        self._writer: LogWriter | None = None
        self._idx: ControlIndex | None = None
        self._shards: list[ShardState] = []
        self._small = SmallStates()
        self.version = 0
        self._last_snapshot_version = 0
        self._last_snapshot_time = clock()
        self._start_version = 0
        # The layout a start snapshot recorded (the log may be truncated below it).
        self._base_layout: RunStarted | None = None

    # ------------------------------------------------------------------ lease
    def acquire(self) -> int:
        """Take (or renew) the snapshotter lease; raises ``FencedError`` if another holds it."""
        token = self._coord.acquire_lease(self._lease, self.holder, self.config.lease_ttl_s)
        if token is None:
            self._token = None
            raise FencedError(f"snapshotter {self.holder} of run {self.address.run_id!r} does not "
                              f"hold the lease: {self._held_by()}; stopping")
        self._token = token
        return token

    def _held_by(self) -> str:
        """Who holds the lease, with its fencing token and when it expires unless renewed."""
        token = self._coord.lease_token(self._lease)
        held = self._coord.lease_holder(self._lease)
        if held is None:
            return f"fencing token {token} belongs to another snapshotter"
        holder, left = held
        return f"{holder} holds it (fencing token {token}) until {_wall(left)} unless it renews it"

    def take_lease(self, stop: threading.Event | None = None) -> bool:
        """Take the lease, first waiting out a holder that does not renew it (one that was
        killed); raises ``FencedError`` if the holder renewed it meanwhile (it is running).
        False if ``stop`` was set while waiting."""
        stop = stop or threading.Event()
        waited = False
        while not stop.is_set():
            try:
                self.acquire()
            except FencedError:
                held = None if waited else self._coord.lease_holder(self._lease)
                if held is None:
                    if waited:
                        raise
                    continue  # freed since
                holder, left = held
                _log.warning("snapshotter %s: waiting for the lease of run %r held by %s to expire "
                             "at %s (%.0f s): a snapshotter that was killed cannot renew it; one "
                             "that is running does, and then this one stops", self.holder,
                             self.address.run_id, holder, _wall(left), left)
                stop.wait(left + 0.1)
                waited = True
                continue
            if waited:
                self._say(f"snapshotter {self.holder} took over the lease of run {self.address.run_id!r}")
            return True
        return False

    def _check_lease(self) -> None:
        """Renew the lease in the middle of a snapshot; ``FencedError`` if it was lost (the
        fencing token changed), which gives the snapshot up."""
        token = self._token
        current = self._coord.acquire_lease(self._lease, self.holder, self.config.lease_ttl_s)
        if token is None or current != token:
            self._token = current
            raise FencedError(
                f"snapshotter {self.holder} of run {self.address.run_id!r} lost the lease during "
                f"its snapshot (fencing token {token} is no longer current: "
                f"{'it holds token ' + str(current) + ' now' if current else self._held_by()})"
            )

    @contextlib.contextmanager
    def _renewing(self) -> Iterator[None]:
        """Renew the lease every third of its time to live while the block runs, from a
        thread with a coordinator of its own: a snapshot's setup or its writes may outlast
        the lease when the log is slow (brokers down), and a lease lost midway would give up
        a snapshot whose begin marker is already in the log."""
        done = threading.Event()

        def renew() -> None:
            try:
                coord = self.address.open_coordinator()
            except RewindError as exc:
                _log.info("snapshotter %s cannot renew its lease meanwhile: %s", self.holder, exc)
                return
            try:
                while not done.wait(self.config.lease_ttl_s / 3):
                    try:
                        coord.acquire_lease(self._lease, self.holder, self.config.lease_ttl_s)
                    except RewindError as exc:  # the check before the end marker decides
                        _log.info("snapshotter %s could not renew its lease: %s", self.holder, exc)
            finally:
                coord.close()

        thread = threading.Thread(target=renew, name="rewind-lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    # ------------------------------------------------------------------ folding
    def catch_up(self) -> int:
        """Fold every newly sealed version; returns how many were folded."""
        if self._idx is None:
            try:
                self._idx = index_control(self._log)
            except RunNotFoundError:
                return 0  # nothing sealed yet: look again on the next poll
            self._start_from_snapshot()
        else:
            index_control(self._log, self._idx)
        target = self._idx.latest_version()
        if target <= self.version:
            return 0
        layout = self._idx.layout_at(target, self._base_layout)
        fold_control(self._log, self._idx, target, self._small, self._small.next_offset - 1
                     if self._small.next_offset else None)
        verify_small(self._small, self._idx.seals[target])
        while len(self._shards) < layout.shard_count:
            self._shards.append(ShardState(len(self._shards)))
        seals = {v: s.seal for v, s in self._idx.seals.items()}
        for state in self._shards:
            fold_shard(self._log, state, self._idx, target,
                       gt_offset=state.next_offset - 1 if state.next_offset else None,
                       since_version=self.version)
            state.conform(layout.tensors)
            verify_shard(state, target, self._idx.seals[target].seal, layout.tensors,
                         layout.chunk_bytes, seals, self.version)
        folded, self.version = target - self.version, target
        return folded

    def _start_from_snapshot(self) -> None:
        assert self._idx is not None
        if not self._idx.seals:
            raise RunNotFoundError(f"run {self.address.run_id!r} has no sealed version yet")
        start, passed = newest_valid(self.store, self._log, self._idx,
                                     self._idx.latest_version(), workers=self.config.workers)
        for sid, why in passed:
            self._say(f"skipping snapshot {sid}: {why}")
        if start is not None:
            self._load(start)

    def _load(self, start: FoldStart) -> None:
        self._shards, self._small, self._base_layout = start.shards, start.small, start.layout
        self.version = self._last_snapshot_version = self._start_version = start.version

    # ------------------------------------------------------------------ snapshots
    def due(self) -> bool:
        """Whether the trigger asks for a snapshot now."""
        return self.config.trigger(Progress(self.version - self._last_snapshot_version,
                                            self._clock() - self._last_snapshot_time))

    def snapshot(self, *, force: bool = False) -> SnapshotResult | None:
        """Catch up, then write a snapshot if due (or ``force``); ``None`` if nothing to do."""
        t0 = time.perf_counter()
        self.catch_up()
        if self.version == 0 or self.version == self._last_snapshot_version or not (force or self.due()):
            return None
        assert self._idx is not None
        return self.publish(SnapshotSource(self.version, self._shards, self._small,
                                           self._idx.layout_at(self.version, self._base_layout)), t0)

    def follow(self, version: int) -> bool:
        """Index the control partition up to sealed ``version`` without folding any state (a
        caller that holds the state itself, ``CommittedSnapshots``); False while the log does
        not show that version yet. On the first call, the newest published snapshot is
        where the trigger counts from."""
        if self._idx is None:
            try:
                self._idx = index_control(self._log)
            except RunNotFoundError:
                return False
            published = [m.version for m in markers(self._idx).values() if m.end is not None]
            self._last_snapshot_version = max(published, default=0)
        else:
            index_control(self._log, self._idx)
        if version not in self._idx.seals:
            return False
        self.version = version
        return True

    def publish(self, source: SnapshotSource, t0: float | None = None) -> SnapshotResult:
        """Write ``source`` (the whole state of a sealed version this snapshotter has indexed)
        as a snapshot and publish it: the setup (the lease, the writer of the markers), then
        ``SnapshotBegin``, the files, the manifest, the lease checked again, ``SnapshotEnd``,
        the catalog; then retention. A snapshot given up in its setup leaves nothing in the
        log; one given up after its begin marker (the lease lost) says so as a warning."""
        t0 = time.perf_counter() if t0 is None else t0
        assert self._idx is not None
        self.acquire()
        with self._renewing():
            self._open_writer()
            # Renewed (or found lost) after the setup, however long it took.
            token = self.acquire()
            sid = f"v{source.version:010d}-t{token}-{uuid.uuid4().hex[:6]}"
            try:
                return self._publish(source, sid, token, t0)
            except FencedError as exc:
                _log.warning("snapshot %s of run %r (version %d) given up: %s", sid,
                             self.address.run_id, source.version, exc)
                raise

    def _publish(self, source: SnapshotSource, sid: str, token: int, t0: float) -> SnapshotResult:
        assert self._idx is not None
        version = source.version
        info = self._idx.seals[version]
        layout = source.layout
        watermark = max([source.small.applied_gsn, *(s.applied_gsn for s in source.shards)])
        self._append(SnapshotBegin(sid, watermark, token), info.version, info.step)
        next_offsets = [source.small.next_offset, *(s.next_offset for s in source.shards)]
        applied = [source.small.applied_gsn, *(s.applied_gsn for s in source.shards)]
        manifest = Manifest(
            format=FORMAT, run_id=self.address.run_id, snapshot_id=sid,
            schema_version=SCHEMA_VERSION, config_digest=layout.config_digest,
            version=version, step=info.step, state_digest=info.seal.state_digest.hex(),
            shard_digests=[d.hex() for d in info.seal.shard_digests],
            small_digest=info.seal.small_digest.hex(), shard_count=layout.shard_count,
            applied_gsns=applied, next_offsets=next_offsets, files=[],
            created_ms=int(time.time() * 1000), fencing_token=token,
            layout=encode_layout(layout, self.address.run_id),
            metrics=dict(self._idx.metrics.get(version, {})),
        )
        uri, digest = self.store.write(manifest, source.shards, source.small,
                                       workers=self.config.workers, before_manifest=self._check_lease)
        self._check_lease()
        self._append(SnapshotEnd(sid, tuple(next_offsets), tuple(applied), digest, uri, token),
                     info.version, info.step)
        self._coord.catalog_put(self.address.run_id, sid, {
            "version": version, "step": info.step, "uri": uri,
            "metrics": manifest.metrics})
        self._last_snapshot_version, self._last_snapshot_time = version, self._clock()
        self._say(f"snapshot {sid} of version {version} (step {info.step}) published")
        deleted, truncated = self._retain()
        return SnapshotResult(sid, version, info.step, uri, time.perf_counter() - t0,
                              deleted, truncated)

    def _open_writer(self) -> None:
        """The writer of the snapshot markers, opened before any marker is written: opening
        one is what meets a log outage first (a Kafka writer's ``init_transactions``, which
        warns while it waits)."""
        if self._writer is None:
            self._writer = self._log.writer(f"{self.address.run_id}.snapshotter")

    def _append(self, body: Body, version: int, step: int) -> None:
        assert self._writer is not None, "publish opens the writer first"
        append_control(self._writer, self._coord, self.address.run_id, self.holder, version, step, [body])

    # ------------------------------------------------------------------ retention
    def retain(self) -> tuple[list[str], list[int] | None]:
        """Apply retention and the history policy now, as a published snapshot does (after
        ``snapshot`` found nothing new to write, for a caller that asked for them): the
        snapshot ids deleted, and the offsets the log was truncated before (``None``: not)."""
        if self._idx is None:
            return [], None
        return self._retain()

    def _retain(self) -> tuple[list[str], list[int] | None]:
        """Apply retention to the published snapshots, then the history policy to the log."""
        assert self._idx is not None
        index_control(self._log, self._idx)
        catalog = self._coord.catalog(self.address.run_id)
        published = [m for m in markers(self._idx).values() if m.end is not None
                     and self.store.directory(self.address.run_id, m.snapshot_id).exists()]
        infos = [SnapshotInfo(m.snapshot_id, m.version, m.step,
                              dict(catalog.get(m.snapshot_id, {}).get("metrics")
                                   or self._idx.metrics.get(m.version, {})))
                 for m in published]
        keep = self.config.retention.keep(infos)
        deleted = []
        for m in published:
            if m.snapshot_id not in keep and try_delete(self.store, self.address.run_id, m.snapshot_id):
                self._coord.catalog_delete(self.address.run_id, m.snapshot_id)
                deleted.append(m.snapshot_id)
                self._say(f"retention {self.config.retention} deleted snapshot {m.snapshot_id} "
                          f"(version {m.version}, step {m.step})")
        kept = [m for m in published if m.snapshot_id not in deleted]
        return deleted, self._truncate(kept)

    def _truncate(self, kept: list) -> list[int] | None:  # type: ignore[type-arg]
        history = self.config.history
        if history == "keep-all" or not kept:
            return None
        if history == "since-oldest-snapshot":
            base = min(kept, key=lambda m: m.version)
        else:
            newest_step = self._idx.seals[self.version].step if self._idx else 0
            eligible = [m for m in kept if m.step <= newest_step - int(history)]
            if not eligible:
                return None
            base = max(eligible, key=lambda m: m.version)
        offsets = list(base.end.next_offsets)
        # Keep the base snapshot's own seal on control, so its version stays addressable.
        offsets[0] = max(0, offsets[0] - 1)
        for p, off in zip([CONTROL, *range(len(offsets) - 1)], offsets, strict=True):
            if off > self._log.start_offset(p):
                self._log.truncate_before(p, off)
        self._say(f"log truncated below snapshot {base.snapshot_id}")
        return offsets

    # ------------------------------------------------------------------ service loop
    def run(self, stop: threading.Event | None = None, *, max_snapshots: int | None = None) -> int:
        """Follow the log until ``stop`` is set (or ``max_snapshots`` were written). First it
        takes the lease (``take_lease``); while no snapshot is due it says what it waits for,
        once, then as a warning past ``WARN_AFTER_S`` of idleness and every ``IDLE_REPEAT_S``."""
        stop = stop or threading.Event()
        written = 0
        if not self.take_lease(stop):
            return written
        seen: int | None = None
        with Idle(self._waiting_for, _log, every_s=IDLE_REPEAT_S) as idle:
            while not stop.is_set():
                result = self.snapshot()
                if result is not None:
                    idle.progress()
                    seen = None
                    written += 1
                    if max_snapshots is not None and written >= max_snapshots:
                        break
                else:
                    self.acquire()  # keeps the lease alive between snapshots
                    if self.version != seen:  # the first look, or a new version: idle anew
                        idle.progress()
                        if seen is None and not written:
                            self._say(f"snapshotter {self.holder}: waiting for {self._waiting_for()}")
                        seen = self.version
                    idle.waiting()
                stop.wait(self.config.poll_interval_s)
        return written

    def _waiting_for(self) -> str:
        """What an idle service waits for: the trigger's condition, and where the run is."""
        progress = Progress(self.version - self._last_snapshot_version,
                            self._clock() - self._last_snapshot_time, self.version)
        last = self._last_snapshot_version
        return (f"{self.config.trigger.waits_for(progress)} to snapshot run {self.address.run_id!r} "
                f"(its newest version is {self.version}; "
                f"{f'last snapshot: version {last}' if last else 'no snapshot yet'})")

    def after_outage(self) -> None:
        """Drop the control writer after a failed attempt: its producer may be in a fatal
        state, and the next snapshot opens a new one (which fences the old)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception as exc:  # noqa: BLE001 - a broken producer may fail to close too
                _log.info("closing the snapshotter's writer: %s", exc)

    def release(self) -> None:
        """Give the lease up and close connections."""
        try:
            self._coord.release_lease(self._lease, self.holder)
        finally:
            if self._writer is not None:
                self._writer.close()
            self._log.close()
            self._coord.close()

    def __enter__(self) -> Snapshotter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class SnapshotterThread:
    """A snapshotter serving one run from a daemon thread of the trainer's own process.

    While another snapshotter holds the run's lease it stands by, and takes over once that
    lease is free. An outage of the log or the coordinator is logged and the snapshot tried
    again ``RETRY_AFTER_S`` later; any other failure stops it, is logged, and is kept in
    ``error``: the log still holds every version, so a missed snapshot only lengthens the
    next restore's tail.
    """

    def __init__(self, snapshotter: Snapshotter) -> None:
        self.snapshotter = snapshotter
        #: The failure that stopped it, if any.
        self.error: Exception | None = None
        #: Snapshots it published, and the newest of them.
        self.published = 0
        self.newest: SnapshotResult | None = None
        self._stop = threading.Event()
        self._final = True
        self._thread = threading.Thread(target=self._serve, name="rewind-snapshotter", daemon=True)

    def start(self) -> None:
        """Start following the log."""
        self._thread.start()

    def stop(self, *, final: bool = True) -> None:
        """Stop, first taking the snapshot that is due if ``final``; releases the lease."""
        self._final = final
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _serve(self) -> None:
        intraop.serial_torch()
        snap = self.snapshotter
        try:
            while not self._stop.is_set():
                self._turn()
                self._stop.wait(snap.config.poll_interval_s)
            if self._final:
                self._turn()
        except Exception as exc:  # noqa: BLE001 - training goes on without snapshots
            self.error = exc
            _log.warning("snapshotter of run %r stopped (%s: %s); restores replay a longer tail "
                         "of the log until a snapshotter runs again", snap.address.run_id,
                         type(exc).__name__, exc)
        finally:
            snap.release()

    def _turn(self) -> None:
        """Renew the lease and write a snapshot if one is due."""
        snap = self.snapshotter
        try:
            snap.acquire()
            result = snap.snapshot()
        except FencedError as exc:
            # Another snapshotter serves the run: look again once its lease could have expired.
            _log.info("%s", exc)
            self._stop.wait(snap.config.lease_ttl_s)
            return
        except Exception as exc:
            if not unreachable(exc):
                raise
            _paused(snap, exc)
            self._stop.wait(RETRY_AFTER_S)
            return
        if result is not None:
            self.published += 1
            self.newest = result


class CommittedSnapshots:
    """Snapshots that a recorder writes itself, each from the version it has just committed.

    The recorder keeps every committed version's bits as the base of its next commit; a
    snapshot is written from those very buffers (``SnapshotSource``), streamed into the shard
    files, while no commit replaces them. So it costs the trainer no fold and no copy of the
    state, only the time to write the files. Like ``SnapshotterThread``, it stands by while
    another snapshotter holds the run's lease, retries after an outage, and any other failure
    stops it, is logged and kept in ``error``: the log still holds every version.
    """

    def __init__(self, snapshotter: Snapshotter) -> None:
        self.snapshotter = snapshotter
        #: The failure that stopped it, if any.
        self.error: Exception | None = None
        #: Snapshots it published, and the newest of them.
        self.published = 0
        self.newest: SnapshotResult | None = None
        self._standby_until = -math.inf
        self._renewed = -math.inf

    def offer(self, version: int, source: Callable[[int], SnapshotSource]) -> SnapshotResult | None:
        """Sealed ``version`` is committed: write its snapshot if the trigger asks for one,
        from ``source(control offset after the version's seal)``. The caller keeps the
        source's buffers unchanged until this returns."""
        snap = self.snapshotter
        if self.error is not None or snap._clock() < self._standby_until:
            return None
        try:
            if not snap.follow(version) or version == snap._last_snapshot_version:
                return None
            if not snap.due():
                # Renewed between snapshots too, so another snapshotter stands by meanwhile.
                if snap._clock() - self._renewed > snap.config.lease_ttl_s / 3:
                    snap.acquire()
                    self._renewed = snap._clock()
                return None
            assert snap._idx is not None
            result = snap.publish(source(snap._idx.seals[version].offset + 1))
        except FencedError as exc:
            # Another snapshotter serves the run: try again once its lease could have expired.
            _log.info("%s", exc)
            self._standby_until = snap._clock() + snap.config.lease_ttl_s
            return None
        except Exception as exc:  # noqa: BLE001 - training goes on without snapshots
            if unreachable(exc):
                _paused(snap, exc)
                self._standby_until = snap._clock() + RETRY_AFTER_S
                return None
            self.error = exc
            _log.warning("snapshots of run %r stopped (%s: %s); restores replay a longer tail "
                         "of the log until a snapshotter runs again", snap.address.run_id,
                         type(exc).__name__, exc)
            return None
        self._renewed = snap._clock()
        self.published += 1
        self.newest = result
        return result

    def close(self) -> None:
        """Give the lease up and close connections."""
        self.snapshotter.release()


def _wall(seconds_from_now: float) -> str:
    """The UTC wall-clock time ``seconds_from_now``, as ``HH:MM:SS UTC``."""
    return time.strftime("%H:%M:%S UTC", time.gmtime(time.time() + seconds_from_now))


def _paused(snap: Snapshotter, exc: BaseException) -> None:
    """Log a snapshot attempt that met an outage, and get ready to try again."""
    _log.warning("snapshot of run %r not written (%s: %s); trying again in %.0f s, the log "
                 "still holds every version", snap.address.run_id, type(exc).__name__, exc,
                 RETRY_AFTER_S)
    snap.after_outage()
