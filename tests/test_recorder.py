"""Recorder behaviours a trainer relies on: commits, restores from the newest snapshot plus
the log tail, snapshots taken by the recorder itself, and a killed trainer's restart."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eventlog import (
    ConfigError,
    RewindError,
    RunAddress,
    StaleVersionError,
    Target,
    TruncatedHistoryError,
    statecodec,
)
from eventlog.capture import INLINE_TENSOR_BYTES, flatten, rebuilt_tensors
from eventlog.fold.engine import index_control, rebuild
from eventlog.statecodec import TensorRef
from replayer.replay import replay
from rewind import Snapshots, distributed, every_versions, keep_last
from rewind.recorder import Recorder
from snapshotter.service import Snapshotter
from snapshotter.store import SnapshotStore
from snapshotter.verify import verify_run


def _address(tmp_path: Path, run: str = "r") -> RunAddress:
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    return RunAddress(url, url, run)


def test_layout_may_grow_when_optimizer_state_appears(tmp_path: Path) -> None:
    """Committing before the first optimizer step is allowed: Adam's moments appear later."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    with Recorder(_address(tmp_path), model, opt) as rec:
        rec.commit(0, wait=True)  # no optimizer state yet
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        rec.commit(1, wait=True)
    with _address(tmp_path).open_log() as log:
        idx = index_control(log)
        assert len(idx.run_started) == 2  # the layout was re-announced when it grew
        v1 = rebuild(log, Target("version", 1))
        assert not any("exp_avg" in n for n in v1.tensors())
        v2 = rebuild(log, Target("version", 2))
        assert any("exp_avg" in n for n in v2.tensors())
    fresh_model = torch.nn.Linear(8, 4)
    fresh_opt = torch.optim.Adam(fresh_model.parameters())
    with Recorder(_address(tmp_path), fresh_model, fresh_opt) as rec:
        assert rec.restore().version == 2
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_unchanged_state_costs_no_tensor_events(tmp_path: Path) -> None:
    model = torch.nn.Linear(64, 64)
    with Recorder(_address(tmp_path), model, rng=False) as rec:
        first = rec.commit(0, wait=True).result()
        second = rec.commit(1, wait=True).result()
    assert first.encoded_bytes > 0
    assert second.encoded_bytes == 0 and second.events == 1  # only the seal


def test_async_commits_queue_up_and_are_all_durable_after_flush(tmp_path: Path) -> None:
    model = torch.nn.Linear(256, 256)
    with Recorder(_address(tmp_path), model, rng=False, max_inflight=2) as rec:
        futures = []
        for step in range(8):
            with torch.no_grad():
                model.weight.add_(0.01)
            futures.append(rec.commit(step))
        rec.flush()
        assert [f.result().version for f in futures] == list(range(1, 9))
    with _address(tmp_path).open_log() as log:
        assert sorted(index_control(log).seals) == list(range(1, 9))


def test_after_a_failed_commit_every_commit_is_refused_until_a_new_recorder_restores(tmp_path: Path) -> None:
    """What the README says of a failed commit: the recorder stops; every later ``commit()``
    raises a ``RewindError`` naming that failure; a new recorder restores and goes on."""
    model = torch.nn.Linear(2, 1)
    with Recorder(_address(tmp_path), model, rng=False) as rec:
        rec.commit(0, wait=True)
        with pytest.raises(StaleVersionError):  # the run is at version 1, not 0
            rec.commit(1, base_version=0, wait=True)
        stopped = (r"^recorder stopped after a failed commit \(StaleVersionError: stale version: .*\); "
                   r"create a new Recorder and restore\(\)$")
        for step in (1, 2):
            with pytest.raises(RewindError, match=stopped):
                rec.commit(step)
    with Recorder(_address(tmp_path), model, rng=False) as rec:
        assert rec.restore().version == 1
        assert rec.commit(1, wait=True).result().version == 2


