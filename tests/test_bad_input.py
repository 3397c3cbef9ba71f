"""Bad input gets a specific error that names the problem, and destroys nothing.

Acceptance: "Each of the following gets a specific exception type and a message that names
the problem, and none of them changes the log or the model": a corrupted message byte, an
unknown schema fingerprint, another run's log, a model whose parameter names or shapes
differ, a truncated database file.

Every case records a real run with the real ``Recorder`` on the embedded backend, damages
the SQLite file directly (table ``records(run, partition, offset, value)``), then checks the
error type, that its message names the run / partition / offset / file, that the model (and
the global RNG) passed to the failing ``Recorder`` kept its bits, and that the log is
byte-for-byte what it was before the failed operation.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import random
import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from eventlog import (
    ConfigError,
    CorruptMessageError,
    CorruptStoreError,
    DecodeError,
    EventLogError,
    RewindError,
    RunAddress,
    RunNotFoundError,
    StateMismatchError,
    UnknownSchemaError,
    WrongRunError,
    list_runs,
    open_log,
    serde,
    tensorcodec,
)
from eventlog.events import TensorDelta
from eventlog.fold.engine import rebuild
from rewind.recorder import Recorder

from .storage import plain_records

# ----------------------------------------------------------------------------- helpers


class Net(torch.nn.Module):
    def __init__(self, width: int = 8, extra: bool = False, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):  # seeded weights, global RNG left alone
            torch.manual_seed(seed)
            self.fc = torch.nn.Linear(16, width)
            self.head = torch.nn.Linear(width, 2)
            if extra:
                self.extra = torch.nn.Linear(2, 2)
        self.register_buffer("counts", torch.zeros(32, dtype=torch.int64))  # compresses: blosc2


@dataclass
class Run:
    db: Path
    url: str
    run_id: str
    model: Net  # the live model, at the last committed version

    def address(self, run_id: str | None = None) -> RunAddress:
        return RunAddress(self.url, self.url, run_id or self.run_id)


def record(tmp_path: Path, run_id: str = "alpha", versions: int = 3, seed: int = 0) -> Run:
    """Record ``versions`` commits of a small model, then close everything cleanly."""
    db = tmp_path / "rewind.db"
    url = f"sqlite://{db}"
    model = Net(seed=seed)
    with Recorder(RunAddress(url, url, run_id), model, chunk_bytes=64, shards=2) as rec:
        for v in range(versions):
            with torch.no_grad():
                model.fc.weight[v, 0] += 1.0
                model.counts[v] += 1
            rec.commit(step=100 + v, metrics={"loss": 1.0 / (v + 1)}, wait=True)
    settle(db)
    plain_records(db)  # every message in table records, where the cases damage it
    return Run(db, url, run_id, model)


def settle(db: Path) -> None:
    """Close stray connections and fold the WAL into the main file (as after a clean exit)."""
    gc.collect()
    with sqlite3.connect(db) as c:
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.close()


def log_rows(db: Path) -> list[tuple[Any, ...]]:
    """The log itself: every record, partition and run row (not the coordinator's cache)."""
    with sqlite3.connect(db) as c:
        rows = [("records", *r) for r in c.execute("SELECT * FROM records ORDER BY 1, 2, 3")]
        rows += [("partitions", *r) for r in c.execute("SELECT * FROM partitions ORDER BY 1, 2")]
        rows += [("runs", *r) for r in c.execute("SELECT * FROM runs ORDER BY 1")]
    c.close()
    return rows


def file_digest(db: Path) -> str:
    h = hashlib.sha256(db.read_bytes())
    for suffix in ("-wal",):
        side = db.with_name(db.name + suffix)
        if side.exists():
            h.update(side.read_bytes())
    return h.hexdigest()


def read_record(db: Path, run: str, partition: int, offset: int) -> bytes:
    with sqlite3.connect(db) as c:
        (value,) = c.execute(
            "SELECT value FROM records WHERE run=? AND partition=? AND offset=?", (run, partition, offset)
        ).fetchone()
    c.close()
    return bytes(value)


def write_record(db: Path, run: str, partition: int, offset: int, value: bytes) -> None:
    with sqlite3.connect(db) as c:
        n = c.execute(
            "UPDATE records SET value=? WHERE run=? AND partition=? AND offset=?",
            (value, run, partition, offset)
        ).rowcount
        assert n == 1
    c.close()
    settle(db)


def tensor_deltas(db: Path, run: str) -> list[tuple[int, int, bytes, TensorDelta]]:
    """Every stored TensorDelta of a run: (partition, offset, message, body)."""
    out = []
    with sqlite3.connect(db) as c:
        rows = c.execute(
            "SELECT partition, offset, value FROM records WHERE run=? AND partition>=0 ORDER BY 1, 2", (run,)
        ).fetchall()
    c.close()
    for partition, offset, value in rows:
        env = serde.decode(bytes(value))
        assert isinstance(env.body, TensorDelta)
        out.append((partition, offset, bytes(value), env.body))
    return out


def bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().reshape(-1).view(torch.uint8) for k, v in model.state_dict().items()}


