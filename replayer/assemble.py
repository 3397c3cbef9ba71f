"""Full tensors of a multi-rank run, assembled from the local shards its ranks recorded.

A run recorded by ``Recorder(..., group=...)`` holds, per rank ``r``, its small states as
``rank<r>/<name>``, the local shard of each sharded DTensor as ``rank<r>/<path>``, and
``layout/rank<r>``: each DTensor's global shape, stride, mesh shape, mesh coordinate and
placements (``S(d)``: sharded along dim ``d``, ``R``: replicated). From these this module
rebuilds the run as one process would have recorded it (``full_state``: names without the
rank prefix, full tensors) for ``rewind export``, followers and a restore into a plain model,
and cuts the region of a full tensor that a rank of another world size holds (``region``).

Shards follow DTensor's ``Shard(d)``: along a mesh dimension of size ``k`` a dimension of
length ``n`` is cut into chunks of ``ceil(n / k)`` (the last ones shorter or empty).
Per-rank small states at another world size: rank ``r`` of ``M`` takes recorded rank ``r``'s
when ``r < N`` (the recorded world size), else recorded rank ``r mod N``'s (``source_rank``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from eventlog import statecodec, tensorcodec
from eventlog.capture import holds_refs
from eventlog.errors import DecodeError, StateMismatchError
from eventlog.events import TensorSpec
from eventlog.fold.apply import ShardState
from eventlog.fold.bits import TensorBits
from eventlog.fold.engine import RebuiltState
from eventlog.statecodec import TensorRef

LAYOUT = "layout/rank"
_RANK = re.compile(r"rank(\d+)/")


def rank_prefix(rank: int) -> str:
    """The name prefix of rank ``rank``'s own tensors and small states."""
    return f"rank{rank}/"


def rank_of(name: str) -> int | None:
    """The rank whose own tensor or small state ``name`` is (``None``: not a rank's own)."""
    m = _RANK.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Placed:
    """One DTensor as one rank recorded it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    mesh: tuple[int, ...]
    placements: tuple[str, ...]
    coord: tuple[int, ...]

    @property
    def sharded(self) -> bool:
        """True when some mesh dimension shards it (its local tensor is not the full one)."""
        return any(p != "R" for p in self.placements)


def shard_dim(name: str, where: str) -> int | None:
    """The tensor dimension placement ``name`` shards (``None``: ``R``, replicated)."""
    if name == "R":
        return None
    if name.startswith("S(") and name.endswith(")") and name[2:-1].isdigit():
        return int(name[2:-1])
    raise DecodeError(f"{where}: unknown placement {name!r}")


def rank_layout(states: Mapping[str, bytes], rank: int) -> tuple[int, dict[str, Placed]]:
    """The world size rank ``rank`` recorded and its DTensors' layout, by log name."""
    where = f"small state '{LAYOUT}{rank}'"
    raw = states.get(f"{LAYOUT}{rank}")
    if raw is None:
        raise StateMismatchError(f"the run recorded no layout of rank {rank}")
    tree = statecodec.unpack(raw, where)
    try:
        world = int(tree["world"])
        out = {}
        for name, e in tree["tensors"].items():
            mesh = tuple(int(x) for x in e["mesh"])
            coord = tuple(int(x) for x in e["coord"])
            placements = tuple(str(p) for p in e["placements"])
            for p in placements:
                shard_dim(p, where)
            if len(coord) != len(mesh) or len(placements) != len(mesh):
                raise DecodeError(f"{where}: tensor {name!r} has mesh {list(mesh)}, coordinate {list(coord)} "
                                  f"and placements {list(placements)} of different lengths")
            out[str(name)] = Placed(tuple(int(x) for x in e["shape"]), tuple(int(x) for x in e["stride"]),
                                    mesh, placements, coord)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DecodeError(f"{where} cannot be read: {exc!r}") from exc
    return world, out


def recorded_world(states: Mapping[str, bytes], tensor_names: Sequence[str] | set[str]) -> int:
    """The world size of the multi-rank run whose version has these small states and tensors;
    0 for a run one process recorded (or one a plain ``Recorder`` continued: rank 0's
    skeletons then refer to tensors the version no longer has)."""
    if f"{LAYOUT}0" not in states:
        return 0
    names = set(tensor_names)
    prefix = rank_prefix(0)
    for name, raw in states.items():
        if name.startswith(prefix):
            refs: set[str] = set()
            collect_refs(statecodec.unpack(raw, f"small state {name!r}"), refs)
            if not refs <= names:
                return 0
    return rank_layout(states, 0)[0]


def source_rank(rank: int, recorded: int) -> int:
    """The recorded rank whose small states (RNG, sampler, ...) rank ``rank`` restores."""
    return rank if rank < recorded else rank % recorded


def collect_refs(node: Any, into: set[str]) -> None:
    """Add the name of every ``TensorRef`` in a skeleton to ``into``."""
    if isinstance(node, TensorRef):
        into.add(node.name)
    elif isinstance(node, dict):
        for v in node.values():
            collect_refs(v, into)
    elif isinstance(node, list | tuple):
        for v in node:
            collect_refs(v, into)


