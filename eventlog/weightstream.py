"""A run's weights stream, stored in its own partition of the run's log (``WEIGHTS``: the
topic ``<prefix>.<run>.weights`` on Kafka, its own rows and segment files in the embedded
database). The stream is derived from the log and never folded by a replay.

Each published version is one transaction: its chunks (``TensorDelta`` envelopes; see
``eventlog.weightcodec``), then its seal (a ``CommitSealed`` envelope). A version is
published iff its seal is committed, so a reader never sees half of one. The seal's fields
read as follows in this stream:

* ``encoding``: ``"keyframe <dtype>"`` or ``"patch <dtype>"``;
* ``base_version``: the published version a patch applies to (0 for a keyframe);
* ``shard_counts``: ``(chunks,)``, the version's chunk messages;
* ``control_count``: the chunk size in bytes the version's tensors are cut by;
* ``state_digest``: the digest of the cast weights (``weightcodec.weights_digest``);
* ``raw_bytes`` / ``encoded_bytes``: the cast weights' size and the chunks' payload size.

Envelopes carry ``gsn = version`` and ``shard = WEIGHTS``; chunk payloads are encrypted
under the active key when one is configured (bound to run, version and chunk).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from eventlog import crypto, serde
from eventlog.errors import CorruptMessageError, IntegrityError
from eventlog.events import CommitSealed, Envelope, TensorDelta
from eventlog.ports import WEIGHTS, EventLog, LogWriter, MessageStream

KEYFRAME, PATCH = "keyframe", "patch"
_ENCODINGS = (TensorDelta.FULL, TensorDelta.XOR)


@dataclass(frozen=True)
class PublishedVersion:
    """One sealed version of the stream, as its seal describes it."""

    version: int
    step: int
    kind: str
    dtype: str
    base_version: int
    chunks: int
    digest: bytes
    raw_bytes: int
    encoded_bytes: int
    #: The chunk size its tensors are cut by (``tensorcodec.chunk_ranges``).
    chunk_bytes: int
    #: Its records lie at offsets ``> start`` and ``< seal_offset``.
    start: int
    seal_offset: int
    time_ms: int

    @property
    def keyframe(self) -> bool:
        """Whether this version holds the full cast weights."""
        return self.kind == KEYFRAME


def _decode(stream: MessageStream, size: int, offset: int) -> Envelope:
    return serde.decode.from_stream(stream, size, f"weights stream offset {offset}")


class WeightsStream:
    """Reads and writes one run's weights stream on its ``EventLog``."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.where = f"weights stream of run {log.run_id!r}"

    def index(self, *, gt: int | None = None) -> list[PublishedVersion]:
        """Every version sealed after offset ``gt`` (from the stream's start: ``None``), oldest
        first. Chunk payloads are read but not decoded."""
        out: list[PublishedVersion] = []
        start = self.log.start_offset(WEIGHTS) - 1 if gt is None else gt
        for rec in self.log.scan_decoded(WEIGHTS, _decode, gt=gt, batch=self.log.scan_batch(WEIGHTS)):
            env: Envelope = rec.value
            if isinstance(env.body, CommitSealed):
                out.append(self._published(env, start, rec.offset))
                start = rec.offset
            elif not isinstance(env.body, TensorDelta):
                raise CorruptMessageError(f"{self.where}, offset {rec.offset}: a {env.kind} event "
                                          "has no place in a weights stream")
        return out

    def _published(self, env: Envelope, start: int, offset: int) -> PublishedVersion:
        seal = env.body
        assert isinstance(seal, CommitSealed)
        kind, _, dtype = seal.encoding.partition(" ")
        if kind not in (KEYFRAME, PATCH) or not dtype or len(seal.shard_counts) != 1 \
                or seal.shard_counts[0] < 0 or env.shard != WEIGHTS or seal.control_count < 16:
            raise CorruptMessageError(f"{self.where}, offset {offset}: damaged seal of version "
                                      f"{env.version} ({seal.encoding!r}, counts {list(seal.shard_counts)})")
        return PublishedVersion(env.version, env.step, kind, dtype, seal.base_version,
                                seal.shard_counts[0], seal.state_digest, seal.raw_bytes,
                                seal.encoded_bytes, seal.control_count, start, offset, env.time_ms)

    def chunks(self, v: PublishedVersion) -> Iterator[TensorDelta]:
        """The chunks of version ``v``, decrypted, each checked to belong to it; raises
        ``IntegrityError`` unless exactly ``v.chunks`` are found."""
        n = 0
        where = f"{self.where}, version {v.version}"
        scan = self.log.scan_decoded(WEIGHTS, _decode, gt=v.start, lte=v.seal_offset - 1,
                                     batch=self.log.scan_batch(WEIGHTS))
        for rec in scan:
            at = f"{where}, offset {rec.offset}"
            env = crypto.decrypt_event(rec.value, at)
            delta = env.body
            if not isinstance(delta, TensorDelta) or env.version != v.version or env.shard != WEIGHTS:
                raise CorruptMessageError(f"{at}: a {env.kind} event of version {env.version} among "
                                          f"the chunks of version {v.version}")
            if delta.encoding not in _ENCODINGS or (delta.encoding == TensorDelta.XOR
                                                     and delta.base_version != v.base_version):
                raise CorruptMessageError(f"{at}: chunk {delta.chunk_index} of {delta.name!r} is "
                                          f"{delta.encoding} against version {delta.base_version}, "
                                          f"the seal says {v.kind} against {v.base_version}")
            n += 1
            yield delta
        if n != v.chunks:
            raise IntegrityError(f"{where}: {n} chunks found, the seal names {v.chunks} "
                                 f"(offsets {v.start + 1}..{v.seal_offset - 1})")

    def publish(
        self, writer: LogWriter, version: int, step: int, kind: str, dtype: str, base_version: int,
        chunks: Sequence[TensorDelta], digest: bytes, raw_bytes: int, chunk_bytes: int,
    ) -> None:
        """Write one version, its chunks and its seal, in one transaction."""
        keys = crypto.keyring()
        now = int(time.time() * 1000)
        seal = CommitSealed(base_version, (len(chunks),), chunk_bytes, (), b"", digest,
                            f"{kind} {dtype}", raw_bytes, sum(len(c.payload) for c in chunks))

        def envelope(body: TensorDelta | CommitSealed) -> Envelope:
            return Envelope(self.log.run_id, version, version, step, WEIGHTS, writer.writer_id, now, body)

        with writer.transaction() as txn:
            for delta in chunks:
                env = envelope(delta)
                if keys is not None:
                    env = crypto.encrypt_event(env, keys)
                # No bulk hint: a reader gets each chunk as a copy it drops, not a view that
                # keeps a map of the whole segment file in the actor's memory.
                txn.append(WEIGHTS, serde.encode.in_parts(env)[0])
            txn.append(WEIGHTS, serde.encode(envelope(seal)))

    def truncate_before(self, v: PublishedVersion) -> None:
        """Delete everything published before version ``v``."""
        self.log.truncate_before(WEIGHTS, v.start + 1)

    def clear(self) -> None:
        """Delete the whole stream (to rebuild it)."""
        self.log.truncate_before(WEIGHTS, self.log.end_offset(WEIGHTS))


def check_chain(where: str, versions: Sequence[PublishedVersion]) -> None:
    """Fail unless ``versions`` (a keyframe, then patches) each apply to the one before."""
    for prev, v in zip(versions, versions[1:], strict=False):
        if v.kind == PATCH and v.base_version != prev.version:
            raise IntegrityError(
                f"{where}: the patch of version {v.version} applies to version {v.base_version}, "
                f"which the stream does not hold (the version before it is {prev.version})")

