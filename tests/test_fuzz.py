"""A bounded, seeded fuzz pass over every decoder of untrusted bytes.

Invariant: an input either decodes (to exactly what was encoded, when it was not damaged)
or raises one of Rewind's own errors; never another exception, never a hang, never an
allocation beyond what the input's own length and the settings allow. 10,000 cases per
decoder; ``REWIND_FUZZ_EXAMPLES`` changes the count. Inputs that once broke the invariant
are kept in ``tests/data/fuzz/`` and replayed first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eventlog import RewindError, optimstep, serde, statecodec, tensorcodec
from eventlog.events import (
    CommitSealed,
    CustomState,
    Envelope,
    Metrics,
    OptimizerStep,
    RngAdvance,
    RunStarted,
    SamplerCursor,
    SchedulerStep,
    SnapshotBegin,
    SnapshotEnd,
    TensorDelta,
    TensorSpec,
)
from eventlog.fold.apply import ShardState
from snapshotter.store import FORMAT, FileEntry, Manifest, SnapshotCorruptError

EXAMPLES = int(os.environ.get("REWIND_FUZZ_EXAMPLES", "10000"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
REGRESSIONS = Path(__file__).resolve().parent / "data" / "fuzz"

_TENSOR = np.arange(64, dtype=np.float32) * 0.37
_BITS = _TENSOR.view(np.uint8)
_CHUNKS = tensorcodec.encode_tensor(_BITS, None, typesize=4, base_version=-1, chunk_bytes=128)


_HYPER = optimstep.pack_hyperparams([{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                      "weight_decay": 0.0, "amsgrad": False, "maximize": False,
                                      "foreach": None, "capturable": False,
                                      "differentiable": False, "fused": None}])


def _delta(c: tensorcodec.EncodedChunk) -> TensorDelta:
    return c.to_delta("w", "float32", (64,))


def _samples() -> list[Envelope]:
    bodies = [
        RunStarted(2, (TensorSpec("w", "float32", (64,), 0),), ("rng",), "cd", "2.4", "cpu", "0.1", 2, 128),
        _delta(_CHUNKS[0]),
        CommitSealed(3, (1, 0), 2, (b"a" * 16, b"b" * 16), b"c" * 16, b"d" * 16, "xor", 256, 90),
        SchedulerStep("scheduler", statecodec.pack({"last_epoch": 3, "lrs": (0.1, 0.2)})),
        RngAdvance("rng", statecodec.pack({"python": random.Random(1).getstate()})),
        SamplerCursor("sampler", b"\x81\xa1a\x01"),
        Metrics({"reward": 1.5, "loss": -0.25}),
        SnapshotBegin("v1-t1", 99, 1),
        SnapshotEnd("v1-t1", (3, 4, 5), (6, 7, 8), b"m" * 16, "file:///x", 1),
        CustomState("env", statecodec.pack({"obs": np.zeros(4, np.float32)})),
        OptimizerStep("Adam", 0, 1, "2.4", "cpu", _HYPER, ("w",), (0,), ("optimizer/state/0",),
                      ("w",), (b"e" * 16,)),
    ]
    return [Envelope("run", 7 + i, 3, 2, -1, "w#s", 1000, b) for i, b in enumerate(bodies)]


ENCODED = [serde.encode(e) for e in _samples()]
STATES = [
    statecodec.pack(x) for x in (
        {"python": random.Random(2).getstate(), "numpy": np.random.RandomState(3).get_state(),
         "torch": torch.Generator().manual_seed(4).get_state()},
        {"a": [1, 2.5, None, True, b"x", "s", (1, (2, 3))], 7: {"big": 2**80}},
        {"t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)},
    )
]


def _regressions(kind: str) -> list[bytes]:
    folder = REGRESSIONS / kind
    return [p.read_bytes() for p in sorted(folder.iterdir())] if folder.exists() else []


@st.composite
def damaged(draw: st.DrawFn, bases: list[bytes]) -> bytes:
    """A valid input with a few bytes flipped, cut, or inserted, or random bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=300))
    data = bytearray(draw(st.sampled_from(bases)))
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] ^= draw(st.integers(1, 255))
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(data)))
        data = data[:cut] if draw(st.booleans()) else data[:cut] + draw(st.binary(max_size=16)) + data[cut:]
    return bytes(data)


