"""Reads of the Kafka backend: ``read_committed`` consumers that fetch committed records,
kept assigned between the batches of one scan and shared by the threads of one log."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from eventlog.errors import EventLogError
from eventlog.kafka.calls import UNKNOWN, client, message_offset, wrap
from eventlog.kafka.config import REQUEST_TIMEOUT_S, logger
from eventlog.ports import Record
from eventlog.waits import Idle

#: ``read`` gives up when no record or end-of-partition arrives for this long.
READ_STALL_S = 60.0
#: Consumers a ``KafkaLog`` keeps for ``read`` (shards fold in parallel threads).
MAX_READERS = max(4, os.cpu_count() or 1)


class Reader:
    """One ``read_committed`` consumer, assigned to one partition at a time (never a group member).

    Between the batch reads of one scan it stays assigned, so the next batch continues from
    what librdkafka already prefetched: ``cursor`` is the offset after the last record
    returned, ``stash`` holds records consumed but not returned (they lay past ``stop``).
    Once a read reaches its end, or the reader idles, it is parked (unassigned), so that a
    cached consumer neither long-polls the broker nor prefetches chunks nobody asked for.
    (Not pause/resume: pausing drops the prefetched messages anyway, and librdkafka only
    resumes fetching on its next ~1 s broker wake-up.)
    """

    def __init__(self, conf: dict[str, Any]) -> None:
        self.consumer: Consumer = client(Consumer, conf, "consumer")
        self.at: tuple[str, int] | None = None
        self.cursor = -1
        # False until the current assignment delivered something: before that, position()
        # may still describe the previous assignment.
        self.live = False
        self.known: set[str] = set()  # topics whose metadata this client has
        self.stash: deque[Message] = deque()
        self.idle_since = time.monotonic()
        self.gap = (0, 0)  # after a read: offsets known to hold no committed record
        self.refreshed_at = 0.0

    def continues(self, topic: str, kp: int, start: int | None) -> bool:
        """True if reading ``(topic, kp)`` from ``start`` needs no repositioning."""
        if self.at != (topic, kp) or start is None:
            return False
        if self.stash:  # no committed record lies between cursor and the stashed one
            return self.cursor <= start <= message_offset(self.stash[0])
        return start == self.cursor

    def fetch(self, partition: int, topic: str, kp: int, start: int, stop: int,
              limit: int | None) -> list[Record]:
        """Committed records with ``start <= offset < stop``, at most ``limit`` of them."""
        where = f"{topic} [{kp}]"
        tp = TopicPartition(topic, kp)
        try:
            if topic not in self.known:
                # Fetching a topic the client has no metadata for waits for librdkafka's
                # 1 s topic scan; asking for it now fills the metadata cache at once.
                self.consumer.list_topics(topic, timeout=REQUEST_TIMEOUT_S)
                self.known.add(topic)
            if not self.continues(topic, kp, start):
                self.stash.clear()
                self.consumer.assign([TopicPartition(topic, kp, start)])
                self.at, self.cursor, self.live = (topic, kp), start, False
        except KafkaException as exc:
            self.at = None
            raise wrap(exc, f"positioning at {where} offset {start}") from exc
        self.gap = (0, 0)
        out = self._fetch(partition, where, tp, stop, limit)
        if len(out) < (limit or 1 << 62):
            self.park()  # the read reached its end: no batch follows right away
        return out

    def _fetch(self, partition: int, where: str, tp: TopicPartition, stop: int,
               limit: int | None) -> list[Record]:
        want = limit if limit is not None else 1 << 62
        out: list[Record] = []
        while self.stash and len(out) < want:
            if message_offset(self.stash[0]) >= stop:
                return out
            msg = self.stash.popleft()
            out.append(Record(partition, message_offset(msg), msg.value() or b""))
            self.cursor = message_offset(msg) + 1
        stalled_at = time.monotonic() + READ_STALL_S
        done = False
        stall = Idle(lambda: f"records of {where} before offset {stop} (at {self.cursor}; given up after "
                            f"{READ_STALL_S:.0f} s without one; brokers down?)", logger)
        with stall:
            while not done and len(out) < want:
                try:
                    # Take what is already fetched without waiting.
                    msgs = self.consumer.consume(min(want - len(out), 1000), 0)
                    if not msgs:
                        # Transaction markers and aborted records occupy offsets without yielding
                        # a record (consume skips them silently): once the position passes
                        # ``stop`` there is nothing more to wait for.
                        if self.live and not self.stash and self._position(tp, where) >= stop:
                            break
                        # Wait briefly for the next one; short, so the position is checked often.
                        msgs = self.consumer.consume(1, 0.01)
                        if not msgs:
                            stall.waiting()
                except (KafkaException, RuntimeError) as exc:
                    raise wrap(exc, f"reading {where}") from exc
                for msg in msgs:
                    self.live = True
                    err = msg.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            done = done or message_offset(msg) >= stop
                        elif err.fatal() or err.code() in UNKNOWN:
                            raise EventLogError(f"reading {where}: {err.name()}: {err.str()}")
                        else:  # librdkafka recovers from the rest itself; the stall bound still holds
                            logger.warning("reading %s: %s: %s", where, err.name(), err.str())
                            self._refresh(tp.topic)
                        continue
                    stalled_at = time.monotonic() + READ_STALL_S
                    stall.progress()
                    if done or message_offset(msg) >= stop or len(out) >= want:
                        self.stash.append(msg)
                        done = True
                        continue
                    out.append(Record(partition, message_offset(msg), msg.value() or b""))
                    self.cursor = message_offset(msg) + 1
                if not done and time.monotonic() > stalled_at:
                    raise EventLogError(
                        f"reading {where}: no record for {READ_STALL_S:.0f} s before offset {stop} "
                        f"(at {self.cursor}); is the broker reachable?"
                    )
        if self.live and not self.stash:
            # Everything consumed was returned, so [cursor, position) holds only markers
            # and aborted records; committed history never changes, so that stays true.
            self.gap = (self.cursor, self._position(tp, where))
        return out

    def _refresh(self, topic: str) -> None:
        """Ask for the topic's metadata (at most once a second): after a fetch error, the
        partition may have a new leader that the next periodic refresh would find later."""
        now = time.monotonic()
        if now - self.refreshed_at < 1.0:
            return
        self.refreshed_at = now
        try:
            self.consumer.list_topics(topic, timeout=1.0)
        except KafkaException as exc:
            logger.info("refreshing metadata of %s: %s", topic, exc)

    def _position(self, tp: TopicPartition, where: str) -> int:
        try:
            return int(self.consumer.position([tp])[0].offset)
        except KafkaException as exc:
            raise wrap(exc, f"reading {where}") from exc

    def park(self) -> None:
        """Stop fetching (unassign); the next read repositions."""
        if self.at is None:
            return
        self.at, self.live = None, False
        self.stash.clear()
        try:
            self.consumer.unassign()
        except KafkaException as exc:
            logger.warning("unassigning a Kafka consumer: %s", exc)

    def close(self) -> None:
        try:
            self.consumer.close()
        except (KafkaException, RuntimeError) as exc:
            logger.warning("closing a Kafka consumer: %s", exc)


class ReaderPool:
    """Consumers shared by the threads of one ``KafkaLog`` (a consumer is not thread-safe).

    A janitor thread parks readers left assigned but idle for ``PARK_AFTER_S`` (a scan that
    stopped early), and exits once none is left.
    """

    PARK_AFTER_S = 1.0

    def __init__(self, make: Callable[[], Reader], size: int) -> None:
        self._make, self._size = make, size
        self._idle: list[Reader] = []
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False
        self._janitor: threading.Thread | None = None

    @contextmanager
    def borrow(self, topic: str, kp: int, start: int | None) -> Iterator[Reader]:
        """A consumer for this thread, preferably one already positioned at ``start``."""
        reader = self._take(topic, kp, start)
        ok = False
        try:
            yield reader
            ok = True
        finally:
            self._give_back(reader, ok)

    def describe(self, topic: str, kp: int) -> str:
        """The idle readers assigned to ``(topic, kp)``: cursor, stashed offsets, last gap."""
        with self._cond:
            return "; ".join(
                f"cursor {r.cursor}, stash {[message_offset(m) for m in r.stash]}, gap {r.gap}, live {r.live}"
                for r in self._idle if r.at == (topic, kp))

    def drop(self, topic: str, kp: int) -> None:
        """Close the idle readers assigned to ``(topic, kp)``: the next read starts afresh."""
        with self._cond:
            gone = [r for r in self._idle if r.at == (topic, kp)]
            self._idle = [r for r in self._idle if r.at != (topic, kp)]
            self._count -= len(gone)
            self._cond.notify_all()
        for r in gone:
            r.close()

    def _give_back(self, reader: Reader, ok: bool) -> None:
        with self._cond:
            if ok and not self._closed:
                reader.idle_since = time.monotonic()
                self._idle.append(reader)
                if reader.at is not None and self._janitor is None:
                    self._janitor = threading.Thread(
                        target=self._park_idle, name="rewind-kafka-park", daemon=True)
                    self._janitor.start()
                reader = None  # type: ignore[assignment]
            else:  # its stream state is unknown after an error: start afresh next time
                self._count -= 1
            self._cond.notify()
        if reader is not None:
            reader.close()

    def _take(self, topic: str, kp: int, start: int | None) -> Reader:
        deadline = time.monotonic() + READ_STALL_S * 5
        with self._cond:
            while True:
                if self._closed:
                    raise EventLogError("the Kafka log is closed")
                for i, r in enumerate(self._idle):
                    if r.continues(topic, kp, start):
                        return self._idle.pop(i)
                # Then a parked one, then a new one: an assigned one may be continued soon.
                for i, r in enumerate(self._idle):
                    if r.at is None:
                        return self._idle.pop(i)
                if self._count < self._size:
                    self._count += 1
                    break
                if self._idle:
                    return self._idle.pop(0)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EventLogError(f"no Kafka consumer became free in {READ_STALL_S * 5:.0f} s")
                self._cond.wait(left)
        try:
            return self._make()
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def _park_idle(self) -> None:
        while True:
            time.sleep(self.PARK_AFTER_S / 2)
            with self._cond:
                now = time.monotonic()
                due = [r for r in self._idle
                       if r.at is not None and now - r.idle_since >= self.PARK_AFTER_S]
                for r in due:
                    self._idle.remove(r)
                if not due and (self._closed or all(r.at is None for r in self._idle)):
                    self._janitor = None
                    return
            for r in due:
                r.park()
            for r in due:
                self._give_back(r, True)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for r in idle:
            r.close()
