"""Multi-rank runs on real ranks (gloo, CPU, ``tests/multirank_trainer.py``), all launched by one
launcher process (a module fixture) to keep the suite short:

* a 2-rank FSDP2 job killed at four points in turn (between steps, inside a rank's part,
  inside the global seal, after a part and before the seal), each time restarted whole by
  the launcher, ends bit-equal to one uninterrupted run; every crashed part is skipped as
  unsealed and its version number is never sealed; on Kafka, one kill inside a commit;
  each restore at the recorded world size folds only the rank's own shards;
* DDP replica drift fails that version's commit, naming rank and tensor;
* a run recorded at 4 ranks restores at 2 (every full tensor bit-equal to the recorded full
  state) and continues, grows back to 4, then restores at 3 (which does not divide its 8
  shards); a run of 3 shards restores at 2; ``export`` and a ``Follower`` of it get full
  tensors; a 2-rank run restores into a plain model;
* the random-kill matrix: FSDP2 jobs at 2 and 4 ranks, on each backend, each killed on a
  random rank at ``REWIND_MULTIRANK_MATRIX`` (default 10) random points drawn from a printed
  seed (2 in 5 inside a commit), restarted whole after each, end bit-equal to an
  uninterrupted run (``REWIND_MULTIRANK_MATRIX=0`` leaves it out)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import safetensors.torch
import torch

import rewind
from eventlog.backends import RunAddress
from eventlog.capture import rebuilt_tensors
from eventlog.events import SMALL_STATE_TYPES, EnvironmentFingerprint, Resumed
from eventlog.fold.engine import events, index_control
from eventlog.ports import CONTROL
from eventlog.target import Target
from replayer.export import export
from replayer.follower import Follower
from replayer.replay import replay
from tests.conftest import KAFKA, REDIS, make_address
from tests.multirank_trainer import IN, KILL_WITHIN, Sampler, random_kills, tiny_model

# Its module-scoped fixture is built once: every test of the file on one xdist worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_multirank")]

TRAINER = Path(__file__).with_name("multirank_trainer.py")
STEPS = 6
# One kill per round; each round restarts the whole job, which restores and goes on.
# Rank 0's transactions of a round alternate: its part of a version, then that version's seal.
CHAIN = ["step:1:2", "emit:0:3:2", "emit:0:4:0", "part:1:2"]
# Rounds whose previous round's crash left a part no seal names, and why.
LEAVES_PART = {3: "inside the global seal", 4: "after rank 1's part, before the seal"}
KAFKA_KILL = ["part:1:3"]
#: Kills per job of the random-kill matrix (each kill is one more launch of the job).
MATRIX = os.environ.get("REWIND_MULTIRANK_MATRIX", "10")


class Jobs:
    """Every job's run address, output directory and outcome."""

    def __init__(self, root: Path, config: pytest.Config) -> None:
        self.root = root
        # The launcher stops a minute before pytest-timeout would, so a failure has its output.
        self.timeout = float(config.getini("timeout") or 900) - 60
        self.specs: list[dict[str, Any]] = []
        self.addresses: dict[str, RunAddress] = {}
        self.outcome: dict[str, list[dict[str, Any]]] = {}

    def add(self, name: str, address: RunAddress, nproc: int = 2, **cfg: Any) -> None:
        self.addresses[name] = address
        self.specs.append({"name": name, "nproc": nproc, "cfg": {
            "log": address.log_url, "coord": address.coord_url, "run": address.run_id,
            "out": str(self.out(name)), "steps": STEPS, **cfg}})

    def out(self, name: str) -> Path:
        return self.root / name

    def run(self) -> None:
        timeout = self.timeout
        path = self.root / "jobs.json"
        path.write_text(json.dumps(self.specs))
        # A session of its own: on a timeout, every process of it (launcher, agents, ranks) is
        # asked for its threads' stacks, then killed.
        launcher = subprocess.Popen([sys.executable, str(TRAINER), str(path)], text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=self.root,
                                    start_new_session=True)
        try:
            _, stderr = launcher.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _, stderr = self._stop(launcher)
            raise AssertionError(f"the jobs ran past {timeout:g} s; rounds so far: {self.so_far()}\n"
                                 f"{self.hangs()}\n{stderr[-3000:]}") from None
        assert launcher.returncode == 0, stderr[-3000:]
        assert not self.hangs(), self.hangs()
        for r in json.loads(path.with_name("jobs.json.out").read_text()):
            self.outcome.setdefault(r["name"], []).append(r)

    def _stop(self, launcher: subprocess.Popen[str]) -> tuple[str, str]:
        """Ask every process of the launcher's session for its stacks (SIGUSR1, see
        ``multirank_trainer``), give them a moment to write them, then kill them all."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGUSR1)
            time.sleep(3)
            os.killpg(launcher.pid, signal.SIGKILL)
        return launcher.communicate()

    def so_far(self) -> str:
        """Each finished round's job, number, outcome and seconds."""
        out = self.root / "jobs.json.out"
        if not out.exists():
            return "none"
        return ", ".join(f"{r['name']}#{r['round']} {'ok' if r['ok'] else 'failed'} {r['seconds']} s"
                         for r in json.loads(out.read_text()))

    def hangs(self) -> str:
        """The stacks of every process that hung (see ``multirank_trainer``), file by file."""
        found = sorted([*self.root.glob("hang*.txt"), *self.root.glob("*/hang*.txt")])
        return "\n".join(f"{p}:\n{p.read_text()[-4000:]}" for p in found if p.stat().st_size)

    def ok(self, name: str, why: str = "") -> None:
        """The job's last round ended well, and every round before it failed (its kill)."""
        *killed, last = self.outcome[name]
        assert last["ok"], f"{why}\n{last['error']}"
        assert not [r["round"] for r in killed if r["ok"]], f"{why}: rounds whose kill never fired"

    def ranks(self, name: str, world: int = 2) -> list[dict[str, Any]]:
        return [_read(self.out(name) / f"rank{r}.msgpack") for r in range(world)]

    def rounds(self, name: str) -> list[dict[str, Any]]:
        return [json.loads((self.out(name) / f"round{k}.json").read_text())
                for k in range(len(list(self.out(name).glob("round*.json"))))]


