"""The fast read paths keep the old semantics: blob reads of the embedded log, in-place
decode, and the zero-copy snapshot shard loader (which validates the header itself)."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from eventlog import CorruptMessageError, CorruptStoreError, serde
from eventlog import tensorcodec as tc
from eventlog.embedded import EmbeddedLog
from eventlog.events import Envelope, TensorDelta
from eventlog.fold.apply import ShardState
from eventlog.fold.bits import TensorBits
from eventlog.ports import CONTROL
from snapshotter.store import SnapshotCorruptError, load_shard_file, shard_file_bytes

# ------------------------------------------------------------------ embedded log blob reads


def _filled(path: Path, run: str = "r") -> EmbeddedLog:
    log = EmbeddedLog(f"sqlite://{path}", run)
    log.create(1)
    w = log.writer("w")
    for i in range(12):
        with w.transaction() as txn:
            txn.append(0, bytes([i]) * (i * 1000))  # includes an empty value
            txn.append(CONTROL, f"c{i}".encode())
    w.close()
    return log


def test_blob_reads_match_plain_selects(tmp_path: Path) -> None:
    log = _filled(tmp_path / "a.db")
    db = sqlite3.connect(tmp_path / "a.db")
    want = [(o, bytes(v)) for o, v in db.execute(
        "SELECT offset, value FROM records WHERE partition=0 ORDER BY offset")]
    got = [(r.offset, r.value) for r in log.read(0)]
    assert got == want and got[0][1] == b""
    assert all(type(r.value) is bytes for r in log.read(0))
    assert [r.offset for r in log.read(0, gt=3, lte=7)] == [4, 5, 6, 7]
    assert [r.offset for r in log.read(0, gt=3, limit=2)] == [4, 5]
    assert log.read(0, gt=11) == [] and log.read(0, lte=-1) == []
    assert [r.offset for r in log.scan(0, batch=5)] == list(range(12))
    assert not log._db.conn().in_transaction  # the read transaction was closed
    log.truncate_before(0, 6)  # writes still work on the reading thread's connection
    assert [r.offset for r in log.read(0)] == list(range(6, 12))
    log.close()


def _chunk_message(payload: bytes) -> bytes:
    """A real encoded message of one raw GRAD chunk carrying ``payload``."""
    n = len(payload) // 4
    delta = TensorDelta("w", "float32", (n,), 0, 1, 0, len(payload), TensorDelta.GRAD, "none", 0,
                        tc.digest(payload), payload)
    return serde.encode(Envelope("r", 1, 1, 1, 0, "w", 0, delta))


def test_decoding_from_a_blob_reads_the_payload_in_one_piece(tmp_path: Path) -> None:
    """The embedded log's decoded reads give the same event as decoding the whole record."""
    payload = np.random.default_rng(0).bytes(1 << 20)
    log = EmbeddedLog(f"sqlite://{tmp_path / 'd.db'}", "r")
    log.create(1)
    w = log.writer("w")
    with w.transaction() as txn:
        txn.append(0, _chunk_message(payload))
    w.close()
    (got,) = log.read_decoded(0, lambda stream, size, offset: serde.decode.from_stream(stream, size))
    assert got.value == serde.decode(log.read(0)[0].value) and got.value.body.payload == payload
    log.close()


class _FailingBlob:
    """A blob whose reads past its first ``good`` bytes fail as a damaged file's would."""

    def __init__(self, data: bytes, good: int) -> None:
        self._data, self._good, self._pos = data, good, 0

    def __len__(self) -> int:
        return len(self._data)

    def seek(self, pos: int) -> None:
        self._pos = pos

    def read(self, n: int) -> bytes:
        if self._pos + n > self._good:
            raise sqlite3.DatabaseError("database disk image is malformed")
        self._pos += n
        return self._data[self._pos - n:self._pos]


def test_a_store_error_while_decoding_a_payload_names_the_file(tmp_path: Path) -> None:
    """A large payload is read from SQLite inside fastavro's decode: SQLite's error there is
    the store's (it names the database file), not a corrupt message."""
    from eventlog.embedded.reader import BlobStream

    message = _chunk_message(bytes(1 << 20))
    log = EmbeddedLog(f"sqlite://{tmp_path / 'e.db'}", "r")
    stream = BlobStream.over(_FailingBlob(message, 4096), log._db)  # type: ignore[arg-type]
    with pytest.raises(CorruptStoreError) as info:
        serde.decode.from_stream(stream, len(message), "msg-under-test")
    assert str(tmp_path / "e.db") in str(info.value) and "malformed" in str(info.value)
    log.close()


