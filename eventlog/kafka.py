"""The Kafka backend: a run's log is two topics on a Kafka cluster (librdkafka via confluent_kafka).

Topics: ``<prefix>.<run>.control`` (one partition: ``ports.CONTROL``) and
``<prefix>.<run>.tensors`` (one partition per shard). A writer is an idempotent
transactional producer whose ``transactional.id`` is ``<prefix>.<run>.<writer_id>``: opening
a new writer with the same id fences the old one (Kafka bumps the producer epoch), and a
transaction's records are visible to ``read_committed`` consumers only once it commits.

URL: ``kafka://host:port[,host:port...][?prefix=rewind&replication=3&<librdkafka key>=<value>...]``.
``prefix`` (default ``rewind``) and ``replication`` (topic replication factor; default
``min(3, brokers)``) are ours; every other query parameter is passed to librdkafka as is,
so TLS and SASL work (``security.protocol=SASL_SSL&sasl.mechanism=SCRAM-SHA-512&...``).
A key written ``producer.<key>``, ``consumer.<key>`` or ``admin.<key>`` applies to that client
only (e.g. ``producer.transaction.timeout.ms=300000``). Secrets can stay out of the URL:
``REWIND_KAFKA_CONF_SASL_PASSWORD=...`` sets ``sasl.password`` (``_`` -> ``.``, lower case;
URL parameters win over the environment).

Kafka offsets are not dense: transaction markers and aborted records occupy offsets that
``read`` never returns. Nothing here assumes ``offset + 1`` is the next record.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qsl

from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import (  # type: ignore[attr-defined]  # not re-exported in stubs
    AdminClient,
    ClusterMetadata,
    NewTopic,
)
from tenacity import (
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from eventlog.errors import ConfigError, EventLogError, FencedError, RewindError
from eventlog.ports import CONTROL, EventLog, LogTransaction, LogWriter, Record

T = TypeVar("T")

_log = logging.getLogger("rewind.kafka")

DEFAULT_PREFIX = "rewind"
#: Largest message a writer produces (value + envelope). A 4 MiB chunk is far below it; the
#: headroom is for ``REWIND_CHUNK_BYTES`` raised up to ~12-15 MiB.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: The topics' ``max.message.bytes``: a record batch holding one maximal message also carries
#: the batch and record headers, so the topic allows a little more than the producer sends.
TOPIC_MAX_MESSAGE_BYTES = MAX_MESSAGE_BYTES + 256 * 1024
#: One fetch response may hold two maximal messages; the socket must take the whole response.
FETCH_MAX_BYTES = 2 * TOPIC_MAX_MESSAGE_BYTES
#: A transaction must commit within this (the broker aborts it after). It also bounds how long
#: ``read_committed`` readers stall behind a crashed writer's open transaction.
TRANSACTION_TIMEOUT_MS = 120_000
#: Bound on one blocking librdkafka call (metadata, watermarks, admin requests).
REQUEST_TIMEOUT_S = 10.0
#: After a commit, how long a writer waits for its records to become readable.
VISIBLE_WAIT_S = 5.0
#: ``read`` gives up when no record or end-of-partition arrives for this long.
READ_STALL_S = 60.0
#: ``append`` gives up when the producer queue stays full (broker not taking data) this long.
QUEUE_FULL_S = 300.0
#: Consumers a ``KafkaLog`` keeps for ``read`` (shards fold in parallel threads).
MAX_READERS = max(4, os.cpu_count() or 1)

_ROLES = ("producer", "consumer", "admin")
# Settings the log's guarantees rest on (fencing, exactly-once, visibility): not overridable.
_PINNED = {
    "transactional.id", "enable.idempotence", "acks", "isolation.level", "enable.auto.commit",
    "enable.auto.offset.store", "enable.partition.eof", "group.id", "on_delivery", "error_cb",
    "logger",
}
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
_SECRET_KEY = re.compile(r"password|secret|token|key\.pem|credentials", re.IGNORECASE)

# Errors of a writer that a newer writer with the same transactional.id took over.
_FENCING = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
# Errors worth another attempt even when librdkafka does not flag them retriable.
_TRANSIENT = {
    KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
    KafkaError._WAIT_COORD, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.NOT_COORDINATOR,
    KafkaError.LEADER_NOT_AVAILABLE, KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NETWORK_EXCEPTION, KafkaError.CONCURRENT_TRANSACTIONS,
    getattr(KafkaError, "NOT_LEADER_FOR_PARTITION", 6),
}
_UNKNOWN = {KafkaError._UNKNOWN_PARTITION, KafkaError._UNKNOWN_TOPIC,
            KafkaError.UNKNOWN_TOPIC_OR_PART}


# ---------------------------------------------------------------------------- configuration
class KafkaSettings:
    """A parsed ``kafka://`` URL: the servers, our options, and librdkafka config per client."""

    def __init__(self, url: str) -> None:
        if not url.startswith("kafka://"):
            raise ConfigError(f"not a Kafka URL (kafka://host:port[,...][?...]): {redact(url)!r}")
        rest = url[len("kafka://"):]
        hosts, _, query = rest.partition("?")
        hosts = hosts.rstrip("/")
        servers = [h.strip() for h in hosts.split(",") if h.strip()]
        if not servers:
            raise ConfigError(f"Kafka URL {redact(url)!r} names no bootstrap server")
        self.bootstrap = ",".join(servers)
        options: dict[str, str] = {}
        # The environment first, so that the URL wins.
        for name, value in os.environ.items():
            if name.startswith("REWIND_KAFKA_CONF_") and len(name) > len("REWIND_KAFKA_CONF_"):
                options[name[len("REWIND_KAFKA_CONF_"):].lower().replace("_", ".")] = value
        options.update(parse_qsl(query, keep_blank_values=True))
        self.prefix = options.pop("prefix", DEFAULT_PREFIX)
        if not self.prefix or not _TOPIC_NAME.match(self.prefix):
            raise ConfigError(f"Kafka topic prefix {self.prefix!r} may only use [A-Za-z0-9._-]")
        raw_rf = options.pop("replication", "")
        try:
            self.replication: int | None = int(raw_rf) if raw_rf else None
        except ValueError:
            raise ConfigError(f"replication={raw_rf!r} in the Kafka URL is not a number") from None
        if self.replication is not None and self.replication < 1:
            raise ConfigError(f"replication={raw_rf} in the Kafka URL must be >= 1")
        self.common: dict[str, str] = {}
        self.by_role: dict[str, dict[str, str]] = {r: {} for r in _ROLES}
        for key, value in options.items():
            role, dot, sub = key.partition(".")
            if (sub if dot and role in _ROLES else key) in _PINNED:
                raise ConfigError(f"Kafka setting {key!r} is set by Rewind and cannot be changed")
            if dot and role in _ROLES:
                self.by_role[role][sub] = value
            else:
                self.common[key] = value
        self.redacted_url = redact(url)

    def config(self, role: str, **ours: Any) -> dict[str, Any]:
        """librdkafka config for one client: our settings, then the user's (which win, except
        for the pinned ones)."""
        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap,
            "logger": _log,
            # Small requests (commits, watermarks) would otherwise wait on Nagle's algorithm.
            "socket.nagle.disable": True,
            **ours,
        }
        conf.update(self.common)
        conf.update(self.by_role[role])
        return conf


