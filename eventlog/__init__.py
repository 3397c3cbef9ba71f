"""Rewind's log layer: events, serde, codecs, the EventLog/Coordinator ports, backends, the fold engine.

The errors load with the package (they import nothing); every other name loads from its
module on first use (``eventlog.lazy``), so ``import eventlog`` does not import torch.
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
    from eventlog.backends import RunAddress, list_runs, open_coordinator, open_log
    from eventlog.capture import Stateful
    from eventlog.crypto import AuthenticationError, Keyring
    from eventlog.target import Target
else:
    from eventlog.lazy import lazy_exports

    __getattr__, __dir__ = lazy_exports(globals(), {
        "eventlog.backends": ("RunAddress", "list_runs", "open_coordinator", "open_log"),
        "eventlog.capture": ("Stateful",),
        "eventlog.crypto": ("AuthenticationError", "Keyring"),
        "eventlog.target": ("Target",),
    })
    del lazy_exports

__all__ = [
    "AuthenticationError", "Keyring", "ConfigError", "CoordinationError", "CorruptMessageError",
    "CorruptStoreError", "DecodeError", "DigestMismatchError", "EventLogError", "FencedError",
    "IntegrityError", "RewindError", "RunAddress",
    "RunNotFoundError", "StaleVersionError", "StateMismatchError", "Stateful", "Target",
    "TargetNotFoundError", "TruncatedHistoryError", "UnknownSchemaError", "WrongRunError",
    "list_runs", "open_coordinator", "open_log",
]