def assert_same_bits(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    now = bits(model)
    assert now.keys() == before.keys()
    changed = [k for k in now if not torch.equal(now[k], before[k])]
    assert not changed, f"a failed restore changed the model: {changed}"


def restore_fails(
    run: Run, model: torch.nn.Module, error: type[Exception], run_id: str | None = None, **kwargs: Any
) -> Exception:
    """A new Recorder's restore() into ``model`` raises ``error``; nothing else changes."""
    before_model = bits(model)
    before_rng = torch.get_rng_state().clone()
    before_log = log_rows(run.db)
    with pytest.raises(error) as info, Recorder(run.address(run_id), model, chunk_bytes=64,
                                                **kwargs) as rec:
        rec.restore()
    settle(run.db)
    assert_same_bits(model, before_model)
    assert torch.equal(torch.get_rng_state(), before_rng), "a failed restore changed the global RNG"
    assert log_rows(run.db) == before_log, "a failed restore changed the log"
    return info.value


def rebuild_fails(run: Run, error: type[Exception], run_id: str | None = None) -> Exception:
    """Folding the log (no Recorder, read only) raises ``error`` and leaves the file as it was."""
    before = file_digest(run.db)
    with pytest.raises(error) as info, open_log(run.url, run_id or run.run_id) as log:
        rebuild(log)
    settle(run.db)
    assert file_digest(run.db) == before, "a failed rebuild changed the database file"
    return info.value


def names_location(exc: Exception, run: str, partition: int, offset: int) -> None:
    msg = str(exc)
    where = "control" if partition == -1 else f"shard {partition}"
    assert f"run {run!r}" in msg, msg
    assert where in msg, msg
    assert re.search(rf"\boffset {offset}\b", msg), msg


# ----------------------------------------------------------------------------- sanity


def test_the_undamaged_run_restores(tmp_path: Path) -> None:
    """The baseline every case below damages: it restores cleanly and exactly."""
    run = record(tmp_path)
    fresh = Net(seed=5)
    with Recorder(run.address(), fresh, chunk_bytes=64) as rec:
        result = rec.restore()
    assert (result.step, result.version) == (102, 3)
    assert_same_bits(fresh, bits(run.model))
    compressions = {d.compression for *_, d in tensor_deltas(run.db, run.run_id)}
    assert compressions == {"none", "blosc2-zstd"}, "the cases below need both kinds of chunk"


# ----------------------------------------------------------------------------- corrupted message


@pytest.mark.parametrize("compression", ["none", "blosc2-zstd"])
@pytest.mark.parametrize("where", ["size-field", "body", "last"])
def test_corrupted_payload_byte(tmp_path: Path, compression: str, where: str) -> None:
    run = record(tmp_path)
    # the chunk with the longest payload of that kind: for blosc2, a real zstd stream rather
    # than a header-only "all zeros" chunk (whose ignored header bytes are tested below)
    partition, offset, value, delta = max(
        (t for t in tensor_deltas(run.db, run.run_id) if t[3].compression == compression),
        key=lambda t: len(t[3].payload),
    )
    start = value.rfind(delta.payload)  # the payload closes the body (v2 adds key_id after it)
    assert start > 0
    # Byte 4 of a blosc2 payload is in its header's uncompressed-size field; "body" is 3/4
    # into the payload, past the 32-byte blosc2 header, inside the zstd stream. (Some header
    # bytes are ignored by blosc2: see test_a_damaged_payload_never_yields_wrong_bits.)
    size = len(delta.payload)
    index = {"size-field": start + 4, "body": start + 3 * size // 4, "last": start + size - 1}[where]
    damaged = bytearray(value)
    damaged[index] ^= 0x5A
    write_record(run.db, run.run_id, partition, offset, bytes(damaged))

    exc = rebuild_fails(run, CorruptMessageError)
    names_location(exc, run.run_id, partition, offset)
    assert delta.name in str(exc) or "payload" in str(exc) or "blosc2" in str(exc)

    exc = restore_fails(run, Net(seed=9), CorruptMessageError)
    names_location(exc, run.run_id, partition, offset)


def test_a_damaged_payload_never_yields_wrong_bits() -> None:
    """Flip each payload byte of FULL and XOR chunks, raw and blosc2: the chunk is refused
    with ``CorruptMessageError``, or (a header byte blosc2 ignores) it still produces exactly
    the recorded bits, which the chunk digest proves. Never silently different bits."""
    rng = random.Random(3)
    zeros = np.zeros(256, dtype=np.uint8)
    ramp = np.frombuffer(np.arange(32, dtype=np.int64).tobytes(), dtype=np.uint8).copy()
    noise = np.frombuffer(rng.randbytes(256), dtype=np.uint8).copy()
    bumped = ramp.copy()
    bumped[17] ^= 0x40
    cases = [(zeros, None), (ramp, None), (noise, None), (bumped, ramp)]
    outcomes: dict[str, int] = {}
    for new, prev in cases:
        for c in tensorcodec.encode_tensor(new, prev, typesize=8, base_version=1, chunk_bytes=4096):
            for i in range(len(c.payload)):
                payload = bytearray(c.payload)
                payload[i] ^= 0x5A
                delta = TensorDelta("t", "int64", (32,), c.chunk_index, c.chunk_count, c.byte_offset,
                                    c.byte_length, c.encoding, c.compression, c.base_version, c.digest,
                                    bytes(payload))
                buf = (prev if prev is not None else np.full(256, 0xEE, dtype=np.uint8)).copy()
                before = buf.copy()
                try:
                    tensorcodec.decode_chunk(delta, buf, "chunk-under-test")
                except CorruptMessageError as exc:
                    assert "chunk-under-test" in str(exc)
                    assert np.array_equal(buf, before), "a refused chunk wrote bytes"
                    outcomes["refused"] = outcomes.get("refused", 0) + 1
                else:
                    assert np.array_equal(buf, new), f"byte {i} of a {c.compression} payload gave wrong bits"
                    outcomes["harmless"] = outcomes.get("harmless", 0) + 1
    assert outcomes["refused"] > 300


@pytest.mark.parametrize("partition", [-1, 0, 1])
def test_corrupted_magic_byte(tmp_path: Path, partition: int) -> None:
    run = record(tmp_path)
    offset = 1
    value = bytearray(read_record(run.db, run.run_id, partition, offset))
    assert value[:2] == b"\xc3\x01"
    value[0] ^= 0xFF
    write_record(run.db, run.run_id, partition, offset, bytes(value))

    for exc in (rebuild_fails(run, CorruptMessageError),
                restore_fails(run, Net(seed=9), CorruptMessageError)):
        names_location(exc, run.run_id, partition, offset)
        assert "c301" in str(exc), "the message should say which magic was expected"


def test_truncated_message(tmp_path: Path) -> None:
    run = record(tmp_path)
    value = read_record(run.db, run.run_id, 0, 2)
    write_record(run.db, run.run_id, 0, 2, value[: len(value) - 7])
    exc = rebuild_fails(run, CorruptMessageError)
    names_location(exc, run.run_id, 0, 2)
    names_location(restore_fails(run, Net(seed=9), CorruptMessageError), run.run_id, 0, 2)


def test_trailing_bytes_after_a_message(tmp_path: Path) -> None:
    run = record(tmp_path)
    value = read_record(run.db, run.run_id, -1, 0)
    write_record(run.db, run.run_id, -1, 0, value + b"\x00\x00")
    exc = rebuild_fails(run, CorruptMessageError)
    names_location(exc, run.run_id, -1, 0)
    assert "trailing" in str(exc)


def _messages(tmp_path: Path) -> list[bytes]:
    run = record(tmp_path, versions=2)
    with sqlite3.connect(run.db) as c:
        rows = [bytes(v) for (v,) in c.execute("SELECT value FROM records WHERE length(value) < 400")]
    c.close()
    return rows


def test_any_damaged_byte_is_a_decode_error_or_a_valid_event(tmp_path: Path) -> None:
    """Flip every byte of real messages (and cut them at every length): the decoder either
    raises a ``DecodeError`` naming the place, or returns an event; never a raw exception."""
    rng = random.Random(0)
    kinds: dict[str, int] = {}
    for value in _messages(tmp_path)[:12]:
        for i in range(len(value)):
            damaged = bytearray(value)
            damaged[i] ^= rng.choice((0x01, 0x80, 0xFF))
            try:
                serde.decode(bytes(damaged), "msg-under-test")
                kinds["decoded"] = kinds.get("decoded", 0) + 1
            except DecodeError as exc:
                assert "msg-under-test" in str(exc)
                kinds[type(exc).__name__] = kinds.get(type(exc).__name__, 0) + 1
        for n in range(len(value)):
            with pytest.raises(CorruptMessageError, match="msg-under-test"):
                serde.decode(value[:n], "msg-under-test")
    # the cases really happened (the test is not vacuous)
    assert kinds.get("CorruptMessageError", 0) > 0 and kinds.get("UnknownSchemaError", 0) > 0


# ----------------------------------------------------------------------------- unknown schema


@pytest.mark.parametrize("partition", [-1, 0])
def test_unknown_schema_fingerprint(tmp_path: Path, partition: int) -> None:
    run = record(tmp_path)
    offset = 2
    value = read_record(run.db, run.run_id, partition, offset)
    forged = bytes.fromhex("0123456789abcdef")
    write_record(run.db, run.run_id, partition, offset, value[:2] + forged + value[10:])

    for exc in (rebuild_fails(run, UnknownSchemaError), restore_fails(run, Net(seed=9), UnknownSchemaError)):
        assert "0123456789abcdef" in str(exc), "the message must name the unknown fingerprint"
        names_location(exc, run.run_id, partition, offset)


# ----------------------------------------------------------------------------- another run's log


def test_a_message_of_another_run(tmp_path: Path) -> None:
    run = record(tmp_path, run_id="alpha")
    record(tmp_path, run_id="beta", seed=1)  # same database file, another run
    foreign = read_record(run.db, "beta", 0, 0)
    assert serde.decode(foreign).run_id == "beta"
    write_record(run.db, "alpha", 0, 0, foreign)

    for exc in (rebuild_fails(run, WrongRunError), restore_fails(run, Net(seed=9), WrongRunError)):
        assert "'alpha'" in str(exc) and "'beta'" in str(exc), str(exc)
        names_location(exc, "alpha", 0, 0)


def test_a_message_whose_run_id_was_rewritten(tmp_path: Path) -> None:
    run = record(tmp_path)
    original = serde.decode(read_record(run.db, run.run_id, -1, 0))
    forged = serde.encode(dataclasses.replace(original, run_id="gamma"))
    write_record(run.db, run.run_id, -1, 0, forged)
    for exc in (rebuild_fails(run, WrongRunError), restore_fails(run, Net(seed=9), WrongRunError)):
        assert "'alpha'" in str(exc) and "'gamma'" in str(exc), str(exc)
        names_location(exc, "alpha", -1, 0)


def test_a_run_that_does_not_exist(tmp_path: Path) -> None:
    run = record(tmp_path)
    before_log = log_rows(run.db)

    # Folding it is an error naming the run...
    exc = rebuild_fails(run, RunNotFoundError, run_id="nope")
    assert "'nope'" in str(exc)

    # ...while a Recorder's restore() says "fresh run" and loads nothing.
    model = Net(seed=9)
    before = bits(model)
    with Recorder(run.address("nope"), model, chunk_bytes=64) as rec:
        result = rec.restore()
    assert result.fresh and result.step is None and result.version == 0
    assert_same_bits(model, before)
    settle(run.db)
    assert log_rows(run.db) == before_log
    assert list_runs(run.url) == ["alpha"]


def test_run_dir_addressing(tmp_path: Path) -> None:
    run = record(tmp_path, run_id="alpha")
    assert RunAddress.from_run_dir(tmp_path).run_id == "alpha"
    record(tmp_path, run_id="beta", seed=1)
    with pytest.raises(ConfigError) as info:
        RunAddress.from_run_dir(tmp_path)
    assert str(info.value) == f"{tmp_path} holds 2 runs (alpha, beta): name one (--run ID; to bisect, " \
        f"{tmp_path}#ID)"
    named = RunAddress.from_run_dir(tmp_path, "beta")
    assert (named.run_id, named.log_url) == ("beta", run.url)
    with pytest.raises(ConfigError) as info:  # the database named instead of its directory
        RunAddress.from_run_dir(tmp_path / "rewind.db")
    assert str(info.value) == f"{tmp_path / 'rewind.db'} is the run's database: pass the directory " \
        f"that holds it (--run-dir {tmp_path})"

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError) as info:
        RunAddress.from_run_dir(empty)
    assert str(empty) in str(info.value)
    assert list(empty.iterdir()) == [], "looking for a run must not create a database"


# ----------------------------------------------------------------------------- model mismatch


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: Net(extra=True, seed=9), "model/extra.weight"),
        (lambda: Net(width=12, seed=9), "model/fc.weight"),
        (lambda: Net(seed=9).double(), "model/fc.weight"),
    ],
    ids=["extra-layer", "wider", "float64"],
)
def test_model_that_does_not_fit(tmp_path: Path, make: Callable[[], Net], named: str) -> None:
    run = record(tmp_path)
    exc = restore_fails(run, make(), StateMismatchError)
    assert named in str(exc), str(exc)


