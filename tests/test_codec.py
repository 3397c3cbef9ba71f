"""The tensor delta codec and the small-state codec are exact to the bit.

Acceptance: "Codec property test (hypothesis). The round trip is bit-exact over dtypes,
shapes and random bit patterns, and the digests match."

Tensors are generated as raw bytes and then reinterpreted, so NaN payloads, signalling
NaNs, -0.0, infinities and subnormals all appear; comparisons are always on uint8 views,
never on values (NaN != NaN would hide a wrong bit).
"""

from __future__ import annotations

import math
import random
import sqlite3
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from eventlog import RunAddress, open_log, statecodec, tensorcodec
from eventlog.errors import CorruptMessageError, DecodeError
from eventlog.events import TensorDelta
from eventlog.fold.engine import Target, rebuild
from rewind.recorder import Recorder

# ----------------------------------------------------------------------------- helpers

DTYPES = [
    torch.float32, torch.bfloat16, torch.float16, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
    torch.complex64,
]


def _u(fmt: str, *values: int) -> bytes:
    return struct.pack("<" + fmt, *values)


#: Bit patterns that value-based comparisons get wrong, per dtype (little-endian raw bytes).
SPECIAL: dict[torch.dtype, list[bytes]] = {
    torch.float32: [_u("I", v) for v in (
        0x7FC00001, 0xFFC00000, 0x7F800001, 0x7FBFFFFF,  # quiet/signalling NaNs with payloads
        0x80000000, 0x00000000, 0x7F800000, 0xFF800000,  # -0.0, +0.0, +-inf
        0x00000001, 0x807FFFFF, 0x3F800000,              # subnormals, 1.0
    )],
    torch.float64: [_u("Q", v) for v in (
        0x7FF8000000000001, 0xFFF8000000000000, 0x7FF0000000000001, 0x8000000000000000,
        0x7FF0000000000000, 0xFFF0000000000000, 0x0000000000000001, 0x800FFFFFFFFFFFFF,
    )],
    torch.float16: [_u("H", v) for v in (
        0x7E01, 0xFE00, 0x7C01, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x83FF,
    )],
    torch.bfloat16: [_u("H", v) for v in (
        0x7FC1, 0xFFC0, 0x7F81, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x807F,
    )],
    torch.int8: [_u("b", v) for v in (0, -1, -128, 127)],
    torch.int16: [_u("h", v) for v in (0, -1, -(2**15), 2**15 - 1)],
    torch.int32: [_u("i", v) for v in (0, -1, -(2**31), 2**31 - 1)],
    torch.int64: [_u("q", v) for v in (0, -1, -(2**63), 2**63 - 1)],
    torch.uint8: [bytes([v]) for v in (0, 1, 127, 128, 255)],
    torch.bool: [b"\x00", b"\x01"],
}
SPECIAL[torch.complex64] = [a + b for a in SPECIAL[torch.float32][:6] for b in SPECIAL[torch.float32][3:9]]


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def name_of(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_tensor(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor whose bits are exactly ``raw`` (no value conversion anywhere)."""
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def u8(t: torch.Tensor) -> torch.Tensor:
    """Bits of a tensor as a flat uint8 tensor (independent of the code under test)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def assert_bit_identical(got: torch.Tensor, want: torch.Tensor, what: str = "tensor") -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    a, b = u8(got), u8(want)
    if not torch.equal(a, b):
        diff = (a != b).nonzero().reshape(-1)[:8].tolist()
        raise AssertionError(f"{what}: bits differ at bytes {diff}")


def as_delta(c: tensorcodec.EncodedChunk, dtype: str, shape: tuple[int, ...], name: str = "t") -> TensorDelta:
    return TensorDelta(
        name, dtype, shape, c.chunk_index, c.chunk_count, c.byte_offset, c.byte_length,
        c.encoding, c.compression, c.base_version, c.digest, c.payload,
    )


def apply_all(
    chunks: list[tensorcodec.EncodedChunk], bits: np.ndarray, dtype: str, shape: tuple[int, ...]
) -> None:
    """Apply chunks like a replayer does, checking each chunk's digest against what it produced."""
    for c in chunks:
        tensorcodec.decode_chunk(as_delta(c, dtype, shape), bits, "test")
        produced = bits[c.byte_offset : c.byte_offset + c.byte_length]
        assert c.digest == tensorcodec.digest(produced), f"chunk {c.chunk_index}: digest differs"
        assert c.digest == tensorcodec.digest(produced.tobytes())


# ----------------------------------------------------------------------------- strategies


def _seeded_bits(kind: str, dtype: torch.dtype, n: int, seed: int) -> bytes:
    """Bits of ``n`` elements from a seeded generator: cheap for big tensors, reproducible."""
    rng = random.Random(seed)
    size = itemsize(dtype)
    if dtype == torch.bool:
        p = {"random": 0.5, "special": 0.3, "sparse": 0.02, "values": 0.1}[kind]
        return bytes(int(rng.random() < p) for _ in range(n))
    if kind == "random":
        return rng.randbytes(n * size)
    if kind == "special":  # special patterns mixed with noise
        return b"".join(rng.choice(SPECIAL[dtype]) if rng.random() < 0.5 else rng.randbytes(size)
                        for _ in range(n))
    if kind == "sparse":  # mostly zeros with special patterns sprinkled in: compresses well
        zero = bytes(size)
        return b"".join(rng.choice(SPECIAL[dtype]) if rng.random() < 0.03 else zero for _ in range(n))
    # "values": what real weights look like (smooth values, a few NaN/inf)
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        t = (torch.randn(n, generator=g, dtype=torch.float64) * 0.02).to(dtype)
    else:
        t = torch.randint(-3, 4, (n,), generator=g).to(dtype)
    return u8(t).numpy().tobytes()


_SHAPES = st.one_of(
    st.lists(st.integers(0, 6), max_size=3).map(tuple),  # 0-d, empty and tiny shapes
    st.tuples(st.integers(64, 3000)),  # long vectors: many chunks
    st.tuples(st.integers(1, 48), st.integers(1, 48)),
    st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(1, 20)),
)


@st.composite
def tensor_case(draw: st.DrawFn) -> tuple[torch.dtype, tuple[int, ...], bytes]:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(_SHAPES)
    size = itemsize(dtype)
    n = math.prod(shape)
    kind = draw(st.sampled_from(["binary", "random", "special", "sparse", "values"]))
    if kind == "binary" and n <= 64:  # let hypothesis choose (and shrink) every byte
        if dtype == torch.bool:
            raw = bytes(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
        else:
            elem = st.one_of(st.sampled_from(SPECIAL[dtype]), st.binary(min_size=size, max_size=size))
            raw = b"".join(draw(st.lists(elem, min_size=n, max_size=n)))
    else:
        raw = _seeded_bits("special" if kind == "binary" else kind, dtype, n, draw(st.integers(0, 2**32)))
    assert len(raw) == n * size
    return dtype, shape, raw


@st.composite
def second_version(draw: st.DrawFn, dtype: torch.dtype, raw: bytes) -> bytes:
    """The next version's bits: unchanged, a few flipped bits, or unrelated bytes."""
    n = len(raw)
    mode = draw(st.sampled_from(["same", "flip", "flip", "unrelated"]))
    if mode == "same" or n == 0:
        return raw
    if mode == "unrelated":
        new = random.Random(draw(st.integers(0, 2**32))).randbytes(n)
        return bytes(b & 1 for b in new) if dtype == torch.bool else new
    out = bytearray(raw)
    bit_choices = [0] if dtype == torch.bool else list(range(8))
    flips = draw(st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from(bit_choices)),
                          min_size=1, max_size=12))
    for byte, bit in flips:
        out[byte] ^= 1 << bit
    return bytes(out)


