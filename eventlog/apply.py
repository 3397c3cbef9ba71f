"""The exactly-once apply rule, shared by the snapshotter and the replayer.

An event is applied to a shard's state only if its gsn is above the shard's applied gsn
(otherwise it is snapshot overlap or a duplicate) and its version is sealed at or before the
replay target (otherwise it belongs to a version that does not exist).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from . import tensorcodec
from .digests import chunk_digests, shard_digest, tensor_digest
from .errors import DigestMismatchError, IntegrityError
from .events import CommitSealed, Envelope, TensorDelta, TensorSpec

APPLIED = "applied"
SKIPPED_BY_SNAPSHOT = "skipped_by_snapshot"
SKIPPED_DUPLICATE = "skipped_duplicate"
SKIPPED_UNSEALED = "skipped_unsealed"


@dataclass
class ApplyCounts:
    """What a fold did with the events it read."""

    applied: int = 0
    skipped_by_snapshot: int = 0
    skipped_duplicate: int = 0
    skipped_unsealed: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, outcome: str, nbytes: int) -> None:
        """Count one event's outcome and its message bytes."""
        setattr(self, outcome, getattr(self, outcome) + 1)
        self.bytes += nbytes

    def merged(self, other: ApplyCounts) -> ApplyCounts:
        """The sum of two counts (seconds: the longer one, as shards run in parallel)."""
        return ApplyCounts(
            self.applied + other.applied,
            self.skipped_by_snapshot + other.skipped_by_snapshot,
            self.skipped_duplicate + other.skipped_duplicate,
            self.skipped_unsealed + other.skipped_unsealed,
            self.bytes + other.bytes,
            max(self.seconds, other.seconds),
        )


@dataclass
class TensorBits:
    """A tensor's raw bits as the fold rebuilds them."""

    dtype: str
    shape: tuple[int, ...]
    bits: np.ndarray


@dataclass
class ShardState:
    """One shard's tensors and the highest gsn applied to them."""

    shard: int
    tensors: dict[str, TensorBits] = field(default_factory=dict)
    applied_gsn: int = 0
    #: gsn covered by the snapshot this state was loaded from (0: none).
    snapshot_gsn: int = 0
    version: int = 0
    #: The offset after the last record folded (where a follow-up fold continues).
    next_offset: int = 0
    counts: ApplyCounts = field(default_factory=ApplyCounts)
    applied_per_version: Counter[int] = field(default_factory=Counter)

    def apply(self, env: Envelope, sealed: Container[int], nbytes: int, where: str) -> str:
        """Apply one event under the exactly-once rule; returns its outcome."""
        outcome = classify(env, self.applied_gsn, self.snapshot_gsn, sealed)
        if outcome == APPLIED:
            body = env.body
            if not isinstance(body, TensorDelta):
                raise IntegrityError(f"{where}: a {env.kind} event on tensor shard {self.shard}")
            self._apply_delta(body, where)
            self.applied_gsn = env.gsn
            self.version = max(self.version, env.version)
            self.applied_per_version[env.version] += 1
        self.counts.add(outcome, nbytes)
        return outcome

    def _apply_delta(self, delta: TensorDelta, where: str) -> None:
        buf = self.tensors.get(delta.name)
        shape = tuple(delta.shape)
        if buf is None or buf.dtype != delta.dtype or buf.shape != shape:
            if delta.encoding != TensorDelta.FULL:
                raise IntegrityError(
                    f"{where}: XOR chunk for tensor {delta.name!r} {delta.dtype}{list(shape)} "
                    "has no base state to apply to"
                )
            n = tensorcodec.nbytes_of(delta.dtype, shape, where)
            tensorcodec.torch_dtype(delta.dtype, where)
            buf = TensorBits(delta.dtype, shape, np.zeros(n, dtype=np.uint8))
            self.tensors[delta.name] = buf
        tensorcodec.decode_chunk(delta, buf.bits, where)

    def digest(self, specs: Sequence[TensorSpec], chunk_bytes: int) -> bytes:
        """This shard's digest over the tensors ``specs`` assigns to it."""
        digests = {}
        for spec in specs:
            if spec.shard != self.shard:
                continue
            buf = self.tensors.get(spec.name)
            if buf is None or buf.dtype != spec.dtype or buf.shape != tuple(spec.shape):
                raise IntegrityError(
                    f"shard {self.shard}: tensor {spec.name!r} {spec.dtype}{list(spec.shape)} "
                    "was never fully written by the log"
                )
            digests[spec.name] = tensor_digest(
                spec.name, spec.dtype, tuple(spec.shape), chunk_digests(buf.bits, chunk_bytes)
            )
        return shard_digest(digests)

    def conform(self, specs: Sequence[TensorSpec]) -> None:
        """Match the target layout: forget tensors it no longer has, and materialise its
        empty tensors (zero bytes, so no chunk ever carries them)."""
        listed = {s.name: s for s in specs if s.shard == self.shard}
        for name in list(self.tensors):
            if name not in listed:
                del self.tensors[name]
        for name, spec in listed.items():
            if name not in self.tensors and tensorcodec.nbytes_of(spec.dtype, tuple(spec.shape)) == 0:
                self.tensors[name] = TensorBits(spec.dtype, tuple(spec.shape), np.empty(0, np.uint8))


def classify(env: Envelope, applied_gsn: int, snapshot_gsn: int, sealed: Container[int]) -> str:
    """The exactly-once rule: the outcome of an event, given what was applied before it."""
    if env.gsn <= applied_gsn:
        return SKIPPED_BY_SNAPSHOT if env.gsn <= snapshot_gsn else SKIPPED_DUPLICATE
    if env.version not in sealed:
        return SKIPPED_UNSEALED
    return APPLIED


def verify_shard(
    state: ShardState,
    version: int,
    seal: CommitSealed,
    specs: Sequence[TensorSpec],
    chunk_bytes: int,
    seals: Mapping[int, CommitSealed],
    since_version: int,
) -> None:
    """Fail loudly unless the shard holds exactly the sealed state of ``version``.

    Checks that every version after ``since_version`` had all of its events applied (none
    half applied), then the shard digest against the seal.
    """
    for v, s in sorted(seals.items()):
        if since_version < v <= version:
            want = s.shard_counts[state.shard]
            got = state.applied_per_version.get(v, 0)
            if got != want:
                raise IntegrityError(
                    f"shard {state.shard}, version {v}: applied {got} of the {want} events its "
                    "seal counts (the log is missing records)"
                )
    got_digest = state.digest(specs, chunk_bytes)
    if got_digest != seal.shard_digests[state.shard]:
        raise DigestMismatchError(
            f"shard {state.shard} rebuilt to version {version} has digest {got_digest.hex()}, "
            f"but the seal of version {version} records {seal.shard_digests[state.shard].hex()}"
        )
