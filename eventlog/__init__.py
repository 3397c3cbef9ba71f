"""Rewind's log layer: events, serde, codecs, the EventLog/Coordinator ports, backends, the fold engine."""

from eventlog.backends import RunAddress, list_runs, open_coordinator, open_log
from eventlog.capture import Stateful
from eventlog.crypto import AuthenticationError, Keyring
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
from eventlog.fold.engine import Target

__all__ = [
    "AuthenticationError", "Keyring", "ConfigError", "CoordinationError", "CorruptMessageError",
    "CorruptStoreError", "DecodeError", "DigestMismatchError", "EventLogError", "FencedError",
    "IntegrityError", "RewindError", "RunAddress",
    "RunNotFoundError", "StaleVersionError", "StateMismatchError", "Stateful", "Target",
    "TargetNotFoundError", "TruncatedHistoryError", "UnknownSchemaError", "WrongRunError",
    "list_runs", "open_coordinator", "open_log",
]
