"""Long waits say so: ``warned_wait`` logs a WARNING naming what a wait is for once it has
lasted ``WARN_AFTER_S``, and again every ``REPEAT_S`` while it goes on.

One watchdog thread serves every wait of the process, so entering a wait costs a lock and
a heap push, not a thread: commits wrap each of theirs.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: A wait a user can meet says what it waits for once it lasts this long.
WARN_AFTER_S = 10.0
#: Then it says so again this often while it goes on.
REPEAT_S = 60.0
#: How often a service that waits for work (a snapshotter, a follower) says so again.
IDLE_REPEAT_S = 600.0

#: What a wait is for: a phrase, or a callable that gives one when the warning is due (it may
#: name what is going on by then). Completed by "waiting for ...".
What = str | Callable[[], str]


class _Wait:
    def __init__(self, what: What, log: logging.Logger, every_s: float) -> None:
        self.what, self.log, self.every_s = what, log, every_s
        self.started = time.monotonic()
        self.said = ""  # the description last logged ("" until the first warning)
        self.done = False

    def warn(self) -> None:
        try:
            what = self.what() if callable(self.what) else self.what
        except Exception as exc:  # noqa: BLE001 - a failing description must not break the wait
            what = f"<description failed: {exc}>"
        self.log.warning("waiting for %s (%.0f s so far)", what, time.monotonic() - self.started)
        self.said = what


class _Watchdog:
    """The thread that logs the warnings of the waits that are due."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start afresh (in a forked child: the parent's thread and lock are not its own)."""
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, _Wait]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, wait: _Wait, after_s: float) -> None:
        entry = (wait.started + after_s, next(self._order), wait)
        with self._cond:
            heapq.heappush(self._due, entry)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="rewind-waits", daemon=True)
                self._thread.start()
            if self._due[0] is entry:  # due before the one it sleeps for (else: no wake-up)
                self._cond.notify()

    def remove(self, wait: _Wait) -> None:
        with self._cond:
            wait.done = True  # (dropped from the heap when it comes up)

    def _serve(self) -> None:
        while True:
            with self._cond:
                while self._due and self._due[0][2].done:
                    heapq.heappop(self._due)
                if not self._due:
                    self._cond.wait()
                    continue
                at, _, wait = self._due[0]
                now = time.monotonic()
                if at > now:
                    self._cond.wait(at - now)
                    continue
                heapq.heapreplace(self._due, (now + wait.every_s, next(self._order), wait))
            wait.warn()  # outside the lock: the description may take a lock of its own


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG.reset)


@contextmanager
def warned_wait(what: What, log: logging.Logger, *, after_s: float = WARN_AFTER_S,
                every_s: float = REPEAT_S) -> Iterator[None]:
    """Run the block; if it lasts ``after_s`` seconds, log a WARNING "waiting for ``what``"
    on ``log``, then again every ``every_s``; once a warned wait ends, log when it ended."""
    wait = _Wait(what, log, every_s)
    _WATCHDOG.add(wait, after_s)
    try:
        yield
    finally:
        _WATCHDOG.remove(wait)
        if wait.said:
            log.warning("done waiting for %s after %.0f s", wait.said, time.monotonic() - wait.started)


class Idle:
    """A loop's wait that begins when the loop makes no progress and ends when it does:
    ``waiting()`` on each turn without progress (the first starts a ``warned_wait``),
    ``progress()`` on each turn with some. Use it as a context manager."""

    def __init__(self, what: What, log: logging.Logger, *, every_s: float = REPEAT_S) -> None:
        self._what, self._log, self._every_s = what, log, every_s
        self._wait: contextlib.AbstractContextManager[None] | None = None

    def waiting(self) -> None:
        """This turn made no progress: a wait begins, unless one is under way."""
        if self._wait is None:
            self._wait = warned_wait(self._what, self._log, every_s=self._every_s)
            self._wait.__enter__()

    def progress(self) -> None:
        """This turn made progress: the wait under way, if any, ends."""
        wait, self._wait = self._wait, None
        if wait is not None:
            wait.__exit__(None, None, None)

    def __enter__(self) -> Idle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress()
