"""Crash tests' fault injection, loaded into a child process as its ``sitecustomize``.

``REWIND_TEST_FAULT_KILL=<point>`` makes the process SIGKILL itself when it reaches that
point (``tests.faulthook.killing_at`` puts this directory on the child's ``PYTHONPATH``):

* ``commit:V:N``: inside the log transaction of version V, after N of its events;
* ``publish:V:N``: inside the weights-stream transaction of version V, after N of its messages;
* ``snapshot:begun``: after a snapshot's begin marker was appended;
* ``snapshot:files:K``: after K + 1 of the snapshot's shard files were written;
* ``snapshot:manifest``: after every data file, before the manifest;
* ``snapshot:written``: after the manifest, before the end marker.

The product carries none of this: product functions are wrapped here as their modules are
imported (the log transactions' ``append`` of every backend, the version claim that opens
a commit, the snapshot store's file writes, the snapshotter's marker appends).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, cast

POINT = os.environ.get("REWIND_TEST_FAULT_KILL", "")
_POINTS = re.compile(r"(commit|publish):\d+:\d+|snapshot:(begun|files:\d+|manifest|written)")

#: The version the next log transaction of this thread commits (set by the version claim).
_committing = threading.local()
_files = {"written": 0}
_files_lock = threading.Lock()


def _kill_at(point: str) -> None:
    if point == POINT:
        os.kill(os.getpid(), signal.SIGKILL)


def _patch_ports(ports: ModuleType) -> None:
    """Count the appends of every transaction of every backend (each subclass's own
    ``append``, wrapped as the subclass is defined)."""
    base = ports.LogTransaction

    def init_subclass(cls: type, /, **kwargs: Any) -> None:
        super(base, cls).__init_subclass__(**kwargs)
        own = cls.__dict__.get("append")
        if own is not None:
            cls.append = _counted(own)  # type: ignore[attr-defined]

    base.__init_subclass__ = classmethod(init_subclass)


def _counted(append: Callable[..., None]) -> Callable[..., None]:
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        state = self.__dict__.get("_fault_count")
        if state is None:  # the transaction's first append: which version it commits
            state = self.__dict__["_fault_count"] = [getattr(_committing, "version", None), 0,
                                                     getattr(_committing, "kind", "commit")]
            _committing.version, _committing.kind = None, "commit"
        version, appended, kind = state
        if version is not None:
            _kill_at(f"{kind}:{version}:{appended}")
        state[1] = appended + 1
        append(self, *args, **kwargs)

    return wrapped


def _patch_pipeline(pipeline: ModuleType) -> None:
    claim = pipeline.CommitPipeline.claim_version

    def wrapped(self: Any, base: int, version: int) -> None:
        claim(self, base, version)
        _committing.version = version  # its transaction follows, on this thread

    pipeline.CommitPipeline.claim_version = wrapped


def _patch_store(store: ModuleType) -> None:
    atomic_write, stream_write, write = store._atomic_write, store._stream_write, store.SnapshotStore.write

    def count(path: Any) -> None:
        if path.name.startswith("shard-"):
            with _files_lock:
                _files["written"] += 1
                done = _files["written"]
            _kill_at(f"snapshot:files:{done - 1}")

    def counting_write(path: Any, data: bytes) -> None:
        if path.name == store.MANIFEST:
            _kill_at("snapshot:manifest")
        atomic_write(path, data)
        count(path)

    def counting_stream(path: Any, parts: Any) -> Any:
        out = stream_write(path, parts)
        count(path)
        return out

    def snapshot_write(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _files_lock:
            _files["written"] = 0
        return write(self, *args, **kwargs)

    setattr(store, "_atomic_write", counting_write)  # noqa: B010 - a module's private name
    setattr(store, "_stream_write", counting_stream)  # noqa: B010 - a module's private name
    store.SnapshotStore.write = snapshot_write


def _patch_service(service: ModuleType) -> None:
    append = service.Snapshotter._append

    def wrapped(self: Any, body: Any, version: int, step: int) -> None:
        kind = type(body).__name__
        if kind == "SnapshotEnd":
            _kill_at("snapshot:written")
        append(self, body, version, step)
        if kind == "SnapshotBegin":
            _kill_at("snapshot:begun")

    service.Snapshotter._append = wrapped


def _patch_weightstream(stream: ModuleType) -> None:
    publish = stream.WeightsStream.publish

    def wrapped(self: Any, writer: Any, version: int, *args: Any, **kwargs: Any) -> None:
        _committing.version, _committing.kind = version, "publish"  # its transaction follows
        publish(self, writer, version, *args, **kwargs)

    stream.WeightsStream.publish = wrapped


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "eventlog.weightstream": _patch_weightstream,
    "eventlog.ports": _patch_ports,
    "eventlog.commit.pipeline": _patch_pipeline,
    "snapshotter.store": _patch_store,
    "snapshotter.service": _patch_service,
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the patched modules as the other finders would, and patches each once it ran."""

    def find_spec(self, name: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        patch = _PATCHES.get(name)
        spec = None if patch is None else self._found_by_others(name, path, target)
        if patch is None or spec is None:
            return None
        loader: Any = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)

        loader.exec_module = exec_module
        return spec

    def _found_by_others(self, name: str, path: Sequence[str] | None,
                         target: ModuleType | None) -> importlib.machinery.ModuleSpec | None:
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = cast(importlib.machinery.ModuleSpec | None, find(name, path, target))
            if spec is not None and spec.loader is not None:
                return spec
        return None

if POINT:
    if not _POINTS.fullmatch(POINT):
        sys.stderr.write(f"REWIND_TEST_FAULT_KILL={POINT!r} names no fault point\n")
        os._exit(2)
    sys.meta_path.insert(0, _PatchOnImport())
