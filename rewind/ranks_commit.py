"""One rank's side of a multi-rank ``Recorder`` (``group=``): creating the run, writing the
rank's part of each version, sealing it (rank 0), and restoring the rank's own part.

``RankCommit`` keeps what only a multi-rank recorder has (its rank group, the shards this rank
owns, the run's global layout, the version numbers an unsealed part took) and commits through
the recorder's commit pipeline (``eventlog.commit.pipeline``), as a single process does: the
pipeline holds the base (the XOR base, the specs, the small states, the version and the gsn
floor), the gsns, the version CAS and the transactions.

A rank's part uses the predictive codec on the rank's own tensors under the single-process
rules (Adam, AdamW and SGD are element-wise, so a local shard steps alone): the gradients'
local shards and the steps' hyperparameters, then residuals; the names the codec's plan
knows (``model/<path>``) map to the rank's log names (``rank<r>/model/<path>``). A rank that
cannot predict writes XOR deltas, and the seal names each part's encoding. The
agreement's messages, the per-rank capture and the loading of a part are
``rewind.distributed``'s; ``docs/multirank.md`` describes the protocol.

A restore at the recorded world size folds only this rank's shards (the newest valid
snapshot plus the tail), each checked against the global seal's count and digest for that
shard; the replicated tensors, which rank 0's shards hold, reach the other ranks in one
broadcast from rank 0. At another world size every rank folds the whole version, since it
cuts its region out of full tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from eventlog import predictive, tensorcodec
from eventlog.backends import RunAddress
from eventlog.capture import Stateful
from eventlog.commit.pipeline import CommitPipeline
from eventlog.digests import tensor_digest
from eventlog.errors import ConfigError, DecodeError, RewindError, RunNotFoundError, StaleVersionError
from eventlog.events import Body, OptimizerStep, RunStarted, TensorSpec
from eventlog.fold.bits import TensorBits
from eventlog.fold.engine import RebuiltState, SmallStates
from eventlog.optimstep import StepCapture
from eventlog.ports import CONTROL
from eventlog.provenance import PROVENANCE
from eventlog.target import LATEST
from replayer import assemble
from replayer.replay import ReplayReport, Restorer, replay
from rewind import distributed, fingerprint
from rewind.results import CommitResult
from rewind.staged import StagedCommit


class RankCommit:
    """The multi-rank side of a recorder that commits through ``pipe``: agrees with the other
    ranks on the run's shard count (``shards`` per rank for a new run) and creates it.
    ``restorer``: the recorder's own restore hook, if it was given one (it rebuilds the whole
    version on every rank). ``objects`` are the recorder's recorded objects (a restore loads
    this rank's part into them), ``plan`` and ``steps`` its predictive codec's plan and
    captured optimizer steps."""

    def __init__(self, pipe: CommitPipeline, group: distributed.RankGroup, shards: int,
                 restorer: Restorer | None, *, address: RunAddress, objects: Mapping[str, Stateful],
                 plan: predictive.StepPlan | str, steps: StepCapture | None) -> None:
        self._pipe, self.group, self._restorer, self._address = pipe, group, restorer, address
        self._objects, self._plan, self._steps = objects, plan, steps
        total = pipe.log.shard_count() or shards * group.world
        if total < group.world:
            raise ConfigError(f"run {pipe.run_id!r} has {total} tensor shards, fewer than the {group.world} "
                              "ranks (each rank writes shards of its own): restore it at a world size of "
                              f"at most {total}")
        if group.rank == 0:
            pipe.log.create(total)
        group.barrier()  # the partitions exist before any rank writes its part
        pipe.shards = total
        self.owned = distributed.owned_shards(group.rank, group.world, total)
        #: The run's global layout, and how many version numbers unsealed parts took.
        self.global_specs: tuple[TensorSpec, ...] = ()
        self.skip = 0

    # ------------------------------------------------------------------ commit
    def write(self, job: StagedCommit) -> CommitResult:
        """This rank's side of a version: its part in its own transaction, then the
        agreement; rank 0 seals the version once every part is durable."""
        pipe, g = self._pipe, self.group
        t0 = time.perf_counter()
        base = pipe.base.version
        version = base + 1 + self.skip
        failure = None
        job.record_consumed(version, assemble.rank_prefix(g.rank) + PROVENANCE)
        try:
            part = self._write_part(job, base, version)
        except BaseException as exc:  # noqa: BLE001 - told to every rank, then raised here
            failure = exc
            part = _Written(distributed.PartReport(error=f"{type(exc).__name__}: {exc}"))
        report = part.report
        reports = [distributed.PartReport.unpack(b, r) for r, b in enumerate(g.all_gather(report.pack()))]
        distributed.check_parts(reports, version, failure)
        small = dict(pipe.base.small)
        for rep in reports:
            small.update(rep.small)
        global_specs = tuple(sorted((TensorSpec(n, d, s, h) for rep in reports for n, d, s, h in rep.specs),
                                    key=lambda s: s.name))
        outcome, sealed = "", None
        if g.rank == 0:
            try:
                sealed = self._seal(job, base, version, reports, global_specs, small)
            except BaseException as exc:  # noqa: BLE001 - told to every rank, then raised here
                failure, outcome = exc, f"{type(exc).__name__}: {exc}"
        outcome = g.broadcast(outcome.encode()).decode()
        if failure is not None:
            raise failure
        if outcome:
            raise RewindError(f"version {version} was not sealed: rank 0 failed to seal it ({outcome})")
        self.global_specs, self.skip = global_specs, 0
        last = max(report.last_gsn, pipe.base.last_gsn, sealed or 0)
        pipe.advance(job.staged, part.specs, part.chunk_digests, small, version, last)
        return CommitResult(version, job.step, part.emitted + (1 if sealed else 0), report.raw_bytes,
                            report.encoded_bytes, time.perf_counter() - t0, _encoding(reports), part.residual)

    def _write_part(self, job: StagedCommit, base: int, version: int) -> _Written:
        """This rank's part of ``version``, durable in its own transaction, and its report."""
        pipe, g = self._pipe, self.group
        if job.base_version is not None and job.base_version != base:
            raise StaleVersionError(job.base_version, base)
        own = {n: b for n, b in job.staged.items() if g.rank == 0 or n not in job.replicated}
        layout = {n: job.layout[n] for n in own}
        names = _Names(own, g.rank)
        specs = pipe.base.specs
        relayout = {s.name: (s.dtype, tuple(s.shape)) for s in specs} != layout
        if relayout:
            specs = distributed.assign_rank_shards(layout, self.owned, specs, names.owners(self._plan))
        spec_of = {s.name: s for s in specs}
        part = _predict(pipe, self._plan, job, names, spec_of, relayout, base)
        job.steps = []  # the prediction holds the gradients until it has logged them
        out = _Written(distributed.PartReport(), specs)
        out.report.encoding = pipe.codec(part.prediction, part.why_not) if own else "no tensors"
        counts = [0] * pipe.shards
        if own:
            most = sum(len(tensorcodec.chunk_ranges(len(b), pipe.chunk_bytes)) for b in own.values())
            most += part.prediction.event_count(pipe.chunk_bytes) if part.prediction else 0
            with pipe.transaction(version, job.step, most) as emit:
                for shard, body in part.events(pipe):  # each shard's steps before its residuals
                    emit(shard, body)
                out.chunk_digests, out.residual, _ = pipe.encode(own, spec_of, part.predicted, emit)
            out.report.encoded_bytes = out.residual + (part.prediction.grad_bytes if part.prediction else 0)
            counts, out.emitted, out.report.last_gsn = emit.shard_counts, emit.gsn - emit.first, emit.gsn - 1
        digests = {s.name: tensor_digest(s.name, s.dtype, s.shape, out.chunk_digests[s.name]) for s in specs}
        report = out.report
        report.specs = [(s.name, s.dtype, tuple(s.shape), s.shard) for s in specs]
        report.counts = {s: counts[s] for s in self.owned}
        report.digests = distributed.shard_digests_of(specs, self.owned, digests)
        report.small = {n: b for n, b in job.small.items() if pipe.base.small.get(n) != b}
        report.replicas = {n: digests[n] if n in digests else distributed.bits_digest(
            n, job.layout[n], job.staged[n], pipe.chunk_bytes) for n in job.replicated}
        report.raw_bytes = sum(len(b) for b in own.values())
        return out

    def _seal(self, job: StagedCommit, base: int, version: int, reports: list[distributed.PartReport],
              specs: tuple[TensorSpec, ...], small: dict[str, bytes]) -> int:
        """Rank 0: the version's control events and its global seal, in one transaction,
        after every rank's part is durable; returns the seal's gsn."""
        pipe = self._pipe
        head: list[Body] = [pipe.layout_event(specs, small)] if specs != self.global_specs else []
        if base == 0 and job.environment is not None:  # the run's first seal: rank 0's environment
            head.append(job.environment)
        control = pipe.control_events(head, small, job.metrics, ranked=True)
        counts, digests = [0] * pipe.shards, [b""] * pipe.shards
        for rep in reports:
            for shard, n in rep.counts.items():
                counts[shard] = n
            for shard, d in rep.digests.items():
                digests[shard] = d
        control.append(pipe.seal(base, counts, len(control), digests, small, _encoding(reports),
                                 sum(r.raw_bytes for r in reports), sum(r.encoded_bytes for r in reports)))
        with pipe.transaction(version, job.step, len(control), claim_from=base) as emit:
            for event in control:
                emit(CONTROL, event)
        return emit.gsn - 1

    # ------------------------------------------------------------------ restore
    def restore(self) -> tuple[RebuiltState, ReplayReport] | None:
        """Load this rank's part of the newest sealed version (``None``: nothing sealed yet);
        every rank learns which version numbers a crashed commit's unsealed parts took, so
        none is reused."""
        pipe, g = self._pipe, self.group
        state, report = None, None
        with contextlib.suppress(RunNotFoundError):
            state, report = self._rebuild()
        sealed = 0 if state is None else state.version
        part = state is not None and len(state.shards) < state.layout.shard_count
        newest, floor = self._agree(sealed, part)
        if state is not None:
            self._load(state, part)
            floor = max([floor, state.seal.gsn, *(e.gsn for _, e in state.index.markers)])
        pipe.base.chunk_digests = {}
        if self._steps is not None:
            self._steps.take()  # steps taken before the restore led to another state
        pipe.base.version, self.skip = sealed, newest - sealed
        pipe.base.last_gsn = max(pipe.base.last_gsn, floor)
        if g.rank == 0:
            pipe.coord.reset_version(pipe.run_id, sealed)
            pipe.coord.raise_gsn_floor(pipe.run_id, pipe.base.last_gsn)
            if state is not None and report is not None:
                # Every rank checked its part against the seal (they agreed on the version).
                fingerprint.log_resume(pipe, state, report)
        g.barrier()  # no rank commits before rank 0 set the coordinator
        if state is None or report is None:
            return None
        return state, report

    def _agree(self, sealed: int, part: bool) -> tuple[int, int]:
        """Check that every rank restored version ``sealed`` the same way (``part``: rank by
        rank); returns the newest version number an unsealed part took and the gsn floor."""
        # Each rank reads the ends of its own partitions; the maximum over ranks covers all.
        tail_version, tail_gsn = distributed.unsealed_tail(self._pipe.log, self.owned, sealed)
        mine = msgpack.packb([sealed, tail_version, tail_gsn, part])
        seen = [msgpack.unpackb(b) for b in self.group.all_gather(mine)]
        if any(v != sealed for v, _, _, _ in seen):
            raise RewindError(f"the ranks restored different versions ({[v for v, _, _, _ in seen]}): the "
                              "log changed while they read it; restore again once no rank commits")
        if any(p != part for _, _, _, p in seen):
            raise RewindError(f"the ranks disagree on whether version {sealed} is restored rank by rank "
                              f"({[p for _, _, _, p in seen]}); restore again")
        return max(max(v for _, v, _, _ in seen), sealed), max(t for _, _, t, _ in seen)

    def _load(self, state: RebuiltState, part: bool) -> None:
        """Load this rank's part of ``state`` into the objects, and make it the pipeline's base."""
        g, base = self.group, self._pipe.base
        replicated = self._share_replicated(state) if part else {}
        distributed.load_rank(self._objects, state, g.rank, g.world, replicated)
        self._pipe.retire_base()
        self.global_specs = tuple(sorted(state.layout.tensors, key=lambda s: s.name))
        if distributed.recorded_world(state) == g.world:
            mine = set(self.owned)
            base.specs = tuple(s for s in state.layout.tensors if s.shard in mine)
            # The rebuilt bits themselves (the objects hold copies of them or were written
            # from them); bits still in a snapshot file's map are copied into bits of the
            # base's own on the staging thread ``Recorder`` starts next (``add_staging``).
            base.bits = {n: t.bits for s in state.shards if s.shard in mine for n, t in s.tensors.items()}
        else:
            # Resharded: the shards this rank now owns held other ranks' tensors, so its
            # first commit writes every tensor in full (the new layout drops the old names).
            base.specs, base.bits = (), {}
        self._pipe.chunk_bytes = state.layout.chunk_bytes
        base.small = dict(state.small.states)

    def _rebuild(self) -> tuple[RebuiltState, ReplayReport]:
        """The newest sealed version: this rank's shards of it when it was recorded at this
        world size, else all of it (or what the recorder's own restore hook rebuilds)."""
        if self._restorer is not None:
            return self._restorer(self._pipe.log)
        return replay(self._address, LATEST, workers=2, shards=self._shards_to_fold)

    def _shards_to_fold(self, layout: RunStarted, small: SmallStates) -> Collection[int]:
        """This rank's own shards if the version was recorded at this world size (its shards
        then hold exactly what this rank wrote), else every shard."""
        if assemble.recorded_world(small.states, {s.name for s in layout.tensors}) == self.group.world:
            return self.owned
        return range(layout.shard_count)

    def _share_replicated(self, state: RebuiltState) -> dict[str, TensorBits]:
        """Rank 0's replicated tensors (folded from its shards, checked against the seal) on
        every rank, in one broadcast of msgpack bytes."""
        data = b""
        if self.group.rank == 0:
            data = msgpack.packb([[n, t.dtype, list(t.shape), t.bits.tobytes()]
                                  for s in state.shards for n, t in s.tensors.items()
                                  if assemble.rank_of(n) is None], use_bin_type=True)
        got = self.group.broadcast(data)
        if self.group.rank == 0:
            return {}
        try:
            return {str(n): TensorBits(str(d), tuple(int(x) for x in shape), np.frombuffer(b, dtype=np.uint8))
                    for n, d, shape, b in msgpack.unpackb(got, raw=False)}
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise DecodeError(f"rank 0's replicated tensors of version {state.version} cannot be "
                              f"decoded: {exc}") from exc


