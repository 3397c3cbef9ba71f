"""Provenance for asynchronous RL, on every backend: actor processes stamp each rollout with
``Follower.stamp()``, the learner records the stamps its steps consumed with each commit,
``rewind history --json`` shows each version's policy lag, and ``rewind verify`` fails a
stamp that names no sealed version or another digest. Recording stamps changes nothing in
the run."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from eventlog import ConfigError, DecodeError, RunAddress, Target, statecodec
from eventlog.fold.engine import index_control
from eventlog.provenance import Stamp
from eventlog.weightcodec import WeightsConfig
from replayer.follower import Follower
from replayer.publisher import Publisher
from replayer.replay import replay, tensors_of
from replayer.weights_follower import WeightsFollower
from rewind import Recorder

from .conftest import make_address
from .provenance_actor import OBS, policy

REWIND = shutil.which("rewind")
#: Each stamped version's policy lag, ``(min, median, max, count)``: actor A polls before every
#: rollout (lag 1), actor B before every other one (lag 1, then 2). Versions 1, 6 and 8 are
#: committed without stamps; the learner restarts (restore) after version 6.
LAGS = {2: (1, 1, 1, 2), 3: (1, 1.5, 2, 2), 4: (1, 1, 1, 2), 5: (1, 1.5, 2, 2), 7: (1, 1, 1, 2)}


@pytest.fixture
def run(backend: str, tmp_path: Path) -> RunAddress:
    return make_address(backend, tmp_path)


def _rewind(*args: str) -> subprocess.CompletedProcess[str]:
    assert REWIND, "the rewind command is not installed"
    return subprocess.run([REWIND, *args], capture_output=True, text=True, timeout=300)


def _where(run: RunAddress) -> list[str]:
    return ["--log", run.log_url, "--coord", run.coord_url, "--run", run.run_id]


def _verify(run: RunAddress) -> tuple[int, list[str]]:
    """``rewind verify``'s exit code, and its failures as ``subject: detail``."""
    done = _rewind("verify", "--json", *_where(run))
    found = json.loads(done.stdout)["findings"]
    return done.returncode, [f"{f['subject']}: {f['detail']}" for f in found if f["status"] == "FAIL"]


def _history(run: RunAddress) -> dict[int, dict[str, Any]]:
    done = _rewind("history", "--json", *_where(run))
    assert done.returncode == 0, done.stderr
    return {r["version"]: r for r in json.loads(done.stdout)["rows"] if r["kind"] == "version"}


class Learner:
    """Trains ``policy()`` with SGD on the rollouts it is given, committing each step."""

    def __init__(self, address: RunAddress) -> None:
        torch.manual_seed(0)
        self.model = policy()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.rec = Recorder(address, self.model, self.opt, chunk_bytes=256)

    def step(self, rollouts: Sequence[torch.Tensor], stamps: Sequence[Stamp] = ()) -> int:
        loss = self.model(OBS).pow(2).mean() * torch.rand(()).item()  # draws from the global RNG
        for r in rollouts:
            loss = loss + (self.model(OBS) * r).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return self.rec.commit(self.rec.version, consumed=stamps, wait=True).result().version


class Actors:
    """Two actor processes (``tests.provenance_actor``) that follow the run: A polls before every
    rollout, B before every other one."""

    def __init__(self, run: RunAddress) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-m", "tests.provenance_actor", run.log_url,
                                        run.coord_url, run.run_id, str(every)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for every in (1, 2)]

    def rollouts(self, newest: int) -> tuple[list[torch.Tensor], list[Stamp]]:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(f"{newest}\n")
            p.stdin.flush()
        rollouts, stamps = [], []
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line, f"actor exited with {p.wait(timeout=60)}"
            msg = json.loads(line)
            stamps.append(Stamp.unpack(bytes.fromhex(msg["stamp"]), "an actor's stamp"))
            rollouts.append(torch.frombuffer(bytearray(bytes.fromhex(msg["rollout"])),
                                             dtype=torch.float32).reshape(4, 3))
        return rollouts, stamps

    def close(self) -> None:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.close()
            assert p.wait(timeout=60) == 0


def _train(run: RunAddress, data: list[tuple[list[torch.Tensor], list[Stamp]]] | None,
           record: bool) -> tuple[Learner, list[tuple[list[torch.Tensor], list[Stamp]]]]:
    """Versions 1..8 of the schedule in ``LAGS``: with rollouts from live actors (``data``
    ``None``), or with the rollouts ``data`` of an earlier run; ``record``: pass the stamps."""
    learner = Learner(run)
    actors = Actors(run) if data is None else None
    got: list[tuple[list[torch.Tensor], list[Stamp]]] = []

    def stamped(learner: Learner, newest: int) -> int:
        item = actors.rollouts(newest) if actors is not None else data[len(got)]  # type: ignore[index]
        got.append(item)
        return learner.step(item[0], item[1] if record else ())

    try:
        assert learner.step([]) == 1
        for v in range(2, 6):
            assert stamped(learner, v - 1) == v
        assert learner.step([]) == 6
        learner.rec.close()
        learner = Learner(run)  # a learner restarted: it restores version 6
        assert learner.rec.restore().version == 6
        assert stamped(learner, 6) == 7
        assert learner.step([]) == 8
    finally:
        learner.rec.close()
        if actors is not None:
            actors.close()
    return learner, got


