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

Broker failures cost time, never data. On a cluster (``kafka://b1:9092,b2:9092,b3:9092``)
the topics get ``replication`` replicas, ``min.insync.replicas=2`` and no unclean leader
election, and writes use ``acks=all``. When a partition leader dies, the cluster elects a
new one once the dead broker misses heartbeats for ``broker.session.timeout.ms`` (9 s by
default). The producer re-sends to the new leader by itself; every other request that goes
to a partition leader (offset queries, so also the visibility wait after a commit and the
start of every read; DeleteRecords) is retried with fresh metadata for up to
``FAILOVER_S``; readers and clients refresh metadata at least every ``METADATA_REFRESH_MS``.
So a commit or a read that meets a leader change completes within the election time plus a
few seconds. With fewer brokers up than ``min.insync.replicas`` (or no controller quorum),
a commit blocks, logging a warning every ``COMMIT_ATTEMPT_S``, and completes when a broker
returns; if none returns within the transaction timeout (``TRANSACTION_TIMEOUT_MS``) it
fails and the broker aborts it: a version is sealed entirely or not at all.

Kafka offsets are not dense: transaction markers and aborted records occupy offsets that
``read`` never returns. Nothing here assumes ``offset + 1`` is the next record.

Modules, one job each: ``config`` (the URL, librdkafka options, shared sizes and timeouts),
``calls`` (error translation, retries, ``failover``), ``admin`` (topics, metadata, offset
queries, DeleteRecords), ``writer`` (the transactional producer), ``reader`` (the pooled
consumers) and ``log`` (``KafkaLog``, which composes them). A timeout lives in the module
that reads it (patch it there).
"""

from eventlog.kafka.admin import CONNECT_TIMEOUT_S, list_runs
from eventlog.kafka.calls import FAILOVER_S
from eventlog.kafka.config import (
    DEFAULT_PREFIX,
    FETCH_MAX_BYTES,
    MAX_MESSAGE_BYTES,
    METADATA_REFRESH_MS,
    REQUEST_TIMEOUT_S,
    TOPIC_MAX_MESSAGE_BYTES,
    TRANSACTION_TIMEOUT_MS,
    KafkaSettings,
    redact,
)
from eventlog.kafka.log import KafkaLog
from eventlog.kafka.reader import MAX_READERS, READ_STALL_S
from eventlog.kafka.writer import COMMIT_ATTEMPT_S, QUEUE_FULL_S, VISIBLE_WAIT_S, KafkaWriter

__all__ = [
    "COMMIT_ATTEMPT_S", "CONNECT_TIMEOUT_S", "DEFAULT_PREFIX", "FAILOVER_S", "FETCH_MAX_BYTES",
    "MAX_MESSAGE_BYTES", "MAX_READERS", "METADATA_REFRESH_MS", "QUEUE_FULL_S", "READ_STALL_S",
    "REQUEST_TIMEOUT_S", "TOPIC_MAX_MESSAGE_BYTES", "TRANSACTION_TIMEOUT_MS", "VISIBLE_WAIT_S",
    "KafkaLog", "KafkaSettings", "KafkaWriter", "list_runs", "redact",
]
