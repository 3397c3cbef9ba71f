"""Broker failures on the 3-broker KRaft cluster (``scripts/services start --brokers 3``).

A trainer subprocess commits a tiny model with ``commit(step, wait=True)`` to
``kafka://b1,b2,b3?replication=3`` and Redis, printing each commit's version, latency and
state digest, while the test SIGKILLs brokers: the control partition's leader, then a
tensor partition's leader (a replay starting right after each kill), then 2 of 3 brokers
(below ``min.insync.replicas``). Every acknowledged version must be sealed, replays must be
bit-exact, and no commit may take longer than ``COMMIT_BOUND_S``. Killed nodes are restarted.

Run as ``python -m tests.test_kafka_cluster LOG COORD RUN STOPFILE`` it is the trainer.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
from confluent_kafka.admin import AdminClient

from eventlog.kafka import COMMIT_ATTEMPT_S, VISIBLE_WAIT_S

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = os.environ.get("REWIND_TEST_KAFKA_CLUSTER", "")
PIDFILES = [p for p in os.environ.get("REWIND_KAFKA_CLUSTER_PIDFILES", "").split(",") if p]
REDIS = os.environ.get("REWIND_TEST_REDIS", "")
#: The cluster fences a dead broker after broker.session.timeout.ms (6 s, scripts/kafka);
#: the new leader is elected then, and the clients find it within their metadata refresh
#: (eventlog.kafka.config.METADATA_REFRESH_MS, 5 s) or at once on a failed request. This is twice
#: that, with room for a loaded 2-core test machine.
COMMIT_BOUND_S = 25.0
#: Commits the trainer makes before it looks at the stop file.
MIN_COMMITS = 100
PACE_S = 0.1  # between commits: a few hundred versions per run, not thousands


# ---------------------------------------------------------------------------- the processes
def _model() -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(log_url: str, coord_url: str, run_id: str, stop_file: Path, mode: str, snapshots: str) -> None:
    """Commit a tiny model until ``stop_file`` exists (and, waiting, MIN_COMMITS are done), taking a
    snapshot every 10 versions. ``wait``: ``commit(step, wait=True)``, then print ``commit
    VERSION STARTED_AT SECONDS DIGEST MODEL_DIGEST``. ``nowait``: commits stay in flight;
    print ``queued STEP DIGEST`` as each is queued and the ``commit`` line once it is durable.
    Restores first: a restart prints ``restored STEP DIGEST``."""
    import torch

    from rewind import Recorder, RunAddress, Snapshots, every_versions, keep_last
    from rewind.demo.digest import digest_of

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    model, opt = _model()
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    out = threading.Lock()

    def say(line: str) -> None:
        with out:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    address = RunAddress(log_url, coord_url, run_id, snapshots)
    with Recorder(address, model, opt, rng=False, shards=1,
                  snapshots=Snapshots(every_versions(10), keep=keep_last(3))) as rec:
        start = rec.restore()
        step = 0 if start.fresh else int(start.step or 0)
        if not start.fresh:
            say(f"restored {step} {digest_of({'model': model, 'optimizer': opt})}")
        while (mode == "wait" and step < MIN_COMMITS) or not stop_file.exists():
            step += 1
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            digest = digest_of({"model": model, "optimizer": opt})
            model_digest = digest_of({"model": model})
            started, t0 = time.time(), time.monotonic()
            if mode == "nowait":
                say(f"queued {step} {digest}")

            def done(future: Any, started: float = started, t0: float = t0, digest: str = digest,
                     model_digest: str = model_digest) -> None:
                if future.exception() is None:
                    result = future.result()
                    say(f"commit {result.version} {started:.3f} {time.monotonic() - t0:.3f} "
                        f"{digest} {model_digest}")

            rec.commit(step, wait=mode == "wait").add_done_callback(done)
            time.sleep(PACE_S)


def follow(log_url: str, coord_url: str, run_id: str, stop_file: Path) -> None:
    """Follow the run's newest version until ``stop_file`` exists; print ``followed VERSION
    MODEL_DIGEST`` each time the model moves (and a last poll after the stop)."""
    from rewind import Follower, RunAddress, RunNotFoundError
    from rewind.demo.digest import digest_of

    model, _ = _model()
    with Follower(RunAddress(log_url, coord_url, run_id), model, max_lag=4) as follower:
        while True:
            stopping = stop_file.exists()
            try:
                moved = follower.poll().mode != "noop"
            except RunNotFoundError:
                moved = False
            if moved:
                print(f"followed {follower.version} {digest_of({'model': model})}", flush=True)
            if stopping:
                return
            time.sleep(0.2)


# ---------------------------------------------------------------------------- the test side
@dataclass(frozen=True)
class Commit:
    version: int
    started: float  # wall clock
    seconds: float
    digest: str
    model_digest: str


class Child:
    """A subprocess of this module, its output in files (read while it runs)."""

    #: Every child started; the ``cluster`` fixture kills those a failed test left running.
    started: list[Child] = []

    def __init__(self, tmp_path: Path, name: str, args: list[str]) -> None:
        self.stderr_path = tmp_path / f"{name}.err"
        self._out_path = tmp_path / f"{name}.out"
        self._out: IO[str] = self._out_path.open("w")
        self._err: IO[str] = self.stderr_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.test_kafka_cluster", *args], cwd=ROOT,
                                     stdout=self._out, stderr=self._err, text=True)
        Child.started.append(self)

    def lines(self, kind: str) -> list[list[str]]:
        """The printed lines that start with ``kind``, split into words."""
        return [line.split()[1:] for line in self._out_path.read_text().splitlines()
                if line.startswith(f"{kind} ")]

    def stderr(self) -> str:
        return self.stderr_path.read_text()[-3000:]

    def wait(self, timeout: float = 120) -> None:
        try:
            self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._out.close()
            self._err.close()
        assert self.proc.returncode == 0, self.stderr()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)
        self._out.close()
        self._err.close()

    @classmethod
    def kill_leftovers(cls) -> None:
        """Kill the children still running (a test that failed before stopping them would
        leave a trainer committing for the rest of the suite)."""
        for child in cls.started:
            if child.proc.poll() is None:
                child.kill()
        cls.started.clear()


class Trainer(Child):
    """The trainer subprocess (``train``) and what it printed so far."""

    def __init__(self, tmp_path: Path, run_id: str, mode: str = "wait", name: str = "trainer") -> None:
        self.log_url = f"kafka://{CLUSTER}?prefix=rewindcluster&replication=3"
        self.coord_url, self.run_id = REDIS, run_id
        self.snapshots_url = f"file://{tmp_path / 'snapshots'}"
        self.stop_file = tmp_path / "stop"
        super().__init__(tmp_path, name, [mode, self.log_url, self.coord_url, run_id, str(self.stop_file),
                                          self.snapshots_url])

    def commits(self) -> list[Commit]:
        """The acknowledged commits, by version."""
        done = [Commit(int(v), float(at), float(secs), d, m) for v, at, secs, d, m in self.lines("commit")]
        return sorted(done, key=lambda c: c.version)

    def wait_for(self, count: int, timeout: float, why: str) -> list[Commit]:
        """Wait until ``count`` commits are acknowledged."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = self.commits()
            if len(done) >= count:
                return done
            assert self.proc.poll() is None, f"trainer exited {self.proc.returncode}: {self.stderr()}"
            time.sleep(0.1)
        raise AssertionError(f"{why}: {len(self.commits())} commits after {timeout:.0f} s, "
                             f"not {count}\n{self.stderr()}")

    def finish(self) -> list[Commit]:
        self.stop_file.touch()
        self.wait()
        return self.commits()

    def follower(self, tmp_path: Path, stop_file: Path) -> Child:
        """A follower of this run, until ``stop_file`` exists."""
        return Child(tmp_path, "follower", ["follow", self.log_url, self.coord_url, self.run_id,
                                             str(stop_file)])