def redact(url: str) -> str:
    """``url`` with the values of secret-looking parameters replaced by ``***``."""
    head, sep, query = url.partition("?")
    if not sep:
        return url
    parts = []
    for key, value in parse_qsl(query, keep_blank_values=True):
        parts.append(f"{key}={'***' if _SECRET_KEY.search(key) else value}")
    return f"{head}?{'&'.join(parts)}"


# ---------------------------------------------------------------------------- errors
def _kafka_error(exc: BaseException) -> KafkaError | None:
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return exc.args[0]
    return None


def _transient(exc: BaseException) -> bool:
    err = _kafka_error(exc)
    return err is not None and not err.fatal() and (
        err.retriable() or err.code() in _TRANSIENT
    )


def _offset(msg: Message) -> int:
    """A consumed or delivered message's offset (librdkafka always sets it there)."""
    offset = msg.offset()
    return -1 if offset is None else offset


def _describe(err: KafkaError | None, exc: BaseException) -> str:
    return f"{err.name()}: {err.str()}" if err is not None else str(exc)


def _wrap(exc: BaseException, what: str) -> RewindError:
    """Our error for a driver error; ``what`` names the operation, topic and partition."""
    err = _kafka_error(exc)
    if err is not None and err.code() in _FENCING:
        return FencedError(f"{what}: fenced by a newer writer with the same id ({_describe(err, exc)})")
    if err is not None and err.code() == KafkaError._INVALID_ARG:
        return ConfigError(f"{what}: invalid Kafka configuration ({_describe(err, exc)})")
    return EventLogError(f"{what}: {_describe(err, exc)}")


