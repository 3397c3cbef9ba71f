"""A recorder that publishes the weights stream itself (``Recorder(weights=...)``), on every
backend: the stream it writes is bit for bit the one ``rewind publish`` rebuilds from the
log; a trainer SIGKILLed while its stream writer is inside a version restarts, and actors
(a real process among them) never see half a version and end at the trainer's last one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from eventlog import AuthenticationError, ConfigError, RunAddress, serde
from eventlog.events import TensorDelta
from eventlog.ports import WEIGHTS
from eventlog.weightcodec import WeightsConfig
from eventlog.weightstream import WeightsStream
from replayer.publisher import Publisher
from replayer.weights_follower import WeightsFollower
from rewind import Recorder

from .conftest import make_address
from .weights_actor import model_hash, net

CFG = WeightsConfig(keyframe_every=3, keep_keyframes=2, chunk_bytes=256)


@pytest.fixture
def run(backend: str, tmp_path: Path) -> RunAddress:
    return make_address(backend, tmp_path)


def _stream(run: RunAddress) -> list[tuple[Any, ...]]:
    """Every published version's seal fields and its chunks' decrypted payloads."""
    with run.open_log() as log:
        stream = WeightsStream(log)
        return [(v.version, v.step, v.kind, v.dtype, v.base_version, v.digest, v.raw_bytes, v.encoded_bytes,
                 [(c.name, c.encoding, c.chunk_index, bytes(c.payload)) for c in stream.chunks(v)])
                for v in stream.index()]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    torch.manual_seed(step)
    model(torch.randn(8, 16)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _cast_hash(model: torch.nn.Module) -> str:
    return model_hash({k: v.to(torch.bfloat16) if v.is_floating_point() else v
                       for k, v in model.state_dict().items()})


def test_a_recorders_stream_is_the_one_rewind_publish_rebuilds_from_the_log(run: RunAddress) -> None:
    torch.manual_seed(0)
    model = net().float()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Recorder(run, model, opt, rng=False, chunk_bytes=1024, weights=CFG) as rec:
        for step in range(8):
            _train(model, opt, step)
            rec.commit(step)
    # A restarted recorder whose stream ends at the version it restores goes on with patches.
    with Recorder(run, model, opt, rng=False, chunk_bytes=1024, weights=CFG) as rec:
        assert rec.restore().version == 8
        for step in range(8, 10):
            _train(model, opt, step)
            rec.commit(step)
    written = _stream(run)
    # keyframes at 1, 4, 7 and 10; retention keeps the newest two
    assert [(v[0], v[2]) for v in written] == [(7, "keyframe"), (8, "patch"), (9, "patch"), (10, "keyframe")]
    with WeightsFollower(run, net()) as follower:
        assert follower.poll().version_after == 10
        assert model_hash(follower.model.state_dict()) == _cast_hash(model)
    with Publisher(run, CFG) as pub:
        assert pub.rebuild().published == 10
    assert _stream(run) == written


def test_weights_on_a_multi_rank_recorder_or_in_a_dtype_not_served_is_refused(run: RunAddress) -> None:
    with pytest.raises(ConfigError, match="serving dtype 'int8'"):
        Recorder(run, net(), weights="int8")
    with pytest.raises(ConfigError, match="a multi-rank run's weights stream is published by `rewind"):
        Recorder(run, net(), weights=torch.bfloat16, group=object())


#: A trainer that publishes its weights stream; it appends the hash of each version's model
#: cast to bf16, and SIGKILLs itself right after the commit of step ``kill_at`` is durable,
#: while its stream writer is casting or writing that version.
TRAINER = """
import json, os, signal, sys
import torch
from eventlog.weightcodec import WeightsConfig
from rewind import Recorder, RunAddress
from tests.test_weights_recorder import _cast_hash, _train
from tests.weights_actor import net

