"""State digests shared by the recorder (when sealing) and the replayer (when verifying).

A tensor's digest is built from the xxh3-128 of each of its chunks, so the recorder reuses
the chunk digests it computes while encoding and never hashes the state twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import xxhash

from eventlog.tensorcodec import chunk_ranges, digest


def chunk_digests(bits: np.ndarray, chunk_bytes: int) -> list[bytes]:
    """xxh3-128 of every chunk of a tensor's raw bits."""
    return [digest(bits[off : off + n]) for off, n in chunk_ranges(len(bits), chunk_bytes)]


def tensor_digest(name: str, dtype: str, shape: tuple[int, ...], chunks: Iterable[bytes]) -> bytes:
    """Digest of one tensor: its name, dtype, shape and chunk digests."""
    h = xxhash.xxh3_128()
    h.update(f"{name}\0{dtype}\0{','.join(map(str, shape))}\0".encode())
    for c in chunks:
        h.update(c)
    return h.digest()


def shard_digest(tensor_digests: Mapping[str, bytes]) -> bytes:
    """Digest of a shard: its tensors' digests in name order."""
    h = xxhash.xxh3_128()
    for name in sorted(tensor_digests):
        h.update(tensor_digests[name])
    return h.digest()


def small_digest(states: Mapping[str, bytes]) -> bytes:
    """Digest of every small state (msgpack bytes), in name order."""
    h = xxhash.xxh3_128()
    for name in sorted(states):
        h.update(name.encode() + b"\0")
        h.update(xxhash.xxh3_128_digest(states[name]))
    return h.digest()


def state_digest(shard_digests: Iterable[bytes], small: bytes) -> bytes:
    """The whole state's digest: every shard digest, then the small-state digest."""
    h = xxhash.xxh3_128()
    for d in shard_digests:
        h.update(d)
    h.update(small)
    return h.digest()
