"""The Kafka writer commits a transaction only when the broker placed every one of its
records in the log. A stand-in producer plays librdkafka's delivery reports here, since a
real broker refuses a single record of a committed transaction only in a race (a new
partition's leader that has not yet created its log)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from eventlog.errors import EventLogError
from eventlog.kafka import writer as writer_module
from eventlog.kafka.config import KafkaSettings
from eventlog.kafka.writer import KafkaWriter
from eventlog.ports import CONTROL


class _Delivered:
    """A delivery report's message."""

    def __init__(self, topic: str, partition: int, offset: int) -> None:
        self._where = (topic, partition, offset)

    def topic(self) -> str:
        return self._where[0]

    def partition(self) -> int:
        return self._where[1]

    def offset(self) -> int:
        return self._where[2]


class _Producer:
    """Reports each record delivered at the next offset, except the ``lost``-th, which it
    reports as librdkafka reports a batch it may or may not have written (offset -1)."""

    def __init__(self, on_delivery: Callable[[Any, Any], None], lost: int | None) -> None:
        self._on_delivery, self._lost = on_delivery, lost
        self._pending: list[_Delivered] = []
        self.calls: list[str] = []
        self._next = 0

    def init_transactions(self, timeout: float) -> None:
        self.calls.append("init")

    def begin_transaction(self) -> None:
        self.calls.append("begin")

    def produce(self, topic: str, value: bytes, partition: int) -> None:
        offset = -1 if self._next == self._lost else self._next
        self._next += 1
        self._pending.append(_Delivered(topic, partition, offset))

    def poll(self, timeout: float) -> int:
        pending, self._pending = self._pending, []
        for msg in pending:
            self._on_delivery(None, msg)
        return len(pending)

    def commit_transaction(self, timeout: float) -> None:
        self.calls.append("commit")

    def abort_transaction(self, timeout: float) -> None:
        self.calls.append("abort")


class _Target:
    settings = KafkaSettings("kafka://127.0.0.1:1?prefix=unit")
    run_id = "unit"
    control_topic = "unit.unit.control"

    def locate(self, partition: int, *, produce: bool = False) -> tuple[str, int]:
        return (self.control_topic, 0) if partition == CONTROL else ("unit.unit.tensors", partition)

    def end_offset(self, partition: int, *, within: float | None = None) -> int:
        return 1 << 40  # every record visible at once


def _writer(monkeypatch: pytest.MonkeyPatch, lost: int | None) -> tuple[KafkaWriter, _Producer]:
    made: list[_Producer] = []

    def client(kind: Any, conf: dict[str, Any], what: str) -> _Producer:
        made.append(_Producer(conf["on_delivery"], lost))
        return made[0]

    monkeypatch.setattr(writer_module, "client", client)
    return KafkaWriter(_Target(), "trainer"), made[0]


def test_a_record_the_broker_did_not_place_aborts_the_transaction(monkeypatch: pytest.MonkeyPatch) -> None:
    writer, producer = _writer(monkeypatch, lost=1)
    with pytest.raises(EventLogError) as caught, writer.transaction() as txn:
        for partition in (0, 1, 0, CONTROL):
            txn.append(partition, b"record")
    assert producer.calls == ["init", "begin", "abort"]  # never committed
    assert str(caught.value) == (
        "Kafka writer 'unit.unit.trainer': transaction aborted: 1 of its 4 records were not "
        "placed in the log (message to unit.unit.tensors [1] acknowledged without a log offset); "
        "nothing of it was committed")


def test_a_transaction_whose_records_are_all_placed_commits(monkeypatch: pytest.MonkeyPatch) -> None:
    writer, producer = _writer(monkeypatch, lost=None)
    with writer.transaction() as txn:
        for partition in (0, 1, CONTROL):
            txn.append(partition, b"record")
    assert producer.calls == ["init", "begin", "commit"]
