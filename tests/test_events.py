"""The event contract: every event type round-trips, any Avro implementation can read it, and
data written with schema v1 stays readable.

Acceptance: "Every event type written by Rewind decodes with Apache's own ``avro`` Python
package, using only the files in schemas/. Messages are not decoded with fastavro here."
(The interoperability tests below import ``avro`` only; ``serde`` itself uses fastavro to
*write*, which is the point: another implementation must be able to read what it wrote.)

Golden files: ``tests/data/v1/<EventType>.bin`` hold one message of each type written with
schema v1. Regenerate them only on purpose, with ``REWIND_REGEN_GOLDEN=1 pytest
tests/test_events.py`` (or ``python tests/test_events.py``), and only while v1 is current.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import struct
from pathlib import Path
from typing import Any

import avro.io
import avro.name
import avro.schema
import numpy as np
import pytest
import torch

import schemas
from eventlog import optimstep, serde, tensorcodec
from eventlog.events import (
    BODY_TYPES,
    CommitSealed,
    CustomState,
    Envelope,
    EnvironmentFingerprint,
    Metrics,
    OptimizerStep,
    Resumed,
    RngAdvance,
    RunStarted,
    SamplerCursor,
    SchedulerStep,
    SnapshotBegin,
    SnapshotEnd,
    TensorDelta,
    TensorSpec,
)

from .storage import plain_records

GOLDEN_DIR = Path(__file__).resolve().parent / "data" / "v1"
CURRENT_DIR = Path(__file__).resolve().parent / "data" / f"v{schemas.SCHEMA_VERSION}"
MAGIC = b"\xc3\x01"

# ----------------------------------------------------------------------------- samples

#: The tensor the golden TensorDelta rebuilds: its bits are known without the codec.
GOLDEN_TENSOR = torch.arange(64, dtype=torch.float32) * 0.5 - 3.0


def _digest(i: int) -> bytes:
    return bytes((i * 16 + k) % 256 for k in range(16))


def sample_bodies() -> dict[str, Any]:
    """One body of every event type, with values that exercise each Avro type's edges."""
    bits = GOLDEN_TENSOR.view(torch.uint8).numpy()
    (chunk,) = tensorcodec.encode_tensor(bits, None, typesize=4, base_version=0, chunk_bytes=4096)
    return {
        "RunStarted": RunStarted(
            shard_count=2,
            tensors=(
                TensorSpec("model/fc.weight", "float32", (16, 24), 0),
                TensorSpec("model/fc.bias", "bfloat16", (16,), 1),
                TensorSpec("model/scalar", "float64", (), 1),
                TensorSpec("optimizer/state/0/step", "int64", (0, 3), 0),
            ),
            small_states=("optimizer", "rng", "scheduler"),
            config_digest="0123456789abcdef",
            torch_version="2.4.0+cpu",
            device="cpu",
            rewind_version="0.1.0",
            schema_version=1,
            chunk_bytes=4 * 1024 * 1024,
        ),
        "TensorDelta": TensorDelta(
            name="model/golden",
            dtype="float32",
            shape=(64,),
            chunk_index=chunk.chunk_index,
            chunk_count=chunk.chunk_count,
            byte_offset=chunk.byte_offset,
            byte_length=chunk.byte_length,
            encoding=chunk.encoding,
            compression=chunk.compression,
            base_version=chunk.base_version,
            digest=chunk.digest,
            payload=chunk.payload,
        ),
        "CommitSealed": CommitSealed(
            base_version=6,
            shard_counts=(3, 0, 12),
            control_count=4,
            shard_digests=(_digest(1), _digest(2), _digest(3)),
            small_digest=_digest(4),
            state_digest=_digest(5),
            encoding="xor-delta/blosc2-zstd",
            raw_bytes=2**40 + 3,
            encoded_bytes=123_456,
        ),
        "SchedulerStep": SchedulerStep("scheduler", b"\x82\xa7last_lr\x91\xcb?\x1a6\xe2\xeb\x1cC-"),
        "RngAdvance": RngAdvance("rng", bytes(range(256)) * 3),
        "SamplerCursor": SamplerCursor("sampler", b"\x00"),
        "Metrics": Metrics({"loss": 0.125, "reward": -17.5, "tiny": 5e-324, "big": float("inf"),
                            "zero": -0.0}),
        "SnapshotBegin": SnapshotBegin("snap-000042", gsn_watermark=2**53 + 1, fencing_token=7),
        "SnapshotEnd": SnapshotEnd(
            snapshot_id="snap-000042",
            next_offsets=(10, 0, 2**33),
            applied_gsns=(99, 0, -1),
            manifest_digest=_digest(6),
            manifest_uri="file:///var/rewind/snapshots/snap-000042/manifest.json",
            fencing_token=7,
        ),
        "CustomState": CustomState("env", b""),
        "OptimizerStep": OptimizerStep(
            optimizer="AdamW",
            index=1,
            count=2,
            torch_version="2.4.0+cpu",
            device="cpu",
            hyperparams=optimstep.pack_hyperparams([{"lr": 1e-3, "betas": (0.9, 0.999), "foreach": None}]),
            params=("model/fc.weight", "model/fc.bias"),
            groups=(0, 0),
            states=("optimizer/state/0", "optimizer/state/1"),
            predicted=("model/fc.weight", "optimizer/state/0/exp_avg"),
            predicted_digests=(_digest(7), _digest(8)),
        ),
        "EnvironmentFingerprint": EnvironmentFingerprint(
            reason="resume",
            torch_version="2.4.0+cu121",
            cuda_version="12.1",
            cudnn_version=None,  # both branches of the nullable strings
            deterministic_algorithms=True,
            cublas_workspace_config=":4096:8",
            cudnn_benchmark=False,
            cudnn_deterministic=True,
            matmul_precision="highest",
            num_threads=2**31 - 1,
            hostname="node-é✓-7",
            world_size=8,
            python_version="3.11.9",
        ),
        "Resumed": Resumed(
            restored_version=2**40 + 5,
            restored_step=-1,
            state_digest=_digest(9),
            snapshot_id=None,
            snapshot_version=0,
            tail_versions=17,
            applied=123_456,
        ),
    }


