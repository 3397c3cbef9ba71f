"""Typed, frozen events: one dataclass per Avro record in ``schemas/``.

Field names match the schema exactly, so the Avro form of an event is its fields, with
tuples for arrays and a dict for the map. ``Envelope.to_avro`` / ``Envelope.from_avro``
are an exact round trip.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

CONTROL_SHARD = -1
#: The partition of a run's weights stream (its cast serving weights; ``eventlog.weightstream``).
WEIGHTS_SHARD = -2


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the run's state and the shard that owns it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: int


@dataclass(frozen=True)
class RunStarted:
    """First event of a run; the log describes its own layout."""

    shard_count: int
    tensors: tuple[TensorSpec, ...]
    small_states: tuple[str, ...]
    config_digest: str
    torch_version: str
    device: str
    rewind_version: str
    schema_version: int
    chunk_bytes: int


@dataclass(frozen=True)
class TensorDelta:
    """One chunk of one tensor of one version."""

    FULL: ClassVar[str] = "FULL"
    XOR: ClassVar[str] = "XOR"
    #: v3, predictive versions: the gradient of ``name`` the next ``OptimizerStep`` consumes
    #: (bits themselves, like FULL), and the residual: actual bits XOR the predicted bits.
    GRAD: ClassVar[str] = "GRAD"
    RESIDUAL: ClassVar[str] = "RESIDUAL"

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunk_index: int
    chunk_count: int
    byte_offset: int
    byte_length: int
    encoding: str
    compression: str
    base_version: int
    digest: bytes
    payload: bytes = field(repr=False)


@dataclass(frozen=True)
class CommitSealed:
    """Seals a version; a version exists iff its seal is committed."""

    base_version: int
    shard_counts: tuple[int, ...]
    control_count: int
    shard_digests: tuple[bytes, ...]
    small_digest: bytes
    state_digest: bytes
    encoding: str
    raw_bytes: int
    encoded_bytes: int


@dataclass(frozen=True)
class _NamedState:
    """A named small state, msgpack bytes (the shape the four small-state records share)."""

    name: str
    state: bytes = field(repr=False)


@dataclass(frozen=True)
class SchedulerStep(_NamedState):
    """LR scheduler state after a step (msgpack)."""


@dataclass(frozen=True)
class RngAdvance(_NamedState):
    """RNG states after a step (msgpack)."""


@dataclass(frozen=True)
class SamplerCursor(_NamedState):
    """Sampler / data-cursor state (msgpack)."""


@dataclass(frozen=True)
class CustomState(_NamedState):
    """A user ``Stateful`` object's state, or the optimizer's param groups (msgpack)."""


@dataclass(frozen=True)
class Metrics:
    """Scalar metrics reported with a commit."""

    values: dict[str, float]


@dataclass(frozen=True)
class SnapshotBegin:
    """A snapshot covering every event with gsn <= gsn_watermark is being written."""

    snapshot_id: str
    gsn_watermark: int
    fencing_token: int


@dataclass(frozen=True)
class SnapshotEnd:
    """A snapshot is complete; without this marker it does not exist for recovery."""

    snapshot_id: str
    next_offsets: tuple[int, ...]
    applied_gsns: tuple[int, ...]
    manifest_digest: bytes
    manifest_uri: str
    fencing_token: int


@dataclass(frozen=True)
class OptimizerStep:
    """v3: one ``optimizer.step()`` of a predictively encoded version, on one tensor shard.

    The ``GRAD`` chunks of ``params`` precede it on the shard. Replaying it runs the same
    step (``eventlog.optimstep``) on the previous state; the ``RESIDUAL`` chunks after it
    turn the prediction into the recorded bits."""

    optimizer: str
    index: int
    count: int
    torch_version: str
    device: str
    hyperparams: bytes = field(repr=False)
    params: tuple[str, ...]
    groups: tuple[int, ...]
    states: tuple[str, ...]
    predicted: tuple[str, ...]
    predicted_digests: tuple[bytes, ...] = field(repr=False)


@dataclass(frozen=True)
class EnvironmentFingerprint:
    """v4: the environment recording the run, at its start (``reason`` "start") and at each
    resume ("resume"): the versions and settings that decide which bits a step computes."""

    START: ClassVar[str] = "start"
    RESUME: ClassVar[str] = "resume"

    reason: str
    torch_version: str
    cuda_version: str | None
    cudnn_version: str | None
    deterministic_algorithms: bool
    cublas_workspace_config: str | None
    cudnn_benchmark: bool
    cudnn_deterministic: bool
    matmul_precision: str
    num_threads: int
    hostname: str
    world_size: int
    python_version: str

    def differences(self, other: EnvironmentFingerprint) -> dict[str, tuple[Any, Any]]:
        """The settings (not the reason) that differ: ``{field: (self's, other's)}``."""
        return {f.name: (getattr(self, f.name), getattr(other, f.name))
                for f in dataclasses.fields(self)
                if f.name != "reason" and getattr(self, f.name) != getattr(other, f.name)}


@dataclass(frozen=True)
class Resumed:
    """v4: a ``restore()`` loaded ``restored_version`` and checked its state digest against
    the version's seal; where it started (a snapshot, or the log's start) and the tail."""

    restored_version: int
    restored_step: int
    state_digest: bytes
    snapshot_id: str | None
    snapshot_version: int
    tail_versions: int
    applied: int


SmallState = SchedulerStep | RngAdvance | SamplerCursor | CustomState
Body = (RunStarted | TensorDelta | CommitSealed | SchedulerStep | RngAdvance | SamplerCursor | Metrics
        | SnapshotBegin | SnapshotEnd | CustomState | OptimizerStep | EnvironmentFingerprint | Resumed)

BODY_TYPES: dict[str, type[Any]] = {
    f"rewind.{cls.__name__}": cls
    for cls in (
        RunStarted,
        TensorDelta,
        CommitSealed,
        SchedulerStep,
        RngAdvance,
        SamplerCursor,
        Metrics,
        SnapshotBegin,
        SnapshotEnd,
        CustomState,
        OptimizerStep,
        EnvironmentFingerprint,
        Resumed,
    )
}
SMALL_STATE_TYPES = (SchedulerStep, RngAdvance, SamplerCursor, CustomState)


def _to_avro(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {name: _to_avro(getattr(value, name)) for name in _field_names(type(value))}
    if isinstance(value, tuple):
        return [_to_avro(v) for v in value]
    return value


_FIELD_NAMES: dict[type[Any], tuple[str, ...]] = {}


def _field_names(cls: type[Any]) -> tuple[str, ...]:
    # ``dataclasses.fields`` filters every attribute again on each call: a replay decodes
    # an event per record, so the names are looked up once per class.
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _from_avro(cls: type[Any], data: dict[str, Any]) -> Any:
    kwargs: dict[str, Any] = {}
    for name in _field_names(cls):
        v = data[name]
        if name == "tensors":
            v = tuple(_from_avro(TensorSpec, t) for t in v)
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[name] = v
    return cls(**kwargs)


@dataclass(frozen=True)
class Envelope:
    """Every event: its place in the run's global order, and its body."""

    run_id: str
    gsn: int
    version: int
    step: int
    shard: int
    writer: str
    time_ms: int
    body: Body
    #: Schema v2: the key that encrypted the body's payload/state (``None``: plaintext).
    key_id: str | None = None

    def to_avro(self) -> dict[str, Any]:
        """The record fastavro writes (the union branch named explicitly)."""
        record = {name: getattr(self, name) for name in _field_names(type(self))}
        record["body"] = (f"rewind.{type(self.body).__name__}", _to_avro(self.body))
        return record

    @classmethod
    def from_avro(cls, record: dict[str, Any]) -> Envelope:
        """Build from a record read with ``return_record_name=True``."""
        name, body = record["body"]
        body_cls = BODY_TYPES[name]
        fields: dict[str, Any] = {name: record.get(name) for name in _field_names(cls)
                                  if name != "body"}
        return cls(**fields, body=_from_avro(body_cls, body))

    @property
    def kind(self) -> str:
        """The body's type name, e.g. ``TensorDelta``."""
        return type(self.body).__name__
