"""The weights-stream codec: a model's tensors cast to a serving dtype, the patch from one
published version to the next, and the digest of the cast weights.

A patch holds, per tensor, only the chunks whose cast bits changed, each XORed with the
previous published bits and compressed (``tensorcodec.encode_chunk``: byte shuffle + zstd;
a chunk that packs better whole is stored ``FULL``). A keyframe holds every chunk ``FULL``.
Every chunk carries the xxh3-128 of the bits it produces, and the digest of a version's cast
weights is built from those chunk digests, so a reader checks a patch against its seal
before applying any of it. Pure: no I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from eventlog import tensorcodec
from eventlog.digests import chunk_digests, shard_digest, tensor_digest
from eventlog.errors import ConfigError
from eventlog.events import TensorDelta

#: The dtypes a weights stream can be published in.
SERVING_DTYPES = ("bfloat16", "float16", "float32")
_MiB = 1024 * 1024


def serving_dtype(dtype: str | torch.dtype) -> str:
    """The stream name of a serving dtype (``torch.bfloat16`` or ``"bf16"`` -> ``bfloat16``)."""
    name = tensorcodec.dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32"}.get(name, name)
    if name not in SERVING_DTYPES:
        raise ConfigError(f"serving dtype {dtype!r}: use one of {', '.join(SERVING_DTYPES)}")
    return name


@dataclass(frozen=True)
class WeightsConfig:
    """How a run's weights stream is published: dtype, keyframe cadence, retention."""

    #: The serving dtype floating tensors are cast to (other tensors keep their dtype).
    dtype: str = "bfloat16"
    #: A keyframe (the full cast weights) every this many versions.
    keyframe_every: int = 32
    #: Keyframes kept; the stream below the oldest kept one (its patches too) is deleted.
    keep_keyframes: int = 2
    #: Raw bytes of cast bits per chunk (one stream message).
    chunk_bytes: int = 4 * _MiB

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", serving_dtype(self.dtype))
        if self.keyframe_every < 1 or self.keep_keyframes < 1:
            raise ConfigError(f"weights stream needs keyframe_every >= 1 and keep_keyframes >= 1 "
                              f"(got {self.keyframe_every}, {self.keep_keyframes})")
        if self.chunk_bytes < 16 or self.chunk_bytes % 16:
            raise ConfigError(f"weights chunk_bytes must be a positive multiple of 16, "
                              f"got {self.chunk_bytes}")


@dataclass(frozen=True)
class CastTensor:
    """One tensor as published: its dtype name, shape and raw bits (uint8)."""

    dtype: str
    shape: tuple[int, ...]
    bits: np.ndarray

    @property
    def spec(self) -> tuple[str, tuple[int, ...]]:
        """``(dtype, shape)``."""
        return self.dtype, self.shape


def cast_tensor(t: torch.Tensor, dtype: str) -> CastTensor:
    """``t`` cast to ``dtype`` if it is floating point (others keep theirs), as raw bits."""
    t = t.detach().cpu()
    if t.is_floating_point():
        t = t.to(tensorcodec.torch_dtype(dtype))
    name = tensorcodec.dtype_name(t.dtype)
    return CastTensor(name, tuple(t.shape), tensorcodec.tensor_bits(t).copy())


def cast_weights(tensors: Mapping[str, torch.Tensor], dtype: str) -> dict[str, CastTensor]:
    """Every tensor cast (``cast_tensor``), by name."""
    return {name: cast_tensor(t, dtype) for name, t in tensors.items()}


def encode_version(
    new: Mapping[str, CastTensor], prev: Mapping[str, CastTensor] | None, base_version: int,
    chunk_bytes: int,
) -> list[TensorDelta]:
    """The chunks of a patch of ``new`` against ``prev`` (published as ``base_version``), in
    name order; every chunk ``FULL`` (a keyframe) when ``prev`` is ``None``. ``prev`` must
    hold the same names, dtypes and shapes (``same_layout``)."""
    out: list[TensorDelta] = []
    for name in sorted(new):
        t = new[name]
        old = None if prev is None else prev[name].bits
        ranges = tensorcodec.chunk_ranges(len(t.bits), chunk_bytes)
        for i, (off, n) in enumerate(ranges):
            chunk = tensorcodec.encode_chunk(
                t.bits[off : off + n], None if old is None else old[off : off + n],
                typesize=tensorcodec.itemsize(t.dtype), base_version=base_version, index=i,
                count=len(ranges), offset=off)
            if chunk is not None:
                out.append(chunk.to_delta(name, t.dtype, t.shape))
    return out