def rename_refs(node: Any, rename: Mapping[str, str]) -> Any:
    """A skeleton whose ``TensorRef`` s are renamed by ``rename``."""
    if isinstance(node, TensorRef):
        return TensorRef(rename.get(node.name, node.name))
    if isinstance(node, dict):
        return {k: rename_refs(v, rename) for k, v in node.items()}
    if isinstance(node, list):
        return [rename_refs(v, rename) for v in node]
    if isinstance(node, tuple):
        return tuple(rename_refs(v, rename) for v in node)
    return node


def region(shape: Sequence[int], mesh: Sequence[int], placements: Sequence[str],
           coord: Sequence[int]) -> tuple[slice, ...]:
    """The part of a full tensor of ``shape`` that the rank at ``coord`` of ``mesh`` holds."""
    start, stop = [0] * len(shape), list(shape)
    for size, placement, at in zip(mesh, placements, coord, strict=True):
        dim = shard_dim(placement, "placement")
        if dim is None:
            continue
        n = stop[dim] - start[dim]
        chunk = -(-n // size)
        lo = min(at * chunk, n)
        start[dim], stop[dim] = start[dim] + lo, start[dim] + min(n, lo + chunk)
    return tuple(slice(a, b) for a, b in zip(start, stop, strict=True))


def assemble(path: str, world: int, layouts: Sequence[Mapping[str, Placed]],
             local: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The full tensor at ``path`` (``model/fc.weight``) from every rank's local shard."""
    first = layouts[0][rank_prefix(0) + path]
    full: torch.Tensor | None = None
    for rank in range(world):
        name = rank_prefix(rank) + path
        placed, part = layouts[rank].get(name), local.get(name)
        if placed is None or part is None:
            raise StateMismatchError(f"the run recorded no shard of {path!r} for rank {rank}")
        if full is None:
            full = torch.empty(first.shape, dtype=part.dtype)
        cut = region(placed.shape, placed.mesh, placed.placements, placed.coord)
        if tuple(s.stop - s.start for s in cut) != tuple(part.shape):
            raise StateMismatchError(f"rank {rank}'s shard of {path!r} has shape {list(part.shape)}, but its "
                                     f"layout gives {[s.stop - s.start for s in cut]}")
        full[cut] = part
    assert full is not None
    return full


def full_tensors(states: Mapping[str, bytes], bits: Mapping[str, TensorBits], world: int,
                 names: Collection[str] | None = None) -> tuple[dict[str, bytes], dict[str, torch.Tensor]]:
    """A multi-rank version as one process would have recorded it: rank 0's small states
    without the prefix (their skeletons renamed), and every tensor they refer to, full.
    ``names``: only these states (plain names, e.g. ``model``) and their tensors."""
    layouts = [rank_layout(states, r)[1] for r in range(world)]
    prefix = rank_prefix(0)
    small = {n: b for n, b in states.items() if not _RANK.match(n) and not n.startswith(LAYOUT)}
    tensors: dict[str, torch.Tensor] = {}
    local: dict[str, torch.Tensor] = {}

    def tensor(name: str) -> torch.Tensor:
        if name not in local:
            if name not in bits:
                raise StateMismatchError(f"recorded state lacks tensor {name!r}")
            t = bits[name]
            local[name] = tensorcodec.bits_to_tensor(t.bits, t.dtype, t.shape)
        return local[name]

    for name, raw in states.items():
        if not name.startswith(prefix) or (names is not None and name.removeprefix(prefix) not in names):
            continue
        tree = statecodec.unpack(raw, f"small state {name!r}")
        if holds_refs(tree):
            refs: set[str] = set()
            collect_refs(tree, refs)
            plain = {r: r.removeprefix(prefix) for r in refs}
            for ref, path in plain.items():
                placed = layouts[0].get(ref)
                if placed is not None and placed.sharded:
                    for r in range(world):
                        tensor(rank_prefix(r) + path)
                    tensors[path] = assemble(path, world, layouts, local)
                else:
                    tensors[path] = tensor(ref)
            raw = statecodec.pack(rename_refs(tree, plain))
        small[name.removeprefix(prefix)] = raw
    return small, tensors


def full_state(state: RebuiltState) -> RebuiltState:
    """``state`` itself for a run one process recorded; for a multi-rank run, the same version
    with full tensors and rank 0's small states under their plain names (one shard)."""
    tensor_bits = {n: t for s in state.shards for n, t in s.tensors.items()}
    world = recorded_world(state.small.states, set(tensor_bits))
    if not world:
        return state
    small, tensors = full_tensors(state.small.states, tensor_bits, world)
    shard = ShardState(0)
    specs = []
    for name, t in sorted(tensors.items()):
        dtype = tensorcodec.dtype_name(t.dtype)
        shard.tensors[name] = TensorBits(dtype, tuple(t.shape), np.array(tensorcodec.tensor_bits(t)))
        specs.append(TensorSpec(name, dtype, tuple(t.shape), 0))
    layout = dataclasses.replace(state.layout, shard_count=1, tensors=tuple(specs),
                                 small_states=tuple(sorted(small)))
    folded = dataclasses.replace(state.small, states=small)
    return dataclasses.replace(state, layout=layout, shards=[shard], small=folded)