def _retrying(attempts: int = 5, max_delay_s: float = 30.0) -> Retrying:
    """Bounded retries of transient Kafka errors, with exponential backoff up to 2 s."""
    return Retrying(
        stop=stop_after_attempt(attempts) | stop_after_delay(max_delay_s),
        wait=wait_exponential(multiplier=0.1, max=2.0),
        retry=retry_if_exception(_transient),
        reraise=True,
    )


def _call(what: str, fn: Callable[[], T], *, attempts: int = 5) -> T:
    """Run ``fn``, retrying transient Kafka errors; raise our error once they run out."""
    try:
        return _retrying(attempts)(fn)
    except (KafkaException, BufferError, RuntimeError, ValueError) as exc:
        raise _wrap(exc, what) from exc


def _client(kind: Callable[[dict[str, Any]], T], conf: dict[str, Any], what: str) -> T:
    """Create a librdkafka client; a bad config key or value is a ``ConfigError``."""
    try:
        return kind(conf)
    except (KafkaException, ValueError, TypeError) as exc:
        err = _kafka_error(exc)
        raise ConfigError(f"cannot create the Kafka {what}: {_describe(err, exc)}") from exc


# ---------------------------------------------------------------------------- topics
def _topics(prefix: str, run_id: str) -> tuple[str, str]:
    control, tensors = f"{prefix}.{run_id}.control", f"{prefix}.{run_id}.tensors"
    if not _TOPIC_NAME.match(run_id) or len(tensors) > 249:
        raise ConfigError(
            f"run id {run_id!r} cannot name a Kafka topic: use [A-Za-z0-9._-], "
            f"at most {249 - len(prefix) - len('..tensors')} characters"
        )
    return control, tensors


def _metadata(admin: AdminClient, topic: str | None, what: str) -> ClusterMetadata:
    return _call(what, lambda: admin.list_topics(topic=topic, timeout=REQUEST_TIMEOUT_S))


def _partition_count(md: ClusterMetadata, topic: str) -> int | None:
    """Partitions of ``topic`` in ``md``; ``None`` if it does not exist."""
    tm = md.topics.get(topic)
    if tm is None or (tm.error is not None and tm.error.code() in _UNKNOWN):
        return None
    if tm.error is not None:
        raise EventLogError(f"metadata of topic {topic}: {tm.error.name()}: {tm.error.str()}")
    return len(tm.partitions)


def list_runs(url: str) -> list[str]:
    """Runs that have both topics on the cluster at ``url``."""
    settings = KafkaSettings(url)
    admin = _client(AdminClient, settings.config("admin"), "admin client")
    md = _metadata(admin, None, f"listing topics on {settings.bootstrap}")
    names = set(md.topics)
    head, tail = f"{settings.prefix}.", ".control"
    runs = []
    for name in names:
        if name.startswith(head) and name.endswith(tail) and len(name) > len(head) + len(tail):
            run = name[len(head):-len(tail)]
            if f"{head}{run}.tensors" in names:
                runs.append(run)
    return sorted(runs)


