"""A commit as the training thread hands it to the committer: the state copied out, queued."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from eventlog.events import EnvironmentFingerprint
from eventlog.optimstep import CapturedStep
from eventlog.provenance import Stamp, pack_consumed
from rewind.results import CommitResult


@dataclass
class StagedCommit:
    """One ``commit()``'s state, staged: tensor bits in staging buffers, small states packed."""

    step: int
    metrics: dict[str, float]
    base_version: int | None
    staged: dict[str, np.ndarray]
    layout: dict[str, tuple[str, tuple[int, ...]]]
    small: dict[str, bytes]
    future: Future[CommitResult]
    flush_only: bool = False
    steps: list[CapturedStep] = field(default_factory=list)
    #: Multi-rank: replicated tensors in ``staged`` (rank 0 writes them; the others hash them).
    replicated: frozenset[str] = frozenset()
    #: The training thread's environment (its thread count is the training thread's, not
    #: the committer's), taken while the run has no version: version 1 logs it.
    environment: EnvironmentFingerprint | None = None
    #: The stamps of the rollouts this version's steps consumed (``Recorder.commit(consumed=)``).
    consumed: tuple[Stamp, ...] = ()

    def record_consumed(self, version: int, name: str) -> None:
        """Add small state ``name``, the stamps this commit consumed as ``version``'s. Without
        stamps nothing is added: the commit carries the base's small states forward, so a
        version without stamps writes nothing."""
        if self.consumed:
            self.small[name] = pack_consumed(version, self.consumed)