def _read(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = msgpack.unpackb(path.read_bytes(), raw=False)
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config) -> Jobs:
    root = tmp_path_factory.mktemp("multirank")
    j = Jobs(root, pytestconfig)

    def snaps(name: str) -> dict[str, Any]:
        return {"snapshots": f"file://{root}/snaps-{name}", "snapshot_every": 3}

    j.add("uninterrupted", make_address("embedded", root / "u", "u"), full=True, **snaps("u"))
    j.add("chain", make_address("embedded", root / "c", "c"), kills=CHAIN, **snaps("c"))
    if KAFKA and REDIS:
        j.add("kafka", make_address("kafka", root), kills=KAFKA_KILL, **snaps("k"))
    j.add("ddp", make_address("embedded", root / "d", "d"), mode="ddp", perturb="1:3")
    at4 = make_address("embedded", root / "r", "r")
    j.add("at4", at4, nproc=4, full=True)
    j.add("at2", at4, full=True, steps=STEPS + 2)
    j.add("grow", at4, nproc=4, full=True, steps=STEPS + 3)
    j.add("at3", at4, nproc=3, full=True, steps=STEPS + 4)
    for name in ("u", "c", "d", "r"):
        (root / name).mkdir()
    j.run()
    return j


def _check_chain(jobs: Jobs, name: str, leaves_part: dict[int, str], *, world: int = 2, steps: int = STEPS,
                 why: str = "") -> None:
    """The killed job ``name`` ended bit-equal, on every rank, to the job ``uninterrupted``; no
    dead part's version number was sealed, and a replay skips every dead part's records."""
    jobs.ok(name, why)
    assert jobs.ranks(name, world) == jobs.ranks("uninterrupted", world), why
    rounds = jobs.rounds(name)
    address = jobs.addresses[name]
    with address.open_log() as log:
        seals = index_control(log).seals
    assert len(seals) == steps, why
    for k, crash in leaves_part.items():
        assert rounds[k]["orphans"], f"a crash {crash} should leave a part no seal names"
    # Each round sees the parts the crashes before it left (those below a newer seal it saw
    # already): every dead part's version number is skipped, never sealed by a retry, and a
    # replay skips each of its records.
    orphans: dict[str, int] = {}
    for r in rounds:
        orphans.update(r["orphans"])
    assert not {int(v) for v in orphans} & set(seals), why
    state, _ = replay(address, use_snapshots=False)
    assert state.step == steps, why
    assert state.counts.skipped_unsealed == sum(orphans.values()), why


