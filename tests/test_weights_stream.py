"""The weights stream end to end, on every backend: a publisher that follows the log, dtype
followers that hold only the model, exact to the cast bit for bit; keyframes and retention;
a publisher SIGKILLed inside a version's transaction, with an actor process reading through
it; and every kind of bad input refused with one line, nothing applied."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eventlog import (
    AuthenticationError,
    ConfigError,
    IntegrityError,
    RewindError,
    RunAddress,
    StateMismatchError,
    serde,
)
from eventlog.events import TensorDelta
from eventlog.ports import WEIGHTS
from eventlog.weightcodec import WeightsConfig
from eventlog.weightstream import PATCH, WeightsStream
from replayer.follower import followers_table
from replayer.publisher import Publisher
from replayer.weights_follower import WeightsFollower

from .conftest import make_address
from .faulthook import killing_at
from .test_follower import Trainer
from .weights_actor import model_hash, net

CFG = WeightsConfig(keyframe_every=3, keep_keyframes=2, chunk_bytes=256)


@pytest.fixture
def run(backend: str, tmp_path: Path) -> RunAddress:
    return make_address(backend, tmp_path)


def _cast(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}


def _bits_equal(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    want, live = _cast(state), model.state_dict()

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1).view(torch.uint8)

    return live.keys() == want.keys() and all(torch.equal(bits(live[k]), bits(want[k])) for k in want)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rewind.cli", *args], env=env or dict(os.environ),
                          capture_output=True, text=True, timeout=300)


def _where(run: RunAddress) -> list[str]:
    return ["--log", run.log_url, "--coord", run.coord_url, "--run", run.run_id]


def test_an_adam_runs_follower_equals_the_trainer_cast_to_bf16_bit_for_bit(run: RunAddress) -> None:
    trainer = Trainer(run)
    trainer.commit(2)
    with Publisher(run, CFG) as pub, WeightsFollower(run, net(), max_lag=2, name="actor-0") as follower:
        assert pub.publish().published == 2
        first = follower.poll()
        assert (first.mode, first.reason, first.version_after) == ("full", "first sync", 2)
        assert _bits_equal(follower.model, trainer.states[2])
        for lag, mode, why in ((1, "incremental", ""), (2, "full", "version 4 is a keyframe"),
                               (1, "incremental", ""), (1, "full", "version 7 is a keyframe"),
                               (1, "incremental", ""), (3, "full", "lag 3 > max_lag 2")):
            # keyframes: 1, 4, 7, 10
            trainer.commit(lag)
            pub.publish()
            result = follower.poll()
            assert (result.mode, result.reason) == (mode, why)
            assert follower.version == trainer.version
            assert _bits_equal(follower.model, trainer.states[trainer.version])
            row = {r["name"]: r for r in followers_table(run)}["actor-0"]
            assert (row["version"], row["lag"]) == (trainer.version, 0)
        kinds = [v.kind for v in WeightsStream(pub._log).index()]
        assert PATCH in kinds and "keyframe" in kinds
    trainer.rec.close()


def test_a_late_follower_syncs_from_the_newest_keyframe_after_retention(run: RunAddress) -> None:
    trainer = Trainer(run)
    trainer.commit(10)
    with Publisher(run, dataclasses.replace(CFG, keep_keyframes=1)) as pub:
        assert pub.publish().published == 10
        index = WeightsStream(pub._log).index()
        assert [v.version for v in index] == [10]  # keyframes at 1, 4, 7, 10; all but 10 deleted
        assert pub._log.start_offset(WEIGHTS) > 0
    with WeightsFollower(run, net()) as follower:
        result = follower.poll()
        assert (result.mode, result.version_after) == ("full", 10)
        assert _bits_equal(follower.model, trainer.states[10])
    trainer.rec.close()


def test_a_publisher_killed_inside_a_version_publishes_each_version_once_after_restart(
        run: RunAddress, tmp_path: Path) -> None:
    trainer = Trainer(run)
    trainer.commit(6)
    out = tmp_path / "actor.json"
    actor = subprocess.Popen([sys.executable, "-m", "tests.weights_actor", run.log_url, run.coord_url,
                              run.run_id, "6", str(out)])
    args = ["publish", "--keyframe-every", "3", *_where(run)]
    killed = _cli(*args, env=killing_at("publish:4:1"))  # version 4: after its first chunk
    assert killed.returncode == -9, killed.stderr
    with WeightsFollower(run, net()) as follower:
        follower.poll()
        assert follower.version == 3 and _bits_equal(follower.model, trainer.states[3])
        done = _cli(*args)
        assert done.returncode == 0, done.stderr
        assert "published 3 versions" in done.stdout
        assert follower.poll().version_after == 6
        assert _bits_equal(follower.model, trainer.states[6])
    with run.open_log() as log:
        assert [v.version for v in WeightsStream(log).index()] == [1, 2, 3, 4, 5, 6]
    assert actor.wait(timeout=120) == 0
    seen = json.loads(out.read_text())
    published = {model_hash(_cast(trainer.states[v])) for v in range(1, 7)}
    assert seen["version"] == 6 and seen["hash"] == model_hash(_cast(trainer.states[6]))
    assert seen["seen"] and set(seen["seen"]) <= published  # never a mix of two versions
    trainer.rec.close()


def test_rewind_publish_follow_serves_versions_as_the_trainer_commits(run: RunAddress) -> None:
    trainer = Trainer(run)
    trainer.commit(1)  # the run exists
    command = [sys.executable, "-m", "rewind.cli", "publish", "--follow", "--interval", "0.1", *_where(run)]
    service = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with WeightsFollower(run, net()) as follower:
            for _ in range(3):
                trainer.commit(1)
                deadline = time.monotonic() + 60
                while follower.poll().version_after < trainer.version and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert follower.version == trainer.version
                assert _bits_equal(follower.model, trainer.states[trainer.version])
    finally:
        service.send_signal(signal.SIGINT)
        _, err = service.communicate(timeout=60)
    assert service.returncode == 130, err
    with run.open_log() as log:
        assert [v.version for v in WeightsStream(log).index()] == [1, 2, 3, 4]
    trainer.rec.close()


def _stream_with(run: RunAddress, versions: int) -> Trainer:
    trainer = Trainer(run)
    trainer.commit(versions)
    with Publisher(run, WeightsConfig(keyframe_every=100)) as pub:
        pub.publish()
    return trainer


def _forge(run: RunAddress, *, base: int, damage: bool, keyframe: bool = False) -> int:
    """Append a version to the stream by hand (FULL chunks of other weights), sealed as a
    patch against ``base`` or as a keyframe, a payload byte flipped if ``damage``. Returns
    its version."""
    from eventlog.weightcodec import cast_digest, cast_weights, encode_version

    with run.open_log() as log:
        stream = WeightsStream(log)
        last = stream.index()[-1]
        torch.manual_seed(5)
        new = cast_weights({k: v + 0.1 * torch.randn_like(v) if v.is_floating_point() else v
                            for k, v in net().float().state_dict().items()}, "bfloat16")
        chunks = encode_version(new, None, 0, last.chunk_bytes)
        if damage:  # the last chunk: a follower that applied chunk by chunk would be half way
            c = chunks[-1]
            payload = c.payload[:-1] + bytes([c.payload[-1] ^ 0xFF])
            chunks[-1] = dataclasses.replace(c, payload=payload)
        writer = log.writer("forger")
        try:
            stream.publish(writer, last.version + 1, 0, "keyframe" if keyframe else PATCH, "bfloat16",
                           0 if keyframe else base, chunks, cast_digest(new, last.chunk_bytes), 0,
                           last.chunk_bytes)
        finally:
            writer.close()
        return last.version + 1


@pytest.mark.parametrize("case", ["damaged patch", "damaged keyframe", "missing base"])
def test_a_damaged_version_or_a_missing_base_is_refused_with_one_line(run: RunAddress, case: str) -> None:
    trainer = _stream_with(run, 2)
    with WeightsFollower(run, net(), max_lag=4) as follower:
        if case != "damaged keyframe":
            follower.poll()
        before = {k: v.clone() for k, v in follower.model.state_dict().items()}
        version_before = follower.version
        forged = _forge(run, base=version_before - 1 if case == "missing base" else version_before,
                        damage=case != "missing base", keyframe=case == "damaged keyframe")
        with pytest.raises(RewindError) as err:
            follower.poll()
        message = str(err.value)
        assert "\n" not in message and f"weights stream of run {run.run_id!r}" in message
        if case == "missing base":
            assert isinstance(err.value, IntegrityError)
            assert (f"the patch of version {forged} applies to version {version_before - 1}, which the "
                    f"stream does not hold") in message
        else:
            assert f"version {forged}" in message
        assert follower.version == version_before
        assert all(torch.equal(v, before[k]) for k, v in follower.model.state_dict().items())
    trainer.rec.close()


def test_a_model_that_differs_or_a_dtype_not_published_is_refused(run: RunAddress) -> None:
    trainer = _stream_with(run, 1)
    other = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                torch.nn.Linear(32, 4)).to(torch.bfloat16)
    with WeightsFollower(run, other) as follower, pytest.raises(StateMismatchError) as err:
        follower.poll()
    assert str(err.value) == (
        f"the actor model does not match weights stream of run {run.run_id!r}: 2.bias: stream has "
        "bfloat16[3], model has bfloat16[4]; 2.weight: stream has bfloat16[3, 32], model has bfloat16[4, 32]")
    with WeightsFollower(run, net().half(), dtype=torch.float16) as follower, \
            pytest.raises(ConfigError) as err2:
        follower.poll()
    assert str(err2.value) == (f"weights stream of run {run.run_id!r} is published in bfloat16, not "
                               "float16 (version 1): follow it with dtype=bfloat16")
    trainer.rec.close()



def test_an_encrypted_runs_stream_is_encrypted_and_read_only_with_the_key(
        run: RunAddress, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REWIND_KEYS", "k1=" + "11" * 32)
    trainer = _stream_with(run, 2)
    with run.open_log() as log:
        envelopes = [serde.decode(r.value) for r in log.read(WEIGHTS)]
    chunks = [e for e in envelopes if isinstance(e.body, TensorDelta)]
    assert chunks and all(e.key_id == "k1" for e in chunks)
    with WeightsFollower(run, net()) as follower:
        follower.poll()
        assert _bits_equal(follower.model, trainer.states[2])
    monkeypatch.delenv("REWIND_KEYS")
    with WeightsFollower(run, net()) as follower, pytest.raises(AuthenticationError) as err:
        follower.poll()
    assert f"weights stream of run {run.run_id!r}, version 1, offset 0: encrypted with key 'k1', but no " \
           "key is configured" in str(err.value)
    assert follower.version == 0
    trainer.rec.close()


def test_rewind_publish_rebuild_gives_the_same_bits_and_rewind_followers_lists_a_dtype_follower(
        run: RunAddress) -> None:
    trainer = _stream_with(run, 3)

    def published() -> list[tuple[int, str, bytes]]:
        with run.open_log() as log:
            return [(v.version, v.kind, v.digest) for v in WeightsStream(log).index()]

    before = published()
    done = _cli("publish", "--rebuild", "--keyframe-every", "100", "--json", *_where(run))
    assert done.returncode == 0, done.stderr
    assert {k: json.loads(done.stdout)[k] for k in ("published", "keyframes", "last_version")} == \
        {"published": 3, "keyframes": 1, "last_version": 3}
    assert published() == before
    with WeightsFollower(run, net(), name="bf16-actor") as follower:
        follower.poll()
        trainer.commit(1)  # sealed in the log, not yet published
        listed = _cli("followers", "--json", *_where(run))
        assert listed.returncode == 0, listed.stderr
        rows = {r["name"]: r for r in json.loads(listed.stdout)["followers"]}
        assert (rows["bf16-actor"]["version"], rows["bf16-actor"]["lag"]) == (3, 1)
    trainer.rec.close()


def test_rewind_verify_passes_a_run_with_a_weights_stream(run: RunAddress) -> None:
    trainer = _stream_with(run, 2)
    done = _cli("verify", *_where(run))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    trainer.rec.close()


_MEMORY_CHILD = r"""
import json, sys
import torch
from eventlog import RunAddress
from replayer.weights_follower import WeightsFollower


