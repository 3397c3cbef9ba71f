"""The optimizer step that predictive versions replay.

A predictive version logs the *command* of a weight commit (the gradients each
``optimizer.step()`` consumed, and that step's hyperparameters) instead of the resulting
bits. ``run_step`` is the one function that turns a command into state: the recorder runs
it on the previous version's bits to predict the new ones (and logs only the residual,
actual XOR predicted), and every fold runs it to replay the version. Both sides import
this module, so the prediction can never drift between two copies of the math.

It runs torch's own functional optimizers (not a re-implementation) on views of the
caller's buffers, with the arguments the optimizer classes' ``step`` passes: the result is
what torch's step computes, updated in place.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.optim.adam import adam as functional_adam
from torch.optim.adamw import adamw as functional_adamw
from torch.optim.sgd import sgd as functional_sgd

from eventlog import statecodec, tensorcodec
from eventlog.errors import ConfigError, DecodeError, IntegrityError
from eventlog.events import OptimizerStep

#: The optimizers whose step is replayed; any other (subclasses included, since they may
#: override ``step``) is recorded as XOR deltas.
SUPPORTED: dict[type[torch.optim.Optimizer], str] = {
    torch.optim.Adam: "Adam",
    torch.optim.AdamW: "AdamW",
    torch.optim.SGD: "SGD",
}
_MAX_GROUPS = 4096


def supported(optimizer: object) -> str | None:
    """The replayable name of ``optimizer``'s class, or ``None``."""
    return SUPPORTED.get(type(optimizer))  # type: ignore[arg-type]