def sample_envelope(kind: str, body: Any) -> Envelope:
    control = kind not in ("TensorDelta", "OptimizerStep")
    return Envelope(
        run_id="run-é✓-42",  # non-ASCII: Avro strings are UTF-8
        gsn=1000 + list(BODY_TYPES).index(f"rewind.{kind}"),
        version=0 if kind in ("RunStarted", "SnapshotBegin", "SnapshotEnd") else 7,
        step=7 * 128,
        shard=-1 if control else 1,
        writer="run-é✓-42.trainer",
        time_ms=1_700_000_000_123,
        body=body,
    )


def sample_envelopes() -> dict[str, Envelope]:
    return {kind: sample_envelope(kind, body) for kind, body in sample_bodies().items()}


def plain(value: Any) -> Any:
    """An event as Avro data: dataclasses as dicts, tuples as lists (the test's own mapping)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def assert_same_data(got: Any, want: Any, path: str = "event") -> None:
    """Type-exact equality, with floats compared by bits (so -0.0 and NaN are checked)."""
    if isinstance(want, float):
        assert isinstance(got, float), f"{path}: {got!r} is not a float"
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{path}: {got!r} != {want!r}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same_data(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_data(g, w, f"{path}[{i}]")
    else:
        assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
        assert got == want, f"{path}: {got!r} != {want!r}"


def test_samples_cover_every_event_type() -> None:
    kinds = {f"rewind.{k}" for k in sample_bodies()}
    assert kinds == set(BODY_TYPES), "add a sample (and a golden file) for every new event type"
    for kind, body in sample_bodies().items():
        assert type(body).__name__ == kind


# ----------------------------------------------------------------------------- serde round trip


@pytest.mark.parametrize("kind", list(sample_bodies()))
def test_every_event_round_trips_through_serde(kind: str) -> None:
    env = sample_envelopes()[kind]
    data = serde.encode(env)
    assert data[:2] == MAGIC
    assert data[2:10] == schemas.load().fingerprint
    back = serde.decode(data, "test")
    assert back == env
    assert type(back.body) is type(env.body)
    assert back.kind == kind
    assert_same_data(plain(back), plain(env))
    assert serde.encode(back) == data, "encoding is deterministic"


def test_metrics_keep_nan_and_signed_zero_bits() -> None:
    nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8DEADBEEF0001))[0]
    env = sample_envelope("Metrics", Metrics({"nan": nan, "neg": -0.0}))
    back = serde.decode(serde.encode(env))
    assert isinstance(back.body, Metrics)
    assert struct.pack("<d", back.body.values["nan"]) == struct.pack("<Q", 0x7FF8DEADBEEF0001)
    assert struct.pack("<d", back.body.values["neg"]) == struct.pack("<d", -0.0)


# ----------------------------------------------------------------------------- Apache avro interop


def _named_refs(node: Any) -> set[str]:
    if isinstance(node, str):
        return {node} if "." in node else set()
    if isinstance(node, list):
        return set().union(*(_named_refs(n) for n in node)) if node else set()
    if isinstance(node, dict):
        out: set[str] = set()
        for key in ("type", "items", "values", "fields"):
            if key in node:
                out |= _named_refs(node[key])
        return out
    return set()


def avro_envelope_schema(version: int = schemas.SCHEMA_VERSION) -> avro.schema.RecordSchema:
    """Parse ``schemas/v<version>/*.avsc`` with Apache avro, definitions before uses.

    The dependency order is worked out from the files themselves (not taken from Rewind's
    loader), and every file shares one ``Names`` so the Envelope refers to the named types.
    """
    folder = Path(schemas.__file__).resolve().parent / f"v{version}"
    docs = {}
    for path in sorted(folder.glob("*.avsc")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        docs[f"{doc['namespace']}.{doc['name']}"] = doc
    assert "rewind.Envelope" in docs
    names = avro.name.Names()
    parsed: dict[str, avro.schema.Schema] = {}
    while len(parsed) < len(docs):
        ready = [n for n, d in docs.items()
                 if n not in parsed and _named_refs(d) & docs.keys() <= parsed.keys() | {n}]
        assert ready, f"circular or missing schema references among {set(docs) - set(parsed)}"
        for name in sorted(ready):
            parsed[name] = avro.schema.make_avsc_object(docs[name], names)
    envelope = parsed["rewind.Envelope"]
    assert isinstance(envelope, avro.schema.RecordSchema)
    return envelope


def crc64_avro(data: bytes) -> int:
    """CRC-64-AVRO (Rabin) exactly as the Avro specification writes it."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for b in data:
        fp = (fp >> 8) ^ table[(fp ^ b) & 0xFF]
    return fp


def avro_decode(schema: avro.schema.RecordSchema, data: bytes) -> tuple[dict[str, Any], str]:
    """Decode one single-object message with Apache avro: the record and its union branch."""
    body = data[10:]
    reader = io.BytesIO(body)
    record = avro.io.DatumReader(schema).read(avro.io.BinaryDecoder(reader))
    assert reader.tell() == len(body), f"{len(body) - reader.tell()} bytes left after the record"

    # The Python reader returns a union's value without its branch; read the fields again
    # with avro's own decoder, taking the branch index of the ``body`` union.
    reader = io.BytesIO(body)
    decoder = avro.io.BinaryDecoder(reader)
    branch_name = ""
    for f in schema.fields:
        if f.name != "body":
            avro.io.DatumReader(f.type).read(decoder)
            continue
        union = f.type
        assert isinstance(union, avro.schema.UnionSchema)
        branch = union.schemas[decoder.read_long()]
        branch_name = branch.fullname
        assert avro.io.DatumReader(branch).read(decoder) == record["body"]
    assert reader.tell() == len(body)
    return record, branch_name


def avro_encode(schema: avro.schema.RecordSchema, record: dict[str, Any], branch: str) -> bytes:
    """Write a record with Apache avro, choosing the union branch by name (bodies such as
    SchedulerStep and RngAdvance have the same fields, so avro cannot guess it)."""
    out = io.BytesIO()
    encoder = avro.io.BinaryEncoder(out)
    for f in schema.fields:
        if f.name != "body":
            avro.io.DatumWriter(f.type).write(record[f.name], encoder)
            continue
        union = f.type
        assert isinstance(union, avro.schema.UnionSchema)
        (index,) = [i for i, s in enumerate(union.schemas) if s.fullname == branch]
        encoder.write_long(index)
        avro.io.DatumWriter(union.schemas[index]).write(record["body"], encoder)
    return out.getvalue()


V1_FINGERPRINT = bytes.fromhex("e6d5140de9c166be")  # CRC-64-AVRO of the v1 Envelope, little-endian
#: Event types that exist in v1 (later versions added others; v1 golden files stay as written).
V1_KINDS = sorted(p.stem for p in GOLDEN_DIR.glob("*.bin"))


def test_v1_fingerprint_constant_is_what_apache_avro_computes() -> None:
    assert avro_envelope_schema(1).fingerprint("CRC-64-AVRO") == V1_FINGERPRINT


def test_avro_fingerprint_matches_the_message_header() -> None:
    schema = avro_envelope_schema()
    header = serde.encode(sample_envelopes()["Metrics"])[:10]
    assert header[:2] == MAGIC
    # Apache avro returns CRC-64-AVRO as 8 little-endian bytes, the order single-object
    # encoding stores; the spec's integer, written little-endian, is the same bytes.
    avro_fp = schema.fingerprint("CRC-64-AVRO")
    spec_fp = crc64_avro(schema.canonical_form.encode("utf-8"))
    assert avro_fp == spec_fp.to_bytes(8, "little")
    assert header[2:10] == avro_fp
    assert header[2:10] != spec_fp.to_bytes(8, "big"), "byte order must be little-endian"
    assert schemas.load().canonical == schema.canonical_form


@pytest.mark.parametrize("kind", list(sample_bodies()))
def test_every_event_decodes_with_apache_avro(kind: str) -> None:
    schema = avro_envelope_schema()
    env = sample_envelopes()[kind]
    data = serde.encode(env)
    assert data[:2] == MAGIC
    record, branch = avro_decode(schema, data)
    assert branch == f"rewind.{kind}"
    want = plain(env)
    assert_same_data(record, want)
    assert avro_encode(schema, record, branch) == data[10:], "Apache avro writes the same bytes"
    # every field of the Envelope schema was present and compared
    assert {f.name for f in schema.fields} == set(want) == set(record)


def test_real_recorded_messages_decode_with_apache_avro(tmp_path: Path) -> None:
    """Real messages from a real Recorder (not hand-built samples) decode with Apache avro."""
    import sqlite3

    from eventlog import RunAddress
    from rewind.recorder import Recorder

    url = f"sqlite://{tmp_path}/rewind.db"
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    with Recorder(RunAddress(url, url, "interop"), model, opt, chunk_bytes=64) as rec:
        for step in range(2):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            rec.commit(step, {"loss": 1.0 / (step + 1)}, wait=True)
    schema = avro_envelope_schema()
    plain_records(tmp_path / "rewind.db")
    with sqlite3.connect(tmp_path / "rewind.db") as db:
        rows = db.execute("SELECT partition, offset, value FROM records WHERE run='interop'").fetchall()
    seen = set()
    for partition, offset, value in rows:
        data = bytes(value)
        record, branch = avro_decode(schema, data)
        # What Apache avro read, written back by Apache avro, is the message byte for byte.
        assert avro_encode(schema, record, branch) == data[10:], f"partition {partition} offset {offset}"
        assert record["run_id"] == "interop" and record["shard"] == partition
        seen.add(branch)
    assert {"rewind.RunStarted", "rewind.TensorDelta", "rewind.CommitSealed", "rewind.RngAdvance",
            "rewind.Metrics", "rewind.CustomState"} <= seen


# ----------------------------------------------------------------------------- golden v1 data


def regenerate_golden(folder: Path = CURRENT_DIR) -> None:
    """Write one message of every event type with the current schema (on purpose only, see
    the module doc); older versions' files are never rewritten."""
    assert folder == CURRENT_DIR, "only the current schema version's golden files are written"
    folder.mkdir(parents=True, exist_ok=True)
    for kind, env in sample_envelopes().items():
        data = serde.encode(env)
        assert data[2:10] == schemas.load().fingerprint
        (folder / f"{kind}.bin").write_bytes(data)


def test_golden_files_exist_for_every_event_type() -> None:
    kinds = {name.removeprefix("rewind.") for name in BODY_TYPES}
    assert {p.stem for p in CURRENT_DIR.glob("*.bin")} == kinds
    assert len(V1_KINDS) == 10 and set(V1_KINDS) < kinds


@pytest.mark.parametrize("kind", V1_KINDS)
def test_golden_v1_message_decodes_with_the_current_decoder(kind: str) -> None:
    data = (GOLDEN_DIR / f"{kind}.bin").read_bytes()
    assert data[:2] == MAGIC
    assert data[2:10] == V1_FINGERPRINT, "the golden file must stay v1 data"
    env = serde.decode(data, f"golden {kind}")
    want = sample_envelopes()[kind]
    assert env.kind == kind
    # Field by field, so a later schema that adds fields (with defaults) still passes.
    for f in dataclasses.fields(Envelope):
        if f.name != "body":
            assert getattr(env, f.name) == getattr(want, f.name), f.name
    for f in dataclasses.fields(type(want.body)):
        if kind == "TensorDelta" and f.name == "payload":
            continue  # compressor output is checked by decoding it below
        assert_same_data(plain(getattr(env.body, f.name)), plain(getattr(want.body, f.name)),
                         f"{kind}.{f.name}")
    if isinstance(env.body, TensorDelta):
        bits = np.zeros(env.body.byte_length, dtype=np.uint8)
        tensorcodec.decode_chunk(env.body, bits, "golden")
        restored = tensorcodec.bits_to_tensor(bits, env.body.dtype, tuple(env.body.shape))
        assert torch.equal(restored.view(torch.uint8), GOLDEN_TENSOR.view(torch.uint8))
        assert env.body.digest == tensorcodec.digest(GOLDEN_TENSOR.view(torch.uint8).numpy())
        assert env.body.compression == "blosc2-zstd" and env.body.encoding == "FULL"


@pytest.mark.parametrize("kind", V1_KINDS)
def test_golden_v1_message_decodes_with_apache_avro(kind: str) -> None:
    data = (GOLDEN_DIR / f"{kind}.bin").read_bytes()
    schema = avro_envelope_schema(1)
    assert data[2:10] == schema.fingerprint("CRC-64-AVRO")
    record, branch = avro_decode(schema, data)
    assert branch == f"rewind.{kind}"
    assert record["run_id"] == "run-é✓-42"


@pytest.mark.parametrize("version", [v for v in schemas.available_versions() if v < schemas.SCHEMA_VERSION])
def test_every_older_golden_message_still_decodes(version: int) -> None:
    """A log written by any older Rewind stays readable: each kept golden message decodes to
    its event type with the current decoder (Avro schema resolution by fingerprint)."""
    folder = GOLDEN_DIR.parent / f"v{version}"
    files = sorted(folder.glob("*.bin"))
    assert len(files) >= 10, f"golden files of schema v{version} are missing"
    for path in files:
        data = path.read_bytes()
        assert data[2:10] == schemas.load(version).fingerprint
        env = serde.decode(data, str(path))
        assert env.kind == path.stem and env.run_id == "run-é✓-42"


def test_current_writer_still_produces_its_golden_bytes() -> None:
    """An edit to an .avsc without a version bump is caught here."""
    for kind in sample_bodies():
        data = (CURRENT_DIR / f"{kind}.bin").read_bytes()
        assert data[2:10] == schemas.load().fingerprint
        assert serde.encode(serde.decode(data)) == data, kind


def test_current_messages_decode_without_schema_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message in the current schema is read with its own schema alone; only older
    versions are resolved (resolution walks every field of every message: a replay reads
    thousands of 4 MiB chunks)."""
    import fastavro

    readers: list[Any] = []
    real = fastavro.schemaless_reader

    def spy(fo: Any, writer: Any, reader: Any = None, **kw: Any) -> Any:
        readers.append(reader)
        return real(fo, writer, reader, **kw)

    monkeypatch.setattr(fastavro, "schemaless_reader", spy)
    env = Envelope("run", 1, 1, 1, 0, "w", 0, Metrics({"loss": 1.0}))
    assert serde.EnvelopeDeserializer()(serde.encode(env)) == env
    serde.EnvelopeDeserializer()(sorted(GOLDEN_DIR.glob("*.bin"))[0].read_bytes())
    assert readers[0] is None and readers[1] is not None, readers


if os.environ.get("REWIND_REGEN_GOLDEN") == "1":
    regenerate_golden()

if __name__ == "__main__":
    regenerate_golden()
    print(f"wrote {len(BODY_TYPES)} golden messages to {CURRENT_DIR}")