def test_fsdp_killed_at_four_points_then_restarted_is_bit_equal(jobs: Jobs) -> None:
    steps = [r["step"] or 0 for r in jobs.rounds("chain")]
    assert len(steps) == len(CHAIN) + 1 and steps == sorted(steps) and steps[-1] < STEPS
    _check_chain(jobs, "chain", LEAVES_PART)


@pytest.mark.skipif(not (KAFKA and REDIS), reason="kafka services not configured")
def test_fsdp_killed_inside_a_commit_on_kafka_is_bit_equal(jobs: Jobs) -> None:
    _check_chain(jobs, "kafka", {1: "after rank 1's part, before the seal"})


def test_each_rank_restores_by_folding_only_its_own_shards(jobs: Jobs) -> None:
    """Each restore of the chain applies, on rank r, the tail's small-state events and the
    tail's events on rank r's two shards: nothing of the other rank's shards."""
    tails = 0
    with jobs.addresses["chain"].open_log() as log:
        sealed = set(index_control(log).seals)
        for k in range(1, len(CHAIN) + 1):
            got = [json.loads((jobs.out("chain") / f"restore{k}-rank{r}.json").read_text()) for r in range(2)]
            after, upto = got[0]["snapshot_version"], got[0]["version"]
            assert all((g["snapshot_version"], g["version"]) == (after, upto) for g in got)

            def tail(partitions: list[int], after: int = after, upto: int = upto) -> int:
                return sum(1 for p in partitions for _, _, env in events(log, p)
                           if after < env.version <= upto and env.version in sealed
                           and (p != CONTROL or isinstance(env.body, SMALL_STATE_TYPES)))

            control, own = tail([CONTROL]), [tail([2 * r, 2 * r + 1]) for r in range(2)]
            assert [g["applied"] for g in got] == [control + n for n in own], k
            tails += all(n > 0 for n in own)
    assert tails, "no restore in the chain folded a tail on both ranks"


def test_ddp_replica_drift_fails_that_versions_commit(jobs: Jobs) -> None:
    assert not jobs.outcome["ddp"][0]["ok"]
    for rank in range(2):
        said = (jobs.out("ddp") / f"error-rank{rank}.txt").read_text()
        assert ("replica drift at version 3: rank 1's copy of replicated tensor 'model/0.weight' "
                "digest") in said, said
    with jobs.addresses["ddp"].open_log() as log:
        assert index_control(log).latest_version() == 2
    # Recorded without DDP's wrapper: a plain model follows the run under its own names.
    state, _ = replay(jobs.addresses["ddp"])
    with Follower(jobs.addresses["ddp"], tiny_model()) as follower:
        assert follower.poll().version_after == 2
        got = follower.model.state_dict()
    want = {n.removeprefix("model/"): t for n, t in rebuilt_tensors(state).items() if n.startswith("model/")}
    assert sorted(want) == sorted(got) and all(torch.equal(got[k], want[k]) for k in want)


def test_recorded_at_4_ranks_restores_at_2_bit_equal_and_continues(jobs: Jobs) -> None:
    jobs.ok("at4")
    jobs.ok("at2")
    recorded = _read(jobs.out("at4") / "full-final.msgpack")
    restored = _read(jobs.out("at2") / "full-restored.msgpack")
    assert sorted(recorded) == sorted(restored) and len(recorded) == 6 + 3 * 6
    assert restored == recorded
    assert json.loads((jobs.out("at2") / "round0.json").read_text())["step"] == STEPS
    # Rank r of 2 went on from recorded rank r's sampler.
    for rank, (was, now) in enumerate(zip(jobs.ranks("at4", 4), jobs.ranks("at2"), strict=False)):
        assert _advanced(was["sampler"], rank, 2) == now["sampler"]


