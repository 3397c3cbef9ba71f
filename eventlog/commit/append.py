"""Events into an open log transaction: the envelope, encryption, serialization and the append.

Every event a writer puts in the log goes through ``EventAppender``: a version's tensor
chunks and seal, a multi-rank part, the environment fingerprint and resume proof
(``append_control``), and the snapshotter's markers. Encryption is applied to each event
here; an event with no secret field (a seal, a marker: ids, offsets and digests) passes
``crypto.encrypt_event`` unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from eventlog import crypto, serde
from eventlog.events import CONTROL_SHARD, Body, Envelope
from eventlog.ports import CONTROL, Coordinator, LogTransaction, LogWriter


class EventAppender:
    """Appends events to ``txn`` as events of ``version`` and ``step``, with consecutive gsns
    from ``first``; counts the events of each of the ``shards`` tensor shards."""

    def __init__(self, txn: LogTransaction, run_id: str, writer: str, version: int, step: int, first: int,
                 shards: int = 0, serialize: serde.EnvelopeSerializer = serde.encode) -> None:
        self._txn, self._run_id, self._writer = txn, run_id, writer
        self._version, self._step, self._serialize = version, step, serialize
        #: The first event's gsn, and the gsn the next event gets.
        self.first = self.gsn = first
        self.shard_counts = [0] * shards
        self._now = int(time.time() * 1000)
        self._keys = crypto.keyring()

    def __call__(self, shard: int, body: Body) -> None:
        env = Envelope(self._run_id, self.gsn, self._version, self._step,
                       CONTROL_SHARD if shard == CONTROL else shard, self._writer, self._now, body)
        if self._keys is not None:
            env = crypto.encrypt_event(env, self._keys)
        data, bulk_at = self._serialize.in_parts(env)
        self._txn.append(shard, data, bulk_at=bulk_at)
        if shard != CONTROL:
            self.shard_counts[shard] += 1
        self.gsn += 1


def append_control(writer: LogWriter, coord: Coordinator, run_id: str, writer_name: str,
                   version: int, step: int, bodies: Sequence[Body]) -> int:
    """Write ``bodies`` to the control partition in one transaction, as events of ``version``
    with fresh gsns from ``coord``; returns the last gsn used."""
    first = coord.allocate_gsns(run_id, len(bodies))
    with writer.transaction() as txn:
        append = EventAppender(txn, run_id, writer_name, version, step, first)
        for body in bodies:
            append(CONTROL, body)
    return append.gsn - 1