@dataclass
class Published:
    """The newest published version's cast weights and their chunk digests: the base the
    next patch is encoded against (``encode_cast`` brings it to the new version in place)."""

    tensors: dict[str, CastTensor]
    table: DigestTable

    @staticmethod
    def of(tensors: dict[str, CastTensor], chunk_bytes: int) -> Published:
        return Published(tensors, digest_table(tensors, chunk_bytes))

    def specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {n: t.spec for n, t in self.tensors.items()}

    def digest(self) -> bytes:
        """The digest of these cast weights (``weights_digest``)."""
        return weights_digest(self.specs(), self.table)


def cast_spec(t: torch.Tensor, dtype: str) -> tuple[str, tuple[int, ...]]:
    """``(dtype, shape)`` of ``t`` as ``cast_tensor`` publishes it."""
    return (dtype if t.is_floating_point() else tensorcodec.dtype_name(t.dtype)), tuple(t.shape)


def encode_cast(
    tensors: Mapping[str, torch.Tensor], dtype: str, prev: Published | None, base_version: int,
    chunk_bytes: int,
) -> tuple[list[TensorDelta], Published]:
    """``encode_version`` of ``cast_weights(tensors, dtype)`` against ``prev`` (every chunk
    ``FULL`` when ``None``), in one pass: each chunk is cast into a buffer that stays in
    cache, compared, encoded, and written over ``prev``'s bits only if it changed, so no cast
    copy of the whole model is made. Returns the chunks and ``prev`` brought to the new
    version (a new one for a keyframe); ``prev`` must have ``tensors``' cast layout."""
    if prev is None:
        fresh = {n: CastTensor(*cast_spec(t, dtype), np.empty(_nbytes(t, dtype), dtype=np.uint8))
                 for n, t in tensors.items()}
        base, base_version = Published(fresh, {}), 0
    else:
        base = prev
    out: list[TensorDelta] = []
    for name in sorted(tensors):
        src, dst = tensors[name].detach().reshape(-1), base.tensors[name]
        size = tensorcodec.itemsize(dst.dtype)
        ranges = tensorcodec.chunk_ranges(len(dst.bits), chunk_bytes)
        digests = base.table.setdefault(name, [b""] * len(ranges))
        for i, (off, n) in enumerate(ranges):
            new = _cast_scratch(n)
            _flat_view(new, dst.dtype).copy_(src[off // size:(off + n) // size])
            old = None if prev is None else dst.bits[off:off + n]
            chunk = tensorcodec.encode_chunk(new, old, typesize=size, base_version=base_version, index=i,
                                             count=len(ranges), offset=off)
            if chunk is not None:
                out.append(chunk.to_delta(name, dst.dtype, dst.shape))
                dst.bits[off:off + n] = new
                digests[i] = chunk.digest
    return out, base


def _nbytes(t: torch.Tensor, dtype: str) -> int:
    return t.numel() * tensorcodec.itemsize(cast_spec(t, dtype)[0])


_local = threading.local()


def _cast_scratch(n: int) -> np.ndarray:
    """This thread's buffer for one cast chunk (``tensorcodec.chunk_scratch`` is the XOR's)."""
    buf: np.ndarray | None = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _local.buf = np.empty(n, dtype=np.uint8)
    return buf[:n]


def _flat_view(bits: np.ndarray, dtype: str) -> torch.Tensor:
    """A flat tensor of ``dtype`` over uint8 ``bits``."""
    return torch.from_numpy(bits).view(tensorcodec.torch_dtype(dtype))


def same_layout(a: Mapping[str, CastTensor], b: Mapping[str, CastTensor]) -> bool:
    """Whether two versions hold the same names, dtypes and shapes."""
    return a.keys() == b.keys() and all(a[k].spec == b[k].spec for k in a)


#: Per tensor, the xxh3-128 of each chunk of its cast bits.
DigestTable = dict[str, list[bytes]]


def digest_table(tensors: Mapping[str, CastTensor], chunk_bytes: int) -> DigestTable:
    """The chunk digests of every tensor."""
    return {name: chunk_digests(t.bits, chunk_bytes) for name, t in tensors.items()}


def weights_digest(specs: Mapping[str, tuple[str, tuple[int, ...]]],
                   table: Mapping[str, Sequence[bytes]]) -> bytes:
    """The digest of a version's cast weights: each tensor's name, dtype, shape and chunk
    digests (``digests.tensor_digest``), in name order. Empty tensors (no chunks) are left
    out: a stream holds nothing of them."""
    return shard_digest({name: tensor_digest(name, dtype, shape, table[name])
                         for name, (dtype, shape) in specs.items() if table.get(name)})


def cast_digest(tensors: Mapping[str, CastTensor], chunk_bytes: int) -> bytes:
    """The digest of a version's cast weights, from the tensors themselves."""
    return weights_digest({n: t.spec for n, t in tensors.items()}, digest_table(tensors, chunk_bytes))