def test_recorded_at_2_ranks_grows_to_4(jobs: Jobs) -> None:
    jobs.ok("grow")
    assert _read(jobs.out("grow") / "full-restored.msgpack") == _read(jobs.out("at2") / "full-final.msgpack")
    # The new ranks 2 and 3 went on from recorded ranks 0 and 1's sampler.
    at2 = jobs.ranks("at2")
    for rank, now in enumerate(jobs.ranks("grow", 4)):
        assert _advanced(at2[rank % 2]["sampler"], rank, 1) == now["sampler"]
    # The run, recorded at 4, 2 and 4 ranks, verifies.
    state, _ = replay(jobs.addresses["at4"], Target("step", STEPS + 3), use_snapshots=False)
    assert state.step == STEPS + 3


def test_recorded_at_4_ranks_restores_at_3_that_does_not_divide_its_shards(jobs: Jobs) -> None:
    jobs.ok("at3")
    # 8 shards over 3 ranks: 2, 3 and 3; rows of 6, 5 and 4 cut 2+2+2, 2+2+1 and 2+2+0.
    assert _read(jobs.out("at3") / "full-restored.msgpack") == _read(jobs.out("grow") / "full-final.msgpack")
    grow = jobs.ranks("grow", 4)
    for rank, now in enumerate(jobs.ranks("at3", 3)):
        assert _advanced(grow[rank]["sampler"], rank, 1) == now["sampler"]
    # Its version at 3 ranks, each rank's part on shards of its own, is sealed and verifies.
    state, _ = replay(jobs.addresses["at4"], use_snapshots=False)
    assert state.step == STEPS + 4
    assert sorted({s.shard for s in state.layout.tensors if s.name.startswith("rank1/")}) == [2, 3, 4]


def test_a_restore_writes_into_the_ranks_own_parameters_and_moments(tmp_path: Path,
                                                                  pytestconfig: pytest.Config) -> None:
    """Once its optimizer has stepped, a rank restores as ``dcp.load`` does: every local
    parameter and moment keeps its storage and gets the recorded bits back, bit-equal. The
    version restored is snapshotted (the ranks map the snapshot); the version committed next
    is encoded against that base and replays to its seal."""
    jobs = Jobs(tmp_path, pytestconfig)
    (tmp_path / "t").mkdir()
    address = make_address("embedded", tmp_path / "t", "t")
    jobs.add("again", address, restore_again=True)
    jobs.run()
    jobs.ok("again")
    got = [json.loads((jobs.out("again") / f"again-rank{r}.json").read_text()) for r in range(2)]
    assert got == [{"same_storage": True, "equal": True, "tail": 0}] * 2
    state, report = replay(address, use_snapshots=False)
    assert (state.step, report.tail_versions) == (STEPS + 1, STEPS + 1)


def test_a_3_shard_run_restores_at_2_ranks_bit_equal(tmp_path: Path, pytestconfig: pytest.Config) -> None:
    """Any world size up to the run's shard count restores, not only one that divides it: a
    run of 3 shards (3 ranks of ``shards=1``) restores at 2 ranks, every full tensor bit-equal
    to the recorded full state, and goes on with rank 0 on shard 0 and rank 1 on shards 1-2."""
    jobs = Jobs(tmp_path, pytestconfig)
    address = make_address("embedded", tmp_path / "t", "t")
    (tmp_path / "t").mkdir()
    jobs.add("at3", address, nproc=3, full=True, shards=1)
    jobs.add("at2", address, nproc=2, full=True, shards=1, steps=STEPS + 2)
    jobs.run()
    jobs.ok("at3")
    jobs.ok("at2")
    assert _read(jobs.out("at2") / "full-restored.msgpack") == _read(jobs.out("at3") / "full-final.msgpack")
    state, _ = replay(address, use_snapshots=False)
    assert state.step == STEPS + 2 and len(state.shards) == 3
    owned = [sorted({t.shard for t in state.layout.tensors if t.name.startswith(f"rank{r}/")}) for r in "01"]
    assert owned == [[0], [1, 2]]