def _check_envelope(data: bytes) -> None:
    try:
        env = serde.decode(data, "fuzz")
    except RewindError:
        return
    if data in ENCODED:
        assert env == _samples()[ENCODED.index(data)]
    assert serde.decode(serde.encode(env)) == env  # whatever decodes, re-encodes stably


def test_envelope_regressions() -> None:
    for data in _regressions("envelope"):
        _check_envelope(data)


@FUZZ
@given(damaged(ENCODED))
def test_fuzz_envelope_decoder(data: bytes) -> None:
    _check_envelope(data)


_ENCODINGS = st.sampled_from(["FULL", "XOR", "xor", ""])
_COMPRESSIONS = st.sampled_from(["none", "blosc2-zstd", "zstd", ""])
_INTS = st.one_of(st.integers(-3, 300), st.sampled_from([2**31 - 1, 2**62, -(2**62)]))


@st.composite
def chunk_deltas(draw: st.DrawFn) -> TensorDelta:
    base = _delta(draw(st.sampled_from(_CHUNKS)))
    payload = bytearray(base.payload)
    if payload and draw(st.booleans()):
        payload[draw(st.integers(0, len(payload) - 1))] ^= draw(st.integers(1, 255))
    if draw(st.integers(0, 4)) == 0:
        payload = bytearray(draw(st.binary(max_size=200)))
    fields = dict(
        chunk_index=draw(st.one_of(st.just(base.chunk_index), _INTS)),
        chunk_count=draw(st.one_of(st.just(base.chunk_count), _INTS)),
        byte_offset=draw(st.one_of(st.just(base.byte_offset), _INTS)),
        byte_length=draw(st.one_of(st.just(base.byte_length), _INTS)),
        encoding=draw(st.one_of(st.just(base.encoding), _ENCODINGS)),
        compression=draw(st.one_of(st.just(base.compression), _COMPRESSIONS)),
    )
    return TensorDelta(base.name, base.dtype, base.shape, fields["chunk_index"], fields["chunk_count"],
                       fields["byte_offset"], fields["byte_length"], fields["encoding"],
                       fields["compression"], base.base_version, base.digest, bytes(payload))


def test_tensor_chunk_regressions() -> None:
    cases = _regressions("chunk")
    assert cases  # found while developing: a valid payload at a shifted offset was applied
    for data in cases:
        body = serde.decode(data).body
        assert isinstance(body, TensorDelta)
        _check_chunk(body)


@FUZZ
@given(chunk_deltas())
def test_fuzz_tensor_chunk_decoder(delta: TensorDelta) -> None:
    _check_chunk(delta)


def _check_chunk(delta: TensorDelta) -> None:
    bits = np.full(len(_BITS), 0xEE, dtype=np.uint8)
    before = bits.copy()
    try:
        tensorcodec.decode_chunk(delta, bits, "fuzz")
    except RewindError:
        assert np.array_equal(bits, before), "a refused chunk changed the tensor"
        return
    # Accepted: the bits it wrote are exactly the recorded ones (the digest proved it).
    off, n = delta.byte_offset, delta.byte_length
    assert np.array_equal(bits[off:off + n], _BITS[off:off + n])


def _manifest() -> bytes:
    return Manifest(
        format=FORMAT, run_id="run", snapshot_id="v1-t1", schema_version=2, config_digest="cd",
        version=3, step=2, state_digest="00" * 16, shard_digests=["11" * 16, "22" * 16],
        small_digest="33" * 16, shard_count=2, applied_gsns=[1, 2, 3], next_offsets=[4, 5, 6],
        files=[FileEntry("shard-0.safetensors", 10, "44" * 16)], created_ms=5, fencing_token=1,
        layout="", metrics={"reward": 1.0},
    ).to_bytes()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**20) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=20,
)


@st.composite
def manifests(draw: st.DrawFn) -> bytes:
    choice = draw(st.integers(0, 3))
    if choice == 0:  # a structurally plausible manifest with one field replaced
        doc = json.loads(_manifest())
        key = draw(st.sampled_from(sorted(doc)))
        doc[key] = draw(_JSON)
        return json.dumps(doc).encode()
    if choice == 1:
        return json.dumps(draw(_JSON)).encode()
    return draw(damaged([_manifest()]))


