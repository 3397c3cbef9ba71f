"""Which shard owns which tensor: a fixed, size-balanced assignment recorded in ``RunStarted``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import xxhash

from .events import TensorSpec
from .tensorcodec import nbytes_of


def assign_shards(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    shards: int,
    previous: Sequence[TensorSpec] = (),
) -> tuple[TensorSpec, ...]:
    """Assign ``{name: (dtype, shape)}`` to ``shards`` shards, balancing bytes.

    Tensors already in ``previous`` keep their shard, so a layout that grows (an optimizer
    whose state appears at its first step) never moves a tensor between partitions. New
    tensors go, largest first, to the lightest shard.
    """
    kept = {s.name: s.shard for s in previous if s.name in tensors}
    load = [0] * shards
    for name, shard in kept.items():
        load[shard] += nbytes_of(*tensors[name])
    new = sorted(
        (n for n in tensors if n not in kept), key=lambda n: (-nbytes_of(*tensors[n]), n)
    )
    for name in new:
        shard = min(range(shards), key=lambda s: (load[s], s))
        kept[name] = shard
        load[shard] += nbytes_of(*tensors[name])
    return tuple(
        TensorSpec(name=n, dtype=tensors[n][0], shape=tuple(tensors[n][1]), shard=kept[n])
        for n in sorted(tensors)
    )


def config_digest(specs: Sequence[TensorSpec], small_states: Sequence[str]) -> str:
    """A short digest of a run's layout: names, dtypes, shapes, shards and small-state names."""
    h = xxhash.xxh3_64()
    for s in sorted(specs, key=lambda s: s.name):
        h.update(f"{s.name}|{s.dtype}|{s.shape}|{s.shard};".encode())
    for n in sorted(small_states):
        h.update(f"{n};".encode())
    return h.hexdigest()