def _partitions(topic: str) -> dict[int, tuple[int, list[int]]]:
    """``{partition: (leader, isr)}`` of ``topic``."""
    md = AdminClient({"bootstrap.servers": CLUSTER, "log_level": 0}).list_topics(topic, timeout=10)
    return {p: (pm.leader, list(pm.isrs)) for p, pm in md.topics[topic].partitions.items()}


def _kill(node: int) -> int:
    """SIGKILL ``node``; returns its pid."""
    pid = int(Path(PIDFILES[node - 1]).read_text())
    os.kill(pid, signal.SIGKILL)
    return pid


def _gone(*pids: int) -> None:
    """Wait until killed JVMs have exited (it takes a moment; their parent, init, reaps them).
    On a loaded machine a killed broker's exit has taken over 15 s, and ``scripts/kafka start``
    counts a node whose process still runs ``kafka.Kafka`` as up and waits for it in vain."""
    deadline = time.monotonic() + 120
    while True:
        alive = [pid for pid in pids if _is_broker(pid)]
        if not alive:
            return
        assert time.monotonic() < deadline, f"killed brokers still running after 120 s: {alive}"
        time.sleep(0.05)


def _is_broker(pid: int) -> bool:
    """``pid`` is a process (not another's thread: ``/proc`` answers for those too) running Kafka."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return f"\nTgid:\t{pid}\n" in status and "kafka.Kafka" in cmdline


def _start(node: int | None = None) -> subprocess.Popen[str]:
    """Start restarting ``node`` (every node that is down if ``None``); ``_started`` waits.
    The nodes are the ones the pid files name (``scripts/kafka env``), wherever this tree
    is: a tree of its own would format new nodes, of another cluster."""
    args = [str(ROOT / "scripts" / "kafka"), "start", "--brokers", "3"]
    env = dict(os.environ)
    env.setdefault("REWIND_STATE_DIR", str(Path(PIDFILES[0]).parents[2]))
    if os.environ.get("REWIND_KAFKA_HOME"):  # <cache>/kafka/<version>/libs
        env.setdefault("REWIND_CACHE_DIR", str(Path(os.environ["REWIND_KAFKA_HOME"]).parents[2]))
    return subprocess.Popen(args + ([] if node is None else ["--node", str(node)]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _started(proc: subprocess.Popen[str]) -> None:
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]


def _wait_in_sync(topics: list[str], timeout: float = 60) -> None:
    """Wait until every replica is back in sync, so that the next kill keeps min.insync.replicas."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if all(len(isr) == 3 for t in topics for _, isr in _partitions(t).values()):
                return
        except Exception:  # noqa: BLE001 - metadata while nodes come back: ask again
            pass
        assert time.monotonic() < deadline, f"replicas of {topics} not back in sync after {timeout} s"
        time.sleep(0.5)