def test_actor_processes_stamps_give_each_versions_exact_policy_lag_and_change_nothing(
        run: RunAddress, backend: str, tmp_path: Path) -> None:
    learner, data = _train(run, None, record=True)
    # The stamps name the versions the schedule says (A: the newest; B: every other poll).
    assert [[s.version for s in stamps] for _, stamps in data] == [[1, 1], [2, 1], [3, 3], [4, 3], [6, 6]]
    assert all(s.run == run.run_id and s.kind == "state" for _, stamps in data for s in stamps)

    rows = _history(run)
    assert sorted(rows) == list(range(1, 9))
    for v, row in rows.items():
        want = LAGS.get(v)
        assert row["policy_lag"] == (None if want is None else dict(zip(("min", "median", "max", "count"),
                                                                         want, strict=True))), v
        assert row["other_run_stamps"] == {}
    done = _rewind("verify", "--json", *_where(run))
    assert done.returncode == 0, done.stdout
    found = {f["subject"]: f for f in json.loads(done.stdout)["findings"]}
    assert found["provenance"]["status"] == "ok"
    assert found["provenance"]["detail"].startswith("10 stamps consumed by 5 versions: 0 fail")

    # The same run on the same rollouts, without stamps: bit for bit the same training.
    plain_run = make_address(backend, tmp_path, run.run_id + "-plain")
    plain, _ = _train(plain_run, data, record=False)
    for name, t in learner.model.state_dict().items():
        assert torch.equal(t.view(torch.uint8), plain.model.state_dict()[name].view(torch.uint8)), name
    with run.open_log() as log, plain_run.open_log() as plain_log:
        seals, plain_seals = index_control(log).seals, index_control(plain_log).seals
    for v in range(1, 9):
        assert seals[v].seal.shard_digests == plain_seals[v].seal.shard_digests, v
        # A stamped version writes one small state more; a version without stamps nothing new.
        assert seals[v].seal.control_count == plain_seals[v].seal.control_count + (v in LAGS), v
    state, plain_state = replay(run, Target("version", 8))[0], replay(plain_run, Target("version", 8))[0]
    assert {k: v for k, v in state.small.states.items() if k != "provenance"} == plain_state.small.states
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(tensors_of(state).values(), tensors_of(plain_state).values(), strict=True))
    assert not any("policy_lag" in r and r["policy_lag"] for r in _history(plain_run).values())


@pytest.mark.parametrize("forgery", ["wrong digest", "unknown run", "future version", "never published"])
def test_a_forged_stamp_fails_rewind_verify_naming_the_version_and_the_stamp(
        run: RunAddress, forgery: str) -> None:
    learner = Learner(run)
    try:
        learner.step([])
        with Follower(run, policy(), name="actor") as follower:
            follower.poll()
            real = follower.stamp()
        learner.step([OBS[:, :3]], [real])
        forged = {"wrong digest": dataclasses.replace(real, digest="ab" * 32),
                  "unknown run": dataclasses.replace(real, run="no-such-run"),
                  "future version": dataclasses.replace(real, version=4),
                  "never published": dataclasses.replace(real, kind="weights/bfloat16")}[forgery]
        learner.step([OBS[:, :3], OBS[:, 3:]], [real, forged])
    finally:
        learner.rec.close()
    code, failed = _verify(run)
    why = {"wrong digest": f"the seal of version 1 records state digest {real.digest}",
           "unknown run": "run 'no-such-run' has no sealed version",
           "future version": "names version 4, not sealed before version 3 consumed it",
           "never published": f"the weights stream of run {run.run_id!r} has no sealed version 1 in bfloat16",
           }[forgery]
    assert code == 1
    stamp = f"({forged.run}, {forged.version}, {forged.kind} {forged.digest}) x1"
    assert failed == [f"provenance of version 3: stamp {stamp}: {why}",
                      "provenance: 3 stamps consumed by 2 versions: 1 fail, 0 cannot be checked"]


def test_a_weights_followers_stamp_names_the_cast_weights_digest(run: RunAddress) -> None:
    learner = Learner(run)
    try:
        learner.step([])
        learner.step([])
        with Publisher(run, WeightsConfig(keyframe_every=4)) as pub:
            pub.publish()
        with WeightsFollower(run, policy().to(torch.bfloat16), name="bf16-actor") as follower:
            follower.poll()
            stamp = follower.stamp()
        assert (stamp.version, stamp.kind, stamp.digest) == (2, "weights/bfloat16", follower.digest.hex())
        learner.step([OBS[:, :3]], [stamp])
        assert _verify(run) == (0, [])
        assert _history(run)[3]["policy_lag"] == {"min": 1, "median": 1, "max": 1, "count": 1}
        # The state digest of version 2 is not the digest of its cast weights.
        with run.open_log() as log:
            state_digest = index_control(log).seals[2].seal.state_digest.hex()
        learner.step([OBS[:, :3]], [dataclasses.replace(stamp, digest=state_digest)])
    finally:
        learner.rec.close()
    code, failed = _verify(run)
    assert code == 1
    assert failed[0] == (f"provenance of version 4: stamp ({run.run_id}, 2, weights/bfloat16 {state_digest}) "
                         f"x1: the seal of version 2 records weights/bfloat16 digest {stamp.digest}")