cfg = json.loads(sys.argv[1])
torch.manual_seed(0)
model = net().float()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
weights = WeightsConfig(keyframe_every=3, keep_keyframes=2, chunk_bytes=256)
with Recorder(RunAddress(cfg["log"], cfg["coord"], cfg["run"]), model, opt, rng=False, chunk_bytes=1024,
              weights=weights) as rec:
    start = rec.restore()
    for step in range(0 if start.fresh else start.step + 1, cfg["steps"]):
        _train(model, opt, step)
        version = rec.commit(step, wait=True).result().version
        with open(cfg["hashes"], "a") as f:
            f.write(json.dumps({"version": version, "hash": _cast_hash(model)}) + "\\n")
        if step == cfg["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
def test_a_trainer_killed_inside_a_published_version_restarts_and_actors_end_at_its_last_version(
        run: RunAddress, tmp_path: Path) -> None:
    hashes, out = tmp_path / "hashes.jsonl", tmp_path / "actor.json"
    cfg = {"log": run.log_url, "coord": run.coord_url, "run": run.run_id, "hashes": str(hashes),
           "steps": 12, "kill_at": 5}
    actor = subprocess.Popen([sys.executable, "-m", "tests.weights_actor", run.log_url, run.coord_url,
                              run.run_id, "12", str(out)])
    killed = subprocess.run([sys.executable, "-c", TRAINER, json.dumps(cfg)], capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    done = subprocess.run([sys.executable, "-c", TRAINER, json.dumps({**cfg, "kill_at": -1})],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "publishing stopped" not in done.stderr
    casts = {d["version"]: d["hash"] for d in map(json.loads, hashes.read_text().splitlines())}
    assert sorted(casts) == list(range(1, 13))
    assert actor.wait(timeout=180) == 0
    seen = json.loads(out.read_text())
    assert seen["version"] == 12 and seen["hash"] == casts[12]
    assert seen["seen"] and set(seen["seen"]) <= set(casts.values())  # whole versions only
    versions = [v[0] for v in _stream(run)]
    assert versions[-1] == 12 and versions == sorted(set(versions))
    with WeightsFollower(run, net()) as late:
        assert late.poll().version_after == 12
        assert model_hash(late.model.state_dict()) == casts[12]


def test_an_encrypted_runs_recorder_writes_its_stream_encrypted(
        run: RunAddress, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REWIND_KEYS", "k1=" + "11" * 32)
    torch.manual_seed(0)
    model = net().float()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Recorder(run, model, opt, rng=False, weights=CFG) as rec:
        for step in range(2):
            _train(model, opt, step)
            rec.commit(step)
    with run.open_log() as log:
        envelopes = [serde.decode(r.value) for r in log.read(WEIGHTS)]
    chunks = [e for e in envelopes if isinstance(e.body, TensorDelta)]
    assert chunks and all(e.key_id == "k1" for e in chunks)
    with WeightsFollower(run, net()) as follower:
        assert follower.poll().version_after == 2
        assert model_hash(follower.model.state_dict()) == _cast_hash(model)
    monkeypatch.delenv("REWIND_KEYS")
    with WeightsFollower(run, net()) as late, pytest.raises(AuthenticationError, match="with key 'k1'"):
        late.poll()


def test_the_committer_waits_for_the_newest_offered_version_to_be_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream write that outlasts the next commit must not let the committer change the base
    before that next version is read: ``wait_base`` waits for every version offered."""
    import time

    import numpy as np

    from eventlog.events import TensorSpec
    from rewind import weights as weights_module

    events: list[tuple[str, int, float]] = []

    class SlowWriter:
        opened, version = True, 0

        def __init__(self, *_: Any) -> None:
            pass

        def publish(self, version: int, step: int, views: Any, *, on_read: Any) -> None:
            time.sleep(0.3 if version == 2 else 0.0)  # reading version 2 is slow
            events.append(("read", version, time.monotonic()))
            on_read()
            time.sleep(0.6 if version == 1 else 0.0)  # writing version 1 is slower
            self.version = version

        def close(self) -> None:
            pass

    monkeypatch.setattr(weights_module, "StreamWriter", SlowWriter)
    monkeypatch.setattr(RunAddress, "open_log", lambda self: None)
    spec = (TensorSpec("model/w", "float32", (4,), 0),)
    bits = {"model/w": np.zeros(16, dtype=np.uint8)}
    pub = weights_module.CommittedWeights(make_address("embedded", tmp_path), CFG)
    try:
        pub.offer(1, 0, spec, bits)
        pub.wait_base()
        pub.offer(2, 1, spec, bits)  # while version 1 is still being written
        pub.wait_base()
        events.append(("base may change", 2, time.monotonic()))
    finally:
        pub.close()
    order = [(what, v) for what, v, _ in events]
    assert order.index(("read", 2)) < order.index(("base may change", 2)), order
