"""Security: no code execution from data, encryption at rest, authenticated transport."""

from __future__ import annotations

import base64
import dataclasses
import os
import re
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eventlog import CoordinationError, IntegrityError, RunAddress, Target, crypto
from eventlog.crypto import AuthenticationError, Keyring
from eventlog.fold.engine import rebuild
from replayer.replay import replay, state_dicts
from snapshotter.service import Snapshotter, SnapshotterConfig
from snapshotter.store import SnapshotStore

from .conftest import make_address
from .storage import plain_records
from .test_snapshotter import Trainer, _bit_equal

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("eventlog", "snapshotter", "replayer", "rewind", "schemas", "benchmarks")
_MODULES = r"(?:c?pickle|_pickle|dill|cloudpickle|shelve|marshal|joblib)"
_PICKLE = re.compile(rf"\b{_MODULES}\.\w+\s*\(|^\s*(?:import|from)\s+{_MODULES}\b")
_TORCH_LOAD = re.compile(r"(?<!safetensors\.)\btorch\.load\((?![^)]*weights_only\s*=\s*True)")


def unsafe_loads(root: Path) -> list[str]:
    """Lines in the Python sources under ``root`` that could run code from data."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _PICKLE.search(code) or _TORCH_LOAD.search(code):
                found.append(f"{path}:{n}: {line.strip()}")
    return found


def test_no_pickle_and_no_unsafe_torch_load_in_the_package() -> None:
    found = [hit for pkg in PACKAGES for hit in unsafe_loads(ROOT / pkg)]
    assert found == []


def test_the_scan_catches_a_planted_pickle_load(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "eventlog", tmp_path / "eventlog")
    planted = tmp_path / "eventlog" / "serde.py"
    planted.write_text(planted.read_text() + "\nimport pickle\nstate = pickle.loads(data)\n")
    (tmp_path / "eventlog" / "x.py").write_text("import torch\nt = torch.load(path)\n")
    found = unsafe_loads(tmp_path / "eventlog")
    assert any("pickle.loads(data)" in f for f in found)
    assert any("import pickle" in f for f in found)
    assert any("torch.load(path)" in f for f in found)


def _key() -> bytes:
    return os.urandom(32)


def _ring(**keys: bytes) -> Keyring:
    return Keyring({k: v for k, v in keys.items()}, list(keys)[-1])


@pytest.fixture
def run(tmp_path: Path) -> RunAddress:
    return dataclasses.replace(make_address("embedded", tmp_path),
                               snapshots_url=f"file://{tmp_path / 'snapshots'}")


def test_encrypted_run_recovers_bit_exactly_and_a_wrong_key_is_refused(run: RunAddress) -> None:
    k1 = _key()
    with crypto.using(_ring(k1=k1)):
        trainer = Trainer(run)
        trainer.train(5)
        trainer.rec.close()
        model = state_dicts(replay(run, Target())[0])["model"]
        assert _bit_equal(model, trainer.states[4])
    plain_records(Path(run.log_url[len("sqlite://"):]))  # segment files' bytes included
    with sqlite3.connect(run.log_url[len("sqlite://"):]) as db:
        values = [bytes(v) for (v,) in db.execute("SELECT value FROM records")]
    plain = trainer.states[4]["0.weight"].numpy().tobytes()[:64]
    assert not any(plain in v for v in values)  # tensor bits are not in the log in clear
    with crypto.using(_ring(k1=_key())), pytest.raises(
            AuthenticationError, match="authentication failed with key 'k1'"):
        replay(run, Target())
    with crypto.using(None), pytest.raises(AuthenticationError, match="no key is configured"):
        replay(run, Target())


def _record_encrypted(run: RunAddress, ring: Keyring, versions: int) -> str:
    """Record ``versions`` encrypted versions; returns the embedded database's path."""
    with crypto.using(ring):
        trainer = Trainer(run)
        trainer.train(versions)
        trainer.rec.close()
    plain_records(Path(run.log_url[len("sqlite://"):]))  # every message where SQL reaches it
    return run.log_url[len("sqlite://"):]