def test_a_stamp_of_a_version_retention_deleted_from_the_stream_is_a_warning(run: RunAddress) -> None:
    learner = Learner(run)
    try:
        with Publisher(run, WeightsConfig(keyframe_every=2, keep_keyframes=1)) as pub, \
                WeightsFollower(run, policy().to(torch.bfloat16), name="bf16-actor") as follower:
            learner.step([])
            learner.step([])
            pub.publish()
            follower.poll()
            old = follower.stamp()
            for _ in range(3):
                learner.step([])
            pub.publish()  # version 5 is a keyframe: the stream keeps it alone
            learner.step([OBS[:, :3]], [old])
    finally:
        learner.rec.close()
    done = _rewind("verify", "--json", *_where(run))
    assert done.returncode == 0, done.stdout
    found = json.loads(done.stdout)["findings"]
    warned = [f"{f['subject']}: {f['detail']}" for f in found if f["status"] == "warn"]
    assert warned == [f"provenance of version 6: stamp ({run.run_id}, 2, weights/bfloat16 {old.digest}) x1: "
                      f"cannot be checked: the weights stream of run {run.run_id!r} holds versions from 5 on"]


def test_bad_stamps_are_refused_with_one_line() -> None:
    with pytest.raises(ConfigError, match="its digest must be lowercase hex"):
        Stamp("run", 1, "XYZ")
    with pytest.raises(ConfigError, match="its version must be an int >= 1"):
        Stamp("run", 0, "ab")
    with pytest.raises(ConfigError, match="its kind must be 'state' or 'weights/<dtype>'"):
        Stamp("run", 1, "ab", "weights/")
    with pytest.raises(DecodeError, match=r"rollout 7: a stamp is \[run, version, digest, kind\]"):
        Stamp.unpack(statecodec.pack(["run", 1]), "rollout 7")
    with pytest.raises(DecodeError, match="rollout 8: bad stamp .* its digest must be lowercase hex"):
        Stamp.unpack(statecodec.pack(["run", 1, "nothex", "state"]), "rollout 8")
    bf16 = Stamp("run", 3, "ab", "weights/bfloat16")
    assert Stamp.unpack(bf16.pack()) == bf16


def test_a_commit_refuses_what_is_not_a_stamp(tmp_path: Path) -> None:
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    learner = Learner(RunAddress(url, url, "r"))
    try:
        with pytest.raises(ConfigError, match=r"commit\(consumed=...\) takes Stamp objects .* got tuple"):
            learner.rec.commit(1, consumed=[("r", 1, "ab")])  # type: ignore[list-item]
        assert learner.rec.version == 0
    finally:
        learner.rec.close()


def _rank(rank: int, log: str, coord: str, run: str, port: int) -> None:
    """One rank of a 2-rank learner: each rank records the stamps of its own data."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    address = RunAddress(log, coord, run)
    torch.manual_seed(0)  # replicated (DDP-like) weights: every rank trains the same
    model = policy()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    rec = Recorder(address, model, opt, shards=1, group=dist.group.WORLD)

    def commit(stamps: list[Stamp]) -> int:
        model(OBS).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        return rec.commit(rec.version, consumed=stamps, wait=True).result().version

    def stamp(version: int) -> Stamp:
        with address.open_log() as log_:
            return Stamp(run, version, index_control(log_).seals[version].seal.state_digest.hex())

    try:
        assert commit([]) == 1
        assert commit([stamp(1)] * (2 - rank)) == 2  # rank 0: 2 rollouts of version 1; rank 1: one
        assert commit([] if rank == 0 else [stamp(1), stamp(2)]) == 3  # rank 0 consumed none
        assert commit([]) == 4
    finally:
        rec.close()
        dist.destroy_process_group()


def test_each_rank_records_the_stamps_of_its_own_data(run: RunAddress) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Each rank's failure is raised here, naming its rank (torch's spawn is untyped).
    mp.spawn(_rank, args=(run.log_url, run.coord_url, run.run_id, port), nprocs=2,  # type: ignore[attr-defined, no-untyped-call]
             join=True)
    rows = _history(run)
    assert {v: r["policy_lag"] for v, r in rows.items()} == {
        1: None, 2: {"min": 1, "median": 1, "max": 1, "count": 3},
        3: {"min": 1, "median": 1.5, "max": 2, "count": 2}, 4: None}
    assert _verify(run) == (0, [])