def test_restore_of_a_new_run_is_fresh(tmp_path: Path) -> None:
    with Recorder(_address(tmp_path, "never-written"), torch.nn.Linear(2, 2)) as rec:
        result = rec.restore()
    assert result.fresh and result.version == 0


def test_extra_state_names_are_checked(tmp_path: Path) -> None:
    class Env:
        def state_dict(self) -> dict[str, int]:
            return {"t": 1}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    with pytest.raises(Exception, match="reserved or used twice"):
        Recorder(_address(tmp_path), torch.nn.Linear(2, 2), extra={"model": Env()})


class _Tied(torch.nn.Module):
    """An embedding shared with the output layer, as language models tie them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.head = torch.nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight


def test_a_tied_weight_is_recorded_once_and_restored_tied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Recorder(_address(tmp_path), model, opt) as rec:
        for step in range(3):
            opt.zero_grad()
            model.head(model.embed(torch.arange(10))).logsumexp(1).mean().backward()
            opt.step()
            result = rec.commit(step, wait=True).result()
    assert result.encoding.startswith("predictive") and result.residual_bytes == 0
    state, _ = replay(_address(tmp_path))
    recorded = sorted(t.name for t in state.layout.tensors if t.name.startswith("model/"))
    assert recorded == ["model/embed.weight"]
    again = _Tied()
    with Recorder(_address(tmp_path), again, torch.optim.Adam(again.parameters(), lr=1e-2)) as rec:
        assert rec.restore().step == 2
    assert again.head.weight is again.embed.weight
    assert torch.equal(again.embed.weight.view(torch.int32), model.embed.weight.view(torch.int32))


class _Ring:
    """A replay-buffer-like state: a preallocated tensor filled a few rows per step."""

    def __init__(self, rows: int) -> None:
        self.obs = torch.zeros(rows, 16)
        self.pos = 0

    def state_dict(self) -> dict[str, object]:
        return {"obs": self.obs, "pos": self.pos}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.obs.copy_(state["obs"])  # type: ignore[arg-type]
        self.pos = state["pos"]  # type: ignore[assignment]


def test_a_buffer_costs_what_was_added_and_restores_bit_equal(tmp_path: Path) -> None:
    added_bytes = {}
    for rows in (1 << 15, 1 << 18):
        torch.manual_seed(0)
        ring = _Ring(rows)
        with Recorder(_address(tmp_path, f"r{rows}"), torch.nn.Linear(2, 2), buffers={"rb": ring}) as rec:
            sizes = []
            for step in range(4):
                ring.obs[ring.pos:ring.pos + 64] = torch.randn(64, 16)
                ring.pos += 64
                sizes.append(rec.commit(step, wait=True).result().encoded_bytes)
        added_bytes[rows] = sizes[-1]
        again = _Ring(rows)
        with Recorder(_address(tmp_path, f"r{rows}"), torch.nn.Linear(2, 2), buffers={"rb": again}) as rec:
            assert rec.restore().step == 3
        assert torch.equal(again.obs.view(torch.int32), ring.obs.view(torch.int32)) and again.pos == 256
    # 8x the buffer, the same rows added: a commit's bytes follow the rows, not the buffer.
    assert added_bytes[1 << 18] < 1.2 * added_bytes[1 << 15]


class _Target:
    """A DQN-style target network (the online network's copy, updated by ``load_state_dict``)."""

    def __init__(self, online: torch.nn.Module) -> None:
        self.net = copy.deepcopy(online)

    def state_dict(self) -> dict[str, object]:
        return {"net": dict(self.net.state_dict()), "updates": 0}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.net.load_state_dict(state["net"])  # type: ignore[arg-type]


def _log_bytes(address: RunAddress) -> int:
    """Every byte the run's log holds, over all its partitions."""
    with address.open_log() as log:
        return sum(len(r.value) for p in log.partitions() for r in log.read(p))


def _record_target(address: RunAddress, kind: str, versions: int) -> tuple[torch.nn.Module, _Target, int]:
    """Record ``versions`` of a network whose head trains, with its target network passed as
    ``kind`` (``extra`` or ``small``) and updated at each; returns them and the bytes of the
    last version."""
    torch.manual_seed(0)
    online = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
    target = _Target(online)
    opt = torch.optim.SGD(online[1].parameters(), lr=0.1)
    before = 0
    with Recorder(address, online, opt, **{kind: {"target": target}}) as rec:  # type: ignore[arg-type]
        for step in range(versions):
            _train(online[1], opt)  # type: ignore[arg-type]
            target.net.load_state_dict(online.state_dict())  # a hard update: the head changed
            if step == versions - 1:
                rec.flush()
                before = _log_bytes(address)
            rec.commit(step, wait=True)
    return online, target, _log_bytes(address) - before


def test_an_extra_objects_tensors_are_deltas_and_a_log_with_them_whole_restores(tmp_path: Path) -> None:
    """A target network in ``extra`` costs the chunks that changed, not a copy per version;
    a log that holds it whole in a small state (``small=``) restores into ``extra``."""
    _, _, as_extra = _record_target(_address(tmp_path, "extra"), "extra", 3)
    online, target, whole = _record_target(_address(tmp_path, "whole"), "small", 3)
    target_bytes = sum(t.numel() * 4 for t in target.net.state_dict().values())
    assert whole > target_bytes and as_extra < whole // 10, (as_extra, whole, target_bytes)
    resumed = copy.deepcopy(online)
    opt = torch.optim.SGD(resumed[1].parameters(), lr=0.1)
    again = _Target(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4)))
    with Recorder(_address(tmp_path, "whole"), resumed, opt, extra={"target": again}) as rec:
        assert rec.restore().step == 2
        with torch.no_grad():
            again.net[0].weight[0, 0] += 1
        rec.commit(3, wait=True)  # its tensors now go to the shards
    later = _Target(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4)))
    with Recorder(_address(tmp_path, "whole"), resumed, opt, extra={"target": later}) as rec:
        assert rec.restore().step == 3
    for name, t in again.net.state_dict().items():
        assert torch.equal(later.net.state_dict()[name].view(torch.int32), t.view(torch.int32)), name
    assert not torch.equal(later.net[0].weight, target.net[0].weight)


