"""Rewind's log layer: events, codecs, the EventLog/Coordinator ports and backends, trainer hooks."""

from .backends import RunAddress, list_runs, open_coordinator, open_log
from .capture import Stateful
from .crypto import AuthenticationError, Keyring
from .errors import (
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
from .fold import Target
from .recorder import CommitResult, Recorder, RestoreResult

__all__ = [
    "AuthenticationError", "Keyring", "CommitResult", "ConfigError", "CoordinationError", "CorruptMessageError",
    "CorruptStoreError", "DecodeError", "DigestMismatchError", "EventLogError", "FencedError",
    "IntegrityError", "Recorder", "RestoreResult", "RewindError", "RunAddress",
    "RunNotFoundError", "StaleVersionError", "StateMismatchError", "Stateful", "Target",
    "TargetNotFoundError", "TruncatedHistoryError", "UnknownSchemaError", "WrongRunError",
    "list_runs", "open_coordinator", "open_log",
]