from benchmarks.memory import status_kib


torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 2048)).to(torch.bfloat16)
size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
baseline = status_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS from here on
    f.write("5")
with WeightsFollower(RunAddress(*sys.argv[1:4]), model) as follower:
    result = follower.poll()
print(json.dumps({"size": size, "peak": (status_kib("VmHWM") - baseline) * 1024,
                  "mode": result.mode, "version": result.version_after}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable VmHWM")
def test_a_followers_peak_memory_above_a_bare_model_stays_under_1_25x_the_model(run: RunAddress) -> None:
    from rewind.recorder import Recorder

    torch.manual_seed(0)  # 25.2M parameters: 50 MB in bf16
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 2048))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    with Recorder(run, model, opt, rng=False) as rec:
        for v in range(1, 5):
            model(torch.randn(8, 4096)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            rec.commit(v - 1, wait=True).result()
    with Publisher(run, WeightsConfig(keyframe_every=3)) as pub:
        assert pub.publish().published == 4  # keyframes at 1 and 4: the sync reads 4
    out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, run.log_url, run.coord_url, run.run_id],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert (figures["mode"], figures["version"]) == ("full", 4)
    assert figures["peak"] <= 1.25 * figures["size"], f"peak {figures['peak'] / figures['size']:.2f}x"
