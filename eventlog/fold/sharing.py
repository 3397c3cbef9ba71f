"""Work that replay workers share, so that no core idles while another shard has work left.

A parallel replay gives each worker whole shards. Two equal shards still do not finish
together (virtual CPUs, for one, do not run at one steady speed), and one core then idles
while the other does the rest. Here a worker that runs a batch of units (tiles of
optimizer steps) posts them on a ``WorkBoard``; a worker with nothing left of its own takes
units from it. Every unit is still run exactly once, by one thread, and the poster waits
until all of its units are done (its own and those taken by others) before it goes on, so
a batch's results are complete when ``run`` returns, and its first error is raised there.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def run_threads(count: int, target: Callable[[], None]) -> None:
    """Run ``target`` on ``count`` new threads and wait for them all; ``target`` must not
    raise. Every thread is started before any of them runs ``target``: a thread started
    while a sibling runs Python code waits for the GIL (up to the interpreter's switch
    interval, 5 ms by default) before it can even report that it started, and the caller
    waits with it."""
    go = threading.Event()

    def run() -> None:
        go.wait()
        target()

    threads = [threading.Thread(target=run, name=f"rewind-worker-{i}", daemon=True) for i in range(count)]
    try:
        for t in threads:
            t.start()
    finally:
        go.set()  # (the started ones run, and are joined, even if a start failed)
        for t in threads:
            if t.ident is not None:
                t.join()


def map_shared(workers: int, items: Sequence[T], fn: Callable[[T, WorkBoard | None], R]) -> list[R]:
    """``[fn(item, board) for item in items]`` on ``workers`` threads; raises the error of
    the first item that failed.

    With more than one worker and item, ``fn`` gets a ``WorkBoard`` to post its units on,
    and a worker with no item left to take runs the others' units until every item is done.
    Otherwise ``board`` is ``None`` and ``fn`` runs its units itself (on one pool thread)."""
    n = len(items)
    if workers <= 1 or n <= 1:
        out: list[R] = []
        failed: list[BaseException] = []

        def alone() -> None:
            try:
                out.extend(fn(item, None) for item in items)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
                failed.append(exc)

        run_threads(1, alone)
        if failed:
            raise failed[0]
        return out
    board = WorkBoard(participants=n, threads=min(workers, n))
    results: list[R | None] = [None] * n
    errors: dict[int, BaseException] = {}
    claims = itertools.count()  # items are taken in order, each by one worker

    def worker() -> None:
        while (i := next(claims)) < n:
            try:
                results[i] = fn(items[i], board)
            except BaseException as exc:  # noqa: BLE001 - raised below, for the first failed item
                errors[i] = exc
            finally:
                board.leave()
        board.help()

    run_threads(min(workers, n), worker)
    if errors:
        raise errors[min(errors)]
    return results  # type: ignore[return-value]


@dataclass(eq=False)
class _Job(Generic[T]):
    units: Sequence[T]
    work: Callable[[T], None]
    taken: int = 0
    running: int = 0
    #: Errors by unit index. Units are taken in order, so once unit k failed, every unit
    #: before it was taken and will finish: the lowest index is the error a loop over the
    #: units, one after another, would have raised.
    errors: dict[int, BaseException] = field(default_factory=dict)

    def open(self) -> bool:
        return not self.errors and self.taken < len(self.units)


class WorkBoard:
    """Batches of units posted by workers, for idle workers to take a share of."""

    def __init__(self, participants: int = 0, threads: int = 1) -> None:
        """``participants``: how many workers may still post work; a helper waits for
        each to ``leave`` before it stops looking for units. ``threads``: how many run
        units at once (a poster sizes its units by it: ``eventlog.fold.deferred``)."""
        self.threads = max(1, threads)
        self._cond = threading.Condition()
        self._jobs: list[_Job[Any]] = []
        self._active = participants

    def leave(self) -> None:
        """One participant will post no more work."""
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def run(self, units: Sequence[T], work: Callable[[T], None]) -> None:
        """Run ``work`` on every unit, here and on helpers; return when all are done.

        If units fail, no unit starts after the first failure, and the error of the
        lowest-numbered failed unit is raised: the one a plain loop would have raised."""
        job = _Job(units, work)
        with self._cond:
            self._jobs.append(job)
            self._cond.notify_all()
        try:
            while self._run_one(job):
                pass
        finally:
            with self._cond:
                job.taken = len(job.units)  # however this ends, no helper starts another unit
                self._jobs.remove(job)
                while job.running:
                    self._cond.wait()
        if job.errors:
            raise job.errors[min(job.errors)]

    def help(self) -> int:
        """Run other workers' units until none are left and no participant can post more;
        returns how many ran here."""
        ran = 0
        while True:
            with self._cond:
                job = next((j for j in self._jobs if j.open()), None)
                if job is None:
                    if not self._active:
                        return ran
                    self._cond.wait()
                    continue
            if self._run_one(job):
                ran += 1

    def _run_one(self, job: _Job[T]) -> bool:
        """Take ``job``'s next unit and run it; ``False`` when none was left to take."""
        with self._cond:
            if not job.open():
                return False
            index = job.taken
            job.taken += 1
            job.running += 1
        try:
            job.work(job.units[index])
        except BaseException as exc:  # noqa: BLE001 - handed to the poster, which raises it
            with self._cond:
                job.errors[index] = exc
        finally:
            with self._cond:
                job.running -= 1
                self._cond.notify_all()
        return True