def _encoding(reports: Sequence[distributed.PartReport]) -> str:
    """A multi-rank version's ``CommitSealed.encoding``: the codec family its parts share
    (``mixed`` when they differ), then each rank's part's encoding."""
    families = {re.split(r"[/ (]", r.encoding, maxsplit=1)[0] for r in reports if r.encoding != "no tensors"}
    family = families.pop() if len(families) == 1 else "mixed" if families else "no tensors"
    parts = "; ".join(f"rank {i}: {r.encoding}" for i, r in enumerate(reports))
    return f"{family} (multi-rank, {len(reports)} ranks: {parts})"


class _Names:
    """A rank's own tensors under the names one process would give them (``rank<r>/`` taken
    off), so that the predictive codec's plan, which names params by their place in the
    model, finds them; ``log`` maps those names back to the log's."""

    def __init__(self, own: Collection[str], rank: int) -> None:
        prefix = assemble.rank_prefix(rank)
        self.log = {n.removeprefix(prefix): n for n in own}
        self.clash = len(self.log) != len(own)  # ``x`` and ``rank<r>/x`` both recorded

    def owners(self, plan: predictive.StepPlan | str) -> dict[str, str]:
        """Each of the rank's optimizer state tensors' param (log names): the layout keeps
        them on one shard, so the shard replays its step alone."""
        if isinstance(plan, str):
            return {}
        return {self.log[s]: self.log[p] for s, p in plan.owners(list(self.log)).items() if p in self.log}

    def state_prefixes(self, plan: predictive.StepPlan) -> dict[str, str] | str:
        """Each optimizer param's state prefix in the log (``rank<r>/optimizer/state/<i>`` for a
        sharded param), or why a prefix cannot be named (its states are split between the
        rank's own tensors and the replicated ones)."""
        out: dict[str, str] = {}
        for i, param in enumerate(plan.params):
            plain, logged = predictive.state_prefix(i), self.log.get(param, param)
            out[plain] = logged[:len(logged) - len(param)] + plain
        for name, logged in self.log.items():
            prefix = name.rpartition("/")[0]
            if prefix in out and logged.rpartition("/")[0] != out[prefix]:
                return f"the optimizer state {name} is not recorded beside its param"
        return out