def _replay(trainer: Trainer) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", "from rewind.cli import main; main()", "replay", "--to", "latest",
         "--json", "--log", trainer.log_url, "--coord", trainer.coord_url, "--run", trainer.run_id],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _replayed(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    data = json.loads(out)
    report: dict[str, object] = data.get("report", data)
    return report


def _sealed(trainer: Trainer) -> list[int]:
    """The run's sealed versions, as a reader sees them."""
    from eventlog import RunAddress
    from eventlog.fold.engine import index_control

    with RunAddress(trainer.log_url, trainer.coord_url, trainer.run_id).open_log() as log:
        return sorted(index_control(log).seals)


def _assert_all_sealed(trainer: Trainer, commits: list[Commit]) -> None:
    assert [c.version for c in commits] == list(range(1, len(commits) + 1))
    assert _sealed(trainer) == list(range(1, len(commits) + 1))


def _slow(commits: list[Commit], bound: float) -> list[tuple[int, float]]:
    return [(c.version, c.seconds) for c in commits if c.seconds > bound]


def _around(commits: list[Commit], at: float) -> str:
    """The latencies of the commits around wall time ``at`` (for the record)."""
    near = [c for c in commits if at - 2 <= c.started <= at + COMMIT_BOUND_S]
    return ", ".join(f"v{c.version}:{c.seconds:.2f}s" for c in near[:12])


@pytest.fixture
def cluster() -> Iterator[None]:
    """The cluster, with every node running again afterwards."""
    assert CLUSTER and len(PIDFILES) == 3, "REWIND_KAFKA_CLUSTER_PIDFILES must name 3 pid files"
    try:
        yield
    finally:
        Child.kill_leftovers()
        _started(_start())


@pytest.mark.parametrize("code", ["_TIMED_OUT", "_TIMED_OUT_QUEUE"])
def test_failover_refreshes_metadata_before_each_retry(monkeypatch: pytest.MonkeyPatch,
                                                       code: str) -> None:
    """A request to a dead leader times out, sent or still queued for a broker that is not
    connected, until fresh metadata names the new leader."""
    from confluent_kafka import KafkaError, KafkaException

    from eventlog import EventLogError
    from eventlog.kafka import calls as kafka_calls

    calls: list[str] = []

    def ask(timeout: float) -> int:
        calls.append(f"ask {timeout:g}")
        if calls.count("refresh") < 2:
            raise KafkaException(KafkaError(getattr(KafkaError, code)))
        return 7

    def refresh(timeout: float) -> None:
        calls.append("refresh")

    assert kafka_calls.failover("reading offsets of t [0]", ask, refresh) == 7
    assert calls == ["ask 1", "refresh", "ask 2", "refresh", "ask 3"]

    calls.clear()
    monkeypatch.setattr(kafka_calls, "FAILOVER_S", 0.0)
    with pytest.raises(EventLogError, match=r"^reading offsets of t \[0\] \(no partition leader "
                       rf"answered in 0 s of retries with fresh metadata\): {code}:"):
        kafka_calls.failover("reading offsets of t [0]", ask, lambda timeout: None)


def test_failover_retries_an_unknown_partition_only_when_asked_to() -> None:
    """A partition just created is unknown to its leader for a moment (``unknown="retry"``);
    elsewhere an unknown partition fails at once, or goes back to the caller as is."""
    from confluent_kafka import KafkaError, KafkaException

    from eventlog import EventLogError
    from eventlog.kafka import calls as kafka_calls

    def answers() -> Callable[[float], int]:
        left = [2]

        def ask(timeout: float) -> int:
            left[0] -= 1
            if left[0] >= 0:
                raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
            return 7
        return ask

    assert kafka_calls.failover("w", answers(), lambda timeout: None, unknown="retry") == 7
    with pytest.raises(EventLogError, match=r"^w: UNKNOWN_TOPIC_OR_PART"):
        kafka_calls.failover("w", answers(), lambda timeout: None)
    with pytest.raises(KafkaException):
        kafka_calls.failover("w", answers(), lambda timeout: None, unknown="raise")


def _kill_leader(topic: str) -> tuple[int, int, float]:
    """SIGKILL the leader of ``topic`` [0]; returns its node, pid and wall time."""
    leader = _partitions(topic)[0][0]
    return leader, _kill(leader), time.time()


@pytest.mark.kafka_cluster
@pytest.mark.exclusive
@pytest.mark.slow
def test_leader_kills_lose_nothing_and_commits_snapshots_followers_go_on(
        tmp_path: Path, cluster: None) -> None:
    run_id = f"c{os.urandom(5).hex()}"
    trainer = Trainer(tmp_path, run_id)
    follower = trainer.follower(tmp_path, tmp_path / "stop-follower")
    control, tensors = f"rewindcluster.{run_id}.control", f"rewindcluster.{run_id}.tensors"
    notes: list[tuple[str, float]] = []
    reports: list[dict[str, object]] = []
    seen = len(trainer.wait_for(20, 120, "before the first kill"))
    restart, at_kill = None, 0
    for topic in (control, tensors):
        if restart is not None:  # the next kill must leave min.insync.replicas
            _started(restart)
            _wait_in_sync([control, tensors])
        leader, pid, killed_at = _kill_leader(topic)
        replay = _replay(trainer)  # started right after the kill, while the partition is leaderless
        assert time.time() - killed_at < 1.0
        at_kill = len(trainer.commits())
        _gone(pid)
        seen = len(trainer.wait_for(seen + 10, 120, f"after killing node {leader}, leader of {topic}"))
        restart = _start(leader)
        reports.append(_replayed(replay))
        notes.append((f"leader of {topic.rsplit('.', 1)[1]} [0] (node {leader})", killed_at))
    seen = len(trainer.wait_for(max(MIN_COMMITS, seen + 10), 120, "after the restarts"))
    commits = trainer.finish()
    (tmp_path / "stop-follower").touch()  # its last poll comes after the trainer's last commit
    follower.wait()
    for what, at in notes:
        print(f"commit latencies around the kill of the {what}: {_around(commits, at)}")
    _assert_all_sealed(trainer, commits)
    digests = {c.version: c.digest for c in commits}
    for report in reports:
        assert report["state_digest"] == digests[int(str(report["version"]))]
    assert not _slow(commits, COMMIT_BOUND_S), trainer.stderr()
    # The follower went on through both kills, to the last version, every step verified.
    followed = [(int(v), d) for v, d in follower.lines("followed")]
    model_digests = {c.version: c.model_digest for c in commits}
    assert followed[-1][0] == len(commits)
    assert all(model_digests[v] == d for v, d in followed)
    assert any(at_kill < v < len(commits) for v, _ in followed), "the follower stalled at the kills"
    # The trainer's snapshotter went on too: the newest snapshot is after the second kill.
    final = _replayed(_replay(trainer))
    assert final["state_digest"] == commits[-1].digest
    assert int(str(final["snapshot_version"])) > at_kill
    assert restart is not None
    _started(restart)


@pytest.mark.kafka_cluster
@pytest.mark.exclusive
@pytest.mark.slow
def test_commits_in_flight_through_kills_and_below_min_insync_replicas_lose_nothing(
        tmp_path: Path, cluster: None) -> None:
    """``commit(wait=False)``: versions in flight while the control leader dies, then while a
    second broker dies (below ``min.insync.replicas``: commits block and say why), complete
    once one broker returns; a trainer killed with commits in flight restores bit-exact."""
    run_id = f"c{os.urandom(5).hex()}"
    trainer = Trainer(tmp_path, run_id, mode="nowait")
    control, tensors = f"rewindcluster.{run_id}.control", f"rewindcluster.{run_id}.tensors"
    seen = len(trainer.wait_for(20, 120, "before the first kill"))
    first, pid, _ = _kill_leader(control)
    _gone(pid)
    seen = len(trainer.wait_for(seen + 5, 120, "after the control leader's kill"))
    _, pid, _ = _kill_leader(tensors)
    _gone(pid)
    # The commit in flight first waits out its visibility check (bounded), then warns after
    # one commit attempt; the rest is slack for a loaded machine.
    deadline = time.monotonic() + VISIBLE_WAIT_S + COMMIT_ATTEMPT_S + 60
    while "min.insync.replicas" not in trainer.stderr():
        assert time.monotonic() < deadline, f"no warning while commits block: {trainer.stderr()}"
        time.sleep(0.2)
    blocked = len(trainer.commits())
    assert "commit not acknowledged after" in trainer.stderr()
    time.sleep(2)
    assert len(trainer.commits()) == blocked, "a commit completed with 1 of 3 brokers up"
    assert len(trainer.lines("queued")) > blocked, "no commit was in flight while they blocked"
    _started(_start(first))
    trainer.wait_for(blocked + 10, 120, "after one broker returned")
    # Kill the trainer at a moment when a queued commit is not yet acknowledged.
    while True:
        queued = {int(step): digest for step, digest in trainer.lines("queued")}
        if len(queued) > len(trainer.commits()):
            trainer.kill()
            break
        time.sleep(0.005)
    acknowledged = [c.version for c in trainer.commits()]
    _started(_start())
    again = Trainer(tmp_path, run_id, mode="nowait", name="restarted")
    again.wait_for(1, 120, "after the restart")
    again.finish()
    # Every acknowledged version survived; the restore is one queued step, bit for bit.
    [(step, digest)] = again.lines("restored")
    assert int(step) >= acknowledged[-1] and queued[int(step)] == digest
    assert acknowledged == list(range(1, len(acknowledged) + 1))
    assert _sealed(trainer) == list(range(1, int(step) + len(again.commits()) + 1))
    verified = subprocess.run(
        [sys.executable, "-c", "from rewind.cli import main; main()", "verify", "--log", trainer.log_url,
         "--coord", trainer.coord_url, "--run", run_id], capture_output=True, text=True, timeout=300)
    assert verified.returncode == 0, verified.stdout[-3000:] + verified.stderr[-3000:]


@pytest.mark.kafka_cluster
@pytest.mark.exclusive
@pytest.mark.slow
def test_a_snapshot_that_meets_two_dead_brokers_warns_and_leaves_no_orphan_marker(
        tmp_path: Path, cluster: None) -> None:
    """2 of 3 brokers are SIGKILLed as the trainer's first snapshot starts (right after
    version 10, the trigger's): the commit waiting behind it says so in a WARNING within
    15 s, naming what it waits for. Once the brokers return, every version is sealed and
    no snapshot was left with a begin marker and no end marker."""
    from eventlog import RunAddress
    from eventlog.fold.engine import index_control
    from snapshotter.catalog import markers

    run_id = f"c{os.urandom(5).hex()}"
    trainer = Trainer(tmp_path, run_id)
    deadline = time.monotonic() + 120
    while not any(c.version >= 10 for c in trainer.commits()):
        assert time.monotonic() < deadline and trainer.proc.poll() is None, trainer.stderr()
        time.sleep(0.002)
    # Spare the control and tensor leaders where one node leads both: then the snapshot's
    # reads go on, and it meets the outage opening its writer (init_transactions).
    leaders = {_partitions(f"rewindcluster.{run_id}.{topic}")[0][0] for topic in ("control", "tensors")}
    doomed = [n for n in (1, 2, 3) if n not in leaders] if len(leaders) == 1 else [1, 2]
    pids = [_kill(node) for node in doomed[:2]]
    killed_at = time.monotonic()
    while not re.search(r"WARNING waiting for .*commit", trainer.stderr_path.read_text()):
        assert time.monotonic() - killed_at < 15, f"no WARNING within 15 s: {trainer.stderr()}"
        time.sleep(0.1)
    print(f"warned {time.monotonic() - killed_at:.1f} s after the kill")
    # 20 s down: longer than a third of the 30 s lease, which must be renewed meanwhile.
    time.sleep(max(0.0, 20 - (time.monotonic() - killed_at)))
    _gone(*pids)
    _started(_start())

    def snapshots() -> dict[str, Any]:
        with RunAddress(trainer.log_url, trainer.coord_url, run_id).open_log() as log:
            return markers(index_control(log))

    deadline = time.monotonic() + 180  # the trainer's snapshots try again 30 s after an outage
    while not [m for m in snapshots().values() if m.end is not None]:
        assert time.monotonic() < deadline, f"no snapshot after the outage: {trainer.stderr()}"
        time.sleep(1)
    commits = trainer.finish()
    _assert_all_sealed(trainer, commits)
    orphans = [sid for sid, m in snapshots().items() if m.end is None]
    assert not orphans, f"begin markers without an end: {orphans}\n{trainer.stderr()}"


if __name__ == "__main__":
    if sys.argv[1] == "follow":
        follow(sys.argv[2], sys.argv[3], sys.argv[4], Path(sys.argv[5]))
    else:
        train(sys.argv[2], sys.argv[3], sys.argv[4], Path(sys.argv[5]), sys.argv[1], sys.argv[6])