CHUNK_SIZES = st.sampled_from([16, 48, 64, 100, 256, 1024, 4096])


# ----------------------------------------------------------------------------- codec property


@settings(max_examples=500, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=tensor_case(), chunk_bytes=CHUNK_SIZES, data=st.data())
def test_codec_round_trip_is_bit_exact(
    case: tuple[torch.dtype, tuple[int, ...], bytes], chunk_bytes: int, data: st.DataObject
) -> None:
    dtype, shape, raw0 = case
    raw1 = data.draw(second_version(dtype, raw0), label="second version")
    t0, t1 = make_tensor(raw0, dtype, shape), make_tensor(raw1, dtype, shape)
    dname, size = name_of(dtype), itemsize(dtype)
    ranges = tensorcodec.chunk_ranges(len(raw0), chunk_bytes)

    # Version 1: every chunk is written, FULL, and rebuilds the tensor from nothing.
    bits0 = tensorcodec.tensor_bits(t0)
    assert bits0.tobytes() == raw0
    first = tensorcodec.encode_tensor(bits0, None, typesize=size, base_version=0, chunk_bytes=chunk_bytes)
    assert [(c.byte_offset, c.byte_length) for c in first] == ranges
    assert all(c.encoding == TensorDelta.FULL and c.base_version == -1 for c in first)
    assert all(c.chunk_count == len(ranges) for c in first)
    assert all(c.byte_offset % size == 0 and c.byte_length % size == 0 for c in first), "element split"
    buf = np.zeros(len(raw0), dtype=np.uint8)
    apply_all(first, buf, dname, shape)
    assert buf.tobytes() == raw0
    assert_bit_identical(tensorcodec.bits_to_tensor(buf, dname, shape), t0, "version 1")

    # Version 2: only changed chunks are written, and applying them onto version 1 gives t1.
    bits1 = tensorcodec.tensor_bits(t1)
    second = tensorcodec.encode_tensor(bits1, bits0, typesize=size, base_version=7, chunk_bytes=chunk_bytes)
    changed = [i for i, (o, n) in enumerate(ranges) if raw0[o : o + n] != raw1[o : o + n]]
    assert [c.chunk_index for c in second] == changed
    for c in second:
        assert c.encoding in (TensorDelta.FULL, TensorDelta.XOR)
        assert c.base_version == (7 if c.encoding == TensorDelta.XOR else -1)
        assert c.compression in tensorcodec.COMPRESSIONS
        if c.compression == "none":
            assert c.encoding == TensorDelta.FULL
            assert c.payload == raw1[c.byte_offset : c.byte_offset + c.byte_length]
        assert len(c.payload) <= c.byte_length, "an encoded chunk is never larger than raw bits"
    for c in second:
        event(f"v2 chunk {c.encoding}/{c.compression}")
    event(f"chunks: {'multi' if len(ranges) > 1 else len(ranges)}")
    apply_all(second, buf, dname, shape)
    assert buf.tobytes() == raw1
    assert_bit_identical(tensorcodec.bits_to_tensor(buf, dname, shape), t1, "version 2")
    # bits_to_tensor owns its memory: later writes to the buffer do not leak into it.
    restored = tensorcodec.bits_to_tensor(buf, dname, shape)
    buf[:] = 0
    assert_bit_identical(restored, t1, "version 2 after buffer reuse")


