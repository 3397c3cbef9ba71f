"""``KafkaLog``: a run's ``EventLog`` on Kafka, composed of the cluster requests
(``admin``), the transactional writers (``writer``) and the pooled readers (``reader``)."""

from __future__ import annotations

import threading

from eventlog.errors import EventLogError, RunNotFoundError
from eventlog.kafka.admin import (
    Watermarks,
    admin_client,
    create_topics,
    delete_records,
    first_contact,
    partition_counts,
    topic_names,
    wait_for_topics,
)
from eventlog.kafka.config import (
    WEIGHTS_READ_AHEAD_BYTES,
    WEIGHTS_SCAN_BATCH,
    KafkaSettings,
    consumer_config,
)
from eventlog.kafka.reader import MAX_READERS, Reader, ReaderPool
from eventlog.kafka.writer import KafkaWriter
from eventlog.ports import CONTROL, WEIGHTS, EventLog, LogWriter, Record


class KafkaLog(EventLog):
    """A run's log on Kafka: a 1-partition control topic and an S-partition tensors topic
    (and, once published, the 1-partition weights topic ``<prefix>.<run>.weights``)."""

    def __init__(self, url: str, run_id: str) -> None:
        self.settings = KafkaSettings(url)
        self.url, self.run_id = self.settings.redacted_url, run_id
        self.control_topic, self.tensors_topic = topic_names(self.settings.prefix, run_id)
        self.weights_topic = f"{self.settings.prefix}.{run_id}.weights"
        self._weights_created = False
        self._admin = admin_client(self.settings)
        first_contact(self._admin, self.settings, self.control_topic)
        self._shards: int | None = None  # known once the topics exist (they never shrink)
        self._created = False
        self._lock = threading.Lock()
        conf = consumer_config(self.settings)
        self._readers = ReaderPool(lambda: Reader(conf), MAX_READERS)
        # Weights followers hold only a model: their reads keep little read-ahead, and one
        # consumer (a librdkafka instance with its threads and buffers) serves every pass over
        # a version, seeking back, instead of a new one per pass.
        weights_conf = consumer_config(self.settings, read_ahead=WEIGHTS_READ_AHEAD_BYTES)
        self._weights_readers = ReaderPool(lambda: Reader(weights_conf), 1)
        self._offsets = Watermarks(conf)
        # Per partition, the last offset range a read found holding only transaction markers
        # and aborted records (a scan's final read usually asks for exactly that range).
        self._gaps: dict[tuple[str, int], tuple[int, int]] = {}

    def scan_batch(self, partition: int) -> int:
        return WEIGHTS_SCAN_BATCH if partition == WEIGHTS else super().scan_batch(partition)

    def locate(self, partition: int, *, produce: bool = False) -> tuple[str, int]:
        """The topic and Kafka partition of a log partition; ``produce``: also check that the
        partition exists, so that a writer fails now rather than in a delivery report at commit."""
        if partition == CONTROL:
            return self.control_topic, 0
        if partition == WEIGHTS:
            return self.weights_topic, 0
        if partition < 0:
            raise EventLogError(f"run {self.run_id!r} has no partition {partition}")
        if produce:
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
                create_topics(self._admin, self.settings, missing, want, what)
                have = wait_for_topics(self._admin, self.settings, want, what)
            for topic, n in want.items():
                if have[topic] != n:
                    raise EventLogError(
                        f"run {self.run_id!r} exists with {have[topic]} partitions in {topic}, "
                        f"not {n}" + (" (shards)" if topic == self.tensors_topic else "")
                    )
            # Also when another process created them a moment ago (rank 0 of a group).
            self._offsets.wait_placed([(t, kp) for t, n in want.items() for kp in range(n)], what)
            self._shards, self._created = shards, True

    def create_weights(self) -> None:
        """Create the weights topic (one partition) if missing; the run must exist."""
        with self._lock:
            if self._weights_created:
                return
        if self.shard_count() is None:
            raise RunNotFoundError(f"run {self.run_id!r} is not on {self.settings.bootstrap}")
        what = f"creating the weights topic of run {self.run_id!r} on {self.settings.bootstrap}"
        want = {self.weights_topic: 1}
        have = partition_counts(self._admin, (self.weights_topic,), what)
        if have[self.weights_topic] is None:
            create_topics(self._admin, self.settings, [self.weights_topic], want, what)
            have = wait_for_topics(self._admin, self.settings, want, what)
        if have[self.weights_topic] != 1:
            raise EventLogError(f"{self.weights_topic} has {have[self.weights_topic]} partitions, not 1")
        self._offsets.wait_placed([(self.weights_topic, 0)], what)
        with self._lock:
            self._weights_created = True

    def _counts(self, what: str) -> dict[str, int | None]:
        return partition_counts(self._admin, (self.control_topic, self.tensors_topic), what)

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
        return KafkaWriter(self, writer_id)

    def read(
        self, partition: int, *, gt: int | None = None, lte: int | None = None,
        limit: int | None = None,
    ) -> list[Record]:
        """Committed records with ``gt < offset <= lte``, up to the last stable offset now."""
        topic, kp = self.locate(partition)
        if limit is not None and limit <= 0:
            return []
        first = None if gt is None else gt + 1
        marks = self._offsets.marks(topic, kp)
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
        with self._pool(partition).borrow(topic, kp, start) as reader:
            out = reader.fetch(partition, topic, kp, start, stop, limit)
            if reader.gap[1] > reader.gap[0]:
                self._gaps[(topic, kp)] = reader.gap
            return out

    def describe_reads(self, partition: int) -> str:
        topic, kp = self.locate(partition)
        return (f"{topic} [{kp}]: low watermark and last stable offset {self._offsets.marks(topic, kp)}, "
                f"cached empty range {self._gaps.get((topic, kp))}, idle readers "
                f"{self._pool(partition).describe(topic, kp) or 'none assigned to it'}")

    def forget_reads(self, partition: int) -> None:
        """Forget the empty range cached for ``partition`` and close its idle readers."""
        topic, kp = self.locate(partition)
        self._gaps.pop((topic, kp), None)
        self._pool(partition).drop(topic, kp)

    def _pool(self, partition: int) -> ReaderPool:
        return self._weights_readers if partition == WEIGHTS else self._readers

    def _watermarks(self, partition: int, within: float | None = None) -> tuple[int, int]:
        topic, kp = self.locate(partition)
        return self._offsets.marks(topic, kp, within) or (0, 0)

    def end_offset(self, partition: int, *, within: float | None = None) -> int:
        """The last stable offset: the committed end (past any trailing transaction marker).
        Waits out a leader change for at most ``within`` seconds (``FAILOVER_S``)."""
        return self._watermarks(partition, within)[1]

    def start_offset(self, partition: int) -> int:
        """The low watermark: records below it were deleted."""
        return self._watermarks(partition)[0]

    def truncate_before(self, partition: int, offset: int) -> None:
        """Delete records below ``offset`` (clamped to the committed end) with DeleteRecords."""
        topic, kp = self.locate(partition)
        low, high = self._watermarks(partition)
        target = min(offset, high)
        if target <= low:
            return
        delete_records(self._admin, topic, kp, target)

    def close(self) -> None:
        """Close the cached consumers (writers are closed by whoever opened them)."""
        self._readers.close()
        self._weights_readers.close()
        self._offsets.close()
