"""The recorder's side of the predictive codec: log the optimizer step, not its result.

For a version that is a few ``optimizer.step()`` calls after the previous one, the recorder
logs each step's gradients (``GRAD`` chunks) and hyperparameters (``OptimizerStep``), runs
the same step (``optimstep.run_step``) on the previous version's bits to predict the new
ones, and leaves the caller to log only ``actual XOR predicted`` (``RESIDUAL`` chunks),
which is almost always all zeros and then costs nothing. Anything the prediction cannot
cover falls back to XOR deltas, and the seal says why.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import torch

from eventlog import optimstep, tensorcodec
from eventlog.events import OptimizerStep, TensorDelta, TensorSpec
from eventlog.optimstep import CapturedStep, tensor_view

STATE_PREFIX = "optimizer/state"


@dataclass(frozen=True)
class StepPlan:
    """How a recorder's optimizer maps onto its log tensors (fixed for the recorder's life)."""

    optimizer: str  # the replayable class name
    params: tuple[str, ...]  # log name of each optimizer param, by state_dict index

    @staticmethod
    def of(model: torch.nn.Module | None, optimizer: object) -> StepPlan | str:
        """The plan for this model and optimizer, or the reason there is none."""
        if optimizer is None or model is None:
            return "no model and optimizer to predict"
        name = optimstep.supported(optimizer)
        if name is None:
            return f"optimizer {type(optimizer).__name__} is not replayable (supported: Adam, AdamW, SGD)"
        names = optimstep.param_names(model, optimizer)  # type: ignore[arg-type]
        if isinstance(names, str):
            return names
        return StepPlan(name, tuple(names))

    def owners(self, tensors: Sequence[str]) -> dict[str, str]:
        """Each optimizer state tensor's param: the layout keeps them on one shard."""
        out = {}
        for name in tensors:
            index = _state_index(name)
            if index is not None and index < len(self.params):
                out[name] = self.params[index]
        return out


def _state_index(name: str) -> int | None:
    parts = name.split("/")
    if len(parts) == 4 and f"{parts[0]}/{parts[1]}" == STATE_PREFIX and parts[2].isdigit():
        return int(parts[2])
    return None


def state_prefix(index: int) -> str:
    """The log name prefix of optimizer param ``index``'s state tensors."""
    return f"{STATE_PREFIX}/{index}"


@dataclass
class Prediction:
    """A version's predictive part: per shard, each step's gradients then its ``OptimizerStep``,
    all before the shard's residuals. The gradient chunks are encoded as ``events`` yields
    them, so that a version's gradients are never all held encoded at once."""

    grads: list[dict[int, np.ndarray]]  # per step: optimizer param index -> its bits (copied)
    step_bodies: dict[int, list[OptimizerStep]]  # per shard: one per step
    plan: StepPlan
    spec_of: Mapping[str, TensorSpec]
    predicted: set[str]  # tensors whose previous bits now hold the prediction
    steps: int
    #: Bytes of gradient payloads ``events`` yielded so far.
    grad_bytes: int = 0

    def event_count(self, chunk_bytes: int) -> int:
        """How many events ``events`` yields."""
        chunks = sum(len(tensorcodec.chunk_ranges(len(bits), chunk_bytes))
                     for grads in self.grads for bits in grads.values())
        return chunks + sum(len(b) for b in self.step_bodies.values())

    def events(self, pool: Executor, chunk_bytes: int, compression: str,
               window: int) -> Iterator[tuple[int, TensorDelta | OptimizerStep]]:
        """``(shard, body)`` of every gradient chunk and step, in log order; gradient chunks
        are encoded on ``pool``, at most ``window`` of them ahead of the caller
        (``compression``: ``Settings.grad_compression``)."""
        # In log order: (shard, the step's body) or (shard, the spec of a gradient chunk).
        order: list[tuple[int, OptimizerStep | TensorSpec]] = []
        calls: list[Callable[[], tensorcodec.EncodedChunk | None]] = []
        for shard in sorted(self.step_bodies):
            for k, grads in enumerate(self.grads):
                for i, bits in grads.items():
                    spec = self.spec_of[self.plan.params[i]]
                    if spec.shard != shard:
                        continue
                    ranges = tensorcodec.chunk_ranges(len(bits), chunk_bytes)
                    for j, (off, n) in enumerate(ranges):
                        order.append((shard, spec))
                        calls.append(functools.partial(
                            tensorcodec.encode_chunk, bits[off:off + n], None,
                            typesize=tensorcodec.itemsize(spec.dtype), base_version=-1, index=j,
                            count=len(ranges), offset=off, compression=compression))
                order.append((shard, self.step_bodies[shard][k]))
        encoded = tensorcodec.map_ordered(pool, calls, window)
        for shard, item in order:
            if isinstance(item, OptimizerStep):
                yield shard, item
                continue
            chunk = next(encoded)
            assert chunk is not None  # a chunk without a base is always written
            self.grad_bytes += len(chunk.payload)
            chunk = dataclasses.replace(chunk, encoding=TensorDelta.GRAD)
            yield shard, chunk.to_delta(item.name, item.dtype, tuple(item.shape))


