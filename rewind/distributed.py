"""Multi-rank runs: how the ranks of a ``torch.distributed`` job agree on one version, and
which part of the state each rank records and restores.

Every rank runs a ``Recorder`` on the same run with its process group. The recorder makes a
gloo group of its own (``RankGroup``), so its agreement, on the committer thread, never
interleaves with the trainer's collectives. Rank ``r`` of ``W`` owns a contiguous run of
the ``S`` tensor shards, ``r*S//W .. (r+1)*S//W - 1`` (``owned_shards``; each partition keeps
one writer), and records:

* the local shards of its DTensors as ``rank<r>/<path>`` (``<path>``: the tensor's place in
  the state tree, e.g. ``model/fc.weight``), and so the plain tensors of an optimizer state
  entry that holds a sharded one (AdamW's ``step``);
* replicated tensors (the other plain tensors of the model and optimizer, all-``Replicate()``
  DTensors) under ``<path>``, on rank 0 only; the other ranks only hash theirs, and the
  hashes are compared at each commit (``check_parts``);
* its small states as ``rank<r>/<name>``, and ``layout/rank<r>``: the world size, and each
  DTensor's global shape, stride, mesh shape, this rank's mesh coordinate and placements
  (msgpack).

Parts travel between ranks as msgpack bytes in uint8 tensors (no pickle). A restore at
another world size reslices the DTensors from the full tensors ``replayer.assemble`` puts
together (``rank_trees``). ``rewind.ranks_commit`` runs the recorder's side of all this.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from eventlog import optimstep, statecodec, tensorcodec
from eventlog.capture import (
    INLINE_TENSOR_BYTES,
    TENSOR_ROLES,
    Stateful,
    check_groups,
    stays_inline,
    unflatten,
)
from eventlog.digests import chunk_digests, shard_digest, tensor_digest
from eventlog.errors import DecodeError, RewindError, StateMismatchError
from eventlog.events import Envelope, TensorSpec
from eventlog.fold.bits import TensorBits
from eventlog.fold.engine import RebuiltState, events
from eventlog.layout import assign_shards
from eventlog.optimstep import CapturedStep
from eventlog.ports import EventLog
from eventlog.statecodec import TensorRef
from eventlog.waits import warned_wait
from replayer import assemble
from replayer.assemble import rank_prefix

_log = logging.getLogger(__name__)

#: How long a rank waits for the others at one step of the agreement.
AGREEMENT_TIMEOUT = datetime.timedelta(minutes=10)


class RankGroup:
    """The recorder's own gloo group over the ranks of the trainer's group."""

    def __init__(self, group: Any) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RewindError("Recorder(group=...) needs torch.distributed initialised "
                              "(dist.init_process_group) first")
        ranks = dist.get_process_group_ranks(group)
        # Collective over the whole world: every rank of the job creates its Recorder.
        with warned_wait(f"every rank of the trainer's group ({len(ranks)} ranks) to create its Recorder",
                         _log):
            made = dist.new_group(ranks=ranks, backend="gloo", timeout=AGREEMENT_TIMEOUT)
        if not isinstance(made, dist.ProcessGroup):
            raise RewindError("this rank is not a member of the Recorder's process group")
        self.group: dist.ProcessGroup = made
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)

    def all_gather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order."""
        with warned_wait(self._others, _log):
            return self._all_gather(data)

    def _others(self) -> str:
        return (f"the other {self.world - 1} ranks of the Recorder's group to reach the same step "
                f"(this is rank {self.rank}; a rank that stopped or fell behind holds every rank)")

    def _all_gather(self, data: bytes) -> list[bytes]:
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        dist.all_gather(sizes, size, group=self.group)
        most = max(int(s.item()) for s in sizes)
        mine = torch.zeros(most, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        got = [torch.empty(most, dtype=torch.uint8) for _ in range(self.world)]
        dist.all_gather(got, mine, group=self.group)
        return [g[:int(s.item())].numpy().tobytes() for g, s in zip(got, sizes, strict=True)]

    def broadcast(self, data: bytes) -> bytes:
        """Rank 0's ``data`` on every rank."""
        with warned_wait(self._others, _log):
            size = torch.tensor([len(data)], dtype=torch.int64)
            dist.broadcast(size, src=self._global(0), group=self.group)
            buf = torch.zeros(int(size.item()), dtype=torch.uint8)
            if self.rank == 0 and data:
                buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            dist.broadcast(buf, src=self._global(0), group=self.group)
            return buf.numpy().tobytes()

    def barrier(self) -> None:
        """Wait for every rank."""
        self.all_gather(b"")

    def _global(self, rank: int) -> int:
        return int(dist.get_global_rank(self.group, rank))


def owned_shards(rank: int, world: int, shards: int) -> range:
    """The tensor shards rank ``rank`` of ``world`` writes, of a run of ``shards``: a
    contiguous run of ``shards // world`` or one more (``r*k .. r*k+k-1`` when ``world``
    divides ``shards`` into ``k`` each)."""
    return range(rank * shards // world, (rank + 1) * shards // world)


# ---------------------------------------------------------------------- capture
@dataclass
class Captured:
    """One rank's state as a commit takes it: tensors by log name, small states by name."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Replicated tensors (written by rank 0; the other ranks only hash them).
    replicated: set[str] = field(default_factory=set)
    small: dict[str, bytes] = field(default_factory=dict)


def _placement_name(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    raise RewindError(f"a DTensor placement {p} cannot be recorded (only Shard(d) and Replicate())")


def _placement_of(name: str, where: str) -> Placement:
    dim = assemble.shard_dim(name, where)
    return Replicate() if dim is None else Shard(dim)


def capture(objects: Mapping[str, Stateful], tensor_roles: Iterable[str], rank: int, world: int,
            inline: Iterable[str] = ()) -> Captured:
    """This rank's tensors (DTensors as their local shards) and small states, named so
    that no two ranks' parts collide (``world``: the number of ranks). The tensors of the
    ``inline`` roles under ``INLINE_TENSOR_BYTES`` stay in their small states, as
    ``Recorder`` leaves them in a single process."""
    roles, inline_roles = frozenset(tensor_roles), frozenset(inline)
    prefix = rank_prefix(rank)
    out = Captured()
    layout: dict[str, dict[str, Any]] = {}
    for obj_name, obj in objects.items():
        tree = obj.state_dict()
        if obj_name not in roles:
            out.small[prefix + obj_name] = statecodec.pack(tree)
            continue
        beside = _beside_shards(tree) if obj_name == "optimizer" else set()

        def leaf(t: torch.Tensor, path: str, replicable: bool = obj_name in TENSOR_ROLES,
                 beside: set[str] = beside, below: int = (INLINE_TENSOR_BYTES if obj_name in inline_roles
                                                           else 0)) -> TensorRef | torch.Tensor:
            # ``replicable``: a plain tensor of the model or optimizer is a replica (a
            # buffer's or an extra's tensors are the rank's own, and so is an optimizer state
            # beside a sharded one, such as AdamW's ``step``: a rank's part replays its step alone).
            if not isinstance(t, DTensor) and stays_inline(t, below):
                return t
            if isinstance(t, DTensor):
                placements = tuple(t.placements)
                local = t.to_local()
                if all(isinstance(p, Replicate) for p in placements):
                    name = path
                    out.replicated.add(name)
                else:
                    name = prefix + path
                layout[name] = {
                    "shape": list(t.shape), "stride": list(t.stride()),
                    "mesh": list(t.device_mesh.shape), "coord": list(t.device_mesh.get_coordinate() or ()),
                    "placements": [_placement_name(p) for p in placements],
                }
                out.tensors[name] = local
            elif replicable and path not in beside:
                out.tensors[path] = t
                out.replicated.add(path)
                name = path
            else:
                name = prefix + path
                out.tensors[name] = t
            return TensorRef(name)

        out.small[prefix + obj_name] = statecodec.pack(_walk(tree, obj_name, leaf))
    out.small[f"{assemble.LAYOUT}{rank}"] = statecodec.pack({"world": world, "tensors": layout})
    return out


def _sharded(t: object) -> bool:
    return isinstance(t, DTensor) and not all(isinstance(p, Replicate) for p in t.placements)


def _beside_shards(tree: Any) -> set[str]:
    """The paths (``optimizer/state/<i>/<key>``) of the plain tensors in an optimizer's state
    entries that also hold a sharded DTensor."""
    state = tree.get("state") if isinstance(tree, Mapping) else None
    out: set[str] = set()
    for i, entry in (state or {}).items():
        if isinstance(entry, Mapping) and any(_sharded(v) for v in entry.values()):
            out |= {f"optimizer/state/{i}/{k}" for k, v in entry.items()
                    if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)}
    return out


def local_steps(steps: Sequence[CapturedStep]) -> list[CapturedStep]:
    """``steps`` with each DTensor gradient as its local shard (what the rank's part logs). A
    gradient changed in place since its step keeps version -1, which the codec refuses."""
    out = []
    for step in steps:
        grads, versions = dict(step.grads), dict(step.versions)
        for i, g in step.grads.items():
            if isinstance(g, DTensor):
                grads[i] = g.to_local().detach()
                versions[i] = (optimstep.version_of(grads[i])
                               if optimstep.version_of(g) == step.versions[i] else -1)
        out.append(dataclasses.replace(step, grads=grads, versions=versions))
    return out


def _walk(node: Any, path: str, leaf: Any) -> Any:
    """``node`` with every tensor replaced by ``leaf(tensor, path)``."""
    if isinstance(node, torch.Tensor):
        return leaf(node, path)
    if isinstance(node, Mapping):
        return {k: _walk(v, f"{path}/{k}", leaf) for k, v in node.items()}
    if isinstance(node, list):
        return [_walk(v, f"{path}/{i}", leaf) for i, v in enumerate(node)]
    if isinstance(node, tuple):
        return tuple(_walk(v, f"{path}/{i}", leaf) for i, v in enumerate(node))
    return node


def assign_rank_shards(
    layout: Mapping[str, tuple[str, tuple[int, ...]]], owned: range, previous: Sequence[TensorSpec],
    owners: Mapping[str, str] | None = None,
) -> tuple[TensorSpec, ...]:
    """``assign_shards`` over this rank's ``owned`` shards only (global shard indices)."""
    base = owned.start
    local_prev = [TensorSpec(s.name, s.dtype, tuple(s.shape), s.shard - base) for s in previous]
    return tuple(TensorSpec(s.name, s.dtype, s.shape, s.shard + base)
                 for s in assign_shards(layout, len(owned), local_prev, owners))


def bits_digest(name: str, spec: tuple[str, tuple[int, ...]], bits: np.ndarray, chunk_bytes: int) -> bytes:
    """A tensor's digest as its seal would record it."""
    return tensor_digest(name, spec[0], spec[1], chunk_digests(bits, chunk_bytes))


# ---------------------------------------------------------------------- agreement
@dataclass
class PartReport:
    """What a rank tells the others once its part of a version is durable (or failed)."""

    error: str = ""
    #: This rank's tensors: ``(name, dtype, shape, shard)``.
    specs: list[tuple[str, str, tuple[int, ...], int]] = field(default_factory=list)
    #: Events and digest of each shard this rank owns.
    counts: dict[int, int] = field(default_factory=dict)
    digests: dict[int, bytes] = field(default_factory=dict)
    #: Small states that changed since the last sealed version.
    small: dict[str, bytes] = field(default_factory=dict)
    #: Digests of the replicated tensors as this rank holds them.
    replicas: dict[str, bytes] = field(default_factory=dict)
    raw_bytes: int = 0
    encoded_bytes: int = 0
    last_gsn: int = 0
    #: How this rank's part is encoded (its codec, and why not predictive).
    encoding: str = ""

    def pack(self) -> bytes:
        """msgpack bytes of the report."""
        packed: bytes = msgpack.packb([
            self.error, [list(s[:2]) + [list(s[2]), s[3]] for s in self.specs],
            list(self.counts.items()), list(self.digests.items()), self.small, self.replicas,
            self.raw_bytes, self.encoded_bytes, self.last_gsn, self.encoding,
        ], use_bin_type=True)
        return packed

    @classmethod
    def unpack(cls, data: bytes, rank: int) -> PartReport:
        """The report of rank ``rank`` from its bytes."""
        try:
            e, specs, counts, digests, small, replicas, raw, enc, last, codec = msgpack.unpackb(
                data, raw=False)
            return cls(str(e), [(str(n), str(d), tuple(int(x) for x in s), int(h)) for n, d, s, h in specs],
                       {int(k): int(v) for k, v in counts}, {int(k): bytes(v) for k, v in digests},
                       dict(small), dict(replicas), int(raw), int(enc), int(last), str(codec))
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise DecodeError(f"rank {rank}'s part report cannot be decoded: {exc}") from exc


def check_parts(reports: Sequence[PartReport], version: int, own: BaseException | None) -> None:
    """Raise unless every rank's part of ``version`` is durable and every replica agrees
    with rank 0's (``own``: this rank's failure, raised as it is)."""
    if own is not None:
        raise own
    for rank, rep in enumerate(reports):
        if rep.error:
            raise RewindError(f"version {version} was not sealed: rank {rank} failed to write "
                              f"its part ({rep.error})")
    ref = reports[0].replicas
    for rank, rep in enumerate(reports[1:], start=1):
        for name in sorted(ref.keys() | rep.replicas.keys()):
            mine, theirs = ref.get(name), rep.replicas.get(name)
            if mine != theirs:
                said = ("is missing on rank 0" if mine is None
                        else "is missing on that rank" if theirs is None
                        else f"digest {theirs.hex()} differs from rank 0's {mine.hex()}")
                raise RewindError(f"replica drift at version {version}: rank {rank}'s copy of replicated "
                                  f"tensor {name!r} {said}; the version was not sealed")


def shard_digests_of(specs: Iterable[TensorSpec], shards: Iterable[int],
                     digests: Mapping[str, bytes]) -> dict[int, bytes]:
    """Each of ``shards``'s digest over the tensors ``specs`` assigns to it."""
    per: dict[int, dict[str, bytes]] = {s: {} for s in shards}
    for s in specs:
        per[s.shard][s.name] = digests[s.name]
    return {s: shard_digest(d) for s, d in per.items()}


# ---------------------------------------------------------------------- restore
def unsealed_tail(log: EventLog, shards: Iterable[int], sealed: int) -> tuple[int, int]:
    """The newest version and gsn of any record on the ``shards`` partitions past the newest
    sealed version ``sealed``: the part of a rank that wrote it before a crash. ``(0, 0)``
    if there is none. Versions within a partition never decrease, so the last record tells."""
    newest, gsn = 0, 0
    for shard in shards:
        env = _last_event(log, shard)
        if env is not None and env.version > sealed:
            newest, gsn = max(newest, env.version), max(gsn, env.gsn)
    return newest, gsn


def _last_event(log: EventLog, partition: int) -> Envelope | None:
    """The partition's last committed event, read through a window that widens from the end
    (offsets need not be dense: Kafka's transaction markers and aborted records take some)."""
    start, end = log.start_offset(partition), log.end_offset(partition)
    width = 4
    while True:
        gt = max(start - 1, end - 1 - width)
        found = list(events(log, partition, gt=gt, lte=end - 1))
        if found:
            return found[-1][2]
        if gt <= start - 1:
            return None
        width *= 8


def rank_trees(objects: Mapping[str, Stateful], state: RebuiltState, rank: int, world: int,
               replicated: Mapping[str, TensorBits] | None = None) -> dict[str, Any]:
    """The state trees rank ``rank`` of ``world`` restores, its DTensors rebuilt over the live
    meshes. At the recorded world size these are its own recorded part (``state`` may hold
    only this rank's shards, ``replicated`` the replicated tensors rank 0's shards hold); at
    another, its DTensors' local shards are cut from the full tensors (``replayer.assemble``)
    with the recorded placements, and its other states are recorded rank
    ``source_rank(rank)``'s.

    At the recorded world size, a tensor the model or the optimizer already holds at the
    recorded place, with its dtype, shape and placements (the parameters, the moments of an
    optimizer that has stepped), is written in place, as ``dcp.load`` does, once every check
    has passed; the tree then holds that very tensor, so ``load_state_dict`` copies nothing."""
    states = state.small.states
    bits = {**(replicated or {}), **{n: t for s in state.shards for n, t in s.tensors.items()}}
    recorded = recorded_world(state)
    if not recorded:
        raise StateMismatchError(f"run {state.run_id!r} was not recorded by the ranks of a process group "
                                 "(restore it with a Recorder without group=)")
    src = assemble.source_rank(rank, recorded)
    prefix = rank_prefix(src)
    missing = [n for n in objects if prefix + n not in states]
    if missing:
        raise StateMismatchError(f"run {state.run_id!r} recorded no state of rank {src} for "
                                 f"{', '.join(map(repr, missing))}")
    skeletons = {n: statecodec.unpack(states[prefix + n], f"small state {prefix + n!r}") for n in objects}
    layouts = [assemble.rank_layout(states, r)[1] for r in range(recorded)]
    wanted: set[str] = set()
    for tree in skeletons.values():
        assemble.collect_refs(tree, wanted)
    lacking = sorted(wanted - bits.keys())
    if lacking:
        raise StateMismatchError(f"run {state.run_id!r}: rank {rank} restores tensors its rebuilt part "
                                 f"lacks: {', '.join(map(repr, lacking[:3]))}")
    in_place = _in_place(objects, skeletons, bits, layouts[src]) if recorded == world else {}
    needed = {n for n in bits if n in wanted or (recorded != world and assemble.rank_of(n) is not None)}
    local = {n: tensorcodec.bits_to_tensor(t.bits, t.dtype, t.shape) for n, t in bits.items()
             if n in needed and n not in in_place}
    tensors = {n: local[n] for n in wanted if n not in in_place}
    meshes = _live_meshes(objects)
    for name, placed in layouts[src].items():
        if name not in wanted:
            continue
        mesh = _mesh_for(placed, meshes, name, same_world=recorded == world)
        if name in in_place:
            continue
        part = local[name]
        if recorded != world and placed.sharded:
            full = assemble.assemble(name.removeprefix(prefix), recorded, layouts, local)
            part = full[assemble.region(placed.shape, tuple(mesh.shape), placed.placements,
                                        tuple(mesh.get_coordinate() or ()))].contiguous()
        placements = tuple(_placement_of(p, f"layout of recorded tensor {name!r}") for p in placed.placements)
        tensors[name] = DTensor.from_local(part, mesh, placements, run_check=False,
                                           shape=torch.Size(placed.shape), stride=placed.stride)
    for name, tree in skeletons.items():
        check_groups(name, objects[name], tree)
    with torch.no_grad():  # every check has passed: write in place
        for name, dest in in_place.items():
            t = bits[name]
            local_dest = dest.to_local() if isinstance(dest, DTensor) else dest
            local_dest.copy_(optimstep.tensor_view(t.bits, t.dtype, tuple(t.shape)))
            tensors[name] = dest
    return {n: unflatten(tree, tensors) for n, tree in skeletons.items()}


def _in_place(objects: Mapping[str, Stateful], skeletons: Mapping[str, Any], bits: Mapping[str, TensorBits],
              layout: Mapping[str, assemble.Placed]) -> dict[str, torch.Tensor]:
    """The live tensors (by recorded name) that can take their recorded bits in place: held
    by a module or an optimizer where its recorded tree refers to that name, with the
    recorded dtype and local shape, and (a DTensor) the recorded global shape, mesh shape
    and placements."""
    out: dict[str, torch.Tensor] = {}

    def walk(skeleton: Any, live: Any) -> None:
        if isinstance(skeleton, TensorRef):
            if isinstance(live, torch.Tensor) and skeleton.name in bits and skeleton.name not in out \
                    and _fits(live, bits[skeleton.name], layout.get(skeleton.name)):
                out[skeleton.name] = live
        elif isinstance(skeleton, Mapping) and isinstance(live, Mapping):
            for key, value in skeleton.items():
                if key in live:
                    walk(value, live[key])
        elif isinstance(skeleton, list | tuple) and isinstance(live, list | tuple) \
                and len(skeleton) == len(live):
            for a, b in zip(skeleton, live, strict=True):
                walk(a, b)

    for name, tree in skeletons.items():
        obj = objects[name]
        if isinstance(obj, torch.nn.Module | torch.optim.Optimizer):
            walk(tree, obj.state_dict())
    return out


def _fits(live: torch.Tensor, t: TensorBits, placed: assemble.Placed | None) -> bool:
    """Whether ``live`` can take the recorded bits ``t`` in place."""
    if isinstance(live, DTensor):
        if placed is None or tuple(live.shape) != tuple(placed.shape) \
                or tuple(live.device_mesh.shape) != tuple(placed.mesh) \
                or tuple(_placement_name(p) for p in live.placements) != tuple(placed.placements):
            return False
        live = live.to_local()
    elif placed is not None:
        return False
    return (live.dtype == tensorcodec.torch_dtype(t.dtype) and tuple(live.shape) == tuple(t.shape)
            and live.is_contiguous())


def _mesh_for(placed: assemble.Placed, meshes: Sequence[DeviceMesh], name: str,
              same_world: bool) -> DeviceMesh:
    """The live mesh a recorded DTensor goes to: of the recorded shape at the recorded world
    size, else of as many dimensions."""
    found = [m for m in meshes
             if (tuple(m.shape) == placed.mesh if same_world else m.ndim == len(placed.mesh))]
    if not found:
        raise StateMismatchError(f"layout of recorded tensor {name!r}: recorded over a device mesh of shape "
                                 f"{list(placed.mesh)}, but the live model has "
                                 f"{[list(m.shape) for m in meshes] or 'no DTensors'}")
    return found[0]


def _live_meshes(objects: Mapping[str, Stateful]) -> list[DeviceMesh]:
    """The device meshes the live objects' DTensors use (a module's parameters, an
    optimizer's param groups)."""
    found: list[DeviceMesh] = []
    for obj in objects.values():
        tensors: list[Any] = []
        if isinstance(obj, torch.nn.Module):
            tensors = list(obj.parameters()) + list(obj.buffers())
        for group in getattr(obj, "param_groups", None) or []:
            tensors += list(group.get("params", []))
        for t in tensors:
            if isinstance(t, DTensor) and all(t.device_mesh is not m for m in found):
                found.append(t.device_mesh)
    return found


def load_rank(objects: Mapping[str, Stateful], state: RebuiltState, rank: int, world: int,
              replicated: Mapping[str, TensorBits] | None = None) -> None:
    """Load what rank ``rank`` of ``world`` restores (``rank_trees``) into the live objects;
    nothing is loaded on a mismatch."""
    trees = rank_trees(objects, state, rank, world, replicated)
    for name, tree in trees.items():
        try:
            objects[name].load_state_dict(tree)
        except (RuntimeError, KeyError, ValueError, TypeError) as exc:
            raise StateMismatchError(f"rank {rank}: cannot load recorded {name!r}: {exc}") from exc


def recorded_world(state: RebuiltState) -> int:
    """The world size that recorded ``state``'s version (0: one process recorded it)."""
    return assemble.recorded_world(state.small.states, {s.name for s in state.layout.tensors})
