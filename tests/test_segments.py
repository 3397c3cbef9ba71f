"""The embedded log's segment files: tensor chunks kept out of SQLite, read through maps.

What a user would notice: the bytes come back exact, through every read path; a payload is
a view of the file, aligned for vector loads (no copy); a writer SIGKILLed mid-transaction
loses nothing committed and leaves nothing visible; a damaged or missing file is named; a
truncated log gives its disk space back; a file written before segments still reads.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from eventlog import CorruptStoreError, TruncatedHistoryError, serde
from eventlog import tensorcodec as tc
from eventlog.embedded import EmbeddedLog, segments
from eventlog.events import Envelope, TensorDelta
from eventlog.ports import CONTROL
from eventlog.settings import Settings, override

ROOT = Path(__file__).resolve().parents[1]


def _envelope(payload: bytes, key_id: str | None = None) -> Envelope:
    delta = TensorDelta("w", "float32", (len(payload) // 4,), 0, 1, 0, len(payload), TensorDelta.GRAD,
                        "none", 0, tc.digest(payload), payload)
    return Envelope("r", 1, 1, 1, 0, "w", 0, delta, key_id)


def _append(log: EmbeddedLog, payloads: list[bytes], writer: str = "w") -> None:
    w = log.writer(writer)
    for p in payloads:
        with w.transaction() as txn:
            parts, bulk_at = serde.encode.in_parts(_envelope(p))  # as the recorder appends
            txn.append(0, parts, bulk_at=bulk_at)
            txn.append(CONTROL, b"small")
    w.close()


def _payload(i: int, n: int = 40_000) -> bytes:
    return np.random.default_rng(i).bytes(n)


def _decode(stream, size, offset):  # type: ignore[no-untyped-def]
    return serde.decode.from_stream(stream, size, f"offset {offset}")


def _segment_files(db: Path) -> list[str]:
    return sorted(p.name for p in Path(f"{db}.segments").rglob("*.seg"))


@pytest.mark.parametrize("key_id", [None, "key-1"])
def test_the_bulk_offset_is_where_the_payload_is(key_id: str | None) -> None:
    payload = _payload(0, 4096)
    data, at = serde.encode.with_bulk(_envelope(payload, key_id))
    assert at is not None and data[at:at + len(payload)] == payload
    assert serde.encode.with_bulk(Envelope("r", 1, 1, 1, -1, "w", 0, _envelope(b"").body))[1] is None
    parts, at = serde.encode.in_parts(_envelope(payload, key_id))
    assert b"".join(parts) == serde.encode(_envelope(payload, key_id)) == data
    assert parts[1] is payload and at == len(parts[0])  # written as it is, never copied


def test_a_message_in_parts_is_written_whole_through_short_writes(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``pwritev`` may write less than asked: the rest of each part follows, in order."""
    real = os.pwritev

    def short(fd: int, buffers: list[memoryview], offset: int) -> int:
        return real(fd, [bytes(b"".join(buffers)[:7])], offset)

    monkeypatch.setattr(segments.os, "pwritev", short)
    parts = (b"head-bytes", _payload(3, 100), b"", b"tail")
    appender = segments.Appender(tmp_path, 1 << 20)
    name, pos = appender.append(None, 0, 0, parts, len(parts[0]))
    appender.flush()
    appender.close()
    assert (tmp_path / name).read_bytes()[pos:] == b"".join(parts)