def check(
    plan: StepPlan | str,
    steps: Sequence[CapturedStep],
    spec_of: Mapping[str, TensorSpec],
    prev: Mapping[str, np.ndarray],
    relayout: bool,
    version: int,
    max_steps: int,
) -> str | None:
    """Why this version cannot be encoded predictively, or ``None`` if it can (``max_steps``:
    ``Settings.predict_max_steps``)."""
    if isinstance(plan, str):
        return plan
    if not steps:
        return "no optimizer step since the last commit"
    if len(steps) > max_steps:
        # Each step's gradients cost ~0.28 of an Adam state; past two, a delta is smaller.
        return f"{len(steps)} optimizer steps since the last commit, over {max_steps}"
    if version == 0 or relayout:
        return "the layout changed (first commit, or new optimizer state)"
    owned = optimstep.states_by_owner(spec_of)
    for step in steps:
        for i, g in step.grads.items():
            if step.versions[i] < 0 or optimstep.version_of(g) != step.versions[i]:
                return "a gradient was changed in place after optimizer.step() (or keeps no version)"
            if i >= len(plan.params):
                return "the optimizer gained params after the recorder started"
            name = plan.params[i]
            spec = spec_of.get(name)
            if spec is None or name not in prev:
                return f"param {name} has no previous bits"
            if (tensorcodec.dtype_name(g.dtype), tuple(g.shape)) != (spec.dtype, tuple(spec.shape)):
                return f"the gradient of {name} does not match the param's dtype and shape"
            states = owned.get(state_prefix(i), {})
            if not states and plan.optimizer != "SGD":  # plain SGD keeps no state
                return f"param {name} has no optimizer state yet"
            for key, sname in states.items():
                if spec_of[sname].shard != spec.shard or sname not in prev:
                    return f"param {name} and its optimizer state {key} are on different shards"
    return None


def predict(
    plan: StepPlan,
    steps: Sequence[CapturedStep],
    spec_of: Mapping[str, TensorSpec],
    prev: Mapping[str, np.ndarray],
    pool: Executor,
    buffers: dict[tuple[int, int], np.ndarray] | None = None,
) -> Prediction:
    """Copy the steps' gradients and run the steps on ``prev`` in place (the prediction).

    Gradients are copied once, off the training thread, into ``buffers`` (reused across
    versions; they must stay untouched until the prediction's ``events`` are written); the
    logged bits and the bits the prediction uses are the same copy, so recorder and
    replayer compute the same thing.
    """
    buffers = {} if buffers is None else buffers
    grads: list[dict[int, np.ndarray]] = []
    for k, step in enumerate(steps):
        frozen = {}
        for i, g in step.grads.items():
            bits = tensorcodec.tensor_bits(g)
            buf = buffers.get((k, i))
            if buf is None or buf.shape != bits.shape:
                # Kept for the next version: fresh pages would fault in on every version.
                buf = buffers[(k, i)] = torch.empty(len(bits), dtype=torch.uint8).numpy()
            torch.from_numpy(buf).copy_(torch.from_numpy(bits))
            frozen[i] = buf
        grads.append(frozen)
    shards = sorted({spec_of[plan.params[i]].shard for step in steps for i in step.grads})
    runs = {s: pool.submit(_predict_shard, plan, steps, grads, spec_of, prev, s) for s in shards}
    step_bodies = {s: fut.result() for s, fut in runs.items()}
    predicted = {n for bs in step_bodies.values() for b in bs for n in b.predicted}
    return Prediction(grads, step_bodies, plan, spec_of, predicted, len(steps))


def _predict_shard(
    plan: StepPlan,
    steps: Sequence[CapturedStep],
    grads: Sequence[Mapping[int, np.ndarray]],
    spec_of: Mapping[str, TensorSpec],
    prev: Mapping[str, np.ndarray],
    shard: int,
) -> list[OptimizerStep]:
    """Run one shard's share of every step on ``prev``; one ``OptimizerStep`` per step."""
    out = []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    owned = optimstep.states_by_owner(spec_of)
    for k, step in enumerate(steps):
        names, groups, prefixes, params, gviews, states = [], [], [], [], [], []
        written: list[str] = []
        for i in sorted(step.grads):
            spec = spec_of[plan.params[i]]
            if spec.shard != shard:
                continue
            names.append(spec.name)
            groups.append(step.groups[i])
            prefixes.append(state_prefix(i))
            params.append(tensor_view(prev[spec.name], spec.dtype, tuple(spec.shape)))
            gviews.append(tensor_view(grads[k][i], spec.dtype, tuple(spec.shape)))
            st = owned.get(state_prefix(i), {})
            states.append({key: tensor_view(prev[n], spec_of[n].dtype, tuple(spec_of[n].shape))
                           for key, n in st.items()})
            written += [spec.name, *sorted(st.values())]
        optimstep.run_step(plan.optimizer, step.hyperparams, params, gviews, states, groups)
        out.append(OptimizerStep(
            plan.optimizer, k, len(steps), torch.__version__, device,
            optimstep.pack_hyperparams(step.hyperparams), tuple(names), tuple(groups),
            tuple(prefixes), tuple(written), tuple(tensorcodec.digest(prev[n]) for n in written)))
    return out

