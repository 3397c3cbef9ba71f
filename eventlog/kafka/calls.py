"""Calling librdkafka: our errors for its errors, bounded retries of transient ones, and
retries with fresh metadata across a partition leader change (``failover``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

from confluent_kafka import KafkaError, KafkaException, Message
from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from eventlog.errors import ConfigError, EventLogError, FencedError, RewindError
from eventlog.kafka.config import REQUEST_TIMEOUT_S, logger
from eventlog.waits import warned_wait

T = TypeVar("T")

#: How long an offset query, a DeleteRecords call or a commit's visibility check keeps
#: retrying across a leader change, asking for fresh metadata before each retry, before it
#: fails. The cluster fences a dead leader and elects a new one within its
#: ``broker.session.timeout.ms`` (9 s by default); this leaves room for that twice over.
FAILOVER_S = 30.0

#: The pause before each retry of ``failover``.
RETRY_PAUSE_S = 0.05

#: Errors of a writer that a newer writer with the same transactional.id took over.
FENCING = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
# Errors worth another attempt even when librdkafka does not flag them retriable.
_TRANSIENT = {
    KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
    # A request that waited out its timeout unsent, in the queue of a broker that was not
    # connected (a killed leader, before fresh metadata names the new one).
    KafkaError._TIMED_OUT_QUEUE,
    KafkaError._WAIT_COORD, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR,
    KafkaError.LEADER_NOT_AVAILABLE, KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NETWORK_EXCEPTION, KafkaError.CONCURRENT_TRANSACTIONS,
    getattr(KafkaError, "NOT_LEADER_FOR_PARTITION", 6),
    # A request in flight to a broker that left the cluster's metadata (a killed leader):
    # librdkafka drops that broker's handle and fails the request; the next one goes to
    # the new leader.
    KafkaError._DESTROY_BROKER, KafkaError._NODE_UPDATE,
    KafkaError.FENCED_LEADER_EPOCH, KafkaError.UNKNOWN_LEADER_EPOCH,
    # A new leader answers offset queries only once its high watermark caught up.
    KafkaError.OFFSET_NOT_AVAILABLE,
}
#: Errors saying a topic or partition does not exist.
UNKNOWN = {KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC,
           KafkaError.UNKNOWN_TOPIC_OR_PART}


def kafka_error(exc: BaseException) -> KafkaError | None:
    """The ``KafkaError`` a driver exception carries, if any."""
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a Kafka error worth another attempt."""
    err = kafka_error(exc)
    return err is not None and not err.fatal() and (
        err.retriable() or err.code() in _TRANSIENT
    )


def message_offset(msg: Message) -> int:
    """A consumed or delivered message's offset (librdkafka always sets it there)."""
    offset = msg.offset()
    return -1 if offset is None else offset


def describe(err: KafkaError | None, exc: BaseException) -> str:
    """``NAME: text`` of a Kafka error, else the exception's text."""
    return f"{err.name()}: {err.str()}" if err is not None else str(exc)


def wrap(exc: BaseException, what: str) -> RewindError:
    """Our error for a driver error; ``what`` names the operation, topic and partition."""
    err = kafka_error(exc)
    if err is not None and err.code() in FENCING:
        return FencedError(f"{what}: fenced by a newer writer with the same id ({describe(err, exc)})")
    if err is not None and err.code() == KafkaError._INVALID_ARG:
        return ConfigError(f"{what}: invalid Kafka configuration ({describe(err, exc)})")
    return EventLogError(f"{what}: {describe(err, exc)}")


def retrying(attempts: int = 5, max_delay_s: float = 30.0) -> Retrying:
    """Bounded retries of transient Kafka errors, with exponential backoff up to 2 s."""
    return Retrying(
        stop=stop_after_attempt(attempts) | stop_after_delay(max_delay_s),
        wait=wait_exponential(multiplier=0.1, max=2.0),
        retry=retry_if_exception(transient),
        reraise=True,
    )


def call(what: str, fn: Callable[[], T], *, attempts: int = 5) -> T:
    """Run ``fn``, retrying transient Kafka errors; raise our error once they run out."""
    try:
        with warned_wait(f"Kafka to answer: {what} (retrying; brokers down?)", logger):
            return retrying(attempts)(fn)
    except (KafkaException, BufferError, RuntimeError, ValueError) as exc:
        raise wrap(exc, what) from exc


def failover(what: str, fn: Callable[[float], T], refresh: Callable[[float], object], *,
             unknown: Literal["fail", "raise", "retry"] = "fail",
             within: float | None = None) -> T:
    """``fn(timeout)`` for a request that goes to a partition's leader, retried across a
    leader change for at most ``within`` seconds (``FAILOVER_S``).

    librdkafka sends such a request to the leader its metadata names; after the leader died
    it keeps asking the dead one until its next metadata refresh. So each retry first calls
    ``refresh(timeout)`` (a metadata request for the topic). The per-attempt timeout grows
    by 1 s from 1 s up to ``REQUEST_TIMEOUT_S``: slowly, because an attempt sent to the dead
    leader just before the election waits out its whole timeout. An unknown topic or
    partition fails the call (``unknown="fail"``), is re-raised as is for the caller to
    decide what it means (``"raise"``), or is retried like a leader change (``"retry"``: a
    partition just created).
    """
    within = FAILOVER_S if within is None else within
    with warned_wait(f"a partition leader to answer: {what} (a leader change, or brokers down; retrying "
                     f"with fresh metadata for up to {within:g} s)", logger):
        return _failover(what, fn, refresh, unknown, within)


def _failover(what: str, fn: Callable[[float], T], refresh: Callable[[float], object],
              unknown: Literal["fail", "raise", "retry"], within: float) -> T:
    deadline = time.monotonic() + within
    timeout = min(1.0, within)
    while True:
        try:
            return fn(timeout)
        except KafkaException as exc:
            err = kafka_error(exc)
            is_unknown = err is not None and err.code() in UNKNOWN
            if is_unknown and unknown == "raise":
                raise
            left = deadline - time.monotonic()
            if not (transient(exc) or (is_unknown and unknown == "retry")):
                raise wrap(exc, what) from exc
            if left <= 0:
                raise wrap(exc, f"{what} (no partition leader answered in {within:g} s of "
                                "retries with fresh metadata)") from exc
            logger.info("%s: %s; retrying with fresh metadata", what, describe(err, exc))
        # A leaderless partition can fail at once: do not ask it in a busy loop.
        time.sleep(min(RETRY_PAUSE_S, max(0.0, deadline - time.monotonic())))
        timeout = max(0.5, min(timeout + 1, REQUEST_TIMEOUT_S, deadline - time.monotonic()))
        try:
            refresh(timeout)
        except KafkaException as exc:  # the next attempt fails too, or the deadline reports it
            logger.info("%s: metadata refresh: %s", what, describe(kafka_error(exc), exc))


def client(kind: Callable[[dict[str, Any]], T], conf: dict[str, Any], what: str) -> T:
    """Create a librdkafka client; a bad config key or value is a ``ConfigError``."""
    try:
        return kind(conf)
    except (KafkaException, ValueError, TypeError) as exc:
        err = kafka_error(exc)
        raise ConfigError(f"cannot create the Kafka {what}: {describe(err, exc)}") from exc