def _advanced(state: dict[str, int], rank: int, batches: int) -> dict[str, int]:
    sampler = Sampler(48, 8, seed=rank)
    sampler.load_state_dict(state)
    for _ in range(batches):
        sampler.next()
    return sampler.state_dict()


def _full_by_name(full: dict[str, Any], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    like = {k.removeprefix("model/"): v for k, v in model.state_dict().items()}
    return {k: torch.frombuffer(bytearray(full[f"model/{k}"]), dtype=t.dtype).reshape(t.shape)
            for k, t in like.items()}


def test_export_and_follower_of_a_sharded_run_get_full_tensors(jobs: Jobs, tmp_path: Path) -> None:
    address = jobs.addresses["at4"]
    model = tiny_model()
    recorded = _full_by_name(_read(jobs.out("at4") / "full-final.msgpack"), model)
    state, report = replay(address, Target("version", _version_of_step(address, STEPS)))
    export(state, report, tmp_path / "hf", "safetensors")
    got = safetensors.torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert got.keys() == recorded.keys()
    assert all(torch.equal(got[k].view(torch.uint8), recorded[k].view(torch.uint8)) for k in got)
    export(state, report, tmp_path / "pt", "torch")
    opt = torch.load(tmp_path / "pt" / "optimizer.pt", weights_only=True)
    assert list(opt["state"][0]["exp_avg"].shape) == [6, IN]

    latest = _full_by_name(_read(jobs.out("at3") / "full-final.msgpack"), model)
    with Follower(address, model) as follower:
        assert follower.poll().version_after == _version_of_step(address, STEPS + 4)
        live = model.state_dict()
        assert all(torch.equal(live[k], latest[k]) for k in latest)


def test_history_diff_and_verify_read_a_sharded_run(jobs: Jobs) -> None:
    """The audit commands on a run recorded at 4 ranks and continued at 2 and 3: every
    version is listed and verifies; a version diffs equal to itself, not to the next."""
    address = jobs.addresses["at4"]
    with address.open_log() as log:
        sealed = sorted(index_control(log).seals)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return _cli(address, *args)

    verified = cli("verify")
    assert verified.returncode == 0, verified.stdout[-2000:] + verified.stderr[-2000:]
    history = cli("history")
    assert history.returncode == 0, history.stderr
    rows = json.loads(history.stdout)["rows"]
    assert [r["version"] for r in rows if r["kind"] == "version"] == sealed
    same = cli("diff", "--from", f"version={sealed[-1]}", "--to", f"version={sealed[-1]}", "--exit-code")
    moved = cli("diff", "--from", f"version={sealed[-2]}", "--to", f"version={sealed[-1]}", "--exit-code")
    assert (same.returncode, moved.returncode) == (0, 1), (same.stderr, moved.stderr)
    assert json.loads(moved.stdout)["differs"] is True


def test_verify_passes_the_version_numbers_a_restart_skipped(jobs: Jobs) -> None:
    """Each restart of the killed job skipped the version number of the part its crash left:
    those are no missing seals, and the run verifies (snapshots included); a replay counts
    the versions it replayed, not the numbers."""
    address = jobs.addresses["chain"]
    with address.open_log() as log:
        seals = index_control(log).seals
    skipped = sorted(set(range(1, max(seals) + 1)) - set(seals))
    assert skipped, "no restart skipped a version number"
    assert replay(address, use_snapshots=False)[1].tail_versions == len(seals)  # not max(seals)
    verified = _cli(address, "verify", "--snapshots", f"file://{jobs.root}/snaps-c")
    assert verified.returncode == 0, verified.stdout[-2000:] + verified.stderr[-2000:]
    report = json.loads(verified.stdout)
    assert report["ok"] and len(report["failed_snapshots"]) == 0 and not report["damaged"], report
    # Rank 0 logged the run's environment once, and a proof of each restore that loaded a
    # version, which verify checked against its seal.
    with address.open_log() as log:
        logged = [env.body for _, env in index_control(log).environment]
    restored = [r["step"] for r in jobs.rounds("chain") if r["step"]]
    assert [b.reason for b in logged if isinstance(b, EnvironmentFingerprint)].count("start") == 1
    assert [b.restored_step for b in logged if isinstance(b, Resumed)] == restored
    proofs = [f for f in report["findings"] if f["subject"].startswith("resume at")]
    assert len(proofs) == len(restored) and all(f["status"] == "ok" for f in proofs), proofs


def _cli(address: RunAddress, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m rewind.cli`` on the run, with ``--json``."""
    return subprocess.run([sys.executable, "-m", "rewind.cli", *args, "--log", address.log_url,
                           "--coord", address.coord_url, "--run", address.run_id, "--json"],
                          capture_output=True, text=True, timeout=300)


def _version_of_step(address: RunAddress, step: int) -> int:
    with address.open_log() as log:
        return next(v for v, s in index_control(log).seals.items() if s.step == step)


def test_two_rank_run_restores_into_a_plain_model(jobs: Jobs) -> None:
    address = jobs.addresses["uninterrupted"]
    recorded = _read(jobs.out("uninterrupted") / "full-final.msgpack")
    final0 = jobs.ranks("uninterrupted")[0]
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    sampler = Sampler(48, 8, seed=0)
    with rewind.Recorder(address, model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                         rng=False) as rec:
        assert rec.restore().step == STEPS
        with pytest.raises(rewind.ConfigError, match=r"was recorded by 2 ranks: a Recorder without group=.* "
                                                     r"at any world size up to its shard count \(4\)"):
            rec.commit(STEPS + 1)
    live = model.state_dict()
    assert all(torch.equal(live[k], v) for k, v in _full_by_name(recorded, model).items())
    for i, st in optimizer.state_dict()["state"].items():
        for k, v in st.items():
            want = torch.frombuffer(bytearray(recorded[f"optimizer/{i}/{k}"]), dtype=v.dtype).reshape(v.shape)
            assert torch.equal(v, want), (i, k)
    assert sampler.state_dict() == final0["sampler"]
    assert scheduler.state_dict()["last_epoch"] == final0["scheduler"]["last_epoch"]


@pytest.mark.skipif(not MATRIX.isdigit() or int(MATRIX) < 1,
                    reason="REWIND_MULTIRANK_MATRIX=0: the random-kill matrix is left out")
@pytest.mark.parametrize("backend", ["embedded", pytest.param("kafka", marks=pytest.mark.kafka)])
@pytest.mark.parametrize("world", [2, 4])
def test_random_kill_matrix(world: int, backend: str, tmp_path: Path, pytestconfig: pytest.Config) -> None:
    """FSDP2 + AdamW + a scheduler + a per-rank sampler, killed on a random rank at random
    points (``random_kills``), restarted whole after each kill, restored and continued: every
    rank's final parameters, optimizer state, scheduler, sampler and RNGs are bit-equal to an
    uninterrupted run's."""
    count = int(MATRIX)
    seed = int(os.environ.get("REWIND_MULTIRANK_SEED") or random.SystemRandom().randrange(2**31))
    kills = random_kills(count, world, seed)
    steps = count * (KILL_WITHIN + 1) + 2  # every kill fires before the job ends
    for name in ("u", "k"):
        (tmp_path / name).mkdir()
    jobs = Jobs(tmp_path, pytestconfig)
    for name, address, cfg in (
            ("uninterrupted", make_address("embedded", tmp_path / "u", "u"), {}),
            ("killed", make_address(backend, tmp_path / "k", "k" if backend == "embedded" else None),
             {"kills": kills})):
        jobs.add(name, address, nproc=world, steps=steps, snapshots=f"file://{tmp_path}/snaps-{name}",
                 snapshot_every=4, **cfg)
    jobs.run()
    rounds = [r["seconds"] for r in jobs.outcome["killed"]]
    print(f"random kill matrix, {world} ranks, {backend}: seed {seed}, uninterrupted "
          f"{jobs.outcome['uninterrupted'][0]['seconds']} s, rounds {rounds} s")
    _check_chain(jobs, "killed", {}, world=world, steps=steps,
                 why=f"REWIND_MULTIRANK_SEED={seed} ({world} ranks, {backend}): kills {kills}")