def test_a_chunk_lives_in_a_segment_file_and_is_read_as_an_aligned_view(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    payloads = [_payload(i, 4 * (1000 + 37 * i)) for i in range(5)]
    _append(log, payloads)
    # SQLite holds no chunk bytes; the control records stay in it.
    sizes = sqlite3.connect(db).execute(
        "SELECT partition, length(value) FROM records ORDER BY partition, offset").fetchall()
    assert sizes == [(-1, 5)] * 5 + [(0, 0)] * 5
    assert _segment_files(db) == ["p0-00000000000000000000.seg"]
    # Every read path gives back the exact message.
    want = [serde.encode(_envelope(p)) for p in payloads]
    assert [r.value for r in log.read(0)] == want
    assert [r.value for r in log.scan(0, batch=2)] == want
    decoded = list(log.scan_decoded(0, _decode, batch=1))
    assert [d.value.body.payload for d in decoded] == payloads
    assert [d.size for d in decoded] == [len(m) for m in want]
    for d in decoded:
        payload = d.value.body.payload
        assert isinstance(payload, memoryview) and payload.readonly
        assert np.frombuffer(payload, np.uint8).ctypes.data % 64 == 0
    log.close()


def test_a_payload_of_a_huge_page_or_more_starts_on_a_huge_page_of_its_file(tmp_path: Path) -> None:
    """Payloads of 2 MiB or more start on a 2 MiB boundary of the file (so the kernel can
    keep and map their page cache a huge page at a time); smaller ones on 64 bytes, packed
    after them. The gap before a big payload is never written, and every read is exact."""
    db = tmp_path / "h.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    big = segments.HUGE_ALIGN
    payloads = [_payload(0, 40_000), _payload(1, big), _payload(2, big + 4096), _payload(3, 4000),
                _payload(4, big - 64)]
    _append(log, payloads)
    rows = sqlite3.connect(db).execute(
        "SELECT pos, bulk, length FROM extents WHERE partition=0 ORDER BY offset").fetchall()
    starts = [pos + bulk for pos, bulk, _ in rows]
    assert [s % big == 0 for s in starts] == [False, True, True, False, False]
    assert all(s % segments.ALIGN == 0 for s in starts)
    # The small payload after a big one is packed behind it, not pushed to the next 2 MiB.
    assert rows[3][0] < rows[2][0] + rows[2][2] + segments.ALIGN
    assert [bytes(d.value.body.payload) for d in log.scan_decoded(0, _decode, batch=1)] == payloads
    log.close()


def test_the_huge_page_placement_starts_at_a_bulk_field_of_exactly_2_mib(tmp_path: Path) -> None:
    """The threshold counts the bulk field and the bytes after it (here the envelope's
    one-byte empty key id): exactly 2 MiB is placed on a 2 MiB boundary, one byte less is not."""
    db = tmp_path / "x.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    big = segments.HUGE_ALIGN
    payloads = [_payload(0, 1000), _payload(1, big - 2), _payload(2, 1000), _payload(3, big - 1)]
    data, at = serde.encode.with_bulk(_envelope(payloads[3]))
    assert at is not None and len(data) - at == big
    _append(log, payloads)
    starts = [pos + bulk for pos, bulk in sqlite3.connect(db).execute(
        "SELECT pos, bulk FROM extents WHERE partition=0 ORDER BY offset")]
    assert [s % big == 0 for s in starts] == [False, False, False, True]
    assert [bytes(d.value.body.payload) for d in log.scan_decoded(0, _decode, batch=1)] == payloads
    log.close()


@pytest.mark.parametrize(("roll_mib", "per_file"), [(9, 1), (13, 2)])
def test_a_segment_file_stays_within_its_roll_size_with_the_gaps(
        tmp_path: Path, configure: Callable[..., Settings], roll_mib: int, per_file: int) -> None:
    """A 4 MiB chunk takes 6 MiB of file (its gap, then itself): a file rolls before a
    message would end past the roll size, and a truncation still frees whole files."""
    configure(embedded_segment_bytes=roll_mib * 1024 * 1024)
    db = tmp_path / "r.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    payloads = [_payload(i, 4 * 1024 * 1024) for i in range(4)]
    _append(log, payloads)
    files = sorted(Path(f"{db}.segments").rglob("*.seg"))
    assert len(files) == 4 // per_file
    assert all(f.stat().st_size <= roll_mib * 1024 * 1024 for f in files)
    assert [bytes(d.value.body.payload) for d in log.scan_decoded(0, _decode, batch=1)] == payloads
    log.truncate_before(0, 2)
    assert [bytes(d.value.body.payload) for d in log.scan_decoded(0, _decode, batch=1)] == payloads[2:]
    assert len(sorted(Path(f"{db}.segments").rglob("*.seg"))) == len(files) - 2 // per_file
    log.close()


def test_a_writer_killed_mid_transaction_leaves_the_committed_records_whole(tmp_path: Path) -> None:
    """A real process, SIGKILLed after its chunk reached the segment file but before the
    commit: the next writer appends after the orphan bytes, and no reader ever sees them."""
    db = tmp_path / "k.db"
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        from eventlog import serde
        from eventlog.embedded import EmbeddedLog
        from tests.test_segments import _envelope, _payload
        log = EmbeddedLog("sqlite://{db}", "r")
        log.create(1)
        w = log.writer("w")
        with w.transaction() as txn:
            data, at = serde.encode.with_bulk(_envelope(_payload(0)))
            txn.append(0, data, bulk_at=at)
        with w.transaction() as txn:
            data, at = serde.encode.with_bulk(_envelope(_payload(1)))
            txn.append(0, data, bulk_at=at)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    seg = next(Path(f"{db}.segments").rglob("*.seg"))
    orphaned = seg.stat().st_size
    log = EmbeddedLog(f"sqlite://{db}", "r")
    assert log.end_offset(0) == 1
    assert [d.value.body.payload for d in log.scan_decoded(0, _decode, batch=1)] == [_payload(0)]
    _append(log, [_payload(2)], writer="w")
    assert seg.stat().st_size > orphaned  # appended after the dead writer's bytes
    assert [bytes(d.value.body.payload) for d in log.scan_decoded(0, _decode, batch=1)] == \
        [_payload(0), _payload(2)]
    log.close()


def test_a_missing_or_short_segment_file_is_named(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    _append(log, [_payload(0), _payload(1)])
    log.close()
    seg = next(Path(f"{db}.segments").rglob("*.seg"))
    with open(seg, "r+b") as f:
        f.truncate(seg.stat().st_size - 10)
    log = EmbeddedLog(f"sqlite://{db}", "r")
    assert len(log.read(0, lte=0)) == 1  # the first record is still whole
    with pytest.raises(CorruptStoreError, match=f"segment file {seg} holds .* offset 1|offset 1.*{seg}"):
        log.read(0)
    # A scan finds both rows in one page, but only reaching the short record fails.
    scan = log.scan_decoded(0, _decode, batch=16)
    assert next(scan).offset == 0
    with pytest.raises(CorruptStoreError, match=f"segment file {seg} holds .* offset 1|offset 1.*{seg}"):
        next(scan)
    log.close()
    seg.unlink()
    log = EmbeddedLog(f"sqlite://{db}", "r")
    with pytest.raises(CorruptStoreError, match=f"partition 0 offset 0: segment file {seg} is missing"):
        list(log.scan_decoded(0, _decode, batch=1))
    # A writer does not make the file again: new bytes would sit where the old rows point.
    with pytest.raises(CorruptStoreError,
                       match=f"segment file {seg}, which the log's newest records name, is missing"):
        _append(log, [_payload(2)])
    assert not seg.exists() and log.end_offset(0) == 2
    log.close()


def test_a_stray_write_through_a_view_changes_neither_the_file_nor_kills_the_process(tmp_path: Path) -> None:
    """torch makes a writable tensor over any buffer; written to, a view of the map takes a
    private copy of its page instead of a fault (the map is private, the view read-only)."""
    import warnings

    import torch

    db = tmp_path / "w.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    _append(log, [_payload(0)])
    (got,) = log.read_decoded(0, _decode)
    array = np.frombuffer(got.value.body.payload, np.uint8)
    assert not array.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.from_numpy(array).add_(1)
    log.close()
    fresh = EmbeddedLog(f"sqlite://{db}", "r")
    assert [bytes(d.value.body.payload) for d in fresh.read_decoded(0, _decode)] == [_payload(0)]
    fresh.close()


def test_a_row_naming_a_file_outside_the_run_is_refused(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    _append(log, [_payload(0)])
    log.close()
    conn = sqlite3.connect(db)
    conn.execute("UPDATE extents SET file='../../../etc/passwd'")
    conn.commit()
    conn.close()
    log = EmbeddedLog(f"sqlite://{db}", "r")
    with pytest.raises(CorruptStoreError, match="offset 0: bad segment file name '../../../etc/passwd'"):
        log.read(0)
    log.close()


def test_a_damaged_bulk_hint_does_not_make_intact_bytes_unreadable(tmp_path: Path) -> None:
    db = tmp_path / "h.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    payloads = [_payload(0), _payload(1)]
    _append(log, payloads)
    log.close()
    data, _ = serde.encode.with_bulk(_envelope(payloads[0]))
    # The hint now points at a string field's bytes (the dtype), where Avro wants bytes.
    conn = sqlite3.connect(db)
    conn.execute("UPDATE extents SET bulk=? WHERE partition=0 AND offset=0", (data.index(b"float32"),))
    conn.commit()
    conn.close()
    log = EmbeddedLog(f"sqlite://{db}", "r")
    for decoded in (list(log.scan_decoded(0, _decode, batch=1)), log.read_decoded(0, _decode)):
        assert [bytes(d.value.body.payload) for d in decoded] == payloads
        assert [d.value.body.dtype for d in decoded] == ["float32", "float32"]
    log.close()


def test_a_damaged_extent_that_holds_no_integer_is_named(tmp_path: Path) -> None:
    """An extent row whose length reads back as text (a damaged page): reading the record is
    a ``CorruptStoreError`` naming it, and a scan that stops before it reads on."""
    db = tmp_path / "x.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    _append(log, [_payload(0), _payload(1)])
    log.close()
    with closing(sqlite3.connect(db)) as c, c:
        c.execute("UPDATE extents SET length=? WHERE partition=0 AND offset=1", ("\x04C",))
    with EmbeddedLog(f"sqlite://{db}", "r") as log:
        assert [bytes(d.value.body.payload) for d in log.scan_decoded(0, _decode, lte=0)] == [_payload(0)]
        with pytest.raises(CorruptStoreError, match=re.escape(
                f"embedded database {db} is damaged: the extent of run 'r' partition 0 offset 1 (in ")
                ) as info:
            log.read(0)
        assert str(info.value).endswith("holds '\\x04C', not an integer"), info.value


def test_truncation_deletes_the_files_wholly_below_the_new_start(
        tmp_path: Path, configure: Callable[..., Settings]) -> None:
    configure(embedded_segment_bytes=100_000)  # two 40 KB chunks a file
    db = tmp_path / "r.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(2)
    payloads = [_payload(i) for i in range(7)]
    _append(log, payloads)
    w = log.writer("w1")
    with w.transaction() as txn:  # partition 1: its file must outlive partition 0's truncation
        data, at = serde.encode.with_bulk(_envelope(_payload(8)))
        txn.append(1, data, bulk_at=at)
    w.close()
    names = [f"p0-{i:020d}.seg" for i in (0, 2, 4, 6)]
    assert _segment_files(db) == names + ["p1-00000000000000000000.seg"]
    reading = list(log.scan_decoded(0, _decode, batch=1))  # views of the first file, held
    log.truncate_before(0, 3)  # offset 2's file still holds offset 3
    assert _segment_files(db) == names[1:] + ["p1-00000000000000000000.seg"]
    assert bytes(reading[0].value.body.payload) == payloads[0]  # a held view stays valid
    del reading
    assert [bytes(d.value.body.payload) for d in log.scan_decoded(1, _decode, batch=1)] == [_payload(8)]
    assert [bytes(d.value.body.payload) for d in log.scan_decoded(0, _decode, batch=1)] == payloads[3:]
    log.truncate_before(0, 7)
    assert _segment_files(db) == ["p1-00000000000000000000.seg"]
    _append(log, [_payload(9)])  # a new file, named by its first offset
    assert _segment_files(db) == ["p0-00000000000000000007.seg", "p1-00000000000000000000.seg"]
    assert [bytes(d.value.body.payload) for d in log.scan_decoded(0, _decode, batch=1)] == [_payload(9)]
    log.close()


def test_records_kept_in_sqlite_and_in_segments_read_alike(
        tmp_path: Path) -> None:
    """A log written before segments existed (every record in SQLite) goes on being read,
    and appended to, by this version."""
    db = tmp_path / "o.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    with override(embedded_segment_min_bytes=1 << 40):
        _append(log, [_payload(0), _payload(1)])
    assert _segment_files(db) == []
    with override(embedded_segment_min_bytes=0):
        _append(log, [_payload(2)])
    assert _segment_files(db) == ["p0-00000000000000000002.seg"]
    decoded = list(log.scan_decoded(0, _decode, batch=1))
    assert [bytes(d.value.body.payload) for d in decoded] == [_payload(i) for i in range(3)]
    assert [type(d.value.body.payload) for d in decoded] == [bytes, bytes, memoryview]
    log.close()


@pytest.mark.parametrize("batch", [1, 2, 16])
def test_a_scan_finds_rows_in_pages_but_decodes_each_record_when_reached(
        tmp_path: Path, batch: int) -> None:
    """Small and large records kept in SQLite and records in segment files come back exact
    and in order, whatever the page size; none is decoded before the caller takes the one
    before it, so a fold that stops at its target never fails on a damaged record after it."""
    db = tmp_path / "o.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    sizes = [1_000, 300_000, 2_000]  # SQLite: small (copied with its page), large, small
    with override(embedded_segment_min_bytes=1 << 40):
        _append(log, [_payload(i, n) for i, n in enumerate(sizes)])
    sizes += [40_000, 40_000]  # segment files
    with override(embedded_segment_min_bytes=0):
        _append(log, [_payload(i, sizes[i]) for i in (3, 4)])
    calls: list[int] = []

    def decode(stream, size, offset):  # type: ignore[no-untyped-def]
        calls.append(offset)
        if offset == 3:
            raise AssertionError("decoded a record the caller never reached")
        return _decode(stream, size, offset)

    scan = log.scan_decoded(0, decode, batch=batch)
    for i in range(3):
        got = next(scan)
        assert calls == list(range(i + 1)) and got.offset == i
        assert bytes(got.value.body.payload) == _payload(i, sizes[i])
    del scan
    rest = list(log.scan_decoded(0, _decode, gt=2, batch=batch))
    assert [bytes(d.value.body.payload) for d in rest] == [_payload(i, sizes[i]) for i in (3, 4)]
    assert [type(d.value.body.payload) for d in rest] == [memoryview, memoryview]
    assert [d.offset for d in log.scan_decoded(0, _decode, gt=0, lte=3, batch=batch)] == [1, 2, 3]
    # A large record kept in SQLite is read again when reached: if a truncation deleted it
    # since its page was found, the scan says so (a page of one finds the next row instead).
    scan = log.scan_decoded(0, _decode, batch=batch)
    assert next(scan).offset == 0
    log.truncate_before(0, 2)
    if batch == 1:
        assert next(scan).offset == 2
    else:
        with pytest.raises(TruncatedHistoryError,
                           match="partition 0 offset 1 was truncated while it was being read"):
            next(scan)
    log.close()


def test_a_bad_row_first_in_its_page_fails_at_once_and_decodes_nothing_after_it(tmp_path: Path) -> None:
    db = tmp_path / "b.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    _append(log, [_payload(i) for i in range(3)])
    with sqlite3.connect(db) as c:  # record 1's extent now runs past its file's end
        c.execute("UPDATE extents SET length=length+(1<<30) WHERE run='r' AND partition=0 AND offset=1")
    c.close()
    calls: list[int] = []

    def decode(stream, size, offset):  # type: ignore[no-untyped-def]
        calls.append(offset)
        return _decode(stream, size, offset)

    with pytest.raises(CorruptStoreError, match="offset 1.*the record ends at byte"):
        next(log.scan_decoded(0, decode, gt=0, batch=16))
    assert calls == []
    log.close()


def _index_entry(run: str, partition: int, offset: int, rowid: int) -> bytes:
    """An index entry's bytes in the database file: a record of (run, partition, offset,
    rowid), for a run id of a few characters and integers below 128."""
    def serial(v: int) -> int:
        return {0: 8, 1: 9}.get(v, 1)
    values = [partition, offset, rowid]
    header = bytes([2 + len(values), 13 + 2 * len(run), *map(serial, values)])
    return header + run.encode() + bytes(v for v in values if v > 1)


@pytest.mark.parametrize("table", ["records", "extents"])
def test_an_index_entry_leading_to_another_records_row_is_named(tmp_path: Path, table: str) -> None:
    """A damaged index entry that points at another record's row: SQLite takes the lookup's
    offset from the index and the bytes from that row, which reads as an intact record in
    the wrong place unless the reader checks whose row it is."""
    db = tmp_path / "i.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    payloads = [_payload(i) for i in range(3)]
    _append(log, payloads)
    log.close()
    with sqlite3.connect(db) as c:
        rowid = {o: r for o, r in c.execute(f"SELECT offset, rowid FROM {table} WHERE partition=0")}
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.close()
    data = bytearray(db.read_bytes())
    entry = _index_entry("r", 0, 1, rowid[1])
    assert data.count(entry) == 1
    at = data.index(entry)
    data[at:at + len(entry)] = _index_entry("r", 0, 1, rowid[2])  # offset 1 now leads to 2's row
    db.write_bytes(bytes(data))

    log = EmbeddedLog(f"sqlite://{db}", "r")
    named = f"embedded database {db} is damaged: the {table} index leads run 'r' partition 0 offset 1 " \
            f"to the row of run 'r' partition 0 offset 2"
    with pytest.raises(CorruptStoreError, match=named):
        log.read(0)
    with pytest.raises(CorruptStoreError, match=named):
        log.read_decoded(0, _decode, gt=0, lte=1)
    scan = log.scan_decoded(0, _decode, batch=16)
    assert bytes(next(scan).value.body.payload) == payloads[0]  # reached before the damage
    with pytest.raises(CorruptStoreError, match=named):
        next(scan)
    log.close()


def test_a_rolled_back_transaction_leaves_bytes_that_no_reader_sees(tmp_path: Path) -> None:
    """Bytes of a transaction that raised are in the file but in no row, also after a reopen."""
    db = tmp_path / "a.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    w = log.writer("w")
    with pytest.raises(RuntimeError), w.transaction() as txn:
        data, at = serde.encode.with_bulk(_envelope(_payload(5)))
        txn.append(0, data, bulk_at=at)
        raise RuntimeError("abort")
    w.close()
    log.close()
    assert os.path.getsize(next(Path(f"{db}.segments").rglob("*.seg"))) > 0
    log = EmbeddedLog(f"sqlite://{db}", "r")
    assert log.read(0) == [] and log.end_offset(0) == 0
    log.close()


def test_a_flipped_byte_in_a_segment_file_is_named_by_the_replay(tmp_path: Path) -> None:
    """A damaged gradient inside a segment file: the replay fails naming the record and its
    file (its bytes do not make their row's checksum), and the log is left as it was."""
    import torch

    from eventlog import RunAddress, Target
    from replayer.replay import replay
    from rewind.recorder import Recorder

    db = tmp_path / "rewind.db"
    address = RunAddress(f"sqlite://{db}", f"sqlite://{db}", "flip")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters())
    with Recorder(address, model, opt, chunk_bytes=1024) as rec:
        for step in range(3):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            rec.commit(step, wait=True)
    with EmbeddedLog(f"sqlite://{db}", "flip") as log:
        grads = [(d.offset, d.value) for d in log.scan_decoded(0, _decode, batch=1)
                 if isinstance(d.value.body, TensorDelta) and d.value.body.encoding == TensorDelta.GRAD]
    offset, env = grads[-1]
    (name, pos, bulk) = sqlite3.connect(db).execute(
        "SELECT file, pos, bulk FROM extents WHERE run='flip' AND partition=0 AND offset=?",
        (offset,)).fetchone()
    seg = next(Path(f"{db}.segments").rglob(name))
    with open(seg, "r+b") as f:
        # One whole gradient element set to a value far from any real gradient: a flipped
        # low mantissa bit can vanish in Adam's rounding and leave the state's bits as
        # recorded (the replay is then right, and finds nothing to name).
        at = pos + bulk + len(env.body.payload) // 8 * 4
        f.seek(at)
        f.write(np.float32(1e3).tobytes())
    before = seg.read_bytes()
    with pytest.raises(CorruptStoreError) as info:
        replay(address, Target())
    assert str(info.value) == f"run 'flip' partition 0 offset {offset} (in {seg}): the record's bytes " \
                              "do not make the checksum its row holds: they are damaged"
    assert seg.read_bytes() == before


def test_a_truncation_racing_a_read_is_named_as_truncation(tmp_path: Path) -> None:
    """A reader whose rows were listed before a truncation deleted their file gets
    ``TruncatedHistoryError`` (a follower then resyncs from a snapshot), not "damaged"."""
    from eventlog import TruncatedHistoryError

    db = tmp_path / "race.db"
    writer = EmbeddedLog(f"sqlite://{db}", "r")
    writer.create(1)
    _append(writer, [_payload(0), _payload(1)])
    reader = EmbeddedLog(f"sqlite://{db}", "r")
    view = reader._segments.view

    def truncate_first(*args):  # type: ignore[no-untyped-def]
        writer.truncate_before(0, 2)  # commits, then deletes the file under the reader
        return view(*args)

    reader._segments.view = truncate_first  # type: ignore[method-assign]
    with pytest.raises(TruncatedHistoryError, match="partition 0 offset 0 was truncated while it "
                                                   "was being read .*starts at offset 2"):
        reader.read(0)
    reader.close()
    writer.close()


def test_a_commit_to_more_files_than_it_keeps_open_keeps_every_byte(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``Appender.MAX_OPEN`` files, the oldest is flushed and closed mid-transaction."""
    from eventlog.embedded import segments

    monkeypatch.setattr(segments.Appender, "MAX_OPEN", 2)
    db = tmp_path / "f.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(5)
    w = log.writer("w")
    for _ in range(2):  # the second transaction reopens files the first one closed
        with w.transaction() as txn:
            for p in range(5):
                data, at = serde.encode.with_bulk(_envelope(_payload(p)))
                txn.append(p, data, bulk_at=at)
            assert len(_open_segment_files(tmp_path)) == 2
    w.close()
    assert len(_segment_files(db)) == 5 and _open_segment_files(tmp_path) == []
    for p in range(5):
        payloads = [bytes(d.value.body.payload) for d in log.scan_decoded(p, _decode, batch=1)]
        assert payloads == [_payload(p)] * 2
    log.close()


def _open_segment_files(under: Path) -> list[str]:
    """The segment files under ``under`` that this process has open (Linux; other tests'
    logs may still hold their own)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.endswith(".seg") and target.startswith(str(under)):
            out.append(target)
    return out


def test_close_lets_go_of_every_map_and_a_held_view_outlives_it(
    tmp_path: Path, configure: Callable[..., Settings],
) -> None:
    """``close`` hands the unmapping to a thread (tearing down maps of gigabytes of touched
    pages takes the kernel a while). Once it is done, a file no view holds is neither
    mapped nor open; a file whose view was handed out before ``close`` stays mapped, and
    the view still reads its bytes."""
    import threading

    configure(embedded_segment_bytes=50_000)  # one 40 KB message per file
    db = tmp_path / "c.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    _append(log, [_payload(0), _payload(1)])
    first, second = sorted(str(p) for p in Path(f"{db}.segments").rglob("*.seg"))
    got = list(log.scan_decoded(0, _decode, batch=1))
    held = got[0].value.body.payload
    del got
    assert isinstance(held, memoryview)

    def mapped(path: str) -> bool:
        return any(line.endswith(path) for line in Path("/proc/self/maps").read_text().splitlines())

    def open_(path: str) -> bool:
        fds = Path("/proc/self/fd")
        return any(os.path.realpath(fds / fd) == path for fd in os.listdir(fds))

    assert mapped(first) and mapped(second) and open_(second)
    log.close()
    for t in threading.enumerate():
        if t.name == "rewind-segment-unmap":
            t.join(timeout=30)
    assert not mapped(second) and not open_(second)
    assert mapped(first) and bytes(held) == _payload(0)  # its map outlives the close
    del held
    assert not mapped(first) and not open_(first)


def test_the_database_names_its_format_and_a_newer_one_is_refused(tmp_path: Path) -> None:
    """A database is marked with its layout (``PRAGMA user_version``); one from before the
    marker is marked on open; one marked newer than this version reads is refused, naming
    the file and both formats, and left as it was."""
    from eventlog import embedded
    from eventlog.errors import EventLogError

    db = tmp_path / "f.db"
    EmbeddedLog(f"sqlite://{db}", "r").close()
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == embedded.FORMAT
        c.execute("PRAGMA user_version=0")  # as a file from before the marker
    c.close()
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    _append(log, [_payload(0)])
    log.close()
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == embedded.FORMAT
        c.execute(f"PRAGMA user_version={embedded.FORMAT + 1}")
    c.close()
    with pytest.raises(EventLogError, match=rf"{db} holds an embedded log of format {embedded.FORMAT + 1}, "
                       rf"written by a newer Rewind; this version reads formats up to {embedded.FORMAT}"):
        EmbeddedLog(f"sqlite://{db}", "r")
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == embedded.FORMAT + 1
        assert c.execute("SELECT COUNT(*) FROM records").fetchone()[0] == 2
    c.close()


def test_records_from_before_checksums_read_unchecked_and_new_ones_are_checked(tmp_path: Path) -> None:
    """A database of format 1 (no checksum column): opened read-only, it is read as it is;
    opened to write, it gains the column (format 2), its old records still read, unchecked,
    and a record appended then is checked: a flipped byte in it is named, in its segment
    file or in the database, while the old records read on."""
    from eventlog import embedded

    db = tmp_path / "old.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    _append(log, [_payload(0)])
    log.close()
    with closing(sqlite3.connect(db)) as c, c:
        c.execute("ALTER TABLE records DROP COLUMN sum")  # as a file written before checksums
        c.execute("PRAGMA user_version=1")

    def formats() -> tuple[int, bool]:
        with closing(sqlite3.connect(db)) as c:
            return (c.execute("PRAGMA user_version").fetchone()[0],
                    any(row[1] == "sum" for row in c.execute("PRAGMA table_info(records)")))

    with EmbeddedLog(f"sqlite://{db}", "r", read_only=True) as old:
        assert [bytes(d.value.body.payload) for d in old.scan_decoded(0, _decode)] == [_payload(0)]
    assert formats() == (1, False)
    log = EmbeddedLog(f"sqlite://{db}", "r")
    _append(log, [_payload(1)])
    log.close()
    assert formats() == (embedded.FORMAT, True)
    with closing(sqlite3.connect(db)) as c:
        assert c.execute("SELECT partition, offset, sum IS NULL FROM records ORDER BY partition, offset"
                         ).fetchall() == [(-1, 0, 1), (-1, 1, 0), (0, 0, 1), (0, 1, 0)]
        (name, pos, length) = c.execute("SELECT file, pos, length FROM extents WHERE offset=1").fetchone()
    seg = next(Path(f"{db}.segments").rglob(name))
    with open(seg, "r+b") as f:  # a byte of its envelope, before the payload
        f.seek(pos + 12)
        byte = f.read(1)
        f.seek(pos + 12)
        f.write(bytes([byte[0] ^ 0x01]))
    with sqlite3.connect(db) as c:
        c.execute("UPDATE records SET value=x'736d616c6d' WHERE partition=-1 AND offset=1")  # "small"
    c.close()
    with EmbeddedLog(f"sqlite://{db}", "r") as log:
        assert [bytes(d.value.body.payload) for d in log.scan_decoded(0, _decode, lte=0)] == [_payload(0)]
        assert [r.value for r in log.read(CONTROL, lte=0)] == [b"small"]
        damaged = " the record's bytes do not make the checksum its row holds: they are damaged"
        with pytest.raises(CorruptStoreError, match=re.escape(f"partition 0 offset 1 (in {seg}):{damaged}")):
            list(log.scan_decoded(0, _decode))
        with pytest.raises(CorruptStoreError, match=re.escape(f"partition -1 offset 1 (in {db}):{damaged}")):
            log.read(CONTROL)


def test_moving_records_into_sqlite_checks_them_and_keeps_them_checked(tmp_path: Path) -> None:
    """``inline_segments`` refuses a record whose envelope in its segment file fails its
    checksum, naming it; the records it moves keep a checksum of all their bytes, so a byte
    damaged anywhere in one, its payload too, is named as the store's."""
    from eventlog import embedded

    db = tmp_path / "i.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    _append(log, [_payload(0), _payload(1)])
    log.close()
    with closing(sqlite3.connect(db)) as c:
        rows = c.execute("SELECT file, pos FROM extents ORDER BY offset").fetchall()
    (name, pos) = rows[1]
    seg = next(Path(f"{db}.segments").rglob(name))
    intact = seg.read_bytes()
    seg.write_bytes(intact[:pos + 12] + bytes([intact[pos + 12] ^ 1]) + intact[pos + 13:])
    with pytest.raises(CorruptStoreError, match=re.escape(
            f"run 'r' partition 0 offset 1 (in segment file {name}): the record's bytes do not make "
            "the checksum its row holds")):
        embedded.inline_segments(db)
    seg.write_bytes(intact)
    assert embedded.inline_segments(db) == 2
    with EmbeddedLog(f"sqlite://{db}", "r") as log:
        payloads = [bytes(d.value.body.payload) for d in log.scan_decoded(0, _decode)]
    assert payloads == [_payload(0), _payload(1)]
    with closing(sqlite3.connect(db)) as c, c:
        (value,) = c.execute("SELECT value FROM records WHERE partition=0 AND offset=0").fetchone()
        middle = len(value) // 2  # in the payload
        c.execute("UPDATE records SET value=? WHERE partition=0 AND offset=0",
                  (value[:middle] + bytes([value[middle] ^ 1]) + value[middle + 1:],))
    with EmbeddedLog(f"sqlite://{db}", "r") as log, pytest.raises(CorruptStoreError, match=re.escape(
            f"run 'r' partition 0 offset 0 (in {db}): the record's bytes do not make the checksum")):
        list(log.scan_decoded(0, _decode))


def test_a_read_only_database_from_before_the_marker_still_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A file that cannot be written (a read-only mount, an archived copy) is not marked,
    and is read as it is: its records come back, and its format stays 0."""
    from eventlog.embedded.db import Database

    db = tmp_path / "ro.db"
    log = EmbeddedLog(f"sqlite://{db}", "r")
    log.create(1)
    _append(log, [_payload(0)])
    log.close()
    with sqlite3.connect(db) as c:
        c.execute("PRAGMA user_version=0")
    c.close()
    connect = Database.connect

    def read_only(self: Any, shared: bool = False) -> sqlite3.Connection:
        conn = connect(self, shared)
        conn.execute("PRAGMA query_only=ON")  # every write fails as on a read-only file
        return conn

    monkeypatch.setattr(Database, "connect", read_only)
    log = EmbeddedLog(f"sqlite://{db}", "r")
    assert [bytes(d.value.body.payload) for d in log.scan_decoded(0, _decode, batch=1)] == [_payload(0)]
    log.close()
    monkeypatch.undo()
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == 0
    c.close()
