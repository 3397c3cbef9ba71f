"""A version seen at the global level, whatever world size recorded it, for comparing runs.

A version one process recorded is seen as it is. A multi-rank version (``replayer.assemble``)
is seen gathered: each sharded tensor whole under its plain name (``model/0.weight``, not
``rank1/model/0.weight``), a rank's own plain tensors under their rank's name, and only the
small states of the ranks that recorded it: those a run recorded at a larger world size
left behind are not current, and a restore ignores them (``live_states``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from eventlog import tensorcodec
from eventlog.errors import StateMismatchError
from eventlog.fold.engine import RebuiltState
from replayer.assemble import (
    LAYOUT,
    Placed,
    assemble,
    full_tensors,
    rank_layout,
    rank_of,
    rank_prefix,
    recorded_world,
    region,
)

#: A tensor's dtype, shape and raw bits.
Bits = tuple[str, tuple[int, ...], np.ndarray]
_LAYOUT_RANK = re.compile(re.escape(LAYOUT) + r"(\d+)$")
_STEP = re.compile(r"^(.*?)( \(optimizer step \d+\))?$")


def owner(name: str) -> int | None:
    """The rank whose own small state or tensor ``name`` is (its layout included)."""
    m = _LAYOUT_RANK.match(name)
    return int(m.group(1)) if m else rank_of(name)


def live_states(states: Mapping[str, bytes], world: int) -> dict[str, bytes]:
    """The small states of a version recorded at ``world`` ranks (0: by one process): those
    of ranks beyond it are left from a larger world size and not current."""
    if not world:
        return dict(states)
    return {n: raw for n, raw in states.items() if (r := owner(n)) is None or r < world}


@dataclass
class GlobalView:
    """One run's state at one version, gathered (see the module docstring)."""

    #: The ranks that recorded the version (0: one process).
    world: int
    #: Tensors by name: dtype, shape, bits, and the shard that holds them (-1: gathered).
    tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray, int]]
    small: dict[str, bytes]
    kinds: dict[str, str]
    layouts: list[dict[str, Placed]] = field(default_factory=list)


def _bits_of(t: torch.Tensor) -> Bits:
    return tensorcodec.dtype_name(t.dtype), tuple(t.shape), np.asarray(tensorcodec.tensor_bits(t))


def _sharded(placed: Placed | None) -> bool:
    return placed is not None and placed.sharded


def global_view(state: RebuiltState) -> GlobalView:
    """``state`` at the global level (see the module docstring)."""
    bits = {n: t for s in state.shards for n, t in s.tensors.items()}
    shard_of = {t.name: t.shard for t in state.layout.tensors}
    states, kinds = state.small.states, state.small.kinds
    world = recorded_world(states, set(bits))
    if not world:
        plain = {n: (t.dtype, tuple(t.shape), t.bits, shard_of.get(n, -1)) for n, t in bits.items()}
        return GlobalView(0, plain, dict(states), dict(kinds))
    layouts = [rank_layout(states, r)[1] for r in range(world)]
    _, full = full_tensors(states, bits, world)
    tensors = {n: (*_bits_of(t), -1) for n, t in full.items()}
    for n, t in bits.items():
        r = rank_of(n)
        # A rank's own plain tensors (rank 0's are in ``full``), and tensors no skeleton names.
        if (r is None and n not in tensors) or (r is not None and 0 < r < world
                                                 and not _sharded(layouts[r].get(n))):
            tensors[n] = (t.dtype, tuple(t.shape), t.bits, shard_of.get(n, -1))
    return GlobalView(world, tensors, live_states(states, world), dict(kinds), layouts)


def gathered(named: Mapping[str, Bits], view: GlobalView) -> dict[str, Bits]:
    """Tensors named as a version's (a step's gradients, say: ``rank1/model/0.weight``, with
    `` (optimizer step 2)`` for a second step) gathered as ``view`` gathers its tensors;
    a gradient a rank did not log is taken as empty where its region is, else left out."""
    if not view.world:
        return dict(named)
    out: dict[str, Bits] = {}
    parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, (dtype, shape, bits) in named.items():
        m = _STEP.match(name)
        assert m is not None
        base, suffix = m.group(1), m.group(2) or ""
        r = rank_of(base)
        if r is None:
            out[name] = (dtype, shape, bits)
        elif r < view.world:
            path = base.removeprefix(rank_prefix(r))
            if _sharded(view.layouts[0].get(rank_prefix(0) + path)):
                parts.setdefault((path, suffix), {})[base] = tensorcodec.bits_to_tensor(bits, dtype, shape)
            elif r == 0:
                out[path + suffix] = (dtype, shape, bits)
            else:
                out[name] = (dtype, shape, bits)
    for (path, suffix), local in parts.items():
        full = _assembled(path, view, local)
        if full is not None:
            out[path + suffix] = _bits_of(full)
    return out


def _assembled(path: str, view: GlobalView, local: dict[str, torch.Tensor]) -> torch.Tensor | None:
    like = next(iter(local.values()))
    for r in range(view.world):
        name = rank_prefix(r) + path
        placed = view.layouts[r].get(name)
        if name not in local and placed is not None:
            cut = region(placed.shape, placed.mesh, placed.placements, placed.coord)
            if all(s.stop > s.start for s in cut):
                return None  # a rank that holds part of it logged no gradient
            local[name] = torch.empty([s.stop - s.start for s in cut], dtype=like.dtype)
    try:
        return assemble(path, view.world, view.layouts, local)
    except StateMismatchError:
        return None
