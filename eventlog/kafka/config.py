"""A ``kafka://`` URL parsed: the servers, Rewind's options, and librdkafka's config per client.

``prefix`` and ``replication`` are ours; every other query parameter goes to librdkafka as
is (TLS, SASL), ``producer.<key>``, ``consumer.<key>`` and ``admin.<key>`` to that client
only. ``REWIND_KAFKA_CONF_<KEY>`` environment variables supply keys the URL does not set.
Also the sizes and timeouts every part of the backend agrees on, and its logger.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from confluent_kafka import KafkaError, Message

from eventlog.errors import ConfigError
from eventlog.settings import deployment

logger = logging.getLogger("rewind.kafka")
# librdkafka's own log lines (a refused connection logs FAIL every second) reach this logger;
# an application that sets up logging sees them, one that does not is not flooded by them.
logger.addHandler(logging.NullHandler())

DEFAULT_PREFIX = "rewind"
#: Largest message a writer produces (value + envelope). A 4 MiB chunk is far below it; the
#: headroom is for ``REWIND_CHUNK_BYTES`` raised up to ~12-15 MiB.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: The topics' ``max.message.bytes``: a record batch holding one maximal message also carries
#: the batch and record headers, so the topic allows a little more than the producer sends.
TOPIC_MAX_MESSAGE_BYTES = MAX_MESSAGE_BYTES + 256 * 1024
#: One fetch response may hold two maximal messages; the socket must take the whole response.
FETCH_MAX_BYTES = 2 * TOPIC_MAX_MESSAGE_BYTES
#: Read-ahead of the weights stream's consumers: one default stream chunk
#: (``WeightsConfig.chunk_bytes``). librdkafka's defaults (a 64 MiB queue plus the fetch in
#: flight) would cost a follower that holds only a small model more than the model.
WEIGHTS_READ_AHEAD_BYTES = 4 * 1024 * 1024
#: Records per read of the weights stream: a follower holds two chunks, not a keyframe's worth.
WEIGHTS_SCAN_BATCH = 2
#: A transaction must commit within this (the broker aborts it after). It also bounds how long
#: ``read_committed`` readers stall behind a crashed writer's open transaction.
TRANSACTION_TIMEOUT_MS = 120_000
#: Bound on one blocking librdkafka call (metadata, watermarks, admin requests).
REQUEST_TIMEOUT_S = 10.0
#: Clients re-read the metadata of the topics they use at least this often (librdkafka's
#: default: 5 minutes), so a leader change that no failed request revealed is seen in seconds.
METADATA_REFRESH_MS = 5_000

ROLES = ("producer", "consumer", "admin")
# Settings the log's guarantees rest on (fencing, exactly-once, visibility): not overridable.
PINNED = {
    "transactional.id", "enable.idempotence", "acks", "isolation.level", "enable.auto.commit",
    "enable.auto.offset.store", "enable.partition.eof", "group.id", "on_delivery", "error_cb",
    "logger",
}
TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
_SECRET_KEY = re.compile(r"password|secret|token|key\.pem|credentials", re.IGNORECASE)


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
        # The environment first, so that the URL wins.
        options = dict(deployment().kafka_conf)
        options.update(parse_qsl(query, keep_blank_values=True))
        self.prefix = options.pop("prefix", DEFAULT_PREFIX)
        if not self.prefix or not TOPIC_NAME.match(self.prefix):
            raise ConfigError(f"Kafka topic prefix {self.prefix!r} may only use [A-Za-z0-9._-]")
        raw_rf = options.pop("replication", "")
        try:
            self.replication: int | None = int(raw_rf) if raw_rf else None
        except ValueError:
            raise ConfigError(f"replication={raw_rf!r} in the Kafka URL is not a number") from None
        if self.replication is not None and self.replication < 1:
            raise ConfigError(f"replication={raw_rf} in the Kafka URL must be >= 1")
        self.common: dict[str, str] = {}
        self.by_role: dict[str, dict[str, str]] = {r: {} for r in ROLES}
        for key, value in options.items():
            role, dot, sub = key.partition(".")
            if (sub if dot and role in ROLES else key) in PINNED:
                raise ConfigError(f"Kafka setting {key!r} is set by Rewind and cannot be changed")
            if dot and role in ROLES:
                self.by_role[role][sub] = value
            else:
                self.common[key] = value
        self.redacted_url = redact(url)

    def config(self, role: str, **ours: Any) -> dict[str, Any]:
        """librdkafka config for one client: our settings, then the user's (which win, except
        for the pinned ones)."""
        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap,
            "logger": logger,
            # Small requests (commits, watermarks) would otherwise wait on Nagle's algorithm.
            "socket.nagle.disable": True,
            "topic.metadata.refresh.interval.ms": METADATA_REFRESH_MS,
            "metadata.max.age.ms": 3 * METADATA_REFRESH_MS,
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


def producer_config(
    settings: KafkaSettings, transactional_id: str,
    on_delivery: Callable[[KafkaError | None, Message], None], on_error: Callable[[KafkaError], None],
) -> dict[str, Any]:
    """librdkafka config of a writer's idempotent transactional producer."""
    return settings.config(
        "producer",
        **{
            "transactional.id": transactional_id,
            "enable.idempotence": True,
            "acks": "all",
            "message.max.bytes": MAX_MESSAGE_BYTES,
            # Chunks are already zstd-compressed; compressing again only costs CPU.
            "compression.type": "none",
            "linger.ms": 2,
            "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS,
            # Bounds librdkafka's copy of queued messages; a full queue is backpressure.
            "queue.buffering.max.kbytes": 256 * 1024,
            "on_delivery": on_delivery,
            "error_cb": on_error,
        },
    )


def consumer_config(settings: KafkaSettings, *, read_ahead: int | None = None) -> dict[str, Any]:
    """librdkafka config of a ``read_committed`` consumer that is only ever assigned partitions;
    ``read_ahead``: at most about that many bytes fetched or queued ahead of the reader."""
    bounded = {} if read_ahead is None else {
        "fetch.max.bytes": read_ahead,
        # A larger record batch is still returned whole (KIP-74): the bound never stalls a read.
        "max.partition.fetch.bytes": read_ahead,
        "queued.max.messages.kbytes": max(1, read_ahead // 1024),
        # A full queue postpones the next fetch by this much (librdkafka: 1 s), not longer
        # than the reader takes to consume a chunk.
        "fetch.queue.backoff.ms": 10,
    }
    return settings.config(
        "consumer",
        **{
            # Required by librdkafka even though we only assign() and never commit.
            "group.id": f"{settings.prefix}.reader",
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
            **bounded,
        },
    )