@settings(max_examples=60, deadline=None, derandomize=True)
@given(case=tensor_case(), chunk_bytes=CHUNK_SIZES)
def test_unchanged_tensor_writes_nothing(case: tuple[torch.dtype, tuple[int, ...], bytes],
                                         chunk_bytes: int) -> None:
    dtype, shape, raw = case
    bits = tensorcodec.tensor_bits(make_tensor(raw, dtype, shape))
    same = bits.copy()
    assert tensorcodec.encode_tensor(same, bits, typesize=itemsize(dtype), base_version=3,
                                     chunk_bytes=chunk_bytes) == []


def test_first_commit_is_full_and_small_change_is_xor() -> None:
    t = torch.arange(4096, dtype=torch.float32)
    bits = tensorcodec.tensor_bits(t)
    first = tensorcodec.encode_tensor(bits, None, typesize=4, base_version=0, chunk_bytes=4096)
    assert len(first) == 4
    assert all(c.encoding == "FULL" and c.compression == "blosc2-zstd" for c in first)
    assert sum(len(c.payload) for c in first) < len(bits) // 2, "arange should compress"

    t2 = t.clone()
    t2[1500] = float("nan")  # lands in chunk 1 (bytes 4096..8191)
    new = tensorcodec.tensor_bits(t2)
    second = tensorcodec.encode_tensor(new, bits, typesize=4, base_version=5, chunk_bytes=4096)
    assert len(second) == 1
    (c,) = second
    assert (c.chunk_index, c.byte_offset, c.byte_length) == (1, 4096, 4096)
    assert c.encoding == "XOR" and c.base_version == 5 and c.compression == "blosc2-zstd"
    assert len(c.payload) < 200, f"a one-element XOR delta should be tiny, got {len(c.payload)} bytes"
    buf = bits.copy()
    apply_all(second, buf, "float32", (4096,))
    assert_bit_identical(tensorcodec.bits_to_tensor(buf, "float32", (4096,)), t2)


