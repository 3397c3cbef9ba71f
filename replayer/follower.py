"""Followers: actors and inference workers that keep a model at a run's newest version.

A ``Follower`` polls the run's log. Within ``max_lag`` versions it folds the new commits
into its own copy of the shard state, with the shared exactly-once rule
(``eventlog.fold.engine.fold_shard``), and verifies every shard against the newest seal. Beyond
``max_lag`` (and on the first poll, or when an incremental step fails verification) it does
a full sync: the newest valid snapshot plus the log tail (``replayer.replay.replay``).

Only a verified version reaches the model. Its tensors are copied in all at once under
``Follower.lock``, so a reader inside ``reading()`` sees one whole version, never a mix.
Each poll reports the follower's version to the coordinator; ``followers_table`` lists
every follower's lag.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Self

import torch

from eventlog import (
    ConfigError,
    CoordinationError,
    DecodeError,
    IntegrityError,
    RewindError,
    RunAddress,
    RunNotFoundError,
    Target,
    TruncatedHistoryError,
    intraop,
    tensorcodec,
)
from eventlog.capture import check_model_fits
from eventlog.events import RunStarted
from eventlog.fold.apply import ShardState, verify_shard
from eventlog.fold.engine import ControlIndex, SmallStates, fold_control, fold_shard, index_control
from eventlog.provenance import STATE, Stamp
from eventlog.waits import IDLE_REPEAT_S, Idle
from replayer import assemble
from replayer.replay import replay

NOOP, INCREMENTAL, FULL = "noop", "incremental", "full"
#: The role whose log tensors (``model/<state_dict key>``) are loaded into the module.
MODEL = "model"
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FollowResult:
    """What one ``poll()`` did."""

    version_before: int
    version_after: int
    #: ``noop`` (nothing new), ``incremental`` (deltas applied) or ``full`` (snapshot + tail).
    mode: str
    versions_applied: int
    #: Tensor events folded from the log (a snapshot's own contents are not counted).
    events_applied: int
    seconds: float
    #: Why a full sync was needed (empty otherwise).
    reason: str = ""
    #: The snapshot a full sync started from (``None``: the start of the log).
    snapshot: str | None = None


class ModelFollower:
    """What every follower shares: a model readers hold at one version through ``reading()``,
    one poll at a time, and a report of its version to the coordinator after each poll
    (dropped at ``close()``). Subclasses implement ``_poll_once`` and ``_release``."""

    def __init__(self, address: RunAddress | str, model: torch.nn.Module, name: str | None) -> None:
        # A run id alone finds its backends in the environment, as a Recorder's does.
        self.address = address if isinstance(address, RunAddress) else RunAddress.from_env(address)
        self.model = model
        self.name = name or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        #: Held while tensors are written into the model; readers hold it through ``reading()``.
        self.lock = threading.RLock()
        self._poll_lock = threading.Lock()  # one poll at a time: polls mutate the staging state
        self._coord = self.address.open_coordinator()
        self._version = 0
        self._closed = False

    @property
    def version(self) -> int:
        """The version the model holds (0: none yet). Stable while ``reading()`` is held."""
        return self._version

    @contextmanager
    def reading(self) -> Iterator[torch.nn.Module]:
        """Hold the model at one version while the block uses it; yields the model."""
        with self.lock:
            yield self.model

    def poll(self) -> FollowResult:
        """Bring the model to the newest version, if there is a newer one.

        Raises if the run cannot be read or the newest version does not verify; the model
        then keeps the version it had.
        """
        with self._poll_lock:
            if self._closed:
                raise RewindError(f"follower {self.name} is closed")
            result = self._poll_once(self._version, time.perf_counter())
            self._report()
            return result

    def stamp(self) -> Stamp:
        """``(run, version, digest)`` of the version the model holds, to attach to each rollout
        made with it (inside ``reading()``: the version the rollout used). Raises before the
        first version."""
        with self.lock:
            if not self._version:
                raise RewindError(f"follower {self.name} holds no version yet: poll() first")
            kind, digest = self._held_digest()
            return Stamp(self.address.run_id, self._version, digest.hex(), kind)

    def follow(self, stop: threading.Event, interval_s: float = 1.0) -> int:
        """Poll every ``interval_s`` until ``stop`` is set; returns how many polls moved the
        model. An error ends the loop (raised to the caller): the model keeps its version."""
        moved = 0
        with Idle(lambda: f"a version of run {self.address.run_id!r} after version {self._version} "
                          f"(follower {self.name}; the trainer commits none)", _log,
                  every_s=IDLE_REPEAT_S) as idle:
            while not stop.is_set():
                if self.poll().mode != NOOP:
                    moved += 1
                    idle.progress()
                else:
                    idle.waiting()
                stop.wait(interval_s)
        return moved

    def close(self) -> None:
        """Release threads and connections, and drop this follower's report from the
        coordinator, so that ``rewind followers`` lists only followers still running (the
        model keeps its last version)."""
        with self._poll_lock:
            if self._closed:
                return
            self._closed = True
            self._release()
            try:
                self._coord.forget_follower(self.address.run_id, self.name)
            except CoordinationError as exc:  # a cache: the entry just goes stale
                _log.warning("follower %s could not drop its report: %s", self.name, exc)
            self._coord.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _poll_once(self, before: int, t0: float) -> FollowResult:
        """One poll, from version ``before`` (started at ``perf_counter()`` ``t0``)."""
        raise NotImplementedError

    def _release(self) -> None:
        """Release what the subclass holds (threads, the log)."""

    def _held_digest(self) -> tuple[str, bytes]:
        """The kind and bytes of the digest of the version the model holds (under ``lock``)."""
        raise NotImplementedError

    def _report(self) -> None:
        # The coordinator is a cache: an outage must not stop an actor from following.
        try:
            self._coord.report_follower(self.address.run_id, self.name, self._version)
        except CoordinationError as exc:
            _log.warning("follower %s could not report version %d: %s", self.name, self._version, exc)


class Follower(ModelFollower):
    """Keeps ``model`` at the run's newest sealed version; poll it, or run ``follow()``.

    Readers that use the model while another thread polls hold ``reading()`` (or ``lock``),
    so they never see a version half applied. Use as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        address: RunAddress | str,
        model: torch.nn.Module,
        *,
        max_lag: int = 8,
        name: str | None = None,
        workers: int = 2,
    ) -> None:
        if max_lag < 0 or workers < 1:
            raise ConfigError(f"follower needs max_lag >= 0 and workers >= 1 (got {max_lag}, {workers})")
        super().__init__(address, model, name)
        self.max_lag, self.workers = max_lag, workers
        self._log = self.address.open_log()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="rewind-follower",
                                        initializer=intraop.serial_torch)
        self._idx: ControlIndex | None = None
        # Staging: the raw bits of every shard at ``_version`` (None: resync from scratch).
        self._shards: list[ShardState] | None = None
        self._layout: RunStarted | None = None
        self._small: SmallStates | None = None  # a multi-rank run's layout is among them
        self._fitted: frozenset[tuple[str, tuple[str, tuple[int, ...]]]] | None = None

    def _poll_once(self, before: int, t0: float) -> FollowResult:
        latest = self._latest()
        if latest <= before:
            return FollowResult(before, before, NOOP, 0, 0, time.perf_counter() - t0)
        try:
            return self._advance(before, latest, t0)
        except BaseException:
            self._shards = None  # staging may be past the model now: resync next time
            raise

    def _release(self) -> None:
        self._pool.shutdown()
        self._log.close()

    def _held_digest(self) -> tuple[str, bytes]:
        assert self._idx is not None  # a version is held: its seal was indexed
        return STATE, self._idx.seals[self._version].seal.state_digest

    # ------------------------------------------------------------------ internals
    def _latest(self) -> int:
        """Extend the control index with what is new; the newest sealed version (0: none)."""
        try:
            self._idx = index_control(self._log, self._idx)
        except RunNotFoundError:
            return 0  # the trainer has not committed its first version yet
        return self._idx.latest_version()

    def _advance(self, before: int, latest: int, t0: float) -> FollowResult:
        reason = self._full_sync_reason(before, latest)
        if reason is None:
            try:
                events = self._fold_incremental(before, latest)
                self._publish(latest)
                return FollowResult(before, latest, INCREMENTAL, latest - before, events,
                                    time.perf_counter() - t0)
            except (IntegrityError, DecodeError, TruncatedHistoryError) as exc:
                # The shared fold refused the tail (short count, digest, damaged message,
                # or retention truncated it under the read): the staging state is suspect,
                # so start again from a verified snapshot.
                reason = f"incremental step failed verification: {exc}"
                _log.warning("follower %s: %s; doing a full sync", self.name, reason)
        state, report = replay(self.address, Target("version", latest), workers=self.workers)
        self._shards, self._idx, self._layout = state.shards, state.index, state.layout
        self._small = state.small
        self._publish(state.version)
        events = sum(s.counts.applied for s in state.shards)
        return FollowResult(before, state.version, FULL, state.version - before, events,
                            time.perf_counter() - t0, reason, report.snapshot)

    def _full_sync_reason(self, before: int, latest: int) -> str | None:
        """Why the incremental path cannot take the follower to ``latest`` (``None``: it can)."""
        assert self._idx is not None
        if self._shards is None:
            return "first sync" if before == 0 else "resync after a failed poll"
        if latest - before > self.max_lag:
            return f"lag {latest - before} > max_lag {self.max_lag}"
        if any(v not in self._idx.seals for v in range(before + 1, latest + 1)):
            return "the control index lacks seals between versions (control truncated)"
        for state in self._shards:
            first = self._log.start_offset(state.shard)
            if first > state.next_offset:
                return (f"shard {state.shard} was truncated below offset {first}, past the "
                        f"follower's position {state.next_offset}")
        return None

    def _fold_incremental(self, before: int, target: int) -> int:
        """Fold every shard from its position to ``target`` and verify it against the seal;
        returns the tensor events applied."""
        idx, shards = self._idx, self._shards
        assert idx is not None and shards is not None
        layout = idx.layout_at(target, self._layout)
        if len(shards) != layout.shard_count:
            raise IntegrityError(f"layout of version {target} has {layout.shard_count} shards, "
                                 f"the follower holds {len(shards)}")
        seal = idx.seals[target].seal
        # Only the seals the fold crossed: verify_shard checks each one's event count.
        crossed = {v: idx.seals[v].seal for v in range(before + 1, target + 1)}

        def one(state: ShardState) -> int:
            applied = state.counts.applied
            fold_shard(self._log, state, idx, target, gt_offset=state.next_offset - 1)
            state.conform(layout.tensors)
            verify_shard(state, target, seal, layout.tensors, layout.chunk_bytes, crossed, before)
            return state.counts.applied - applied

        events = sum(self._pool.map(one, shards))
        if self._small is not None:
            self._small = fold_control(self._log, idx, target, self._small, self._small.next_offset - 1)
        self._layout = layout
        return events

    def _publish(self, version: int) -> None:
        """Copy the staged model tensors into the module: all of one version, under the lock."""
        tensors = self._model_tensors()
        prefix = f"{MODEL}/"
        recorded = {n: (tensorcodec.dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()}
        fingerprint = frozenset(recorded.items())
        if fingerprint != self._fitted:  # once per model layout, not per version
            check_model_fits(MODEL, self.model, recorded)
            self._fitted = fingerprint
        staged = {name.removeprefix(prefix): t for name, t in tensors.items()}
        with self.lock, torch.no_grad():
            live = self.model.state_dict()  # shares storage with the module's params/buffers
            for key, tensor in staged.items():
                live[key].copy_(tensor)
            self._version = version

    def _model_tensors(self) -> dict[str, torch.Tensor]:
        """The model's tensors at the staged version, by log name (``model/<key>``), as
        copies. A multi-rank run's model is assembled from its ranks' shards (full tensors)."""
        assert self._shards is not None and self._layout is not None
        prefix = f"{MODEL}/"
        bits = {n: t for shard in self._shards for n, t in shard.tensors.items()}
        states = self._small.states if self._small is not None else {}
        world = assemble.recorded_world(states, set(bits))
        # Built outside the lock (copies of the staged bits), so readers wait only for copy_.
        if world:
            full = assemble.full_tensors(states, bits, world, names=(MODEL,))[1]
            tensors = {n: t for n, t in full.items() if n.startswith(prefix)}
        else:
            tensors = {s.name: tensorcodec.bits_to_tensor(bits[s.name].bits, s.dtype, tuple(s.shape))
                       for s in self._layout.tensors if s.name.startswith(prefix)}
        return tensors



def forget_silent_followers(address: RunAddress, silent_s: float) -> list[str]:
    """Drop the reports of followers silent for more than ``silent_s`` seconds (a crashed
    actor never drops its own); returns their names. A follower still running reports
    again at its next poll."""
    if not silent_s >= 0:
        raise ConfigError(f"followers silent for {silent_s!r} seconds: give a number >= 0")
    now_ms = time.time() * 1000
    with address.open_coordinator() as coord:
        stale = [name for name, r in sorted(coord.followers(address.run_id).items())
                 if now_ms - r["time_ms"] > silent_s * 1000]
        return [name for name in stale if coord.forget_follower(address.run_id, name)]


def followers_table(address: RunAddress) -> list[dict[str, Any]]:
    """Each follower of the run, by name: its ``version``, the run's ``latest_version``
    (sealed, from the log), its ``lag`` and ``seconds_since_report``."""
    with address.open_log() as log:
        try:
            latest = index_control(log).latest_version()
        except RunNotFoundError:
            latest = 0  # followers may report before the first commit
    with address.open_coordinator() as coord:
        reports = coord.followers(address.run_id)
    now_ms = time.time() * 1000
    return [
        {"name": name, "version": r["version"], "latest_version": latest,
         "lag": max(0, latest - r["version"]),
         "seconds_since_report": max(0.0, (now_ms - r["time_ms"]) / 1000)}
        for name, r in sorted(reports.items())
    ]
