"""Which snapshots exist for recovery, and loading the newest good one.

A snapshot counts only if the log holds its ``SnapshotEnd`` marker, its manifest matches the
digest in that marker, every file verifies, and the rebuilt shard digests equal the seal of
its version. Recovery and ``rewind verify`` use this same code.

Retention deletes a snapshot's directory after writing a tombstone beside it
(``<id>.deleted``), so that readers tell a snapshot deleted on purpose from a damaged one.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from eventlog import RewindError, serde
from eventlog.digests import small_digest
from eventlog.durability import fsync_dir
from eventlog.events import RunStarted, SnapshotBegin, SnapshotEnd
from eventlog.fold.apply import ShardState
from eventlog.fold.engine import ControlIndex, FoldStart
from eventlog.fold.sharing import WorkBoard
from eventlog.ports import EventLog
from eventlog.settings import current
from snapshotter.store import Manifest, ShardCheck, SnapshotCorruptError, SnapshotStore


@dataclass(frozen=True)
class Marker:
    """A snapshot as the log announces it."""

    snapshot_id: str
    version: int
    step: int
    begin_offset: int | None
    end: SnapshotEnd | None
    end_offset: int | None


def markers(idx: ControlIndex) -> dict[str, Marker]:
    """Every snapshot the control partition mentions, by id (complete or orphaned)."""
    out: dict[str, Marker] = {}
    for offset, env in idx.markers:
        body = env.body
        assert isinstance(body, SnapshotBegin | SnapshotEnd)
        old = out.get(body.snapshot_id)
        if isinstance(body, SnapshotBegin):
            out[body.snapshot_id] = Marker(body.snapshot_id, env.version, env.step, offset,
                                           old.end if old else None, old.end_offset if old else None)
        else:
            out[body.snapshot_id] = Marker(body.snapshot_id, env.version, env.step,
                                           old.begin_offset if old else None, body, offset)
    return out


def discovered_store(idx: ControlIndex, run_id: str) -> SnapshotStore | None:
    """The store the run's newest published snapshot names in its ``SnapshotEnd`` marker
    (``None``: no snapshot was published, or none names a local store of this run).

    The log records where a run's snapshots live, so a reader needs no store address; the
    marker's manifest digest still guards every file read from it."""
    published = [m for m in markers(idx).values() if m.end is not None]
    for marker in sorted(published, key=lambda m: m.version, reverse=True):
        assert marker.end is not None
        uri, tail = marker.end.manifest_uri, f"/{run_id}/{marker.snapshot_id}"
        if uri.startswith("file://") and uri.endswith(tail) and len(uri) > len("file://") + len(tail):
            return SnapshotStore(uri[: -len(tail)])
    return None


def run_store(url: str | None, idx: ControlIndex, run_id: str) -> SnapshotStore | None:
    """The run's snapshot store: ``url`` when given (``RunAddress.snapshots_url``), else the
    one its end markers name (``discovered_store``)."""
    return SnapshotStore(url) if url else discovered_store(idx, run_id)


def encode_layout(layout: RunStarted, run_id: str) -> str:
    """A layout as manifest text (the Avro message of a RunStarted envelope, base64)."""
    from eventlog.events import Envelope

    return base64.b64encode(serde.encode(Envelope(run_id, 0, 0, 0, -1, "snapshotter", 0, layout))).decode()


def decode_layout(text: str, where: str) -> RunStarted:
    """The layout a manifest recorded."""
    try:
        env = serde.decode(base64.b64decode(text, validate=True), where)
    except (ValueError, RewindError) as exc:
        raise SnapshotCorruptError(f"{where}: layout is damaged ({exc})") from exc
    if not isinstance(env.body, RunStarted):
        raise SnapshotCorruptError(f"{where}: layout is a {env.kind}")
    return env.body


@contextmanager
def reading(store: SnapshotStore, run_id: str, snapshot_id: str) -> Iterator[None]:
    """Hold a shared lock on a snapshot while it is read, so retention cannot delete it."""
    folder = store.directory(run_id, snapshot_id)
    if not folder.exists():
        yield
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


#: How readers report a snapshot that retention deleted on purpose (never damage).
DELETED_BY_RETENTION = "deleted by retention"
#: A tombstone's name is its snapshot's id plus this (a file: ``SnapshotStore.list`` lists
#: directories only).
TOMBSTONE_SUFFIX = ".deleted"


def tombstone(store: SnapshotStore, run_id: str, snapshot_id: str) -> Path:
    """The file beside a snapshot's directory that says retention deleted it."""
    folder = store.directory(run_id, snapshot_id)
    return folder.with_name(f"{folder.name}{TOMBSTONE_SUFFIX}")


def absence(store: SnapshotStore, run_id: str, snapshot_id: str) -> str | None:
    """Why a published snapshot is not there to load (``None``: its directory is there and
    no tombstone stands beside it): deleted by retention, when its tombstone says so (also
    if a crash left part of its directory); otherwise removed by something else."""
    folder = store.directory(run_id, snapshot_id)
    stone = tombstone(store, run_id, snapshot_id)
    try:
        record = json.loads(stone.read_text())
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(int(record["time_ms"]) / 1000))
        return f"{DELETED_BY_RETENTION} at {when} ({stone})"
    except FileNotFoundError:
        if folder.exists():
            return None
        return f"its directory {folder} is gone, and no retention tombstone says why (deleted by hand?)"
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return f"{DELETED_BY_RETENTION} (its tombstone {stone} is unreadable)"


