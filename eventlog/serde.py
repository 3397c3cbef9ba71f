"""Avro single-object encoding of envelopes: ``C3 01``, 8-byte CRC-64-AVRO fingerprint, body.

Any Avro implementation can decode these messages with the ``.avsc`` files alone. Old
schema versions are resolved to the current one, so old logs stay readable.
"""

from __future__ import annotations

import dataclasses
import io
from typing import IO, Any, cast

import fastavro

import schemas
from eventlog.errors import CorruptMessageError, RewindError, UnknownSchemaError
from eventlog.events import Envelope, TensorDelta
from eventlog.ports import MessageStream

MAGIC = b"\xc3\x01"
HEADER_BYTES = 10


class EnvelopeSerializer:
    """Encodes envelopes with the current schema; a callable ``(envelope) -> bytes``."""

    def __init__(self, version: int = schemas.SCHEMA_VERSION) -> None:
        self._schema = schemas.load(version)
        self._header = MAGIC + self._schema.fingerprint
        self._bulk_last: dict[bool, bool] = {}  # plaintext? -> the payload's place checked

    def __call__(self, envelope: Envelope) -> bytes:
        buf = io.BytesIO()
        buf.write(self._header)
        fastavro.schemaless_writer(buf, self._schema.parsed, envelope.to_avro())
        return buf.getvalue()

    def with_bulk(self, envelope: Envelope) -> tuple[bytes, int | None]:
        """The message, and where its bulk field (a tensor chunk's payload) begins in it
        (``None`` for an event without one)."""
        parts, at = self.in_parts(envelope)
        return parts[0] if len(parts) == 1 else b"".join(parts), at

    def in_parts(self, envelope: Envelope) -> tuple[tuple[bytes, ...], int | None]:
        """The message as consecutive parts, and where its bulk field begins (``None``: one
        part, no bulk field): for ``LogTransaction.append``.

        A tensor chunk's message is ``(head, payload, tail)``, the payload the very bytes
        object the codec made: a multi-MiB payload is then written out without first being
        copied into one buffer (twice: Avro's output stream, then its value)."""
        body = envelope.body
        if self._schema.version != schemas.SCHEMA_VERSION or not isinstance(body, TensorDelta) \
                or not body.payload:
            return (self(envelope),), None
        payload = body.payload
        hollow = self(dataclasses.replace(envelope, body=dataclasses.replace(body, payload=b"")))
        tail = _optional_string(envelope.key_id)
        at = len(hollow) - len(tail) - 1  # the empty payload's length, a single 0
        if not self._payload_is_last(envelope, body, hollow, at):
            return (self(envelope),), None  # not where the schema puts it: no hint, rather than a wrong one
        head = hollow[:at] + _varint(len(payload))
        return (head, payload, tail), len(head)

    def _payload_is_last(self, envelope: Envelope, body: TensorDelta, hollow: bytes, at: int) -> bool:
        """Whether the payload's encoding sits at ``at`` of ``hollow`` (the message with an
        empty payload), with only the envelope's key id after it: checked once for plaintext
        and once for encrypted chunks, by encoding a one-byte payload and finding it there."""
        kind = envelope.key_id is None
        known = self._bulk_last.get(kind)
        if known is None:
            one = self(dataclasses.replace(envelope, body=dataclasses.replace(body, payload=b"\x01")))
            known = at >= HEADER_BYTES and hollow[at] == 0 \
                and one == hollow[:at] + b"\x02\x01" + hollow[at + 1:]
            self._bulk_last[kind] = known
        return known


def _optional_string(value: str | None) -> bytes:
    """The Avro encoding of a ``["null", "string"]`` union."""
    if value is None:
        return b"\x00"
    raw = value.encode()
    return b"\x02" + _varint(len(raw)) + raw


def _varint(n: int) -> bytes:
    """An Avro long (zigzag, then base-128 little-endian)."""
    z, out = (n << 1) ^ (n >> 63), bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


class EnvelopeDeserializer:
    """Decodes single-object messages of any known schema version; ``(bytes, where) -> Envelope``."""

    def __init__(self) -> None:
        self._known = schemas.by_fingerprint()
        # The very object ``_known`` holds, so that ``writer is self._current`` below holds
        # for current messages: ``schemas.load()`` and ``load(3)`` are equal but distinct,
        # and fastavro then resolved every current message against its own schema.
        self._current = self._known[schemas.load().fingerprint]

    def __call__(self, data: bytes, where: str = "message") -> Envelope:
        return self.from_stream(io.BytesIO(data), len(data), where)

    def from_stream(self, stream: MessageStream, size: int, where: str = "message") -> Envelope:
        """Decode one ``size``-byte message read from ``stream`` (at its start). fastavro
        reads a ``bytes`` field, such as a tensor chunk's payload, in one ``read`` call and
        keeps the object it gets: a stream that serves that read from its store saves a
        copy of the whole message (``EventLog.read_decoded``)."""
        head = stream.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES or head[:2] != MAGIC:
            raise CorruptMessageError(
                f"{where}: not an Avro single-object message (got {bytes(head[:2]).hex() or 'nothing'},"
                f" want c301, {size} bytes)"
            )
        fp = bytes(head[2:HEADER_BYTES])
        writer = self._known.get(fp)
        if writer is None:
            raise UnknownSchemaError(
                f"{where}: unknown schema fingerprint {fp.hex()}; known: "
                + ", ".join(f"v{s.version}={s.fingerprint.hex()}" for s in self._known.values())
            )
        reader = None if writer is self._current else self._current.parsed
        try:
            record: Any = fastavro.schemaless_reader(  # any object with read() will do
                cast(IO[bytes], stream), writer.parsed, reader, return_record_name=True
            )
            envelope = Envelope.from_avro(record)
        except RewindError:
            raise  # the stream's own failure (a store error), not the message's
        except Exception as exc:  # fastavro raises many kinds on garbage: normalise them
            raise CorruptMessageError(f"{where}: corrupt Avro body ({type(exc).__name__}: {exc})") from exc
        if stream.tell() != size:
            raise CorruptMessageError(
                f"{where}: {size - stream.tell()} trailing bytes after the Avro body"
            )
        if envelope.version < 0 or envelope.gsn < 0:  # counted from 0: only damage makes these
            raise CorruptMessageError(f"{where}: version {envelope.version}, gsn {envelope.gsn}: "
                                      "neither is ever negative")
        return envelope


encode = EnvelopeSerializer()
decode = EnvelopeDeserializer()
