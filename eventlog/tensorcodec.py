"""The exact tensor delta codec: XOR against the last committed bits, shuffle, compress, chunk.

A tensor's raw bits are cut into chunks of ``Settings.chunk_bytes``. Each chunk is encoded
on its own, so chunks encode and decode in parallel and each fits one log message:

* ``XOR``: new bits XOR the bits of ``base_version``; unchanged chunks are not written at all.
* ``FULL``: the bits themselves; used on a tensor's first commit, and whenever the XOR
  delta compresses worse than the bits do.

Compression is blosc2 (byte shuffle + zstd level 1, chosen by measurement: see
docs/performance.md), or ``none`` when compressing does not pay. Every chunk carries the
xxh3-128 of the bits it produces, checked on decode: a damaged payload is never applied.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import TypeVar

import blosc2
import numpy as np
import torch
import xxhash

from eventlog.errors import ChunkDigestError, ConfigError, CorruptMessageError, DecodeError
from eventlog.events import TensorDelta
from eventlog.settings import current

T = TypeVar("T")

#: torch dtypes Rewind records, by the name used in events.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16,
        torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
        torch.complex64, torch.complex128,
    )
}
COMPRESSIONS = ("none", "blosc2-zstd", "blosc2-lz4")
#: blosc2's codec behind each compression name. zstd packs state deltas best. Gradients
#: (mostly noisy mantissas) are logged raw by default (``Settings.grad_compression``): every
#: replayed version reads a whole gradient, and compression saves little of it
#: (docs/performance.md, "Choices measured").
_CODECS = {"blosc2-zstd": blosc2.Codec.ZSTD, "blosc2-lz4": blosc2.Codec.LZ4}
# python-blosc2 keeps the GIL while it (de)compresses unless told otherwise; chunks are
# encoded and decoded in thread pools, so without this they would run one at a time.
blosc2.set_releasegil(True)
#: Above this compressed/raw ratio, an XOR chunk is also tried as FULL.
_TRY_FULL_ABOVE = 0.85


def dtype_name(dtype: torch.dtype) -> str:
    """The event name of a torch dtype (``torch.bfloat16`` -> ``bfloat16``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise DecodeError(f"dtype {name} is not supported; supported: {', '.join(DTYPES)}")
    return name


def torch_dtype(name: str, where: str = "event") -> torch.dtype:
    """The torch dtype of an event's dtype name, or a clear error naming it."""
    try:
        return DTYPES[name]
    except KeyError:
        raise DecodeError(f"{where}: unknown dtype {name!r}") from None


def itemsize(name: str) -> int:
    """Bytes per element of a dtype name."""
    return torch_dtype(name).itemsize  # (not a tensor's element_size: a fold asks per record)


def nbytes_of(dtype: str, shape: tuple[int, ...], where: str = "event") -> int:
    """Byte size of a tensor, validated against negative dims and ``Settings.max_tensor_bytes``."""
    n, most = itemsize(dtype), current().max_tensor_bytes
    for d in shape:
        if d < 0:
            raise DecodeError(f"{where}: negative dimension in shape {shape}")
        n *= d
        if n > most:
            raise DecodeError(
                f"{where}: shape {shape} of {dtype} needs more than the "
                f"{most} bytes allowed (REWIND_MAX_TENSOR_BYTES)"
            )
    return n


def tensor_bits(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a CPU tensor's raw bits (no copy when contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    # Viewing as uint8 keeps dtypes numpy lacks (bfloat16) bit-exact.
    return t.view(torch.uint8).numpy().reshape(-1) if t.numel() else np.empty(0, np.uint8)


#: Host buffers at least this large are memory maps of their own (``host_buffer``).
_MAP_AT_LEAST = 1 << 20


def host_buffer(nbytes: int) -> np.ndarray:
    """A writable uint8 buffer of ``nbytes`` for a copy of tensor bits kept across commits
    (the recorder's staging and base copies). A large one is an anonymous memory map of its
    own rather than malloc heap: the trainer's gradients, freed and allocated again every
    step, then never sit below it in the heap, where freed memory cannot go back to the
    kernel; and dropping it returns its memory at once. It asks for transparent huge pages
    where the kernel offers them (first-touch faults per 2 MiB rather than per 4 KiB)."""
    if nbytes < _MAP_AT_LEAST:
        return np.empty(nbytes, dtype=np.uint8)
    region = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, dtype=np.uint8)


def bits_to_tensor(bits: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor that owns a copy of ``bits`` reinterpreted as ``dtype`` / ``shape``."""
    if bits.size == 0:  # torch cannot view an empty uint8 tensor as a wider dtype
        return torch.empty(0, dtype=torch_dtype(dtype)).reshape(shape)
    t = torch.from_numpy(bits.copy()).view(torch_dtype(dtype))
    return t.reshape(shape)


def digest(bits: np.ndarray | bytes | memoryview) -> bytes:
    """xxh3-128 of raw bits."""
    return xxhash.xxh3_128_digest(bits)  # type: ignore[arg-type]  # numpy arrays are buffers


def chunk_ranges(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each chunk of a tensor of ``nbytes`` raw bytes."""
    step = max(16, chunk_bytes - chunk_bytes % 16)
    return [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]


@dataclass(frozen=True)
class EncodedChunk:
    """One encoded chunk, ready to become a ``TensorDelta`` body."""

    chunk_index: int
    chunk_count: int
    byte_offset: int
    byte_length: int
    encoding: str
    compression: str
    base_version: int
    digest: bytes
    payload: bytes

    def to_delta(self, name: str, dtype: str, shape: tuple[int, ...]) -> TensorDelta:
        """The ``TensorDelta`` event body of this chunk of tensor ``name``."""
        return TensorDelta(name, dtype, shape, self.chunk_index, self.chunk_count,
                           self.byte_offset, self.byte_length, self.encoding, self.compression,
                           self.base_version, self.digest, self.payload)


def _compress(data: np.ndarray, typesize: int, compression: str = "blosc2-zstd") -> bytes:
    if compression == "none":
        return data.tobytes()
    codec = _CODECS.get(compression)
    if codec is None:
        raise ConfigError(f"unknown compression {compression!r}: use one of {', '.join(COMPRESSIONS)}")
    return bytes(
        blosc2.compress2(
            data, typesize=typesize, clevel=current().zstd_level if codec == blosc2.Codec.ZSTD else 1,
            codec=codec, filters=[blosc2.Filter.SHUFFLE], nthreads=1,
        )
    )


def encode_chunk(
    new: np.ndarray,
    prev: np.ndarray | None,
    *,
    typesize: int,
    base_version: int,
    index: int,
    count: int,
    offset: int,
    compression: str = "blosc2-zstd",
) -> EncodedChunk | None:
    """Encode one chunk of new bits against the previous bits; ``None`` if nothing changed.

    ``compression`` is ``none`` (raw) or a blosc2 codec (a chunk that does not shrink is
    stored raw)."""
    if prev is not None:
        delta = np.bitwise_xor(new, prev, out=chunk_scratch(len(new)))
        if not delta.any():  # unchanged: nothing to write (one pass fewer than comparing first)
            return None
        payload, encoding = _compress(delta, typesize, compression), TensorDelta.XOR
        if len(payload) > _TRY_FULL_ABOVE * len(new):
            full = _compress(new, typesize, compression)
            if len(full) < len(payload):
                payload, encoding = full, TensorDelta.FULL
    else:
        payload, encoding = _compress(new, typesize, compression), TensorDelta.FULL
    if len(payload) >= len(new) and not (encoding == TensorDelta.FULL and compression == "none"):
        # Incompressible bits: store them raw (FULL) rather than pay for a decompress.
        payload, encoding, compression = new.tobytes(), TensorDelta.FULL, "none"
    return EncodedChunk(
        chunk_index=index,
        chunk_count=count,
        byte_offset=offset,
        byte_length=len(new),
        encoding=encoding,
        compression=compression,
        base_version=base_version if encoding == TensorDelta.XOR else -1,
        digest=digest(new),
        payload=payload,
    )


def encode_tensor(
    new: np.ndarray,
    prev: np.ndarray | None,
    *,
    typesize: int,
    base_version: int,
    chunk_bytes: int | None = None,
) -> list[EncodedChunk]:
    """Encode every changed chunk of a tensor (sequentially; callers parallelise over chunks)."""
    ranges = chunk_ranges(len(new), chunk_bytes or current().chunk_bytes)
    out = []
    for i, (off, n) in enumerate(ranges):
        chunk = encode_chunk(
            new[off : off + n], None if prev is None else prev[off : off + n],
            typesize=typesize, base_version=base_version, index=i, count=len(ranges), offset=off,
        )
        if chunk is not None:
            out.append(chunk)
    return out


def map_ordered(pool: Executor, calls: Iterable[Callable[[], T]], window: int) -> Iterator[T]:
    """The results of ``calls``, run on ``pool``, in order; at most ``window`` of them running
    or done but not yet taken. Encoded chunks are written as they come: a version's payloads
    are never all held at once, and their buffers are reused by the allocator instead of
    piling up."""
    pending: deque[Future[T]] = deque()
    try:
        for call in calls:
            if len(pending) >= max(1, window):
                yield pending.popleft().result()
            pending.append(pool.submit(call))
        while pending:
            yield pending.popleft().result()
    finally:
        for fut in pending:  # the caller stopped early (an error): drop what was not started
            fut.cancel()


#: Encodings whose payload is the bits themselves, and those XORed onto the target (a
#: residual is XORed onto the bits the replayed optimizer step predicted).
_BITS = (TensorDelta.FULL, TensorDelta.GRAD)
_XORED = (TensorDelta.XOR, TensorDelta.RESIDUAL)


def decode_chunk(delta: TensorDelta, bits: np.ndarray, where: str, *, verify: bool = True) -> None:
    """Apply one chunk to a tensor's raw bits in place, after validating every field
    (its digest unless ``verify`` is false).

    ``bits`` is the tensor's whole uint8 buffer. On any error nothing is written to it.
    """
    check_chunk(delta, len(bits), where)
    off, n = delta.byte_offset, delta.byte_length
    plain = _plain(delta, where, _scratch(n))
    target = bits[off : off + n]
    if delta.encoding in _BITS:
        if verify:
            _check_digest(delta, plain, where)
        target[:] = plain
        return
    # XOR in place (no new array, one pass fewer); a wrong digest XORs the same bits back,
    # which restores the target exactly, before raising.
    np.bitwise_xor(target, plain, out=target)
    if not verify:
        return
    try:
        got = digest(target)
    except BaseException:
        np.bitwise_xor(target, plain, out=target)
        raise
    if got != delta.digest:
        np.bitwise_xor(target, plain, out=target)
        raise _digest_error(delta, got, where)


def check_result(delta: TensorDelta, bits: np.ndarray, where: str) -> None:
    """Fail unless applying the chunk to ``bits`` (a tensor's whole uint8 buffer) would give
    the bits its digest names; ``bits`` is not written (a caller that must apply several
    chunks all or nothing checks each first)."""
    check_chunk(delta, len(bits), where)
    off, n = delta.byte_offset, delta.byte_length
    plain = _plain(delta, where, _scratch(n))
    if delta.encoding not in _BITS:
        plain = np.bitwise_xor(bits[off : off + n], plain, out=chunk_scratch(n))
    _check_digest(delta, plain, where)


def check_chunk(delta: TensorDelta, total: int, where: str) -> None:
    """Fail unless ``delta`` is a well-formed chunk of a ``total``-byte tensor (its range is
    where ``chunk_ranges`` puts it, its encoding and compression are known)."""
    off, n = delta.byte_offset, delta.byte_length
    if not _is_chunk_of(total, delta.chunk_index, delta.chunk_count, off, n):
        raise CorruptMessageError(
            f"{where}: chunk {delta.chunk_index}/{delta.chunk_count} range "
            f"[{off}, {off + n}) is not a chunk of tensor {delta.name!r} of {total} bytes"
        )
    if delta.encoding not in _BITS and delta.encoding not in _XORED:
        raise CorruptMessageError(f"{where}: unknown encoding {delta.encoding!r}")
    if delta.compression not in COMPRESSIONS:
        raise CorruptMessageError(f"{where}: unknown compression {delta.compression!r}")


def decode_bits_into(delta: TensorDelta, out: np.ndarray, where: str, *, verify: bool = True) -> None:
    """Decode a ``FULL`` or ``GRAD`` chunk (already passed ``check_chunk``) straight into
    ``out`` (``byte_length`` bytes, e.g. a cache-sized tile buffer), checking its digest
    unless ``verify`` is false (see ``raw_bits``). On a bad digest ``out`` holds garbage;
    the caller must not use it."""
    if delta.encoding not in _BITS:
        raise CorruptMessageError(f"{where}: a {delta.encoding} chunk where bits were expected")
    plain = _plain(delta, where, out)
    if plain is not out:
        out[:] = plain
    if verify:
        _check_digest(delta, out, where)


def is_raw(delta: TensorDelta) -> bool:
    """Whether ``raw_bits`` serves the chunk's bits as a view of its payload: a ``FULL`` or
    ``GRAD`` chunk stored uncompressed."""
    return delta.compression == "none" and delta.encoding in _BITS


def raw_bits(delta: TensorDelta, where: str, *, verify: bool = True) -> np.ndarray | None:
    """A ``FULL`` or ``GRAD`` chunk (already passed ``check_chunk``) stored uncompressed:
    its bits as a read-only view of the payload, digest checked (see ``verify``); ``None``
    for any other chunk. Saves a copy where the bits are only read (a replayed step's
    gradient).

    ``verify=False`` skips the digest, for a caller whose result is checked against a seal
    before anyone sees it (a batched replay, ``eventlog.fold.deferred``): the length is still
    checked, and any bits are valid numbers."""
    if not is_raw(delta):
        return None
    plain = _raw(delta, where)
    if verify:
        _check_digest(delta, plain, where)
    return plain


def _raw(delta: TensorDelta, where: str) -> np.ndarray:
    """An uncompressed chunk's payload as read-only bytes, its length checked."""
    if len(delta.payload) != delta.byte_length:
        raise CorruptMessageError(f"{where}: raw payload is {len(delta.payload)} bytes, "
                                  f"want {delta.byte_length}")
    return np.frombuffer(delta.payload, dtype=np.uint8)


def _plain(delta: TensorDelta, where: str, out: np.ndarray) -> np.ndarray:
    """The chunk's plain bytes: its raw payload, or its payload decompressed into ``out``."""
    if delta.compression == "none":
        return _raw(delta, where)
    if delta.compression in _CODECS:
        return _decompress(delta.payload, delta.byte_length, where, out=out)
    raise CorruptMessageError(f"{where}: unknown compression {delta.compression!r}")


def _check_digest(delta: TensorDelta, plain: np.ndarray, where: str) -> None:
    got = digest(plain)
    if got != delta.digest:
        raise _digest_error(delta, got, where)


def _digest_error(delta: TensorDelta, got: bytes, where: str) -> ChunkDigestError:
    return ChunkDigestError(
        f"{where}: chunk {delta.chunk_index} of tensor {delta.name!r} produces bits whose "
        f"xxh3 digest {got.hex()} differs from the recorded {delta.digest.hex()}"
    )


#: Per-thread decompression buffer (decode threads each reuse one, grown as needed).
_local = threading.local()


def _scratch(n: int) -> np.ndarray:
    """This thread's reusable buffer, ``n`` bytes long. Its contents are only valid until
    the thread's next decode: callers copy or XOR them out right away."""
    buf: np.ndarray | None = getattr(_local, "buf", None)
    if buf is None or len(buf) < n:
        buf = _local.buf = np.empty(n, dtype=np.uint8)
    return buf[:n]


def chunk_scratch(n: int) -> np.ndarray:
    """This thread's reusable encoding buffer, ``n`` bytes long: one per encoding thread
    instead of a fresh chunk-sized array per chunk for the allocator to keep. ``encode_chunk``
    XORs into it, and the predictive codec copies a gradient tile into it before encoding
    that tile with no base (which does not use it): one buffer per codec thread serves both.
    Its contents are only valid until the thread's next use."""
    buf: np.ndarray | None = getattr(_local, "chunk", None)
    if buf is None or len(buf) < n:
        buf = _local.chunk = np.empty(n, dtype=np.uint8)
    return buf[:n]


def _is_chunk_of(total: int, index: int, count: int, off: int, n: int) -> bool:
    """Whether ``[off, off+n)`` is chunk ``index`` of ``count`` of a ``total``-byte tensor,
    as ``chunk_ranges`` cuts it (all chunks but the last have one size, a multiple of 16).
    A valid payload moved to another place is refused before its digest is even checked."""
    if not (0 <= index < count) or off < 0 or n <= 0 or off + n > total:
        return False
    if index < count - 1:
        step = n
    elif index == 0:
        return off == 0 and n == total and count == 1
    else:
        step, rest = divmod(off, index)
        if rest or off + n != total or n > step:
            return False
    return step % 16 == 0 and off == index * step and count == -(-total // step)


def _decompress(payload: bytes, n: int, where: str, out: np.ndarray | None = None) -> np.ndarray:
    """The ``n`` bytes a blosc2 payload holds, written into ``out`` (``n`` bytes) if given.

    One blosc2 thread per call: decodes already run one per worker thread (chunks of
    several shards in parallel), so blosc2's own threads would only oversubscribe the
    cores, and make a one-worker replay quietly use two.
    """
    # Check blosc2's own header before handing it the buffer: a forged header must not
    # make the decompressor allocate or write past what the event claims.
    try:
        nbytes, cbytes, _ = blosc2.get_cbuffer_sizes(payload)
    except Exception as exc:
        raise CorruptMessageError(f"{where}: compressed payload has no valid blosc2 header") from exc
    if nbytes != n or cbytes != len(payload):
        raise CorruptMessageError(
            f"{where}: blosc2 header claims {nbytes} bytes from {cbytes}, "
            f"event claims {n} from {len(payload)}"
        )
    if out is None:
        out = np.empty(n, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.shape != (n,) or not out.flags.c_contiguous:
        raise ValueError(f"decompress buffer must be {n} contiguous bytes")
    try:
        got = blosc2.decompress2(payload, dst=out, nthreads=1)
    except Exception as exc:
        raise CorruptMessageError(f"{where}: payload does not decompress ({exc})") from exc
    if got is not None and got != n:  # some versions return the size written
        raise CorruptMessageError(f"{where}: payload decompresses to {got} bytes, want {n}")
    return out
