"""The weights-stream codec alone: casts, patches of only the changed cast bits, keyframes,
and the digest of the cast weights (pure functions, no log)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eventlog import ConfigError, tensorcodec
from eventlog.events import TensorDelta
from eventlog.weightcodec import (
    CastTensor,
    Published,
    WeightsConfig,
    cast_digest,
    cast_weights,
    digest_table,
    encode_cast,
    encode_version,
    same_layout,
    serving_dtype,
    weights_digest,
)


def _state(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {"w": torch.randn(64, 32) * 0.05, "b": torch.randn(32), "n": torch.tensor(7)}


def _apply(chunks: list[TensorDelta], bits: dict[str, np.ndarray]) -> None:
    for delta in chunks:
        tensorcodec.decode_chunk(delta, bits[delta.name], "test")


def test_a_patch_holds_only_changed_cast_bits_and_rebuilds_the_cast_bit_for_bit() -> None:
    old = _state(0)
    new = {k: v.clone() for k, v in old.items()}
    new["w"][0, :4] += 0.01  # first chunk of w changes
    new["b"] += 1e-9  # below bf16's resolution: no cast bit changes
    prev, cur = cast_weights(old, "bfloat16"), cast_weights(new, "bfloat16")
    assert cur["w"].dtype == "bfloat16" and cur["n"].dtype == "int64"
    chunks = encode_version(cur, prev, 3, chunk_bytes=256)
    assert {(c.name, c.chunk_index, c.encoding, c.base_version) for c in chunks} == {("w", 0, "XOR", 3)}
    bits = {k: t.bits.copy() for k, t in prev.items()}
    _apply(chunks, bits)
    for k in cur:
        assert np.array_equal(bits[k], cur[k].bits), k
    want = new["w"].to(torch.bfloat16).view(torch.uint8).reshape(-1).numpy()
    assert np.array_equal(bits["w"], want)


def test_a_keyframe_is_every_chunk_full_and_its_digest_comes_from_chunk_digests() -> None:
    cur = cast_weights(_state(1), "float16")
    chunks = encode_version(cur, None, 0, chunk_bytes=512)
    assert all(c.encoding == TensorDelta.FULL for c in chunks)
    bits = {k: np.zeros_like(t.bits) for k, t in cur.items()}
    _apply(chunks, bits)
    assert all(np.array_equal(bits[k], cur[k].bits) for k in cur)
    specs = {k: t.spec for k, t in cur.items()}
    table: dict[str, list[bytes]] = {}
    for c in chunks:
        table.setdefault(c.name, [b""] * c.chunk_count)[c.chunk_index] = c.digest
    assert weights_digest(specs, table) == cast_digest(cur, 512)
    assert table == digest_table(cur, 512)
    flipped = dict(table, w=[bytes(16)] + table["w"][1:])
    assert weights_digest(specs, flipped) != cast_digest(cur, 512)


def test_layout_and_config_checks() -> None:
    a, b = cast_weights(_state(0), "bfloat16"), cast_weights(_state(0), "float32")
    assert same_layout(a, a) and not same_layout(a, b)
    assert serving_dtype(torch.bfloat16) == serving_dtype("bf16") == "bfloat16"
    with pytest.raises(ConfigError, match=r"serving dtype 'int8': use one of bfloat16, float16, float32"):
        serving_dtype("int8")
    with pytest.raises(ConfigError, match="keyframe_every >= 1"):
        WeightsConfig(keyframe_every=0)
    assert WeightsConfig(dtype="fp16").dtype == "float16"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_one_pass_encoder_writes_what_a_whole_cast_and_patch_write(dtype: str) -> None:
    """``encode_cast`` (each chunk cast in cache, written over the published bits) gives the
    chunks, the bits and the digest of ``cast_weights`` + ``encode_version``: NaNs,
    infinities, subnormals and values past the dtype's range included, fp64 and int sources
    too, at chunk sizes that cut elements' runs anywhere on the 16-byte grid."""
    def state(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(3000, generator=g) * 0.05
        w[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -1e-42, 7e4, 3.4e38, 0.0])
        return {"w": w, "d": torch.randn(77, 5, generator=g, dtype=torch.float64), "n": torch.tensor(seed),
                "e": torch.empty(0)}

    for chunk in (16, 48, 256):
        prev_state, new_state = state(0), state(0)
        new_state["w"][100:140] += 0.01
        new_state["n"] += 1
        prev, cur = cast_weights(prev_state, dtype), cast_weights(new_state, dtype)
        kept = Published.of({k: CastTensor(t.dtype, t.shape, t.bits.copy()) for k, t in prev.items()}, chunk)
        keyframe, first = encode_cast(prev_state, dtype, None, 9, chunk)
        assert keyframe == encode_version(prev, None, 0, chunk)
        assert first.table == kept.table and first.digest() == cast_digest(prev, chunk)
        patch, second = encode_cast(new_state, dtype, kept, 4, chunk)
        assert patch == encode_version(cur, prev, 4, chunk) and patch
        assert second is kept and all(np.array_equal(second.tensors[k].bits, cur[k].bits) for k in cur)
        assert second.digest() == cast_digest(cur, chunk) and second.table == digest_table(cur, chunk)