def test_a_flipped_byte_and_swapped_chunks_are_detected(run: RunAddress) -> None:
    ring = _ring(k1=_key())
    db_path = _record_encrypted(run, ring, 3)
    with sqlite3.connect(db_path) as db:
        rows = db.execute("SELECT partition, offset, value FROM records WHERE partition=0 "
                          "ORDER BY offset").fetchall()
        part, off, value = rows[1]
        flipped = bytearray(value)
        flipped[-20] ^= 0x01  # inside the AES-GCM ciphertext
        db.execute("UPDATE records SET value=? WHERE partition=? AND offset=?", (bytes(flipped), part, off))
    with crypto.using(ring), pytest.raises(AuthenticationError, match=f"shard 0 offset {off}"):
        rebuild(run.open_log(), Target())
    with sqlite3.connect(db_path) as db:
        db.execute("UPDATE records SET value=? WHERE partition=? AND offset=?", (value, part, off))
        # Swap the payloads of two chunks (different gsns) by swapping whole messages' bodies.
        (_, o1, v1), (_, o2, v2) = rows[0], rows[2]
        db.execute("UPDATE records SET value=? WHERE partition=0 AND offset=?", (v2, o1))
        db.execute("UPDATE records SET value=? WHERE partition=0 AND offset=?", (v1, o2))
    with crypto.using(ring), pytest.raises((IntegrityError, AuthenticationError)) as info:
        rebuild(run.open_log(), Target())
    # Moved whole: the gsns are out of order, so the chunks are refused (either as a
    # duplicate that leaves the shard short, or by authentication if only bodies moved).
    assert "shard 0" in str(info.value)


def test_a_payload_moved_to_another_gsn_fails_authentication(run: RunAddress) -> None:
    from eventlog import serde

    ring = _ring(k1=_key())
    db_path = _record_encrypted(run, ring, 2)
    with sqlite3.connect(db_path) as db:
        rows = db.execute("SELECT offset, value FROM records WHERE partition=0 ORDER BY offset").fetchall()
        a, b = serde.decode(rows[0][1]), serde.decode(rows[1][1])
        moved = dataclasses.replace(a, body=dataclasses.replace(a.body, payload=b.body.payload))  # type: ignore[type-var]
        db.execute("UPDATE records SET value=? WHERE partition=0 AND offset=?",
                   (serde.encode(moved), rows[0][0]))
    with crypto.using(ring), pytest.raises(AuthenticationError, match="tampered with or moved"):
        rebuild(run.open_log(), Target())


def test_key_rotation_keeps_old_data_readable(run: RunAddress) -> None:
    k1, k2 = _key(), _key()
    with crypto.using(_ring(k1=k1)):
        trainer = Trainer(run)
        trainer.train(2)
    with crypto.using(_ring(k1=k1, k2=k2)):  # k2 now active, k1 still configured
        trainer.train(2)
        trainer.rec.close()
        with Snapshotter(run, SnapshotStore(run.snapshots_url or ""), SnapshotterConfig()) as snap:
            result = snap.snapshot(force=True)
        assert result is not None
        model = state_dicts(replay(run, Target())[0])["model"]
        assert _bit_equal(model, trainer.states[3])
        old = state_dicts(replay(run, Target("version", 2), use_snapshots=False)[0])["model"]
        assert _bit_equal(old, trainer.states[1])
    manifest = (Path(run.snapshots_url[len("file://"):]) / run.run_id / result.snapshot_id /  # type: ignore[index]
                "manifest.json").read_text()
    assert '"key_id": "k2"' in manifest
    with crypto.using(_ring(k2=k2)), pytest.raises(
            AuthenticationError, match="'k1', which is not configured"):
        replay(run, Target("version", 2), use_snapshots=False)