def test_model_missing_a_layer(tmp_path: Path) -> None:
    run = record(tmp_path)
    model = Net(seed=9)
    del model.head
    exc = restore_fails(run, model, StateMismatchError)
    assert "model/head.weight" in str(exc) and "model/head.bias" in str(exc), str(exc)


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def test_state_missing_for_an_extra_object(tmp_path: Path) -> None:
    run = record(tmp_path)
    exc = restore_fails(run, Net(seed=9), StateMismatchError, extra={"env": Counter()})
    assert "'env'" in str(exc)


# ----------------------------------------------------------------------------- truncated database


@pytest.mark.parametrize("keep", [0.5, 0.25, "first-page+10"])
def test_truncated_database_file(tmp_path: Path, keep: float | str) -> None:
    run = record(tmp_path)
    settle(run.db)
    for suffix in ("-wal", "-shm"):  # a consistent, closed database: no side files
        side = run.db.with_name(run.db.name + suffix)
        if side.exists():
            assert suffix == "-shm" or side.stat().st_size == 0
            side.unlink()
    size = run.db.stat().st_size
    assert size > 4 * 4096
    cut = 4096 + 10 if keep == "first-page+10" else int(size * float(keep))
    with open(run.db, "r+b") as f:
        f.truncate(cut)
    before = run.db.read_bytes()

    def check(exc: BaseException) -> None:
        assert isinstance(exc, EventLogError), f"{type(exc).__name__}: {exc}"
        assert str(run.db) in str(exc), str(exc)

    with pytest.raises(CorruptStoreError) as info, open_log(run.url, run.run_id) as log:
        rebuild(log)
    check(info.value)

    model = Net(seed=9)
    snapshot = bits(model)
    with pytest.raises(CorruptStoreError) as info, Recorder(run.address(), model, chunk_bytes=64) as rec:
        rec.restore()
    check(info.value)
    assert_same_bits(model, snapshot)

    with pytest.raises(CorruptStoreError) as info:
        list_runs(run.url)
    check(info.value)
    with pytest.raises(CorruptStoreError) as info:
        RunAddress.from_run_dir(tmp_path)
    check(info.value)

    gc.collect()
    assert run.db.read_bytes() == before, "opening a damaged database must not write to it"
    wal = run.db.with_name(run.db.name + "-wal")
    assert not wal.exists() or wal.stat().st_size == 0