# ---------------------------------------------------------------------------- writer
class _KafkaTransaction(LogTransaction):
    """Appends of one open Kafka transaction."""

    def __init__(self, writer: _KafkaWriter) -> None:
        self._writer = writer

    def append(self, partition: int, value: bytes, *, bulk_at: int | None = None) -> None:
        self._writer._produce(partition, value)  # a fetched message is one buffer: no views


class _KafkaWriter(LogWriter):
    """An idempotent transactional producer; ``init_transactions`` fences older instances."""

    def __init__(self, log: KafkaLog, writer_id: str) -> None:
        self._log, self.writer_id = log, writer_id
        self.transactional_id = f"{log.settings.prefix}.{log.run_id}.{writer_id}"
        self._what = f"Kafka writer {self.transactional_id!r}"
        self._dead: RewindError | None = None
        self._delivery_error: str | None = None
        # Highest offset delivered per (topic, partition) in the open transaction.
        self._written: dict[tuple[str, int], int] = {}
        self._in_txn = False
        conf = log.settings.config(
            "producer",
            **{
                "transactional.id": self.transactional_id,
                "enable.idempotence": True,
                "acks": "all",
                "message.max.bytes": MAX_MESSAGE_BYTES,
                # Chunks are already zstd-compressed; compressing again only costs CPU.
                "compression.type": "none",
                "linger.ms": 2,
                "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS,
                # Bounds librdkafka's copy of queued messages; a full queue is backpressure.
                "queue.buffering.max.kbytes": 256 * 1024,
                "on_delivery": self._on_delivery,
                "error_cb": self._on_error,
            },
        )
        self._producer = _client(Producer, conf, "producer")
        # The transaction coordinator may still be loading (fresh broker): retry a bounded
        # number of times. A successful init fences every older producer with this id.
        try:
            _retrying(attempts=8, max_delay_s=60.0)(lambda: self._producer.init_transactions(20.0))
        except KafkaException as exc:
            raise self._fail(exc, "initialising transactions") from exc

    # Callbacks run on the thread that polls (append, commit): they only record.
    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            if self._delivery_error is None:
                self._delivery_error = (
                    f"message to {msg.topic()} [{msg.partition()}] failed: {err.name()}: {err.str()}"
                )
            return
        key = (msg.topic() or "", msg.partition() or 0)
        self._written[key] = max(self._written.get(key, -1), _offset(msg))

    def _on_error(self, err: KafkaError) -> None:
        if err.fatal() or err.code() in _FENCING:
            self._dead = self._dead or self._error_for(err, "fatal producer error")
        else:
            _log.warning("%s: %s: %s", self._what, err.name(), err.str())

    def _error_for(
        self, err: KafkaError | None, doing: str, exc: BaseException | None = None
    ) -> RewindError:
        text = _describe(err, exc or KafkaException(err))
        if err is not None and (err.code() in _FENCING or err.fatal()):
            if err.code() in _FENCING or "fenced" in err.str().lower():
                return FencedError(
                    f"{self._what} of run {self._log.run_id!r} was fenced by a newer writer with "
                    f"the same id while {doing} ({text}); this writer must stop"
                )
            return FencedError(
                f"{self._what} hit a fatal producer error while {doing} ({text}); it can no "
                "longer write: open a new writer"
            )
        return _wrap(exc or KafkaException(err), f"{self._what} {doing}")

    def _fail(self, exc: BaseException, doing: str) -> RewindError:
        """Our error for ``exc``; a fatal one also kills the writer for good."""
        err = _kafka_error(exc)
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
        try:
            yield _KafkaTransaction(self)
        except BaseException as exc:
            self._abort(exc)
            raise
        try:
            self._commit()
        finally:
            self._in_txn = False
        self._await_visible()

    def _produce(self, partition: int, value: bytes) -> None:
        self._check_alive()
        topic, kp = self._log._where(partition, produce=True)
        deadline = time.monotonic() + QUEUE_FULL_S
        while True:
            try:
                self._producer.produce(topic, value, partition=kp)
                break
            except BufferError:
                # The local queue is full: wait for the broker to take some (backpressure).
                if time.monotonic() > deadline:
                    raise EventLogError(
                        f"{self._what}: producer queue to {topic} [{kp}] stayed full for "
                        f"{QUEUE_FULL_S:.0f} s; is the broker reachable?"
                    ) from None
                self._producer.poll(0.05)
            except KafkaException as exc:
                err = _kafka_error(exc)
                if err is not None and err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
                    raise EventLogError(
                        f"{self._what}: a {len(value)}-byte message for {topic} [{kp}] exceeds "
                        f"the {MAX_MESSAGE_BYTES}-byte limit; lower REWIND_CHUNK_BYTES"
                    ) from exc
                raise self._fail(exc, f"producing to {topic} [{kp}]") from exc
        self._producer.poll(0)  # serve delivery reports and logs as we go

    def _commit(self) -> None:
        # commit_transaction flushes first; a timeout is retriable (call it again), an
        # abortable error means some message failed: abort and report it.
        try:
            _retrying(attempts=10, max_delay_s=TRANSACTION_TIMEOUT_MS / 1000)(
                lambda: self._producer.commit_transaction(60.0)
            )
        except KafkaException as exc:
            err = _kafka_error(exc)
            if err is not None and err.txn_requires_abort():
                cause = self._delivery_error or f"{err.name()}: {err.str()}"
                self._abort(exc)
                raise EventLogError(f"{self._what}: transaction aborted: {cause}") from exc
            raise self._fail(exc, "committing a transaction") from exc

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
                partition = CONTROL if topic == self._log.control_topic else kp
                try:
                    if self._log.end_offset(partition) > last:
                        del pending[(topic, kp)]
                except RewindError as exc:  # the commit stands; only the wait failed
                    _log.warning("%s: cannot confirm visibility: %s", self._what, exc)
                    return
            if pending and time.monotonic() > deadline:
                _log.warning("%s: committed records of %s not yet visible after %.0f s",
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
            _retrying(attempts=5)(lambda: self._producer.abort_transaction(30.0))
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
            _log.warning("%s: close: %s", self._what, exc)


# ---------------------------------------------------------------------------- readers
class _Reader:
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
        self.consumer: Consumer = _client(Consumer, conf, "consumer")
        self.at: tuple[str, int] | None = None
        self.cursor = -1
        # False until the current assignment delivered something: before that, position()
        # may still describe the previous assignment.
        self.live = False
        self.known: set[str] = set()  # topics whose metadata this client has
        self.stash: deque[Message] = deque()
        self.idle_since = time.monotonic()
        self.gap = (0, 0)  # after a read: offsets known to hold no committed record

    def continues(self, topic: str, kp: int, start: int | None) -> bool:
        """True if reading ``(topic, kp)`` from ``start`` needs no repositioning."""
        if self.at != (topic, kp) or start is None:
            return False
        if self.stash:  # no committed record lies between cursor and the stashed one
            return self.cursor <= start <= _offset(self.stash[0])
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
            raise _wrap(exc, f"positioning at {where} offset {start}") from exc
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
            if _offset(self.stash[0]) >= stop:
                return out
            msg = self.stash.popleft()
            out.append(Record(partition, _offset(msg), msg.value() or b""))
            self.cursor = _offset(msg) + 1
        stalled_at = time.monotonic() + READ_STALL_S
        done = False
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
            except (KafkaException, RuntimeError) as exc:
                raise _wrap(exc, f"reading {where}") from exc
            for msg in msgs:
                self.live = True
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        done = done or _offset(msg) >= stop
                    elif err.fatal() or err.code() in _UNKNOWN:
                        raise EventLogError(f"reading {where}: {err.name()}: {err.str()}")
                    else:  # librdkafka recovers from the rest itself; the stall bound still holds
                        _log.warning("reading %s: %s: %s", where, err.name(), err.str())
                    continue
                stalled_at = time.monotonic() + READ_STALL_S
                if done or _offset(msg) >= stop or len(out) >= want:
                    self.stash.append(msg)
                    done = True
                    continue
                out.append(Record(partition, _offset(msg), msg.value() or b""))
                self.cursor = _offset(msg) + 1
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

    def _position(self, tp: TopicPartition, where: str) -> int:
        try:
            return int(self.consumer.position([tp])[0].offset)
        except KafkaException as exc:
            raise _wrap(exc, f"reading {where}") from exc

    def park(self) -> None:
        """Stop fetching (unassign); the next read repositions."""
        if self.at is None:
            return
        self.at, self.live = None, False
        self.stash.clear()
        try:
            self.consumer.unassign()
        except KafkaException as exc:
            _log.warning("unassigning a Kafka consumer: %s", exc)

    def close(self) -> None:
        try:
            self.consumer.close()
        except (KafkaException, RuntimeError) as exc:
            _log.warning("closing a Kafka consumer: %s", exc)


class _ReaderPool:
    """Consumers shared by the threads of one ``KafkaLog`` (a consumer is not thread-safe).

    A janitor thread parks readers left assigned but idle for ``PARK_AFTER_S`` (a scan that
    stopped early), and exits once none is left.
    """

    PARK_AFTER_S = 1.0

    def __init__(self, make: Callable[[], _Reader], size: int) -> None:
        self._make, self._size = make, size
        self._idle: list[_Reader] = []
        self._count = 0
        self._cond = threading.Condition()
        self._closed = False
        self._janitor: threading.Thread | None = None

    @contextmanager
    def borrow(self, topic: str, kp: int, start: int | None) -> Iterator[_Reader]:
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
                f"cursor {r.cursor}, stash {[_offset(m) for m in r.stash]}, gap {r.gap}, live {r.live}"
                for r in self._idle if r.at == (topic, kp))

    def _give_back(self, reader: _Reader, ok: bool) -> None:
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

    def _take(self, topic: str, kp: int, start: int | None) -> _Reader:
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