def test_keys_come_from_a_file_or_the_environment(tmp_path: Path) -> None:
    k1, k2 = _key(), _key()
    key_file = tmp_path / "keys"
    key_file.write_text(f"# rewind keys\nold = {k1.hex()}\nnew = {base64.b64encode(k2).decode()}\n")
    ring = Keyring.from_env({"REWIND_KEY_FILE": str(key_file)})
    assert ring is not None and ring.active == "new" and ring.keys == {"old": k1, "new": k2}
    ring = Keyring.from_env({"REWIND_KEYS": f"a={k1.hex()},b={k2.hex()}", "REWIND_ACTIVE_KEY": "a"})
    assert ring is not None and ring.active == "a"
    assert Keyring.from_env({}) is None
    from eventlog import ConfigError

    with pytest.raises(ConfigError, match="not 32 bytes"):
        Keyring.from_env({"REWIND_KEYS": "a=abcd"})


def test_kafka_tls_and_sasl_settings_pass_through_the_url() -> None:
    from eventlog.kafka import KafkaSettings

    s = KafkaSettings("kafka://h1:9093,h2:9093?security.protocol=SASL_SSL&sasl.mechanism=SCRAM-SHA-512"
                      "&sasl.username=u&sasl.password=secret&ssl.ca.location=/etc/ca.pem")
    conf = s.config("producer")
    assert conf["bootstrap.servers"] == "h1:9093,h2:9093"
    assert conf["security.protocol"] == "SASL_SSL" and conf["sasl.mechanism"] == "SCRAM-SHA-512"
    assert conf["ssl.ca.location"] == "/etc/ca.pem" and conf["sasl.password"] == "secret"
    assert "secret" not in s.redacted_url


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.kafka  # needs redis-server, which scripts/test installs
def test_redis_auth_wrong_password_is_a_clear_error(tmp_path: Path) -> None:
    from eventlog.redis.coordinator import RedisCoordinator

    port = _free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--requirepass", "s3cret", "--save", "", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        good = RedisCoordinator(f"redis://:s3cret@127.0.0.1:{port}/0")
        good.compare_and_set_version("r", 0, 1)
        assert good.current_version("r") == 1
        good.close()
        with pytest.raises(CoordinationError, match="password") as info:
            RedisCoordinator(f"redis://:wrong@127.0.0.1:{port}/0").current_version("r")
        assert "wrong" not in str(info.value)  # the password is not echoed
    finally:
        server.terminate()
        server.wait(10)


def test_a_forged_one_terabyte_tensor_fails_fast_without_allocating() -> None:
    from eventlog.errors import DecodeError
    from eventlog.events import Envelope, TensorDelta
    from eventlog.fold.apply import ShardState

    forged = TensorDelta("model/w", "float32", (2**38,), 0, 1, 0, 4 * 2**38, "FULL", "none", -1,
                         b"\0" * 16, b"tiny")
    state = ShardState(0)
    t0 = time.perf_counter()
    with pytest.raises(DecodeError, match=r"shape \(274877906944,\) of float32 needs more than"):
        state.apply(Envelope("r", 5, 1, 0, 0, "w", 0, forged), {1}, 100, "forged event")
    assert time.perf_counter() - t0 < 1.0 and state.tensors == {}


@pytest.mark.slow
def test_demo_with_encryption_on_recovers_bit_exactly(tmp_path: Path) -> None:
    env = {**os.environ, "REWIND_KEYS": f"demo={_key().hex()}"}
    demo = subprocess.run(
        [sys.executable, "-c", "from rewind.cli import main; main()", "demo", "--run-dir",
         str(tmp_path / "demo"), "--updates", "6", "--kill-at", "3"],
        capture_output=True, text=True, timeout=600, env=env)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert demo.stdout.strip().splitlines()[-1] == "bit-exact: yes"
    with sqlite3.connect(tmp_path / "demo" / "recorded" / "rewind.db") as db:
        keyed = db.execute("SELECT COUNT(*) FROM records WHERE partition >= 0").fetchone()[0]
    assert keyed > 0
    wrong = subprocess.run(
        [sys.executable, "-c", "from rewind.cli import main; main()", "replay", "--run-dir",
         str(tmp_path / "demo" / "recorded")],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "REWIND_KEYS": f"demo={_key().hex()}"})
    assert wrong.returncode == 2 and "AuthenticationError" in wrong.stderr