def test_full_is_chosen_when_the_delta_compresses_worse() -> None:
    # prev is noise, new is all zeros: the XOR delta is the noise again, the bits compress to nothing.
    prev = np.frombuffer(random.Random(1).randbytes(8192), dtype=np.uint8).copy()
    new = np.zeros(8192, dtype=np.uint8)
    chunks = tensorcodec.encode_tensor(new, prev, typesize=4, base_version=9, chunk_bytes=4096)
    assert len(chunks) == 2
    for c in chunks:
        assert c.encoding == "FULL" and c.base_version == -1 and c.compression == "blosc2-zstd"
        assert len(c.payload) < 256
    buf = prev.copy()
    apply_all(chunks, buf, "float32", (2048,))
    assert not buf.any()


def test_incompressible_bits_are_stored_raw() -> None:
    raw = random.Random(2).randbytes(10_000)
    bits = np.frombuffer(raw, dtype=np.uint8).copy()
    chunks = tensorcodec.encode_tensor(bits, None, typesize=4, base_version=0, chunk_bytes=4096)
    assert [c.compression for c in chunks] == ["none"] * 3
    assert all(c.encoding == "FULL" for c in chunks)
    assert b"".join(c.payload for c in chunks) == raw

    # An XOR delta against unrelated noise is noise too: stored raw, as the new bits.
    other = np.frombuffer(random.Random(3).randbytes(10_000), dtype=np.uint8).copy()
    chunks = tensorcodec.encode_tensor(other, bits, typesize=4, base_version=1, chunk_bytes=4096)
    assert [(c.compression, c.encoding) for c in chunks] == [("none", "FULL")] * 3
    buf = bits.copy()
    apply_all(chunks, buf, "uint8", (10_000,))
    assert np.array_equal(buf, other)