def test_errors_are_rewind_errors() -> None:
    """Every error above can be caught as one type, and the specific ones are distinct."""
    kinds = [CorruptMessageError, UnknownSchemaError, WrongRunError, StateMismatchError,
             CorruptStoreError, RunNotFoundError]
    assert all(issubclass(k, RewindError) for k in kinds)
    assert not issubclass(WrongRunError, DecodeError) and not issubclass(StateMismatchError, DecodeError)


def test_a_schema_damaged_into_text_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    """A table's name in the database's schema damaged into bytes that are not UTF-8: SQLite
    quotes them in its error, and the open names the damaged file instead of failing to
    decode that message."""
    run = record(tmp_path)
    settle(run.db)
    with sqlite3.connect(run.db) as c:
        c.execute("PRAGMA writable_schema=ON")
        c.execute("UPDATE sqlite_master SET name=CAST(X'76657273be6f6ed2' AS TEXT) WHERE name='versions'")
    c.close()
    said = f"embedded database {run.db} is damaged: malformed database schema (vers\ufffdon\ufffd)"
    with pytest.raises(CorruptStoreError, match=re.escape(said)), open_log(run.url, run.run_id) as log:
        rebuild(log)
    with pytest.raises(CorruptStoreError, match=re.escape(said)):
        list_runs(run.url)
