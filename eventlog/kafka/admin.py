"""Cluster requests of the Kafka backend: topic names, metadata, topic creation, offset
(watermark) queries and DeleteRecords, the last two retried across a leader change."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]  # not re-exported in stubs
    AdminClient,
    ClusterMetadata,
    NewTopic,
)

from eventlog.errors import ConfigError, EventLogError
from eventlog.kafka.calls import (
    UNKNOWN,
    call,
    client,
    describe,
    failover,
    kafka_error,
)
from eventlog.kafka.config import (
    REQUEST_TIMEOUT_S,
    TOPIC_MAX_MESSAGE_BYTES,
    TOPIC_NAME,
    KafkaSettings,
    logger,
)

#: Opening a log (or listing runs) first asks for metadata, once, within this: a wrong
#: address or a broker that is down fails then, in one line, not after every retry.
CONNECT_TIMEOUT_S = 5.0


def topic_names(prefix: str, run_id: str) -> tuple[str, str]:
    """The control and tensors topics of a run."""
    control, tensors = f"{prefix}.{run_id}.control", f"{prefix}.{run_id}.tensors"
    if not TOPIC_NAME.match(run_id) or len(tensors) > 249:
        raise ConfigError(
            f"run id {run_id!r} cannot name a Kafka topic: use [A-Za-z0-9._-], "
            f"at most {249 - len(prefix) - len('..tensors')} characters"
        )
    return control, tensors


def admin_client(settings: KafkaSettings) -> AdminClient:
    """An admin client for the cluster of ``settings``."""
    return client(AdminClient, settings.config("admin"), "admin client")


def first_contact(admin: AdminClient, settings: KafkaSettings, topic: str | None) -> ClusterMetadata:
    """Metadata, asked once: fail fast, in one line, when no broker answers in time."""
    try:
        return admin.list_topics(topic=topic, timeout=CONNECT_TIMEOUT_S)
    except KafkaException as exc:
        raise EventLogError(
            f"Kafka at {settings.bootstrap} is unreachable: no broker answered within "
            f"{CONNECT_TIMEOUT_S:g} s ({describe(kafka_error(exc), exc)})") from exc


def metadata(admin: AdminClient, topic: str | None, what: str) -> ClusterMetadata:
    """Metadata of ``topic`` (``None``: of the cluster), retrying transient errors."""
    return call(what, lambda: admin.list_topics(topic=topic, timeout=REQUEST_TIMEOUT_S))


def partition_count(md: ClusterMetadata, topic: str) -> int | None:
    """Partitions of ``topic`` in ``md``; ``None`` if it does not exist."""
    tm = md.topics.get(topic)
    if tm is None or (tm.error is not None and tm.error.code() in UNKNOWN):
        return None
    if tm.error is not None:
        raise EventLogError(f"metadata of topic {topic}: {tm.error.name()}: {tm.error.str()}")
    return len(tm.partitions)


def partition_counts(admin: AdminClient, topics: tuple[str, ...], what: str) -> dict[str, int | None]:
    """``partition_count`` of each topic."""
    return {t: partition_count(metadata(admin, t, what), t) for t in topics}


def list_runs(url: str) -> list[str]:
    """Runs that have both topics on the cluster at ``url``."""
    settings = KafkaSettings(url)
    md = first_contact(admin_client(settings), settings, None)
    names = set(md.topics)
    head, tail = f"{settings.prefix}.", ".control"
    runs = []
    for name in names:
        if name.startswith(head) and name.endswith(tail) and len(name) > len(head) + len(tail):
            run = name[len(head):-len(tail)]
            if f"{head}{run}.tensors" in names:
                runs.append(run)
    return sorted(runs)


def create_topics(admin: AdminClient, settings: KafkaSettings, topics: list[str],
                  want: dict[str, int], what: str) -> None:
    """Create ``topics`` with ``want[topic]`` partitions; one that exists already is left as is."""
    md = metadata(admin, None, what)
    rf = settings.replication or min(3, max(1, len(md.brokers)))
    config = {
        "max.message.bytes": str(TOPIC_MAX_MESSAGE_BYTES),
        "compression.type": "producer",
        # The log is the truth: never expire it by age or size (truncation is explicit).
        "retention.ms": "-1",
        "retention.bytes": "-1",
        "cleanup.policy": "delete",
        "min.insync.replicas": "1" if rf == 1 else "2",
        "unclean.leader.election.enable": "false",
    }

    def create_one(topic: str) -> None:
        fut = admin.create_topics(
            [NewTopic(topic, want[topic], rf, config=config)],
            operation_timeout=REQUEST_TIMEOUT_S, request_timeout=REQUEST_TIMEOUT_S,
        )[topic]
        try:
            fut.result(timeout=REQUEST_TIMEOUT_S * 2)
        except KafkaException as exc:
            err = kafka_error(exc)
            if err is None or err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
            # Another process created it first; its partition count is checked next.

    for topic in topics:
        try:
            call(f"{what}: topic {topic}", functools.partial(create_one, topic))
        except TimeoutError as exc:  # a future that never completed
            raise EventLogError(f"{what}: topic {topic}: no answer from the broker") from exc


def wait_for_topics(admin: AdminClient, settings: KafkaSettings, want: dict[str, int],
                    what: str) -> dict[str, int | None]:
    """Wait (bounded) until every partition of the new topics has a leader, as every broker
    of the cluster sees it.

    Each broker learns of a new topic from the cluster's metadata on its own schedule. A
    transaction coordinator that has not yet heard of it refuses to add its partitions to a
    transaction, which fails the first commit of a new run; so every broker is asked."""
    deadline = time.monotonic() + REQUEST_TIMEOUT_S * 2
    ready = _ready(admin, want, what, deadline)
    brokers = metadata(admin, None, what).brokers
    if len(brokers) > 1:
        for broker in brokers.values():
            # A client that knows only this broker asks it, and no other, for the metadata.
            one = client(AdminClient, {**settings.config("admin"),
                                       "bootstrap.servers": f"{broker.host}:{broker.port}"},
                         "admin client")
            _ready(one, want, f"{what} (broker {broker.id})", deadline)
    return ready


def _ready(admin: AdminClient, want: dict[str, int], what: str, deadline: float) -> dict[str, int | None]:
    while True:
        ready: dict[str, int | None] = {}
        ok = True
        for topic in want:
            md = metadata(admin, topic, what)
            ready[topic] = partition_count(md, topic)
            tm = md.topics.get(topic)
            ok = ok and tm is not None and ready[topic] is not None and all(
                p.leader >= 0 for p in tm.partitions.values())
        if ok or time.monotonic() > deadline:
            if not ok:
                raise EventLogError(f"{what}: topics {list(want)} have no leader after creation")
            return ready
        time.sleep(0.1)


def _offset_calls(consumer: Consumer, topic: str, kp: int) -> tuple[
        Callable[[float], tuple[int, int]], Callable[[float], object]]:
    """An offset query of ``(topic, kp)`` and the metadata refresh ``failover`` runs
    between its attempts."""
    tp = TopicPartition(topic, kp)

    def marks(timeout: float) -> tuple[int, int]:
        return consumer.get_watermark_offsets(tp, timeout=timeout, cached=False)

    def refresh(timeout: float) -> object:
        return consumer.list_topics(topic, timeout=timeout)

    return marks, refresh


def query_marks(consumer: Consumer, topic: str, kp: int,
                within: float | None = None) -> tuple[int, int] | None:
    """``(low watermark, last stable offset)`` of ``(topic, kp)``, or ``None`` if the
    partition does not exist; a leader change is waited out for at most ``within`` seconds."""
    what = f"reading offsets of {topic} [{kp}]"
    marks, refresh = _offset_calls(consumer, topic, kp)
    try:
        return failover(what, marks, refresh, unknown="raise", within=within)
    except KafkaException:
        pass  # an unknown topic or partition
    # Maybe only our metadata cache is stale (topic created since): refresh and ask again.
    md = call(what, lambda: consumer.list_topics(topic, timeout=REQUEST_TIMEOUT_S))
    count = partition_count(md, topic)
    if count is None or kp >= count:
        return None
    return failover(what, marks, refresh, within=within)


class Watermarks:
    """Watermark queries on a consumer of their own, created on first use: on a fetching
    consumer's connection they would queue behind its long-poll fetch requests."""

    def __init__(self, conf: dict[str, Any]) -> None:
        self._conf = conf
        self._consumer: Consumer | None = None
        self._lock = threading.Lock()

    def marks(self, topic: str, kp: int, within: float | None = None) -> tuple[int, int] | None:
        """``(low, last stable offset)``, or ``None`` if the partition does not exist."""
        with self._lock:
            return query_marks(self._client(), topic, kp, within)

    def wait_placed(self, partitions: list[tuple[str, int]], what: str) -> None:
        """Wait (bounded) until each partition's leader answers an offset query, which it
        does once it has created the partition's log.

        A KRaft broker publishes a new topic's metadata before its leaders create the logs.
        A produce request arriving in between is refused while the idempotent producer's next
        batch to that partition may already be appended, at offset 0 (a producer new to a
        partition may start at any sequence number): the transaction then lacks its first
        records."""
        with self._lock:
            consumer = self._client()
            for topic, kp in partitions:
                marks, refresh = _offset_calls(consumer, topic, kp)
                failover(f"{what}: waiting for the leader of {topic} [{kp}]", marks, refresh,
                         unknown="retry", within=REQUEST_TIMEOUT_S * 2)

    def _client(self) -> Consumer:
        if self._consumer is None:
            self._consumer = client(Consumer, self._conf, "consumer")
        return self._consumer

    def close(self) -> None:
        with self._lock:
            if self._consumer is not None:
                try:
                    self._consumer.close()
                except (KafkaException, RuntimeError) as exc:
                    logger.warning("closing a Kafka consumer: %s", exc)
                self._consumer = None


def delete_records(admin: AdminClient, topic: str, kp: int, target: int) -> None:
    """Delete the records of ``(topic, kp)`` below offset ``target`` (DeleteRecords)."""
    what = f"deleting records of {topic} [{kp}] below offset {target}"

    def delete(timeout: float) -> None:
        futures = admin.delete_records(
            [TopicPartition(topic, kp, target)], request_timeout=timeout, operation_timeout=timeout,
        )
        for fut in futures.values():
            try:
                fut.result(timeout=timeout * 2)
            except TimeoutError:  # a future that never completed: as retriable as a timeout
                timed_out = KafkaError(KafkaError._TIMED_OUT, "no answer from the broker")
                raise KafkaException(timed_out) from None

    # Deleting below an offset again is harmless, so a retry after a leader change is safe.
    failover(what, delete, lambda timeout: admin.list_topics(topic=topic, timeout=timeout))