def test_a_rank_takes_an_extra_objects_tensors_apart_as_a_single_process_does() -> None:
    """Multi-rank capture: the same tensors go to the shards (as the rank's own), the same
    small ones stay in the small state."""
    target = _Target(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4)))
    alone, _ = flatten("target", target.state_dict(), INLINE_TENSOR_BYTES)
    part = distributed.capture({"target": target}, {"model", "optimizer", "target"}, 1, 2, inline={"target"})
    assert sorted(alone) == ["target/net/0.weight"]
    assert sorted(part.tensors) == ["rank1/target/net/0.weight"] and not part.replicated
    skeleton = statecodec.unpack(part.small["rank1/target"], "target")
    assert skeleton["net"]["0.weight"] == TensorRef("rank1/target/net/0.weight")
    assert torch.equal(skeleton["net"]["1.weight"], target.net[1].weight)  # 4 KiB: inline


def _train(model: torch.nn.Linear, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, model.in_features)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_restore_starts_from_the_newest_snapshot_and_replays_only_the_tail(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    address = dataclasses.replace(_address(tmp_path), snapshots_url=f"file://{tmp_path / 'snaps'}")
    with Recorder(_address(tmp_path), model, opt) as rec:
        for step in range(9):
            _train(model, opt)
            rec.commit(step, wait=True)
            if step == 5:
                with Snapshotter(address, SnapshotStore(tmp_path / "snaps")) as snap:
                    taken = snap.snapshot(force=True)
    assert taken is not None and taken.version == 6
    fresh_model = torch.nn.Linear(8, 4)
    fresh_opt = torch.optim.Adam(fresh_model.parameters())
    # The address names no store: the log's end markers say where the snapshot lives.
    with Recorder(_address(tmp_path), fresh_model, fresh_opt) as rec:
        result = rec.restore()
    assert (result.snapshot, result.snapshot_version, result.version, result.step, result.tail) == (
        taken.snapshot_id, 6, 9, 8, 3)
    assert torch.equal(fresh_model.weight, model.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    # Only the tail was applied: exactly what a replay from that snapshot applies, fewer
    # events than a fold of the whole log.
    _, from_snapshot = replay(_address(tmp_path))
    _, whole = replay(_address(tmp_path), use_snapshots=False)
    assert (result.applied, result.skipped) == (from_snapshot.applied, from_snapshot.skipped_by_snapshot
                                                + from_snapshot.skipped_duplicate
                                                + from_snapshot.skipped_unsealed)
    assert 0 < result.applied < whole.applied
    assert result.state_digest == whole.state_digest


@pytest.mark.parametrize("stepped", [True, False], ids=["moments-exist", "fresh-optimizer"])
def test_restore_writes_into_the_objects_own_tensors_and_keeps_its_base_apart(
    tmp_path: Path, stepped: bool,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    with Recorder(_address(tmp_path), model, opt) as rec:
        for step in range(3):
            _train(model, opt)
            rec.commit(step, wait=True)
    torch.manual_seed(1)
    live = torch.nn.Linear(8, 4)
    live_opt = torch.optim.Adam(live.parameters())
    if stepped:
        _train(live, live_opt)
    weight, moment = live.weight, live_opt.state.get(live.weight, {}).get("exp_avg")
    pointer = weight.data_ptr()
    with Recorder(_address(tmp_path), live, live_opt) as rec:
        assert rec.restore().version == 3
        # In place: the same parameter, over the same memory, holds the recorded bits.
        assert live.weight is weight and live.weight.data_ptr() == pointer
        assert torch.equal(live.weight, model.weight)
        restored = live_opt.state[live.weight]["exp_avg"]
        assert torch.equal(restored, opt.state[model.weight]["exp_avg"])
        assert (restored is moment) == stepped  # a moment that existed is written in place
        # The objects share no memory with the recorder's base: training on from here and
        # committing gives the same version 4 as the uninterrupted run.
        for m, o in ((model, opt), (live, live_opt)):
            torch.manual_seed(7)
            _train(m, o)
        rec.commit(3, wait=True)
    state, _ = replay(_address(tmp_path))
    assert state.version == 4
    replayed = {n: t for n, t in rebuilt_tensors(state).items() if n.startswith("model/")}
    assert torch.equal(replayed["model/weight"], model.weight.detach())
    assert torch.equal(replayed["model/bias"], model.bias.detach())


def test_the_recorder_takes_snapshots_that_every_reader_finds(address: RunAddress, tmp_path: Path) -> None:
    """A run recorded with ``snapshots=`` is found by restore, replay and verify through an
    address that names no store (a Kafka run records where its snapshots live); closing
    the recorder takes the due snapshot and gives the snapshotter lease up."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    store = tmp_path / "snaps"
    with Recorder(address, model, opt, snapshots=Snapshots(every_versions(4), keep=keep_last(2),
                                                           store=f"file://{store}")) as rec:
        for step in range(10):
            _train(model, opt)
            rec.commit(step)
    kept = sorted(p.name for p in (store / address.run_id).iterdir())
    newest = int(kept[-1][1:11])  # snapshot ids start with their version
    # Retention kept two; closing took the snapshot due, if any: the tail is under 4 versions.
    assert len(kept) <= 2 and 10 - newest < 4
    lease = address.open_coordinator()
    try:
        assert lease.acquire_lease(f"rewind:{address.run_id}:snapshotter", "someone-else", 5.0)
    finally:
        lease.close()
    assert address.snapshots_url is None
    _, report = replay(address)
    assert report.snapshot_id == kept[-1] and report.tail_versions == 10 - newest
    findings = verify_run(address).findings
    assert [f.subject for f in findings if f.status == "ok" and "files and digests verify" in f.detail] == [
        f"snapshot {sid} (version {int(sid[1:11])})" for sid in kept]
    fresh = torch.nn.Linear(16, 8)
    with Recorder(address, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1)) as rec:
        result = rec.restore()
    assert (result.snapshot, result.tail) == (kept[-1], 10 - newest)
    assert torch.equal(fresh.weight, model.weight)


def test_snapshots_of_a_kafka_run_need_a_store() -> None:
    address = RunAddress("kafka://127.0.0.1:1", "redis://127.0.0.1:1/0", "r")
    with pytest.raises(ConfigError, match="its snapshots need a store"):
        Recorder(address, torch.nn.Linear(2, 2), snapshots=every_versions(10))
    # A mistyped log URL is named as that, not as a run without a store.
    for url, said in (("kafak://127.0.0.1:1", "unknown log backend 'kafak' in 'kafak://127.0.0.1:1'"),
                      ("/tmp/x.db", "backend URL '/tmp/x.db' has no scheme")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            Recorder(RunAddress(url, url, "r"), torch.nn.Linear(2, 2), snapshots=every_versions(10))


def test_snapshots_must_be_a_policy(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="pass a trigger such as every_versions"):
        Recorder(_address(tmp_path), torch.nn.Linear(2, 2), snapshots=keep_last(3))  # type: ignore[arg-type]


@pytest.mark.parametrize("role", ["optimizer", "scheduler", "sampler"])
def test_an_argument_without_state_dict_is_refused_up_front(tmp_path: Path, role: str) -> None:
    with pytest.raises(ConfigError, match=f"^{role}=Generator has no state_dict/load_state_dict"):
        Recorder(_address(tmp_path), torch.nn.Linear(2, 2), **{role: torch.Generator()})  # type: ignore[arg-type]


#: A trainer written from the README's API, run as its own process. It appends the digest of
#: its whole state (model, optimizer, global RNG) for each step before committing it, waits
#: once for the log to be truncated below the oldest snapshot, and SIGKILLs itself right
#: after queuing the commit of ``kill_at``.
TRAINER = """
import hashlib, json, os, signal, sys, time
import torch
from rewind import (Recorder, RunAddress, Snapshots, Target, TruncatedHistoryError, every_versions,
                    keep_last, replay)

cfg = json.loads(sys.argv[1])
run = RunAddress(cfg["log"], cfg["coord"], cfg["run"], cfg["snapshots"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)

def digest():
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.numpy().tobytes())
    for i, s in sorted(opt.state_dict()["state"].items()):
        for k, t in sorted(s.items()):
            h.update(f"{i}.{k}".encode() + t.numpy().tobytes())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()

def truncated():
    try:
        replay(run, Target("version", 1))
    except TruncatedHistoryError:
        return True
    return False

snapshots = Snapshots(every_versions(5), keep=keep_last(2), truncate=True)
with Recorder(run, model=model, optimizer=opt, snapshots=snapshots) as rec:
    start = rec.restore()
    print("RESTORED " + json.dumps({"step": start.step, "snapshot": start.snapshot,
                                    "snapshot_version": start.snapshot_version,
                                    "digest": digest()}), flush=True)
    first = 0 if start.fresh else start.step + 1
    for step in range(first, first + cfg["steps"]):
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with open(cfg["digests"], "a") as f:
            f.write(json.dumps({"step": step, "digest": digest()}) + "\\n")
        rec.commit(step, {"loss": loss.item()})
        if step == cfg["truncated_by"]:
            rec.flush()
            deadline = time.monotonic() + 120
            while not truncated():
                assert time.monotonic() < deadline, "the log was not truncated"
                time.sleep(0.2)
        if step == cfg["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)
"""


def _trainer(cfg: dict[str, object]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", TRAINER, json.dumps(cfg)], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_a_killed_trainer_restores_bit_exact_below_a_truncated_log(
    backend: str, address: RunAddress, tmp_path: Path,
) -> None:
    """SIGKILL a README-style trainer whose log was truncated below its oldest snapshot;
    the restarted trainer restores the newest sealed version bit-exact, from a snapshot."""
    run = address if backend == "embedded" else dataclasses.replace(
        address, snapshots_url=f"file://{tmp_path / 'snaps'}")  # embedded: the default store
    digests = tmp_path / "digests.jsonl"
    cfg: dict[str, object] = {
        "log": run.log_url, "coord": run.coord_url, "run": run.run_id, "snapshots": run.snapshots_url,
        "digests": str(digests), "steps": 40, "truncated_by": 14, "kill_at": 22}
    killed = _trainer(cfg)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    recorded = {d["step"]: d["digest"] for d in map(json.loads, digests.read_text().splitlines())}
    assert max(recorded) == 22

    restarted = _trainer({**cfg, "steps": 6, "truncated_by": -1, "kill_at": -1})
    assert restarted.returncode == 0, restarted.stderr[-3000:]
    line = next(ln for ln in restarted.stdout.splitlines() if ln.startswith("RESTORED "))
    restored = json.loads(line[len("RESTORED "):])
    # Commits are asynchronous: the kill may cut the newest one or two short.
    assert 20 <= restored["step"] <= 22
    assert restored["digest"] == recorded[restored["step"]]
    assert restored["snapshot"] is not None
    with pytest.raises(TruncatedHistoryError):
        replay(run, Target("version", 1))
    # The restarted trainer's snapshotter took its killed predecessor's lease back and
    # snapshotted on; closing it took the due one, so the tail is shorter than the interval.
    _, report = replay(run)
    assert report.step == restored["step"] + 6
    assert report.snapshot_version > restored["snapshot_version"] and report.tail_versions < 5


def test_a_log_outage_pauses_trainer_snapshots_and_the_next_version_is_snapshotted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A snapshot that meets an unreachable log is skipped with a warning, not given up for
    the rest of the run: the next due version is snapshotted, and a restore starts there."""
    from eventlog import EventLogError
    from snapshotter import service

    monkeypatch.setattr(service, "RETRY_AFTER_S", 0.0)
    real, tried = service.Snapshotter.publish, []

    def outage_once(self: Snapshotter, source: service.SnapshotSource, t0: float | None = None) -> object:
        tried.append(source.version)
        if len(tried) == 1:
            raise EventLogError("reading offsets of rewind.r.control [0] (no partition leader answered)")
        return real(self, source, t0)

    monkeypatch.setattr(service.Snapshotter, "publish", outage_once)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    with caplog.at_level("WARNING", logger="snapshotter.service"), \
            Recorder(_address(tmp_path), model, opt, snapshots=every_versions(2)) as rec:
        for step in range(4):
            _train(model, opt)
            rec.commit(step, wait=True)
    assert tried == [2, 3]
    assert "snapshot of run 'r' not written (EventLogError: reading offsets" in caplog.text
    fresh = torch.nn.Linear(8, 4)
    with Recorder(_address(tmp_path), fresh, torch.optim.Adam(fresh.parameters())) as rec:
        result = rec.restore()
    assert (result.snapshot_version, result.version, result.tail) == (3, 4, 1)
    assert torch.equal(fresh.weight, model.weight)


def test_a_run_restored_with_fewer_objects_keeps_the_others_states_and_verifies(tmp_path: Path) -> None:
    """A restart that records fewer objects (no scheduler now) still seals versions a replay
    verifies: the states it no longer records are carried forward, as the fold keeps them."""
    db = tmp_path / "rewind.db"
    address = RunAddress(f"sqlite://{db}", f"sqlite://{db}", "fewer")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    with Recorder(address, model, opt, sched) as rec:
        for step in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            sched.step()
            rec.commit(step, wait=True)
    with Recorder(address, model, opt) as rec:
        assert rec.restore().version == 2
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        rec.commit(2, wait=True)
    state, _ = replay(address, Target.parse("latest"))
    assert state.version == 3
    assert "scheduler" in state.small.states
