"""Which shard owns which tensor: a fixed, size-balanced assignment recorded in ``RunStarted``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import xxhash

from eventlog.events import RunStarted, TensorSpec
from eventlog.tensorcodec import nbytes_of


def assign_shards(
    tensors: Mapping[str, tuple[str, tuple[int, ...]]],
    shards: int,
    previous: Sequence[TensorSpec] = (),
    owners: Mapping[str, str] | None = None,
) -> tuple[TensorSpec, ...]:
    """Assign ``{name: (dtype, shape)}`` to ``shards`` shards, balancing bytes.

    Tensors already in ``previous`` keep their shard, so a layout that grows (an optimizer
    whose state appears at its first step) never moves a tensor between partitions.
    ``owners`` maps a tensor to the tensor it must live with (an optimizer state to its
    param, so a shard can replay the optimizer step alone); a new tensor joins its owner's
    shard. The other new tensors go, largest group first, to the lightest shard.
    """
    owners = owners or {}
    kept = {s.name: s.shard for s in previous if s.name in tensors}
    load = [0] * shards
    for name, shard in kept.items():
        load[shard] += nbytes_of(*tensors[name])
    groups: dict[str, list[str]] = {}
    for name in tensors:
        if name not in kept:
            groups.setdefault(owners.get(name, name), []).append(name)

    def size(group: list[str]) -> int:
        return sum(nbytes_of(*tensors[n]) for n in group)

    for owner, members in sorted(groups.items(), key=lambda g: (-size(g[1]), g[0])):
        kept_shard = kept.get(owner)
        shard = (kept_shard if kept_shard is not None
                 else min(range(shards), key=lambda s: (load[s], s)))
        for name in members:
            kept[name] = shard
        load[shard] += size(members)
    return tuple(
        TensorSpec(name=n, dtype=tensors[n][0], shape=tuple(tensors[n][1]), shard=kept[n])
        for n in sorted(tensors)
    )


def intact(layout: RunStarted) -> bool:
    """Whether a layout record holds what its own config digest says (a damaged one would
    place tensors where no chunk of theirs ever was)."""
    return config_digest(layout.tensors, layout.small_states) == layout.config_digest


def config_digest(specs: Sequence[TensorSpec], small_states: Sequence[str]) -> str:
    """A short digest of a run's layout: names, dtypes, shapes, shards and small-state names."""
    h = xxhash.xxh3_64()
    for s in sorted(specs, key=lambda s: s.name):
        h.update(f"{s.name}|{s.dtype}|{s.shape}|{s.shard};".encode())
    for n in sorted(small_states):
        h.update(f"{n};".encode())
    return h.hexdigest()