@dataclass
class _Written:
    """What a rank's ``_write_part`` made: its report to the other ranks, its layout, its
    chunk digests (the next base's), its event count and residual bytes."""

    report: distributed.PartReport
    specs: tuple[TensorSpec, ...] = ()
    chunk_digests: dict[str, list[bytes]] = dataclasses.field(default_factory=dict)
    emitted: int = 0
    residual: int = 0


@dataclass
class _Part:
    """How a rank's part of a version is encoded: a prediction on its own shards (names as
    ``_Names`` gives them) or, with ``why_not``, XOR deltas."""

    prediction: predictive.Prediction | None = None
    why_not: str = ""
    names: _Names | None = None
    prefixes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def predicted(self) -> set[str]:
        """The log names of the tensors the prediction computes (their chunks are residuals)."""
        if self.prediction is None or self.names is None:
            return set()
        return {self.names.log[n] for n in self.prediction.predicted}

    def events(self, pipe: CommitPipeline) -> Iterator[tuple[int, Body]]:
        """The prediction's events, renamed to the log's names."""
        if self.prediction is None or self.names is None:
            return
        log = self.names.log
        for shard, body in pipe.prediction_events(self.prediction):
            if isinstance(body, OptimizerStep):
                body = dataclasses.replace(
                    body, params=tuple(log[n] for n in body.params),
                    states=tuple(self.prefixes[p] for p in body.states),
                    predicted=tuple(log[n] for n in body.predicted))
            else:
                body = dataclasses.replace(body, name=log[body.name])
            yield shard, body