def try_delete(store: SnapshotStore, run_id: str, snapshot_id: str) -> bool:
    """Delete a snapshot for retention unless a reader holds it; returns whether it was
    deleted. A tombstone is written first (durably), so that readers report the snapshot
    as deleted by retention, not as damage (also if a crash leaves part of its directory)."""
    folder = store.directory(run_id, snapshot_id)
    if not folder.exists():
        return True
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        stone = tombstone(store, run_id, snapshot_id)
        tmp = stone.with_name(f"{stone.name}.tmp")
        tmp.write_text(json.dumps({"snapshot_id": snapshot_id, "reason": "retention",
                                   "time_ms": int(time.time() * 1000)}) + "\n")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, stone)
        fsync_dir(stone.parent)
        store.delete(run_id, snapshot_id)
        return True
    finally:
        os.close(fd)


def load_start(
    store: SnapshotStore, log: EventLog, idx: ControlIndex, marker: Marker, *, workers: int = 2,
    mapped: bool = False, checked: bool = True,
) -> FoldStart:
    """Load and verify one snapshot as a fold start, or raise saying what is wrong
    (``mapped``: for a fold with no tail to step through; see ``SnapshotStore.read_buffer``).

    ``checked=False`` leaves the shard files' checksums and the shard digests to the
    caller's seal check (``replayer.replay``, which loads checked after a mismatch); the
    manifest, its digests against the seal, and the small states are checked always."""
    if marker.end is None:
        raise SnapshotCorruptError(f"snapshot {marker.snapshot_id} has no end marker (orphan)")

    layouts: list[RunStarted] = []  # the manifest's, decoded once by the checker

    def checker(manifest: Manifest) -> ShardCheck:
        """The manifest's own checks, before any shard file is read; then each shard's."""
        layout = decode_layout(manifest.layout, f"snapshot {marker.snapshot_id}")
        layouts.append(layout)
        if manifest.version != marker.version:
            raise SnapshotCorruptError(
                f"snapshot {marker.snapshot_id}: manifest says version {manifest.version}, "
                f"its end marker {marker.version}"
            )
        seal = idx.seals.get(manifest.version)  # gone if the log was truncated past it
        if seal is not None and [d.hex() for d in seal.seal.shard_digests] != manifest.shard_digests:
            raise SnapshotCorruptError(
                f"snapshot {marker.snapshot_id}: manifest digests differ from the seal of "
                f"version {manifest.version}"
            )

        def check(state: ShardState, board: WorkBoard | None) -> None:
            state.next_offset = manifest.next_offsets[state.shard + 1]
            if not checked:
                return
            # Right after the shard is read, on its worker (hashing releases the GIL), its
            # tensors shared with a worker done early.
            got = state.digest(layout.tensors, layout.chunk_bytes, board).hex()
            if got != manifest.shard_digests[state.shard]:
                raise SnapshotCorruptError(
                    f"snapshot {marker.snapshot_id}: shard {state.shard} does not rebuild the "
                    f"sealed state of version {manifest.version}"
                )

        return check

    with reading(store, log.run_id, marker.snapshot_id):
        manifest, shards, small = store.load(log.run_id, marker.snapshot_id,
                                             marker.end.manifest_digest, workers=workers,
                                             mapped=mapped, checker=checker, checked=checked)
    layout = layouts[0]
    if small_digest(small.states).hex() != manifest.small_digest:
        raise SnapshotCorruptError(f"snapshot {marker.snapshot_id}: small states do not match")
    small.next_offset = manifest.next_offsets[0]
    return FoldStart(manifest.version, shards, small, list(manifest.next_offsets), layout,
                     f"snapshot {marker.snapshot_id} (version {manifest.version})", marker.snapshot_id)


def newest_valid(
    store: SnapshotStore, log: EventLog, idx: ControlIndex, max_version: int, *, workers: int = 2,
    checked: bool = True, written: bool = False,
) -> tuple[FoldStart | None, list[tuple[str, str]]]:
    """The newest snapshot at or before ``max_version`` that verifies, and why newer ones
    were passed over (``[(snapshot_id, reason)]``: damage, or ``absence``'s reason, which
    begins with ``DELETED_BY_RETENTION`` for one retention deleted; ``checked``: see
    ``load_start``; ``written``: the caller writes into the state, so its files are read,
    never mapped)."""
    passed: list[tuple[str, str]] = []
    complete = [m for m in markers(idx).values() if m.end is not None and m.version <= max_version]
    for marker in sorted(complete, key=lambda m: m.version, reverse=True):
        gone = absence(store, log.run_id, marker.snapshot_id)
        if gone is not None:
            passed.append((marker.snapshot_id, gone))
            continue
        try:
            # A snapshot of the target itself is only read: map it instead of copying it.
            mapped = current().snapshot_map and marker.version == max_version and not written
            return load_start(store, log, idx, marker, workers=workers, mapped=mapped,
                              checked=checked), passed
        except RewindError as exc:
            passed.append((marker.snapshot_id, str(exc)))
    return None, passed
