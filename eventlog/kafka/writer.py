"""The Kafka backend's writer: an idempotent transactional producer per writer id.

Its ``transactional.id`` is ``<prefix>.<run>.<writer_id>``: opening a new writer with the
same id fences the old one (Kafka bumps the producer epoch), and a transaction's records are
visible to ``read_committed`` consumers only once it commits.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from eventlog.errors import EventLogError, FencedError, RewindError
from eventlog.kafka.calls import (
    FENCING,
    client,
    describe,
    kafka_error,
    message_offset,
    retrying,
    transient,
    wrap,
)
from eventlog.kafka.config import (
    MAX_MESSAGE_BYTES,
    TRANSACTION_TIMEOUT_MS,
    KafkaSettings,
    logger,
    producer_config,
)
from eventlog.ports import LogTransaction, LogWriter, MessageBytes, joined
from eventlog.waits import warned_wait

#: One attempt of ``commit_transaction``; a commit that takes longer is logged and retried.
COMMIT_ATTEMPT_S = 10.0
#: After a commit, how long a writer waits for its records to become readable.
VISIBLE_WAIT_S = 5.0
#: ``append`` gives up when the producer queue stays full (broker not taking data) this long.
QUEUE_FULL_S = 300.0


class _Undelivered(Exception):
    """Some record of the open transaction is not in the log: the transaction must abort."""


class WriterTarget(Protocol):
    """What a writer needs of its log: the run, and where its partitions are."""

    settings: KafkaSettings
    run_id: str
    control_topic: str

    def locate(self, partition: int, *, produce: bool = False) -> tuple[str, int]:
        """The topic and Kafka partition of a log partition."""
        ...

    def end_offset(self, partition: int, *, within: float | None = None) -> int:
        """The last stable offset of a log partition, waiting out a leader change for at
        most ``within`` seconds."""
        ...


class KafkaTransaction(LogTransaction):
    """Appends of one open Kafka transaction."""

    def __init__(self, writer: KafkaWriter) -> None:
        self._writer = writer

    def append(self, partition: int, value: MessageBytes, *, bulk_at: int | None = None) -> None:
        self._writer.produce(partition, joined(value))  # a fetched message is one buffer: no views


class KafkaWriter(LogWriter):
    """An idempotent transactional producer; ``init_transactions`` fences older instances."""

    def __init__(self, target: WriterTarget, writer_id: str) -> None:
        self._target, self.writer_id = target, writer_id
        self.transactional_id = f"{target.settings.prefix}.{target.run_id}.{writer_id}"
        self._what = f"Kafka writer {self.transactional_id!r}"
        self._dead: RewindError | None = None
        self._delivery_error: str | None = None
        # Highest offset delivered per (topic, partition) in the open transaction.
        self._written: dict[tuple[str, int], int] = {}
        # The log partition of each (topic, Kafka partition) produced to.
        self._partitions: dict[tuple[str, int], int] = {}
        # Records produced in the open transaction, those with a delivery report, and those
        # the broker placed in the log.
        self._produced = self._acked = self._reported = 0
        self._in_txn = False
        conf = producer_config(target.settings, self.transactional_id, self._on_delivery, self._on_error)
        self._producer = client(Producer, conf, "producer")
        # The transaction coordinator may still be loading (fresh broker): retry a bounded
        # number of times. A successful init fences every older producer with this id.
        what = (f"Kafka's transaction coordinator to initialise {self._what} (init_transactions; "
                "brokers down, or the transaction log below min.insync.replicas?)")
        try:
            with warned_wait(what, logger):
                retrying(attempts=8, max_delay_s=60.0)(lambda: self._producer.init_transactions(20.0))
        except KafkaException as exc:
            raise self._fail(exc, "initialising transactions") from exc

    # Callbacks run on the thread that polls (append, commit): they only record.
    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        self._reported += 1
        if err is not None:
            self._note_undelivered(msg, f"failed: {err.name()}: {err.str()}")
            return
        offset = message_offset(msg)
        if offset < 0:  # "possibly persisted": librdkafka could not tell where, if anywhere
            self._note_undelivered(msg, "acknowledged without a log offset")
            return
        key = (msg.topic() or "", msg.partition() or 0)
        self._written[key] = max(self._written.get(key, -1), offset)
        self._acked += 1

    def _note_undelivered(self, msg: Message, how: str) -> None:
        if self._delivery_error is None:
            self._delivery_error = f"message to {msg.topic()} [{msg.partition()}] {how}"

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal() or err.code() in FENCING:
            self._dead = self._dead or self._error_for(err, "fatal producer error")
        else:
            logger.warning("%s: %s: %s", self._what, err.name(), err.str())

    def _error_for(
        self, err: KafkaError | None, doing: str, exc: BaseException | None = None
    ) -> RewindError:
        text = describe(err, exc or KafkaException(err))
        if err is not None and (err.code() in FENCING or err.fatal()):
            if err.code() in FENCING or "fenced" in err.str().lower():
                return FencedError(
                    f"{self._what} of run {self._target.run_id!r} was fenced by a newer writer with "
                    f"the same id while {doing} ({text}); this writer must stop"
                )
            return FencedError(
                f"{self._what} hit a fatal producer error while {doing} ({text}); it can no "
                "longer write: open a new writer"
            )
        return wrap(exc or KafkaException(err), f"{self._what} {doing}")

    def _fail(self, exc: BaseException, doing: str) -> RewindError:
        """Our error for ``exc``; a fatal one also kills the writer for good."""
        err = kafka_error(exc)
        if err is not None and err.code() == KafkaError._FATAL and self._dead is not None:
            return self._dead  # librdkafka only says "fatal" again; the first cause matters
        error = self._error_for(err, doing, exc)
        if isinstance(error, FencedError):
            self._dead = error
        return error

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    @contextmanager
    def transaction(self) -> Iterator[LogTransaction]:
        """One Kafka transaction: committed when the block exits, aborted if it raises."""
        self._check_alive()
        if self._in_txn:
            raise EventLogError(f"{self._what}: a transaction is already open")
        try:
            self._producer.begin_transaction()
        except KafkaException as exc:
            raise self._fail(exc, "beginning a transaction") from exc
        self._in_txn = True
        self._delivery_error = None
        self._written = {}
        self._produced = self._acked = self._reported = 0
        try:
            yield KafkaTransaction(self)
        except BaseException as exc:
            self._abort(exc)
            raise
        try:
            self._commit()
        finally:
            self._in_txn = False
        self._await_visible()

    def produce(self, partition: int, value: bytes) -> None:
        """Send one record of the open transaction to ``partition``."""
        self._check_alive()
        topic, kp = self._target.locate(partition, produce=True)
        self._partitions[(topic, kp)] = partition
        deadline = time.monotonic() + QUEUE_FULL_S
        with contextlib.ExitStack() as full:
            self._produce(topic, kp, value, deadline, full)
        self._producer.poll(0)  # serve delivery reports and logs as we go

    def _produce(self, topic: str, kp: int, value: bytes, deadline: float,
                 full: contextlib.ExitStack) -> None:
        waiting = False
        while True:
            try:
                self._producer.produce(topic, value, partition=kp)
                self._produced += 1
                break
            except BufferError:
                if not waiting:  # said once the queue stays full: a wait on the broker
                    waiting = True
                    full.enter_context(warned_wait(
                        f"the broker to take records of {self._what} (its queue to {topic} [{kp}] is "
                        "full; brokers down or slow?)", logger))
                # The local queue is full: wait for the broker to take some (backpressure).
                if time.monotonic() > deadline:
                    raise EventLogError(
                        f"{self._what}: producer queue to {topic} [{kp}] stayed full for "
                        f"{QUEUE_FULL_S:.0f} s; is the broker reachable?"
                    ) from None
                self._producer.poll(0.05)
            except KafkaException as exc:
                err = kafka_error(exc)
                if err is not None and err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                    raise EventLogError(
                        f"{self._what}: a {len(value)}-byte message for {topic} [{kp}] exceeds "
                        f"the {MAX_MESSAGE_BYTES}-byte limit; lower REWIND_CHUNK_BYTES"
                    ) from exc
                raise self._fail(exc, f"producing to {topic} [{kp}]") from exc

    def _commit(self) -> None:
        # Every record must be in the log before the commit (see _check_delivered). A
        # timeout is retriable (flush or commit again); an abortable error means some
        # message failed: abort and report it. librdkafka itself re-sends to a new partition
        # leader; a commit still waiting after an attempt is logged, so that a stalled
        # cluster is visible, and retried until the broker would abort the transaction anyway.
        t0 = time.monotonic()
        deadline = t0 + TRANSACTION_TIMEOUT_MS / 1000
        try:
            while True:
                try:
                    if self._await_reports(COMMIT_ATTEMPT_S):
                        self._check_delivered()
                    # (A fatal error: the commit raises it.)
                    self._producer.commit_transaction(COMMIT_ATTEMPT_S)
                    return
                except KafkaException as exc:
                    if not transient(exc) or time.monotonic() >= deadline:
                        raise
                    logger.warning(
                        "%s: commit not acknowledged after %.0f s (%s): waiting for the partition "
                        "leaders and at least min.insync.replicas in-sync replicas (brokers down?); "
                        "retrying for up to %.0f s", self._what, time.monotonic() - t0,
                        describe(kafka_error(exc), exc), TRANSACTION_TIMEOUT_MS / 1000)
        except _Undelivered as exc:
            self._abort(exc)
            raise EventLogError(f"{self._what}: transaction aborted: {exc}") from None
        except KafkaException as exc:
            err = kafka_error(exc)
            if err is not None and err.txn_requires_abort():
                cause = self._delivery_error or f"{err.name()}: {err.str()}"
                self._abort(exc)
                raise EventLogError(f"{self._what}: transaction aborted: {cause}") from exc
            raise self._fail(exc, "committing a transaction") from exc

    def _await_reports(self, timeout: float) -> bool:
        """Serve delivery reports until every record of the transaction has one: True, or
        the producer died: False. A timeout raises a retriable ``KafkaException``.
        (Not ``flush``: after a fatal error, confluent-kafka calls the delivery callbacks
        with that error still pending, and they fail.)"""
        end = time.monotonic() + timeout
        while self._reported < self._produced:
            if self._dead is not None:
                return False
            if time.monotonic() > end:
                raise KafkaException(KafkaError(KafkaError._TIMED_OUT,
                                                "records of the transaction not yet delivered"))
            self._producer.poll(0.005)
        return True

    def _check_delivered(self) -> None:
        """Raise ``_Undelivered`` unless the broker placed every record of the open
        transaction in the log. The commit alone does not say so: an idempotent producer's
        batch refused by a partition leader (one that had not yet created a new topic's log)
        while the next batch was appended leaves the transaction without the first, and it
        still commits."""
        if self._delivery_error is not None or self._acked < self._produced:
            raise _Undelivered(
                f"{self._produced - self._acked} of its {self._produced} records were not "
                f"placed in the log ({self._delivery_error or 'no delivery report'}); nothing "
                "of it was committed")

    def _await_visible(self) -> None:
        """Wait until ``read_committed`` readers see this transaction (read-your-writes).

        commit_transaction returns once the commit is decided and durable; the coordinator
        then writes the commit markers to each partition asynchronously, and only then does
        the partition's last stable offset pass our records. Without this wait, a reader
        right after a commit (restore after close, a test) could miss the newest version.
        """
        # Bounded: another writer's open transaction on the same partition (a snapshotter
        # writing markers to control) holds the last stable offset back; waiting longer
        # would only stall the trainer.
        deadline = time.monotonic() + VISIBLE_WAIT_S
        pending = dict(self._written)
        delay = 0.001
        while pending:
            for (topic, kp), last in list(pending.items()):
                partition = self._partitions.get((topic, kp), kp)
                try:
                    left = max(0.5, deadline - time.monotonic())
                    if self._target.end_offset(partition, within=left) > last:
                        del pending[(topic, kp)]
                except RewindError as exc:  # the commit stands; only the wait failed
                    logger.warning("%s: cannot confirm visibility: %s", self._what, exc)
                    return
            if pending and time.monotonic() > deadline:
                logger.warning("%s: committed records of %s not yet visible after %.0f s",
                               self._what, sorted(pending), VISIBLE_WAIT_S)
                return
            if pending:
                time.sleep(delay)
                delay = min(delay * 2, 0.05)

    def _abort(self, cause: BaseException) -> None:
        """Abort the open transaction; failures are noted on ``cause`` (which is re-raised)."""
        self._in_txn = False
        if self._dead is not None:
            return  # a fenced producer's transaction is aborted by the broker
        try:
            with warned_wait(f"Kafka to abort the open transaction of {self._what}", logger):
                retrying(attempts=5)(lambda: self._producer.abort_transaction(30.0))
        except KafkaException as exc:
            error = self._fail(exc, "aborting a transaction")
            cause.add_note(f"and aborting the transaction failed: {error}")

    def close(self) -> None:
        """Flush and release the producer (an open transaction is aborted by close)."""
        try:
            with warnings.catch_warnings():
                # A fenced producer warns that it cannot abort; being fenced was reported.
                warnings.simplefilter("ignore", RuntimeWarning)
                if self._dead is None:
                    self._producer.flush(10.0)
                self._producer.close()
        except (KafkaException, RuntimeError) as exc:
            logger.warning("%s: close: %s", self._what, exc)