# ---------------------------------------------------------------------------- the log
class KafkaLog(EventLog):
    """A run's log on Kafka: a 1-partition control topic and an S-partition tensors topic."""

    def __init__(self, url: str, run_id: str) -> None:
        self.settings = KafkaSettings(url)
        self.url, self.run_id = self.settings.redacted_url, run_id
        self.control_topic, self.tensors_topic = _topics(self.settings.prefix, run_id)
        self._admin = _client(AdminClient, self.settings.config("admin"), "admin client")
        self._shards: int | None = None  # known once the topics exist (they never shrink)
        self._created = False
        self._lock = threading.Lock()
        consumer_conf = self.settings.config(
            "consumer",
            **{
                # Required by librdkafka even though we only assign() and never commit.
                "group.id": f"{self.settings.prefix}.reader",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "isolation.level": "read_committed",
                "auto.offset.reset": "earliest",  # truncated below us: continue at the start
                "enable.partition.eof": True,
                "fetch.max.bytes": FETCH_MAX_BYTES,
                "max.partition.fetch.bytes": TOPIC_MAX_MESSAGE_BYTES,
                "receive.message.max.bytes": FETCH_MAX_BYTES + 1024 * 1024,
                # A new assignment waits for the fetch in flight (a long poll at the partition
                # end) to return: keep that poll short. Readers are parked when idle.
                "fetch.wait.max.ms": 10,
                "check.crcs": True,
            },
        )
        self._readers = _ReaderPool(lambda: _Reader(consumer_conf), MAX_READERS)
        # Watermark queries get their own idle client: on a fetching consumer's connection
        # they would queue behind its long-poll fetch requests (tens of ms each).
        self._offsets: Consumer | None = None
        self._offsets_conf = consumer_conf
        self._offsets_lock = threading.Lock()
        # Per partition, the last offset range a read found holding only transaction markers
        # and aborted records (a scan's final read usually asks for exactly that range).
        self._gaps: dict[tuple[str, int], tuple[int, int]] = {}

    def _where(self, partition: int, produce: bool = False) -> tuple[str, int]:
        """The topic and Kafka partition of a log partition."""
        if partition == CONTROL:
            return self.control_topic, 0
        if partition < 0:
            raise EventLogError(f"run {self.run_id!r} has no partition {partition}")
        if produce:  # fail now rather than in a delivery report at commit
            shards = self.shard_count()
            if shards is None or partition >= shards:
                raise EventLogError(
                    f"run {self.run_id!r} has no partition {partition} (topic "
                    f"{self.tensors_topic} has {shards or 0} partitions)"
                )
        return self.tensors_topic, partition

    def create(self, shards: int) -> None:
        """Create both topics if missing (idempotent); check an existing run's shard count."""
        if shards < 1:
            raise EventLogError(f"run {self.run_id!r}: shard count must be >= 1, not {shards}")
        with self._lock:
            if self._created:
                if self._shards != shards:
                    raise EventLogError(
                        f"run {self.run_id!r} exists with {self._shards} shards, not {shards}"
                    )
                return
            want = {self.control_topic: 1, self.tensors_topic: shards}
            what = f"creating topics of run {self.run_id!r} on {self.settings.bootstrap}"
            have = self._counts(what)
            missing = [t for t, n in want.items() if have.get(t) is None]
            if missing:
                self._create_topics(missing, want, what)
                have = self._wait_for_topics(want, what)
            for topic, n in want.items():
                if have[topic] != n:
                    raise EventLogError(
                        f"run {self.run_id!r} exists with {have[topic]} partitions in {topic}, "
                        f"not {n}" + (" (shards)" if topic == self.tensors_topic else "")
                    )
            self._shards, self._created = shards, True

    def _counts(self, what: str) -> dict[str, int | None]:
        return {
            t: _partition_count(_metadata(self._admin, t, what), t)
            for t in (self.control_topic, self.tensors_topic)
        }

    def _create_topics(self, topics: list[str], want: dict[str, int], what: str) -> None:
        md = _metadata(self._admin, None, what)
        rf = self.settings.replication or min(3, max(1, len(md.brokers)))
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
            fut = self._admin.create_topics(
                [NewTopic(topic, want[topic], rf, config=config)],
                operation_timeout=REQUEST_TIMEOUT_S, request_timeout=REQUEST_TIMEOUT_S,
            )[topic]
            try:
                fut.result(timeout=REQUEST_TIMEOUT_S * 2)
            except KafkaException as exc:
                err = _kafka_error(exc)
                if err is None or err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
                # Another process created it first; its partition count is checked next.

        for topic in topics:
            try:
                _call(f"{what}: topic {topic}", functools.partial(create_one, topic))
            except TimeoutError as exc:  # a future that never completed
                raise EventLogError(f"{what}: topic {topic}: no answer from the broker") from exc

    def _wait_for_topics(self, want: dict[str, int], what: str) -> dict[str, int | None]:
        """Wait (bounded) until every partition of the new topics has a leader."""
        deadline = time.monotonic() + REQUEST_TIMEOUT_S * 2
        while True:
            ready: dict[str, int | None] = {}
            ok = True
            for topic in want:
                md = _metadata(self._admin, topic, what)
                ready[topic] = _partition_count(md, topic)
                tm = md.topics.get(topic)
                ok = ok and tm is not None and ready[topic] is not None and all(
                    p.leader >= 0 for p in tm.partitions.values())
            if ok or time.monotonic() > deadline:
                if not ok:
                    raise EventLogError(f"{what}: topics {list(want)} have no leader after creation")
                return ready
            time.sleep(0.1)

    def shard_count(self) -> int | None:
        """Partitions of the tensors topic, or ``None`` unless both topics exist."""
        if self._shards is not None:
            return self._shards
        counts = self._counts(f"reading metadata of run {self.run_id!r}")
        if counts[self.control_topic] is None or counts[self.tensors_topic] is None:
            return None
        self._shards = counts[self.tensors_topic]
        return self._shards

    def writer(self, writer_id: str) -> LogWriter:
        """A transactional producer ``<prefix>.<run>.<writer_id>``, fencing older ones."""
        return _KafkaWriter(self, writer_id)

    def read(
        self, partition: int, *, gt: int | None = None, lte: int | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """Committed records with ``gt < offset <= lte``, up to the last stable offset now."""
        topic, kp = self._where(partition)
        if limit is not None and limit <= 0:
            return []
        first = None if gt is None else gt + 1
        marks = self._marks(topic, kp)
        if marks is None:
            return []
        low, high = marks
        start = low if first is None else max(low, first)
        stop = high if lte is None else min(high, lte + 1)
        if start >= stop:
            return []
        gap = self._gaps.get((topic, kp))
        if gap is not None and gap[0] <= start and stop <= gap[1]:
            return []  # e.g. only the commit marker after the last record: no fetch needed
        with self._readers.borrow(topic, kp, start) as reader:
            out = reader.fetch(partition, topic, kp, start, stop, limit)
            if reader.gap[1] > reader.gap[0]:
                self._gaps[(topic, kp)] = reader.gap
            return out

    def describe_reads(self, partition: int) -> str:
        topic, kp = self._where(partition)
        return (f"{topic} [{kp}]: low watermark and last stable offset {self._marks(topic, kp)}, "
                f"cached empty range {self._gaps.get((topic, kp))}, idle readers "
                f"{self._readers.describe(topic, kp) or 'none assigned to it'}")

    def _watermarks(self, partition: int) -> tuple[int, int]:
        topic, kp = self._where(partition)
        return self._marks(topic, kp) or (0, 0)

    def _marks(self, topic: str, kp: int) -> tuple[int, int] | None:
        """``(low, last stable offset)``, or ``None`` if the partition does not exist."""
        with self._offsets_lock:
            if self._offsets is None:
                self._offsets = _client(Consumer, self._offsets_conf, "consumer")
            return self._query_marks(self._offsets, topic, kp)

    @staticmethod
    def _query_marks(consumer: Consumer, topic: str, kp: int) -> tuple[int, int] | None:
        tp = TopicPartition(topic, kp)
        what = f"reading offsets of {topic} [{kp}]"
        try:
            return _retrying()(lambda: consumer.get_watermark_offsets(
                tp, timeout=REQUEST_TIMEOUT_S, cached=False))
        except KafkaException as exc:
            err = _kafka_error(exc)
            if err is None or err.code() not in _UNKNOWN:
                raise _wrap(exc, what) from exc
        # Maybe only our metadata cache is stale (topic created since): refresh and ask again.
        md = _call(what, lambda: consumer.list_topics(topic, timeout=REQUEST_TIMEOUT_S))
        count = _partition_count(md, topic)
        if count is None or kp >= count:
            return None
        return _call(what, lambda: consumer.get_watermark_offsets(
            tp, timeout=REQUEST_TIMEOUT_S, cached=False))

    def end_offset(self, partition: int) -> int:
        """The last stable offset: the committed end (past any trailing transaction marker)."""
        return self._watermarks(partition)[1]

    def start_offset(self, partition: int) -> int:
        """The low watermark: records below it were deleted."""
        return self._watermarks(partition)[0]

    def truncate_before(self, partition: int, offset: int) -> None:
        """Delete records below ``offset`` (clamped to the committed end) with DeleteRecords."""
        topic, kp = self._where(partition)
        low, high = self._watermarks(partition)
        target = min(offset, high)
        if target <= low:
            return
        what = f"deleting records of {topic} [{kp}] below offset {target}"

        def delete() -> None:
            futures = self._admin.delete_records(
                [TopicPartition(topic, kp, target)],
                request_timeout=REQUEST_TIMEOUT_S, operation_timeout=REQUEST_TIMEOUT_S,
            )
            for fut in futures.values():
                fut.result(timeout=REQUEST_TIMEOUT_S * 2)

        try:
            _call(what, delete)
        except TimeoutError as exc:  # a future that never completed
            raise EventLogError(f"{what}: no answer from the broker") from exc

    def close(self) -> None:
        """Close the cached consumers (writers are closed by whoever opened them)."""
        self._readers.close()
        with self._offsets_lock:
            if self._offsets is not None:
                try:
                    self._offsets.close()
                except (KafkaException, RuntimeError) as exc:
                    _log.warning("closing a Kafka consumer: %s", exc)
                self._offsets = None