def hyperparams_of(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's hyperparameters now (lr, betas, eps, ...), detached copies."""
    return [
        {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
         for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]


def pack_hyperparams(groups: Sequence[Mapping[str, Any]]) -> bytes:
    """The ``OptimizerStep.hyperparams`` bytes (strict msgpack, tuples kept)."""
    return statecodec.pack([dict(g) for g in groups])


def unpack_hyperparams(data: bytes, where: str) -> list[dict[str, Any]]:
    """Decode and check ``OptimizerStep.hyperparams``: a list of string-keyed dicts."""
    groups = statecodec.unpack(data, f"{where}: optimizer hyperparameters")
    if not isinstance(groups, list) or not 0 < len(groups) <= _MAX_GROUPS or not all(
        isinstance(g, dict) and all(isinstance(k, str) for k in g) and "lr" in g for g in groups
    ):
        raise DecodeError(f"{where}: optimizer hyperparameters are not a list of param groups")
    return groups


def states_by_owner(names: Iterable[str]) -> dict[str, dict[str, str]]:
    """``{prefix: {state key: log name}}`` of every ``<prefix>/<key>`` name (e.g.
    ``optimizer/state/3`` -> ``{"exp_avg": "optimizer/state/3/exp_avg"}``), in one pass: a
    param's optimizer state is found by its prefix without scanning every tensor per param."""
    out: dict[str, dict[str, str]] = {}
    for name in names:
        prefix, _, key = name.rpartition("/")
        if prefix:
            out.setdefault(prefix, {})[key] = name
    return out


def tensor_view(bits: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over a uint8 buffer (shared memory: the step's writes land in ``bits``)."""
    if bits.size == 0:
        return torch.empty(shape, dtype=tensorcodec.torch_dtype(dtype))
    return torch.from_numpy(bits).view(tensorcodec.torch_dtype(dtype)).reshape(shape)


def run_step(
    optimizer: str,
    hyperparams: Sequence[Mapping[str, Any]],
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Sequence[dict[str, torch.Tensor]],
    groups: Sequence[int],
) -> None:
    """Run one ``optimizer.step()`` in place on ``params`` and their ``states``.

    ``params[i]`` is updated with gradient ``grads[i]`` under the hyperparameters of param
    group ``groups[i]``; ``states[i]`` is its optimizer state by key (``exp_avg``,
    ``step``, ``momentum_buffer``, ...), updated in place too.

    It calls torch's functional optimizers (``torch.optim.adam.adam``, ...) exactly as the
    optimizer classes' ``step`` does for params whose state exists. Not an optimizer
    instance: building one imports ``torch._dynamo``, a slow import that a fresh replay
    process would pay for nothing.
    """
    step = _STEPS.get(optimizer)
    if step is None:
        raise ConfigError(f"optimizer {optimizer!r} cannot be replayed (supported: {', '.join(_STEPS)})")
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        if not 0 <= g < len(hyperparams):
            raise DecodeError(f"param {i} names group {g}, but the step has {len(hyperparams)}")
        members.setdefault(g, []).append(i)
    for g, idx in sorted(members.items()):
        step(optimizer, hyperparams[g], [params[i] for i in idx], [grads[i] for i in idx],
             [states[i] for i in idx])


def _call(fn: Any, *args: Any, **kwargs: Any) -> None:
    """``fn(*args, **kwargs)`` without the keywords this torch's ``fn`` does not take (a
    hyperparameter newer than the replaying torch)."""
    accepted = _accepted(fn)
    fn(*args, **{k: v for k, v in kwargs.items() if k in accepted})


@functools.cache
def _accepted(fn: Any) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _adam_step(name: str, h: Mapping[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
               states: list[dict[str, torch.Tensor]]) -> None:
    """``Adam.step`` / ``AdamW.step`` for one param group whose state exists."""
    beta1, beta2 = h["betas"]
    amsgrad = bool(h.get("amsgrad", False))
    # torch >= 2.6 writes AdamW as Adam with decoupled weight decay (a group key); before,
    # AdamW had its own functional step.
    old_adamw = name == "AdamW" and "decoupled_weight_decay" not in h
    fn = functional_adamw if old_adamw else functional_adam
    _call(fn, params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
          [s["max_exp_avg_sq"] for s in states] if amsgrad else [], [s["step"] for s in states],
          amsgrad=amsgrad, has_complex=any(torch.is_complex(p) for p in params),
          beta1=beta1, beta2=beta2, lr=h["lr"], weight_decay=h["weight_decay"], eps=h["eps"],
          maximize=h.get("maximize", False), foreach=h.get("foreach"),
          capturable=h.get("capturable", False), differentiable=h.get("differentiable", False),
          fused=h.get("fused"), grad_scale=None, found_inf=None,
          decoupled_weight_decay=h.get("decoupled_weight_decay", False))


def _sgd_step(name: str, h: Mapping[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
              states: list[dict[str, torch.Tensor]]) -> None:
    """``SGD.step`` for one param group whose momentum buffers (if any) exist."""
    momentum = h["momentum"]
    buffers: list[torch.Tensor | None] = [s.get("momentum_buffer") if momentum != 0 else None for s in states]
    before = list(buffers)
    _call(functional_sgd, params, grads, buffers, weight_decay=h["weight_decay"],
          momentum=momentum, lr=h["lr"], dampening=h["dampening"], nesterov=h["nesterov"],
          maximize=h.get("maximize", False), has_sparse_grad=False, foreach=h.get("foreach"),
          fused=h.get("fused"), grad_scale=None, found_inf=None)
    for old, new in zip(before, buffers, strict=True):
        # A step that replaces a buffer instead of updating it must land in the caller's.
        if old is not None and new is not None and new is not old:
            old.copy_(new)


_STEPS = {"Adam": _adam_step, "AdamW": _adam_step, "SGD": _sgd_step}


def describe_failure(step: OptimizerStep, version: int, where: str, exc: Exception) -> IntegrityError:
    """The error for a recorded step that torch refuses to replay (recorded values are
    untrusted and drive torch's optimizer code): names the version and both torch builds."""
    return IntegrityError(
        f"{where}: cannot replay the {step.optimizer} step of version {version} (recorded "
        f"under {recorded_under(step)}, replaying under {replaying_under()}): {exc}")


def recorded_under(step: OptimizerStep) -> str:
    """The torch build and device a step was recorded under."""
    return f"torch {step.torch_version} on {step.device}"


def replaying_under() -> str:
    """This process's torch build and device."""
    return f"torch {torch.__version__} on {'cuda' if torch.cuda.is_available() else 'cpu'}"


def check_lists(step: OptimizerStep, where: str) -> None:
    """Fail unless a step's parallel lists have matching lengths."""
    if not len(step.params) == len(step.groups) == len(step.states) or len(step.predicted) != len(
        step.predicted_digests
    ):
        raise DecodeError(f"{where}: optimizer step lists of different lengths")


def version_of(t: torch.Tensor) -> int:
    """A tensor's in-place version counter, or -1 if it keeps none (inference tensors)."""
    try:
        return int(t._version)
    except RuntimeError:
        return -1


@dataclass
class CapturedStep:
    """What one ``optimizer.step()`` consumed: gradient references and hyperparameters."""

    grads: dict[int, torch.Tensor]  # optimizer param index -> the gradient tensor
    versions: dict[int, int]  # its in-place version counter at the step
    groups: dict[int, int]  # optimizer param index -> its param group
    hyperparams: list[dict[str, Any]]


@dataclass
class StepCapture:
    """Records, through a step pre-hook, what each ``optimizer.step()`` consumes.

    The hook runs inside ``step()``, after clipping and unscaling, and only keeps references
    (no copy on the training thread): ``zero_grad(set_to_none=True)`` leaves the referenced
    gradients untouched. A gradient changed in place later is detected by its version
    counter, and even a missed change only costs residual bytes, never exactness.
    """

    optimizer: torch.optim.Optimizer
    #: Steps per commit worth keeping gradients for; past it, every gradient reference is
    #: dropped (the version will be XOR deltas), so many steps per commit never pin memory.
    max_steps: int = 2
    steps: list[CapturedStep] = field(default_factory=list)
    _handle: Any = None

    def __post_init__(self) -> None:
        self._handle = self.optimizer.register_step_pre_hook(self._hook)

    def _hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if len(self.steps) >= self.max_steps:
            for step in self.steps:
                step.grads.clear()
            self.steps.append(CapturedStep({}, {}, {}, []))
            return
        grads: dict[int, torch.Tensor] = {}
        groups: dict[int, int] = {}
        i = 0
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if p.grad is not None:
                    grads[i], groups[i] = p.grad, g
                i += 1
        self.steps.append(CapturedStep(grads, {i: version_of(t) for i, t in grads.items()}, groups,
                                       hyperparams_of(optimizer)))

    def take(self) -> list[CapturedStep]:
        """The steps since the last ``take()``."""
        steps, self.steps = self.steps, []
        return steps

    def close(self) -> None:
        """Remove the hook."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str] | str:
    """The log name of each optimizer param (in ``state_dict`` index order), or why not."""
    by_id = {id(p): f"model/{n}" for n, p in model.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = by_id.get(id(p))
            if name is None:
                return "an optimizer param is not a parameter of the recorded model"
            names.append(name)
    return names
