"""Rewind: event-sourced, bit-exact recovery for PyTorch training.

This is the one package users import. ``Recorder`` records a run from the trainer,
restores it from the newest valid snapshot plus the log tail, and takes snapshots while it
runs (``snapshots=every_versions(100)`` or ``Snapshots(...)``); ``Follower`` keeps an actor
at the newest version; ``replay`` / ``export`` rebuild any reachable version; snapshot
policies compose (``every_versions(100) | every_seconds(600)``, ``keep_last(3)``). Every
error a user can act on is a ``RewindError``.
"""

from eventlog import (
    AuthenticationError,
    ConfigError,
    CoordinationError,
    CorruptMessageError,
    CorruptStoreError,
    DecodeError,
    DigestMismatchError,
    EventLogError,
    FencedError,
    IntegrityError,
    Keyring,
    RewindError,
    RunAddress,
    RunNotFoundError,
    StaleVersionError,
    Stateful,
    StateMismatchError,
    Target,
    TargetNotFoundError,
    TruncatedHistoryError,
    UnknownSchemaError,
    WrongRunError,
)
from replayer.export import export
from replayer.follower import Follower, FollowResult
from replayer.replay import ReplayReport, replay, write_checkpoint
from rewind.recorder import CommitResult, Recorder, RestoreResult
from rewind.snapshots import Snapshots
from snapshotter.policies import (
    every_seconds,
    every_versions,
    keep_all,
    keep_best,
    keep_every,
    keep_last,
)

__all__ = [
    "AuthenticationError", "CommitResult", "ConfigError", "CoordinationError",
    "CorruptMessageError", "CorruptStoreError", "DecodeError", "DigestMismatchError",
    "EventLogError", "FencedError", "FollowResult", "Follower", "IntegrityError", "Keyring",
    "Recorder", "ReplayReport", "RestoreResult", "RewindError", "RunAddress",
    "RunNotFoundError", "Snapshots", "StaleVersionError", "StateMismatchError", "Stateful", "Target",
    "TargetNotFoundError", "TruncatedHistoryError", "UnknownSchemaError", "WrongRunError",
    "every_seconds", "every_versions", "export", "keep_all", "keep_best", "keep_every",
    "keep_last", "replay", "write_checkpoint",
]