def _predict(pipe: CommitPipeline, plan: predictive.StepPlan | str, job: StagedCommit, names: _Names,
             spec_of: Mapping[str, TensorSpec], relayout: bool, base: int) -> _Part:
    """This rank's part of the version as a prediction, when the single-process rules allow
    it (``predictive.check``) on its own tensors, else why not."""
    if isinstance(plan, str):
        return _Part(why_not=plan)
    if names.clash:
        return _Part(why_not="a tensor is recorded both as the rank's own and as a replica")
    prefixes = names.state_prefixes(plan)
    if isinstance(prefixes, str):
        return _Part(why_not=prefixes)
    # A param none of whose elements are this rank's (6 rows over 4 ranks: 2, 2, 2, 0) has no
    # gradient chunk to log: it stays out of the steps, and its states are XOR deltas.
    steps = [dataclasses.replace(s, grads={i: g for i, g in s.grads.items() if g.numel()})
             for s in distributed.local_steps(job.steps)]
    if job.steps and not any(s.grads for s in steps):
        return _Part(why_not="the rank holds no element of any param")
    plain_specs = {n: dataclasses.replace(spec_of[logged], name=n) for n, logged in names.log.items()}
    prev = {n: pipe.base.bits[logged] for n, logged in names.log.items() if logged in pipe.base.bits}
    prediction, why = pipe.predict(plan, steps, plain_specs, prev, relayout, base)
    if prediction is None:
        return _Part(why_not=why)
    return _Part(prediction, "", names, prefixes)