def test_reads_of_a_without_rowid_file_still_work(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE records (run TEXT, partition INTEGER, offset INTEGER, "
               "value BLOB NOT NULL, PRIMARY KEY (run, partition, offset)) WITHOUT ROWID")
    db.execute("INSERT INTO records VALUES ('r', 0, 0, x'0102')")
    db.commit()
    db.close()
    log = EmbeddedLog(f"sqlite://{path}", "r")
    assert [(r.offset, r.value) for r in log.read(0)] == [(0, b"\x01\x02")]
    log.close()


def test_blob_reads_in_threads_while_a_writer_appends(tmp_path: Path) -> None:
    log = _filled(tmp_path / "c.db")
    w = log.writer("w2")
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            for _ in range(30):
                recs = log.read(0)
                offsets = [r.offset for r in recs]
                assert offsets == list(range(len(offsets)))
                assert all(r.value == bytes([r.offset % 256]) * (r.offset * 1000)
                           for r in recs if r.offset < 12)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for _ in range(12, 40):
        with w.transaction() as txn:
            txn.append(0, b"x" * 100)
    for t in threads:
        t.join()
    w.close()
    assert errors == []
    log.close()


# ------------------------------------------------------------------ in-place decode


def _chunks(new: np.ndarray, prev: np.ndarray | None) -> list[TensorDelta]:
    out = tc.encode_tensor(new, prev, typesize=4, base_version=1, chunk_bytes=64 * 1024)
    return [c.to_delta("t", "float32", (len(new) // 4,)) for c in out]


def test_decode_in_place_is_exact_and_a_bad_digest_changes_nothing() -> None:
    rng = np.random.default_rng(1)
    prev = rng.standard_normal(100_000).astype(np.float32)
    new = prev + rng.standard_normal(100_000).astype(np.float32) * 1e-4
    pb, nb = prev.view(np.uint8), new.view(np.uint8)
    deltas = _chunks(nb, pb)
    assert {d.encoding for d in deltas} >= {TensorDelta.XOR}
    bits = pb.copy()
    for d in deltas:
        tc.decode_chunk(d, bits, "x")
    assert np.array_equal(bits, nb)
    for enc_new, base in ((nb, pb), (nb, None)):  # an XOR chunk, then a FULL one
        d = _chunks(enc_new, base)[1]
        bad = dataclasses.replace(d, digest=bytes(16))
        bits = pb.copy()
        with pytest.raises(CorruptMessageError, match="digest"):
            tc.decode_chunk(bad, bits, "x")
        assert np.array_equal(bits, pb)  # left exactly as it was


def test_decode_threads_do_not_share_scratch() -> None:
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(300_000).astype(np.float32).view(np.uint8) for _ in range(4)]
    deltas = [_chunks(a, None) for a in arrays]
    outs = [np.zeros_like(a) for a in arrays]

    def run(i: int) -> None:
        for _ in range(5):
            for d in deltas[i]:
                tc.decode_chunk(d, outs[i], "x")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(o, a) for o, a in zip(outs, arrays, strict=True))


# ------------------------------------------------------------------ zero-copy shard load


def _shard(**tensors: torch.Tensor) -> ShardState:
    return ShardState(0, {
        n: TensorBits(tc.dtype_name(t.dtype), tuple(t.shape), tc.tensor_bits(t).copy()
                      if t.numel() else np.empty(0, np.uint8))
        for n, t in tensors.items()
    })


def _buffer(data: bytes) -> np.ndarray:
    return np.frombuffer(bytearray(data), dtype=np.uint8)


def test_shard_load_is_bit_exact_for_every_dtype_and_views_one_buffer() -> None:
    tensors = {
        "f32": torch.randn(33, 7), "f64": torch.randn(5, dtype=torch.float64),
        "f16": torch.randn(9, dtype=torch.float16), "bf16": torch.randn(3, 3).bfloat16(),
        "i8": torch.arange(-5, 6, dtype=torch.int8), "i16": torch.arange(7, dtype=torch.int16),
        "i32": torch.arange(11, dtype=torch.int32), "i64": torch.arange(3, dtype=torch.int64),
        "u8": torch.arange(13, dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(4, dtype=torch.complex64), "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    data = shard_file_bytes(_shard(**tensors))
    ref = safetensors.torch.load(data)
    for loaded in (load_shard_file(data, 0, "w"), load_shard_file(_buffer(data), 0, "w")):
        assert set(loaded) == set(tensors)
        for name, t in loaded.items():
            want = ref[name]
            assert t.dtype == str(want.dtype).removeprefix("torch.") and t.shape == tuple(want.shape)
            assert t.bits.tobytes() == tc.tensor_bits(want).tobytes()
            assert t.bits.flags.writeable
    buf = _buffer(data)
    loaded = load_shard_file(buf, 0, "w")
    loaded["f32"].bits[:4] = 0  # a view: the fold XORs into the loaded buffer in place
    start = 8 + int.from_bytes(data[:8], "little")
    assert np.shares_memory(loaded["f32"].bits, buf) and start < len(buf)


def _forged(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize("header, data, match", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "outside"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12"),
    ({"a": {"dtype": "XX", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, "not supported"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "overlap"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "gap"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, "cover"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "shape"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4, "offsets"),
    ({"a": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 4]}}, b"\0" * 4,
     "bytes allowed"),
    ({"a": [1]}, b"", "invalid"),
    ({"__metadata__": {"x": 1}}, b"", "metadata"),
])
def test_forged_shard_headers_are_refused(header: dict, data: bytes, match: str) -> None:
    for raw in (_forged(header, data), _buffer(_forged(header, data))):
        with pytest.raises(CorruptMessageError, match=match):
            load_shard_file(raw, 0, "w")


@pytest.mark.parametrize("raw", [
    b"", b"\x01\x02", struct.pack("<Q", 1 << 60) + b"{}", struct.pack("<Q", 4) + b"nope",
    struct.pack("<Q", 2) + b"[]", struct.pack("<Q", 16) + b'{"a":1, "a":2}  ',
])
def test_damaged_shard_files_are_refused(raw: bytes) -> None:
    with pytest.raises(SnapshotCorruptError):
        load_shard_file(raw, 0, "w")