def test_damaged_chunk_is_refused_and_leaves_the_buffer_alone() -> None:
    t = torch.linspace(0, 1, 1024)
    bits = tensorcodec.tensor_bits(t)
    (c,) = tensorcodec.encode_tensor(bits, None, typesize=4, base_version=0, chunk_bytes=4096)
    bad_payload = bytearray(c.payload)
    bad_payload[len(bad_payload) // 2] ^= 0x10
    delta = as_delta(c, "float32", (1024,))
    damaged = TensorDelta(**{**delta.__dict__, "payload": bytes(bad_payload)})
    buf = np.full(len(bits), 0xAB, dtype=np.uint8)
    with pytest.raises(CorruptMessageError, match="chunk-7"):
        tensorcodec.decode_chunk(damaged, buf, "chunk-7")
    assert (buf == 0xAB).all(), "a refused chunk must not write any byte"


def test_non_contiguous_and_zero_dim_tensors_round_trip() -> None:
    base = make_tensor(random.Random(4).randbytes(6 * 8 * 2), torch.bfloat16, (6, 8))
    for t in (base.t(), base[:, ::3], base[2, 5], torch.tensor(float("-nan"), dtype=torch.float64)):
        bits = tensorcodec.tensor_bits(t)
        size = t.element_size()
        chunks = tensorcodec.encode_tensor(bits, None, typesize=size, base_version=0, chunk_bytes=16)
        buf = np.zeros(len(bits), dtype=np.uint8)
        dname = name_of(t.dtype)
        apply_all(chunks, buf, dname, tuple(t.shape))
        assert_bit_identical(tensorcodec.bits_to_tensor(buf, dname, tuple(t.shape)), t)


# ----------------------------------------------------------------------------- through the Recorder


def _patterned(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bits with special patterns sprinkled in (NaN payloads, -0.0, inf, subnormals)."""
    rng = random.Random(seed)
    n, size = math.prod(shape), itemsize(dtype)
    if dtype == torch.bool:
        return make_tensor(bytes(rng.randint(0, 1) for _ in range(n)), dtype, shape)
    elems = [rng.choice(SPECIAL[dtype]) if rng.random() < 0.4 else rng.randbytes(size) for _ in range(n)]
    return make_tensor(b"".join(elems), dtype, shape)


class ManyDtypes(torch.nn.Module):
    """Parameters and buffers of every recorded dtype, including 0-d ones."""

    def __init__(self, seed: int, with_empty: bool = False) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # seeded weights, global RNG left alone
            torch.manual_seed(seed)
            self.fc = torch.nn.Linear(24, 16)
        self.fp16 = torch.nn.Parameter(_patterned(torch.float16, (40,), seed + 1))
        self.register_buffer("bf16", _patterned(torch.bfloat16, (9, 17), seed + 2))
        self.register_buffer("f64", _patterned(torch.float64, (50,), seed + 3))
        self.register_buffer("i8", _patterned(torch.int8, (33,), seed + 4))
        self.register_buffer("i16", _patterned(torch.int16, (5, 3), seed + 5))
        self.register_buffer("i32", _patterned(torch.int32, (21,), seed + 6))
        self.register_buffer("i64", _patterned(torch.int64, (2, 2, 3), seed + 7))
        self.register_buffer("u8", _patterned(torch.uint8, (70,), seed + 8))
        self.register_buffer("flags", _patterned(torch.bool, (19,), seed + 9))
        self.register_buffer("c64", _patterned(torch.complex64, (12,), seed + 10))
        self.register_buffer("scalar_nan", make_tensor(_u("I", 0x7FC0BEEF), torch.float32, ()))
        self.register_buffer("scalar_i64", make_tensor(_u("q", -(2**63)), torch.int64, ()))
        if with_empty:
            self.register_buffer("empty", torch.empty(0, 3))
            self.register_buffer("empty_bf16", torch.empty(4, 0, dtype=torch.bfloat16))


def _bits_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mutate(model: torch.nn.Module, version: int) -> None:
    """Change a few elements in some tensors, writing raw bit patterns."""
    rng = random.Random(100 + version)
    with torch.no_grad():
        sd = model.state_dict()
        for name in sorted(sd)[version % 3 :: 2]:
            t = sd[name]
            if t.numel() == 0:
                continue
            flat = t.reshape(-1) if t.is_contiguous() else None
            if flat is None:
                continue
            raw = bytearray(u8(flat).numpy().tobytes())
            size = t.element_size()
            for _ in range(3):
                i = rng.randrange(flat.numel())
                if t.dtype == torch.bool:
                    raw[i] ^= 1
                else:
                    elem = rng.choice(SPECIAL[t.dtype])
                    raw[i * size : (i + 1) * size] = elem
            flat.copy_(make_tensor(bytes(raw), t.dtype, tuple(flat.shape)))


def _record_and_restore(tmp_path: Path, with_empty: bool) -> None:
    url = f"sqlite://{tmp_path}/rewind.db"
    address = RunAddress(url, url, "dtypes")
    live = ManyDtypes(seed=1, with_empty=with_empty)
    history: dict[int, dict[str, torch.Tensor]] = {}
    with Recorder(address, live, rng=False, chunk_bytes=48, shards=3) as rec:
        for version in range(1, 5):
            if version in (2, 3):
                _mutate(live, version)
            result = rec.commit(step=10 * version, metrics={"v": version}, wait=True).result()
            assert result.version == version
            history[version] = _bits_snapshot(live)
    # version 4 changed nothing, so it wrote no tensor chunk at all
    with sqlite3.connect(tmp_path / "rewind.db") as db:
        per_partition = dict(db.execute(
            "SELECT partition, COUNT(*) FROM records WHERE run='dtypes' GROUP BY partition"
        ).fetchall())
    n_tensors = len(history[4])
    assert sum(v for p, v in per_partition.items() if p >= 0) > n_tensors, "expected multi-chunk tensors"

    fresh = ManyDtypes(seed=999, with_empty=with_empty)
    differs = [k for k, v in fresh.state_dict().items()
               if v.numel() and not torch.equal(u8(v), u8(history[4][k]))]
    assert len(differs) >= 10, "the fresh model must start from other bits, or the test proves nothing"
    with Recorder(address, fresh, rng=False, chunk_bytes=48) as rec:
        result = rec.restore()
    assert (result.step, result.version) == (40, 4)
    got = fresh.state_dict()
    assert set(got) == set(history[4])
    for name, want in history[4].items():
        assert_bit_identical(got[name], want, name)

    # Every intermediate version is recoverable to the bit too.
    with open_log(url, "dtypes") as log:
        for version in (1, 2, 3):
            state = rebuild(log, Target("version", version))
            assert state.step == 10 * version
            tensors = state.tensors()
            for name, want in history[version].items():
                tb = tensors[f"model/{name}"]
                assert_bit_identical(tensorcodec.bits_to_tensor(tb.bits, tb.dtype, tb.shape), want,
                                     f"v{version} {name}")


def test_recorder_restores_every_dtype_bit_exact(tmp_path: Path) -> None:
    _record_and_restore(tmp_path, with_empty=False)


def test_recorder_restores_empty_tensors(tmp_path: Path) -> None:
    _record_and_restore(tmp_path, with_empty=True)


# ----------------------------------------------------------------------------- small states


def same_tree(a: Any, b: Any, path: str = "state") -> None:
    """Structural, type-exact, bit-exact equality (NaN-safe) of two state trees."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same_tree(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            same_tree(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        assert a.tobytes() == b.tobytes(), f"{path}: array bits differ"
    elif isinstance(a, torch.Tensor):
        assert_bit_identical(b, a, path)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def round_trip(tree: Any) -> Any:
    packed = statecodec.pack(tree)
    assert isinstance(packed, bytes)
    out = statecodec.unpack(packed)
    same_tree(tree, out)
    return out


def test_python_random_state_round_trips_and_resumes_the_stream() -> None:
    gen = random.Random(1234)
    gen.random()
    state = gen.getstate()
    restored = round_trip(state)
    expected = [gen.random() for _ in range(5)]
    other = random.Random()
    other.setstate(restored)
    assert [other.random() for _ in range(5)] == expected


def test_numpy_random_state_round_trips_and_resumes_the_stream() -> None:
    rs = np.random.RandomState(77)
    rs.standard_normal(3)  # leave a cached gaussian
    state = rs.get_state()
    restored = round_trip(state)
    expected = rs.standard_normal(7)
    other = np.random.RandomState()
    other.set_state(restored)
    assert other.standard_normal(7).tobytes() == expected.tobytes()


def test_numpy_generator_state_round_trips_and_resumes_the_stream() -> None:
    gen = np.random.default_rng(5)
    gen.integers(0, 10, 3)
    restored = round_trip(gen.bit_generator.state)
    want = gen.random(4)
    other = np.random.default_rng()
    other.bit_generator.state = restored
    assert other.random(4).tobytes() == want.tobytes()


def test_torch_generator_state_round_trips_and_resumes_the_stream() -> None:
    g = torch.Generator().manual_seed(42)
    torch.rand(3, generator=g)
    state = g.get_state()
    restored = round_trip(state)
    want = torch.randn(6, generator=g)
    g2 = torch.Generator()
    g2.set_state(restored)
    assert torch.equal(u8(torch.randn(6, generator=g2)), u8(want))


def test_nested_state_with_int_keys_bytes_tensors_and_arrays() -> None:
    tree = {
        0: {"lr": 3e-4, "betas": (0.9, 0.999), "flags": [True, False, None]},
        -7: (b"\x00\xffraw", "text", -(2**63), 2**64 - 1),
        "tensors": {name_of(d): _patterned(d, (3, 2), seed) for seed, d in enumerate(DTYPES)},
        "c128": torch.tensor([complex(float("nan"), -0.0)], dtype=torch.complex128),
        "scalar": torch.tensor(-0.0),
        "empty": torch.empty(0, 4, dtype=torch.int16),
        "arrays": [
            np.arange(12, dtype=np.int64).reshape(3, 4),
            np.array([np.nan, -0.0, np.inf, 5e-324]),
            np.frombuffer(_u("I", 0x7FC00001) * 3, dtype=np.float32).copy(),
            np.array([1, 2, 3], dtype=">i4"),
            np.zeros((0, 2), dtype=np.uint16),
            np.array([True, False]),
            np.array(3.5),
            np.array([1 + 2j], dtype=np.complex128),
        ],
        "nan": float("nan"),
        "neg_zero": -0.0,
        "nested_tuple": ((1, (2, (3, ()))),),
    }
    out = round_trip(tree)
    assert out[0]["betas"] == (0.9, 0.999)
    assert out["arrays"][3].dtype == np.dtype(">i4")
    assert math.copysign(1.0, out["neg_zero"]) == -1.0


def test_numpy_scalars_become_python_numbers() -> None:
    out = statecodec.unpack(statecodec.pack({"a": np.float32(1.5), "b": np.int64(-3), "c": np.bool_(True)}))
    assert out == {"a": 1.5, "b": -3, "c": True}


def test_unrecordable_state_is_a_clear_error() -> None:
    with pytest.raises(DecodeError, match="object"):
        statecodec.pack({"x": object()})
    assert statecodec.unpack(statecodec.pack({"big": 2**70, "neg": -(2**100)})) == {
        "big": 2**70, "neg": -(2**100)}
    with pytest.raises(DecodeError, match="too large"):
        statecodec.pack({"huge": 2**1000})


_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.text(max_size=8),
    st.binary(max_size=16),
)
_key = st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=6))
_trees = st.recursive(
    _leaf,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(_key, children, max_size=4),
    ),
    max_leaves=25,
)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(tree=_trees)
def test_state_tree_round_trip_property(tree: Any) -> None:
    round_trip(tree)
