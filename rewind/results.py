"""What the recorder reports: a committed version (``CommitResult``) and a restore
(``RestoreResult``); a module of its own, so that the multi-rank commit returns the same
result without importing the recorder."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommitResult:
    """A version that is durable in the log."""

    version: int
    step: int
    events: int
    raw_bytes: int
    encoded_bytes: int
    seconds: float
    #: The codec of the version, and why (``CommitSealed.encoding``).
    encoding: str = ""
    #: Bytes of residual (predictive) or delta chunks, without gradients.
    residual_bytes: int = 0
    #: Seconds the committer spent encoding (predicting, compressing, hashing), not writing.
    encode_seconds: float = 0.0


@dataclass(frozen=True)
class RestoreResult:
    """What ``restore()`` found: the step to resume after, or a fresh run."""

    #: The step of the restored version (``None``: a fresh run, nothing restored).
    step: int | None
    version: int
    #: Events applied from the log, and events skipped (already in the snapshot, duplicates,
    #: or of versions never sealed).
    applied: int = 0
    skipped: int = 0
    seconds: float = 0.0
    #: Where the fold started, in words.
    source: str = ""
    #: The id of the snapshot the restore started from (``None``: the start of the log).
    snapshot: str | None = None
    snapshot_version: int = 0
    #: Versions replayed from the log after the snapshot (or from the start of the log).
    tail: int = 0
    #: Newer snapshots that were passed over, and why: ``((snapshot id, reason), ...)``.
    passed_over: tuple[tuple[str, str], ...] = ()
    #: The restored version's state digest (hex), as its seal records it.
    state_digest: str = ""

    @property
    def fresh(self) -> bool:
        """True when the log held no version and nothing was restored."""
        return self.step is None

    def __str__(self) -> str:
        if self.fresh:
            return "fresh run: nothing to restore"
        return (f"restored version {self.version} (step {self.step}) from {self.source} + "
                f"{self.tail} versions of log tail in {self.seconds:.2f}s")
