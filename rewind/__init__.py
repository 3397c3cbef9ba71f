"""Rewind: event-sourced, bit-exact recovery for PyTorch training.

This is the one package users import. ``Recorder`` records a run from the trainer,
restores it from the newest valid snapshot plus the log tail, and takes snapshots while it
runs (``snapshots=every_versions(100)`` or ``Snapshots(...)``); ``Follower`` keeps an actor
at the newest version; ``replay`` / ``export`` rebuild any reachable version; snapshot
policies compose (``every_versions(100) | every_seconds(600)``, ``keep_last(3)``). Every
error a user can act on is a ``RewindError``.

The errors load with the package; every other name loads from its module on first use
(``eventlog.lazy``), so ``import rewind`` (and the ``rewind`` CLI's ``--help``) imports no torch.
"""

from typing import TYPE_CHECKING

from eventlog.errors import (
    ConfigError,
    CoordinationError,
    CorruptMessageError,
    CorruptStoreError,
    DecodeError,
    DigestMismatchError,
    EventLogError,
    FencedError,
    IntegrityError,
    RewindError,
    RunNotFoundError,
    StaleVersionError,
    StateMismatchError,
    TargetNotFoundError,
    TruncatedHistoryError,
    UnknownSchemaError,
    WrongRunError,
)

if TYPE_CHECKING:
    from eventlog import AuthenticationError, Keyring, RunAddress, Stateful, Target
    from eventlog.provenance import Stamp
    from eventlog.weightcodec import WeightsConfig
    from replayer.export import export
    from replayer.follower import Follower, FollowResult
    from replayer.publisher import Publisher
    from replayer.replay import ReplayReport, read_checkpoint, replay, write_checkpoint
    from replayer.weights_follower import WeightsFollower
    from rewind.recorder import Recorder
    from rewind.results import CommitResult, RestoreResult
    from rewind.snapshots import Snapshots
    from snapshotter.policies import (
        every_seconds,
        every_versions,
        keep_all,
        keep_best,
        keep_every,
        keep_last,
    )
else:
    from eventlog.lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(globals(), {
        "eventlog": ("AuthenticationError", "Keyring", "RunAddress", "Stateful", "Target"),
        "eventlog.provenance": ("Stamp",),
        "eventlog.weightcodec": ("WeightsConfig",),
        "replayer.export": ("export",),
        "replayer.follower": ("Follower", "FollowResult"),
        "replayer.publisher": ("Publisher",),
        "replayer.weights_follower": ("WeightsFollower",),
        "replayer.replay": ("ReplayReport", "read_checkpoint", "replay", "write_checkpoint"),
        "rewind.recorder": ("Recorder",),
        "rewind.results": ("CommitResult", "RestoreResult"),
        "rewind.snapshots": ("Snapshots",),
        "snapshotter.policies": (
            "every_seconds", "every_versions", "keep_all", "keep_best", "keep_every", "keep_last"),
    })
    del lazy_exports

__all__ = [
    "AuthenticationError", "CommitResult", "ConfigError", "CoordinationError",
    "CorruptMessageError", "CorruptStoreError", "DecodeError", "DigestMismatchError",
    "EventLogError", "FencedError", "FollowResult", "Follower", "IntegrityError", "Keyring",
    "Publisher", "Recorder", "ReplayReport", "RestoreResult", "RewindError", "RunAddress",
    "RunNotFoundError", "Snapshots", "Stamp", "StaleVersionError", "StateMismatchError", "Stateful", "Target",
    "TargetNotFoundError", "TruncatedHistoryError", "UnknownSchemaError", "WeightsConfig",
    "WeightsFollower", "WrongRunError",
    "every_seconds", "every_versions", "export", "keep_all", "keep_best", "keep_every",
    "keep_last", "read_checkpoint", "replay", "write_checkpoint",
]
