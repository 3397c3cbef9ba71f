"""Snapshots of a recorded run, taken from inside the trainer: ``Recorder(..., snapshots=...)``.

Whenever the trigger fires, the recorder's committer writes a snapshot of the version it has
just committed, from its own copy of that version (the base of its next commit): no fold
and no extra copy of the state in the trainer (``snapshotter.service.CommittedSnapshots``).
A multi-rank recorder holds only its own part of the state: rank 0 runs a snapshotter that
folds the log in a thread instead. A restore then starts from the newest valid snapshot and
replays only the versions after it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from eventlog.backends import RunAddress, check_log_url
from eventlog.embedded import path_from_url
from eventlog.errors import ConfigError
from snapshotter.policies import Retention, Trigger, every_seconds, every_versions, keep_last
from snapshotter.service import CommittedSnapshots, Snapshotter, SnapshotterConfig, SnapshotterThread
from snapshotter.store import SnapshotStore


@dataclass(frozen=True)
class Snapshots:
    """When a recorded run takes snapshots, which ones it keeps, and where they live.

    ``trigger``: when to take one (``every_versions(100) | every_seconds(600)``).
    ``keep``: retention after each snapshot; the newest is always kept.
    ``truncate``: also delete the log below the oldest snapshot kept (older versions can then
    no longer be replayed). ``store``: ``file://DIR``; by default the run address's
    ``snapshots_url``, else ``snapshots/`` beside an embedded run's database. A Kafka run
    must name one (here or in ``RunAddress.snapshots_url``); readers find it in the log.
    """

    trigger: Trigger = field(default_factory=lambda: every_versions(100) | every_seconds(600))
    keep: Retention = field(default_factory=lambda: keep_last(3))
    truncate: bool = False
    store: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.trigger, Trigger):
            raise ConfigError(f"Snapshots trigger {self.trigger!r} is not a trigger "
                              "(every_versions(n), every_seconds(s), or a composition)")
        if not isinstance(self.keep, Retention):
            raise ConfigError(f"Snapshots keep {self.keep!r} is not a retention rule "
                              "(keep_last(n), keep_best(k, metric), keep_every(steps), keep_all())")
        if self.store is not None:
            SnapshotStore(self.store)  # a bad URL fails here, not in the snapshotter's thread

    @classmethod
    def of(cls, value: Snapshots | Trigger) -> Snapshots:
        """``value`` as a ``Snapshots`` (a bare trigger keeps the default retention)."""
        if isinstance(value, Snapshots):
            return value
        if isinstance(value, Trigger):
            return cls(value)
        raise ConfigError(f"snapshots={value!r}: pass a trigger such as every_versions(100), "
                          "or Snapshots(trigger, keep=..., truncate=..., store=...)")

    def store_url(self, address: RunAddress) -> str:
        """Where the run's snapshots go: ``store``, the address's, or the embedded default."""
        url = self.store or address.snapshots_url
        if url:
            return SnapshotStore(url).url
        check_log_url(address.log_url)  # a mistyped URL is named as that, not as a missing store
        if address.log_url.startswith("sqlite://"):
            return SnapshotStore(path_from_url(address.log_url).resolve().parent / "snapshots").url
        raise ConfigError(
            f"run {address.run_id!r} logs to {address.log_url.partition('?')[0]}: its snapshots "
            "need a store: Snapshots(store='file://DIR'), RunAddress(..., snapshots_url=...) or "
            "REWIND_SNAPSHOTS"
        )

    def start(self, address: RunAddress, holder: str) -> SnapshotterThread:
        """Start a snapshotter for ``address`` (with its store set) in a thread of this process;
        it folds the log (a multi-rank run, whose ranks each hold a part of the state).

        ``holder`` names its lease: a restarted trainer with the same name takes the lease of
        its killed predecessor back at once, instead of waiting for it to expire."""
        thread = SnapshotterThread(self._snapshotter(address, holder))
        thread.start()
        return thread

    def committed(self, address: RunAddress, holder: str) -> CommittedSnapshots:
        """Snapshots a recorder for ``address`` (with its store set) writes from the versions
        it commits (``holder``: as for ``start``)."""
        return CommittedSnapshots(self._snapshotter(address, holder))

    def _snapshotter(self, address: RunAddress, holder: str) -> Snapshotter:
        assert address.snapshots_url, "store_url() sets the address's store first"
        config = SnapshotterConfig(
            trigger=self.trigger, retention=self.keep,
            history="since-oldest-snapshot" if self.truncate else "keep-all")
        return Snapshotter(address, SnapshotStore(address.snapshots_url), config, holder=holder)


def with_store(address: RunAddress, snapshots: Snapshots) -> RunAddress:
    """``address`` with the store ``snapshots`` write to."""
    return dataclasses.replace(address, snapshots_url=snapshots.store_url(address))
