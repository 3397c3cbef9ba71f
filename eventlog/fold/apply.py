"""The exactly-once apply rule, shared by the snapshotter and the replayer.

An event is applied to a shard's state only if its gsn is above the shard's applied gsn
(otherwise it is snapshot overlap or a duplicate) and its version is sealed at or before the
replay target (otherwise it belongs to a version that does not exist).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from eventlog import filemaps, optimstep, tensorcodec
from eventlog.digests import chunk_digests, shard_digest, tensor_digest
from eventlog.errors import (
    BatchedStepsMismatchError,
    DigestMismatchError,
    GsnOrderError,
    IntegrityError,
    RewindError,
    RunNotFoundError,
)
from eventlog.events import CommitSealed, Envelope, OptimizerStep, RunStarted, TensorDelta, TensorSpec
from eventlog.fold.bits import TensorBits
from eventlog.fold.deferred import DeferredSteps
from eventlog.fold.sharing import WorkBoard
from eventlog.layout import intact
from eventlog.optimstep import check_lists, describe_failure, recorded_under, replaying_under
from eventlog.settings import current

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


class Placement:
    """Which tensors the layout in force at each version places on one shard. A chunk that
    names any other is damage at its own record: a name changed in place would otherwise
    gather into a tensor of its own, found only at a later step or seal."""

    def __init__(self, layout_at: Callable[[int], RunStarted], shard: int) -> None:
        self._layout_at, self._shard = layout_at, shard
        self._names: dict[int, frozenset[str] | None] = {}  # version -> names (None: unknown)
        self._of_layout: dict[int, tuple[RunStarted, frozenset[str] | None]] = {}  # id -> names

    def holds(self, version: int, name: str) -> bool:
        """Whether ``name`` is a tensor of this shard at ``version`` (yes, where no intact
        layout of it is at hand: a log truncated past its layouts, folded without a
        snapshot's, or a layout that fails its own digest)."""
        if version not in self._names:
            try:
                layout: RunStarted | None = self._layout_at(version)
            except RunNotFoundError:
                layout = None
            self._names[version] = None if layout is None else self._names_of(layout)
        names = self._names[version]
        return names is None or name in names

    def _names_of(self, layout: RunStarted) -> frozenset[str] | None:
        known = self._of_layout.get(id(layout))
        if known is None or known[0] is not layout:
            names = frozenset(s.name for s in layout.tensors if s.shard == self._shard) \
                if intact(layout) else None  # damaged itself: the chunks are not to blame
            known = self._of_layout[id(layout)] = (layout, names)
        return known[1]


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
    #: Gradients of a predictive version, gathered for its next ``OptimizerStep``.
    grads: dict[str, TensorBits] = field(default_factory=dict)
    grad_chunks: dict[str, tuple[int, set[int]]] = field(default_factory=dict)  # count, seen
    #: Optimizer steps waiting to run as one tiled batch (``apply(..., defer=True)``).
    deferred: DeferredSteps = field(default_factory=DeferredSteps)
    #: The last event applied: the gsn applied before it, its version, and where it is.
    last_applied: tuple[int, int, str] | None = None

    def apply(self, env: Envelope, sealed: Container[int], nbytes: int, where: str,
              defer: bool = False, placement: Placement | None = None,
              chunk_digests: bool = True) -> str:
        """Apply one event under the exactly-once rule; returns its outcome. ``sealed``: the
        sealed versions, or a map of them to their seals' gsns, which no applied event of
        theirs may pass (a damaged gsn would otherwise skip the events after it as
        duplicates). ``placement``:
        the layouts' tensors of this shard, which every applied chunk must name;
        ``chunk_digests=False``: a chunk applied without its digest check (not deferred).

        With ``defer``, optimizer steps and their gradients are queued and run together,
        tile by tile (``eventlog.fold.deferred``), when a non-gradient chunk arrives, the queue
        holds ``Settings.replay_defer_bytes``, or the caller calls ``run_deferred()``, which it
        must before reading the tensors.
        """
        outcome = classify(env, self.applied_gsn, self.snapshot_gsn, sealed)
        if (outcome in (SKIPPED_DUPLICATE, SKIPPED_BY_SNAPSHOT) and env.version > self.version
                and env.version in sealed):
            # Versions only grow along a partition, as gsns do, so a redelivered event (or
            # one a snapshot covers) has the version of an applied one or an older one.
            raise IntegrityError(f"{where}: gsn {env.gsn} is at or below gsn {self.applied_gsn}, "
                                 f"applied through version {self.version}, but the event is of the "
                                 f"later version {env.version}: its gsn is damaged")
        if outcome == SKIPPED_DUPLICATE and self.last_applied is not None:
            before, version, at = self.last_applied
            # Applied gsns only grow, so no applied event has a gsn between the last two: a
            # redelivered event has one of theirs. An event of the same version there was
            # never applied, and the last one's gsn jumped past it.
            if env.version == version and before < env.gsn < self.applied_gsn:
                raise GsnOrderError(f"{at}: gsn {self.applied_gsn} is past gsn {env.gsn} of a later "
                                    f"event of its version ({where}), which no applied event has: "
                                    "its gsn is damaged")
        if outcome == APPLIED:
            if isinstance(sealed, Mapping) and env.gsn > sealed[env.version]:
                raise IntegrityError(f"{where}: gsn {env.gsn} is past the seal of its version "
                                     f"(gsn {sealed[env.version]}), which every event of it precedes")
            body = env.body
            if isinstance(body, OptimizerStep):
                if defer:
                    self._defer_step(body, env.version, where)
                else:
                    self._apply_step(body, env.version, where)
            elif isinstance(body, TensorDelta):
                if placement is not None and not placement.holds(env.version, body.name):
                    raise IntegrityError(f"{where}: a chunk of tensor {body.name!r}, which the layout of "
                                         f"version {env.version} does not place on shard {self.shard}")
                if defer and body.encoding == TensorDelta.GRAD:
                    self.deferred.add_grad(body, where)
                else:
                    self.run_deferred()  # a residual or delta lands on the stepped bits
                    self._apply_delta(body, where, chunk_digests)
            else:
                raise IntegrityError(f"{where}: a {env.kind} event on tensor shard {self.shard}")
            self.last_applied = (self.applied_gsn, env.version, where)
            self.applied_gsn = env.gsn
            self.version = max(self.version, env.version)
            self.applied_per_version[env.version] += 1
        self.counts.add(outcome, nbytes)
        return outcome

    def _apply_delta(self, delta: TensorDelta, where: str, verify: bool = True) -> None:
        into = self.grads if delta.encoding == TensorDelta.GRAD else self.tensors
        buf = into.get(delta.name)
        shape = tuple(delta.shape)
        if buf is None or buf.dtype != delta.dtype or buf.shape != shape:
            if delta.encoding not in (TensorDelta.FULL, TensorDelta.GRAD):
                raise IntegrityError(
                    f"{where}: XOR chunk for tensor {delta.name!r} {delta.dtype}{list(shape)} "
                    "has no base state to apply to"
                )
            n = tensorcodec.nbytes_of(delta.dtype, shape, where)
            tensorcodec.torch_dtype(delta.dtype, where)
            buf = TensorBits(delta.dtype, shape, np.zeros(n, dtype=np.uint8))
            into[delta.name] = buf
        tensorcodec.decode_chunk(delta, buf.bits, where, verify=verify)
        if delta.encoding != TensorDelta.GRAD:  # (a gradient is read again by its step)
            filemaps.release(delta.payload)
        if delta.encoding == TensorDelta.GRAD:
            count, seen = self.grad_chunks.setdefault(delta.name, (delta.chunk_count, set()))
            if count != delta.chunk_count:
                raise IntegrityError(f"{where}: gradient chunks of {delta.name!r} disagree on their count")
            seen.add(delta.chunk_index)

    def run_deferred(self) -> None:
        """Run the queued optimizer steps, if any (see ``apply``)."""
        if self.deferred:
            self.deferred.run(self.tensors, current().replay_tile_bytes)

    def _defer_step(self, step: OptimizerStep, version: int, where: str) -> None:
        if not self.deferred.fits():
            self.run_deferred()
        self.deferred.add_step(step, version, where, self.tensors)
        settings = current()
        if (self.deferred.nbytes >= settings.replay_defer_bytes
                or self.deferred.mapped >= settings.replay_defer_mapped_bytes):
            self.run_deferred()

    def _apply_step(self, step: OptimizerStep, version: int, where: str) -> None:
        """Replay one optimizer step on this shard's tensors, in place, and check that it
        predicted what the recording predicted (residual chunks then follow)."""
        check_lists(step, where)
        params, grads, states = [], [], []
        owned = optimstep.states_by_owner(self.tensors)
        for name, prefix in zip(step.params, step.states, strict=True):
            param, grad = self.tensors.get(name), self.grads.get(name)
            count, seen = self.grad_chunks.get(name, (0, set()))
            if (param is None or grad is None or grad.dtype != param.dtype
                    or grad.shape != param.shape or len(seen) != count):
                raise IntegrityError(f"{where}: optimizer step of version {version} updates {name!r}, "
                                     "but the shard holds no such param or not its whole gradient")
            params.append(optimstep.tensor_view(param.bits, param.dtype, param.shape))
            grads.append(optimstep.tensor_view(grad.bits, grad.dtype, grad.shape))
            states.append({k: optimstep.tensor_view(self.tensors[n].bits, self.tensors[n].dtype,
                                                    self.tensors[n].shape)
                           for k, n in owned.get(prefix, {}).items()})
        try:
            optimstep.run_step(step.optimizer, optimstep.unpack_hyperparams(step.hyperparams, where),
                               params, grads, states, step.groups)
        except RewindError:
            raise
        except Exception as exc:  # recorded (untrusted) values drive torch's optimizer code
            raise describe_failure(step, version, where, exc) from exc
        finally:
            self.grads.clear()
            self.grad_chunks.clear()
        for name, want in zip(step.predicted, step.predicted_digests, strict=True):
            t = self.tensors.get(name)
            got = None if t is None else tensorcodec.digest(t.bits)
            if got != want:
                raise DigestMismatchError(
                    f"{where}: the replayed {step.optimizer} step of version {version} predicted "
                    f"tensor {name!r} differently from the recording (recorded under "
                    f"{recorded_under(step)}; replaying under {replaying_under()}): "
                    f"digest {got.hex() if got else 'missing'}, "
                    f"recorded {want.hex()}"
                )

    def digest(self, specs: Sequence[TensorSpec], chunk_bytes: int,
               board: WorkBoard | None = None) -> bytes:
        """This shard's digest over the tensors ``specs`` assigns to it (``board``: tensors
        hashed by whichever worker of a parallel fold takes them)."""
        mine = [spec for spec in specs if spec.shard == self.shard]
        for spec in mine:
            buf = self.tensors.get(spec.name)
            if buf is None or buf.dtype != spec.dtype or buf.shape != tuple(spec.shape):
                raise IntegrityError(
                    f"shard {self.shard}: tensor {spec.name!r} {spec.dtype}{list(spec.shape)} "
                    "was never fully written by the log"
                )
        digests = dict.fromkeys((spec.name for spec in mine), b"")

        def one(spec: TensorSpec) -> None:
            chunks = chunk_digests(self.tensors[spec.name].bits, chunk_bytes)
            digests[spec.name] = tensor_digest(spec.name, spec.dtype, tuple(spec.shape), chunks)

        if board is not None:
            board.run(mine, one)
        else:
            for spec in mine:
                one(spec)
        return shard_digest(digests)

    def conform(self, specs: Sequence[TensorSpec]) -> None:
        """Match the target layout: forget tensors it no longer has, and materialise its
        empty tensors (zero bytes, so no chunk ever carries them)."""
        listed = {s.name: s for s in specs if s.shard == self.shard}
        for name in list(self.tensors):
            if name not in listed:
                del self.tensors[name]
        for name, spec in listed.items():
            if tensorcodec.nbytes_of(spec.dtype, tuple(spec.shape)) == 0:
                # Also over an older non-empty tensor of that name (a rank's shard that a
                # resharding left empty): its FULL write had no chunk to replace it with.
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
    board: WorkBoard | None = None,
) -> None:
    """Fail loudly unless the shard holds exactly the sealed state of ``version``.

    Checks that every version after ``since_version`` had all of its events applied (none
    half applied), then the shard digest against the seal (hashed on ``board``'s workers).
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
    got_digest = state.digest(specs, chunk_bytes, board)
    if got_digest != seal.shard_digests[state.shard]:
        unchecked = state.deferred.unchecked
        message = (f"shard {state.shard} rebuilt to version {version} has digest {got_digest.hex()}, "
                   f"but the seal of version {version} records {seal.shard_digests[state.shard].hex()}")
        if unchecked:
            skipped, named = (("checking each step or gradient chunk",
                               "the first damaged chunk or the first step")
                              if state.deferred.grads_unchecked else ("per-step checks", "the first step"))
            raise BatchedStepsMismatchError(
                f"{message}; versions {unchecked[0]}..{unchecked[-1]} were replayed by batched "
                f"optimizer steps, without {skipped}: replay with REWIND_REPLAY_DEFER_STEPS=0 "
                f"to name {named} that predicts differently", mismatch=message,
                rebuilt=dict(state.tensors))
        raise DigestMismatchError(message)
    # The seal vouches for every batched step, and every gradient, up to here.
    state.deferred.unchecked.clear()
    state.deferred.grads_unchecked = False
