"""Taking a training state apart into tensors and small states, and putting it back.

Tensor-holding objects (the model, the optimizer, a recorder's ``extra`` and ``buffers``
objects) are flattened: each tensor leaf of their ``state_dict`` becomes a named log tensor
(``model/fc.weight``, ``optimizer/state/0/exp_avg``, ``target/fc.weight``) and the rest of
the tree becomes a small *skeleton* with references in place of tensors. Every other
object's whole ``state_dict`` is a small state; so is a tensor-holding object's in a log
written before its tensors were flattened, and it loads all the same (no references).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from eventlog import statecodec, tensorcodec
from eventlog.errors import StateMismatchError
from eventlog.fold.engine import RebuiltState
from eventlog.optimstep import tensor_view
from eventlog.statecodec import TensorRef

#: The roles whose tensors go to the tensor shards; a recorder adds its ``extra`` and
#: ``buffers`` objects to them.
TENSOR_ROLES = ("model", "optimizer")
#: An ``extra`` object's tensors smaller than this stay in its small state: such a tensor (an
#: RNG or generator state is 5 KiB) changes whole at each commit, or costs less there than
#: as events of its own.
INLINE_TENSOR_BYTES = 16 << 10


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict`` / ``load_state_dict``: modules, optimizers, schedulers,
    samplers, environment wrappers."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


def flatten(prefix: str, tree: Any, inline_below: int = 0) -> tuple[dict[str, torch.Tensor], Any]:
    """Split a state tree into ``{log name: tensor}`` and a skeleton holding ``TensorRef`` s
    (and the tensors of fewer than ``inline_below`` bytes, left in place).

    A tensor that is the same view of the same memory as one met before (tied weights, such
    as an embedding shared with the output layer) is recorded once: its place in the
    skeleton refers to the first name."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[tuple[Any, ...], str] = {}

    def walk(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            if stays_inline(node, inline_below):
                return node
            view = _view_key(node)
            if view is not None and view in seen:
                return TensorRef(seen[view])
            if view is not None:
                seen[view] = path
            tensors[path] = node
            return TensorRef(path)
        if isinstance(node, Mapping):
            return {k: walk(v, f"{path}/{k}") for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(node)]
        if isinstance(node, tuple):
            return tuple(walk(v, f"{path}/{i}") for i, v in enumerate(node))
        return node

    return tensors, walk(tree, prefix)


def stays_inline(t: torch.Tensor, below: int) -> bool:
    """True when ``t`` has fewer than ``below`` bytes: it stays in its small state."""
    return t.numel() * t.element_size() < below


def _view_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors the same view of the same memory (None: not comparable)."""
    if t.numel() == 0 or t.layout != torch.strided or t.device.type == "meta":
        return None
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild a state tree from its skeleton and the rebuilt tensors."""
    if isinstance(skeleton, TensorRef):
        try:
            return tensors[skeleton.name]
        except KeyError:
            raise StateMismatchError(f"recorded state lacks tensor {skeleton.name!r}") from None
    if isinstance(skeleton, dict):
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(unflatten(v, tensors) for v in skeleton)
    return skeleton


class GlobalRng:
    """The process-wide RNGs as one ``Stateful``: torch CPU (and CUDA), numpy, ``random``."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": np.random.get_state(),
            "python": random.getstate(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        np.random.set_state(state["numpy"])
        random.setstate(state["python"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


def check_model_fits(
    name: str, obj: Stateful, recorded: Mapping[str, tuple[str, tuple[int, ...]]]
) -> None:
    """Raise ``StateMismatchError`` naming every tensor whose name, dtype or shape differs."""
    if not isinstance(obj, torch.nn.Module):
        return
    state = obj.state_dict()
    live = {
        f"{name}/{k}": (str(v.dtype).removeprefix("torch."), tuple(v.shape))
        for k, v in state.items()
        if isinstance(v, torch.Tensor)
    }
    recorded_once = flatten(name, state)[0]  # a tied weight is recorded under its first name
    rec = {k: v for k, v in recorded.items() if k.startswith(f"{name}/")}
    problems = [f"missing in the model: {k}" for k in sorted(rec.keys() - live.keys())]
    problems += [f"not in the recording: {k}" for k in sorted(recorded_once.keys() - rec.keys())]
    problems += [
        f"{k}: recorded {rec[k][0]}{list(rec[k][1])}, model has {live[k][0]}{list(live[k][1])}"
        for k in sorted(rec.keys() & live.keys())
        if rec[k] != live[k]
    ]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise StateMismatchError(f"{name!r} does not match the recorded run: {shown}")



def rebuilt_tensors(state: RebuiltState, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """Every rebuilt tensor as a torch tensor, by log name: each owning a copy of its bits,
    or (``copy=False``) a view of them, valid while ``state`` is and writing into it."""
    view = tensorcodec.bits_to_tensor if copy else tensor_view
    return {name: view(t.bits, t.dtype, t.shape)
            for shard in state.shards for name, t in shard.tensors.items()}


def recorded_trees(state: RebuiltState, names: Iterable[str] | None = None, *,
                   copy: bool = True) -> dict[str, Any]:
    """The recorded ``state_dict`` trees by name (tensor roles re-assembled from the shards;
    ``copy=False``: their tensors are views of the rebuilt bits, see ``rebuilt_tensors``)."""
    skeletons = recorded_skeletons(state, names)
    # Tensor roles and buffers hold references into the shards; other small states do not.
    refs = [n for n, tree in skeletons.items() if holds_refs(tree)]
    tensors = rebuilt_tensors(state, copy=copy) if refs else {}
    return {n: unflatten(tree, tensors) if n in refs else tree for n, tree in skeletons.items()}


def recorded_skeletons(state: RebuiltState, names: Iterable[str] | None = None) -> dict[str, Any]:
    """The recorded ``state_dict`` trees by name, with ``TensorRef`` s in place of tensors."""
    wanted = list(state.small.states) if names is None else list(names)
    missing = [n for n in wanted if n not in state.small.states]
    if missing:
        raise StateMismatchError(
            f"run {state.run_id!r} recorded no state for {', '.join(map(repr, missing))} "
            f"(it has: {', '.join(sorted(state.small.states))})"
        )
    return {n: statecodec.unpack(state.small.states[n], f"small state {n!r}") for n in wanted}


def holds_refs(tree: Any) -> bool:
    """True when a state skeleton refers to a tensor recorded in the shards."""
    return next(_refs(tree), None) is not None


def load_into(objects: Mapping[str, Stateful], state: RebuiltState) -> None:
    """Load a rebuilt state into live objects; on any mismatch nothing is loaded.

    No copy of the state is made on the way: a tensor a module or an optimizer already
    holds with the recorded name, dtype and shape (a model's parameters, an optimizer's
    moments once it has stepped) is written in place; any other becomes a tensor of the
    object's own. The objects never share memory with ``state``."""
    recorded = {s.name: (s.dtype, tuple(s.shape)) for s in state.layout.tensors}
    for role in TENSOR_ROLES:
        if role in objects:
            check_model_fits(role, objects[role], recorded)
    # Decode and check everything before loading anything: a failed restore changes nothing.
    skeletons = recorded_skeletons(state, objects)
    views = rebuilt_tensors(state, copy=False)
    for name, tree in skeletons.items():
        check_groups(name, objects[name], tree)
        lacking = next((ref for ref in _refs(tree) if ref not in views), None)
        if lacking is not None:
            raise StateMismatchError(f"recorded state lacks tensor {lacking!r}")
    for name, tree in skeletons.items():
        obj = objects[name]
        try:
            obj.load_state_dict(unflatten(tree, _own_tensors(name, obj, tree, views)))
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise StateMismatchError(f"cannot load recorded {name!r}: {exc}") from exc


def check_groups(name: str, obj: Stateful, tree: Any) -> None:
    """An optimizer's recorded param groups must match its own (torch's own check, made
    before any of its tensors is written in place)."""
    if not isinstance(obj, torch.optim.Optimizer) or not isinstance(tree, Mapping):
        return
    saved = tree.get("param_groups")
    if not isinstance(saved, list) or [len(g.get("params", ())) for g in saved if isinstance(g, Mapping)] \
            != [len(g["params"]) for g in obj.param_groups]:
        raise StateMismatchError(f"cannot load recorded {name!r}: its param groups do not match the "
                                 "optimizer's (the number of groups or of params in a group differs)")


def _own_tensors(name: str, obj: Stateful, tree: Any,
                 views: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """For each tensor ``tree`` refers to, the tensor ``obj`` loads: its own tensor of that
    name, dtype and shape with the rebuilt bits copied in (modules and optimizers), or else
    a copy of the rebuilt bits."""
    holds_own = isinstance(obj, torch.nn.Module | torch.optim.Optimizer)
    live = flatten(name, obj.state_dict())[0] if holds_own else {}
    out: dict[str, torch.Tensor] = {}
    for ref in _refs(tree):
        if ref in out:
            continue
        src, dest = views[ref], live.get(ref)
        if dest is not None and dest.dtype == src.dtype and dest.shape == src.shape:
            with torch.no_grad():
                dest.copy_(src)
            out[ref] = dest
        else:
            out[ref] = src.clone()
    return out


def _refs(tree: Any) -> Iterator[str]:
    """The tensor names a skeleton refers to."""
    if isinstance(tree, TensorRef):
        yield tree.name
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _refs(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _refs(v)