def test_manifest_regressions() -> None:
    cases = _regressions("manifest")
    assert cases  # found while developing: a null list field raised TypeError
    for data in cases:
        _check_manifest(data)


@FUZZ
@given(manifests())
def test_fuzz_manifest_loader(data: bytes) -> None:
    _check_manifest(data)


def _check_manifest(data: bytes) -> None:
    try:
        m = Manifest.from_bytes(data, "fuzz")
    except SnapshotCorruptError:
        return
    assert isinstance(m, Manifest) and m.to_bytes() and all(isinstance(f, FileEntry) for f in m.files)
    if data == _manifest():
        assert m.to_bytes() == data


@FUZZ
@given(damaged(STATES))
def test_fuzz_small_state_loader(data: bytes) -> None:
    try:
        value = statecodec.unpack(data, "fuzz")
    except RewindError:
        return
    if data in STATES:
        assert statecodec.pack(value) == data


# ----------------------------------------------------------------------------- optimizer steps
_FIELDS = st.fixed_dictionaries({
    "optimizer": st.sampled_from(["Adam", "AdamW", "SGD", "Adagrad", ""]),
    "hyperparams": st.one_of(damaged([_HYPER]), st.builds(lambda d: statecodec.pack([d]),
                             st.dictionaries(st.sampled_from(["lr", "betas", "eps", "momentum", "foreach",
                                                              "fused", "capturable", "nesterov", "params"]),
                                             _JSON, max_size=6))),
    "params": st.lists(st.sampled_from(["w", "v", "optimizer/state/0/exp_avg", ""]), max_size=3),
    "groups": st.lists(_INTS, max_size=3),
    "states": st.lists(st.sampled_from(["optimizer/state/0", "optimizer/state", "w", ""]), max_size=3),
})


def _shard_with_gradient(defer: bool = False) -> ShardState:
    """A shard holding param ``w``, its Adam state and a complete gradient for it (queued
    for a batched step if ``defer``)."""
    shard = ShardState(0)
    gsn = iter(range(1, 1000))
    for name, value in (("w", _TENSOR), ("optimizer/state/0/exp_avg", _TENSOR * 0.1),
                        ("optimizer/state/0/exp_avg_sq", _TENSOR * _TENSOR),
                        ("optimizer/state/0/step", np.array([3.0], np.float32))):
        bits = value.astype(np.float32).view(np.uint8).copy()
        shape = () if name.endswith("step") else (64,)
        for c in tensorcodec.encode_tensor(bits, None, typesize=4, base_version=-1, chunk_bytes=256):
            shard.apply(Envelope("run", next(gsn), 1, 0, 0, "w#s", 0,
                                 c.to_delta(name, "float32", shape)), {1}, 0, "fuzz")
    for c in _CHUNKS:
        grad = dataclasses.replace(c, encoding=TensorDelta.GRAD)
        shard.apply(Envelope("run", next(gsn), 2, 1, 0, "w#s", 0,
                             grad.to_delta("w", "float32", (64,))), {2}, 0, "fuzz", defer=defer)
    assert shard.counts.applied == gsn.__next__() - 1 and len(shard.tensors) == 4
    return shard


@pytest.mark.parametrize("defer", [False, True], ids=["step-by-step", "batched"])
@settings(FUZZ, max_examples=max(1, EXAMPLES // 5))
@given(_FIELDS)
def test_fuzz_optimizer_step_replay(defer: bool, fields: dict) -> None:
    """A damaged ``OptimizerStep`` drives torch's optimizer code with recorded values: it
    either replays (at once, or batched and tiled), or fails with one of Rewind's errors,
    never another exception."""
    n = len(fields["params"])
    body = OptimizerStep(fields["optimizer"], 0, 1, "2.4", "cpu", fields["hyperparams"],
                         tuple(fields["params"]), tuple(fields["groups"]), tuple(fields["states"]),
                         ("w",) if n else (), (b"e" * 16,) if n else ())
    try:
        shard = _shard_with_gradient(defer)
        shard.apply(Envelope("run", 2000, 2, 1, 0, "w#s", 0, body), {2}, 0, "fuzz", defer=defer)
        shard.run_deferred()
    except RewindError:
        return
