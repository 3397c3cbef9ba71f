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
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest
from confluent_kafka.admin import AdminClient

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


# ---------------------------------------------------------------------------- the trainer
def train(log_url: str, coord_url: str, run_id: str, stop_file: Path) -> None:
    """Commit a tiny model with wait=True until ``stop_file`` exists (and MIN_COMMITS are
    done); print ``commit VERSION STARTED_AT SECONDS DIGEST`` after each."""
    import torch

    from eventlog import RunAddress
    from rewind import Recorder
    from rewind.demo.digest import digest_of

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    with Recorder(RunAddress(log_url, coord_url, run_id), model, opt, rng=False, shards=1) as rec:
        step = 0
        while step < MIN_COMMITS or not stop_file.exists():
            step += 1
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            started, t0 = time.time(), time.monotonic()
            result = rec.commit(step, wait=True).result()
            seconds = time.monotonic() - t0
            digest = digest_of({"model": model, "optimizer": opt})
            print(f"commit {result.version} {started:.3f} {seconds:.3f} {digest}", flush=True)
            time.sleep(PACE_S)


# ---------------------------------------------------------------------------- the test side
@dataclass(frozen=True)
class Commit:
    version: int
    started: float  # wall clock
    seconds: float
    digest: str


class Trainer:
    """The trainer subprocess and what it printed so far."""

    def __init__(self, tmp_path: Path, run_id: str) -> None:
        self.log_url = f"kafka://{CLUSTER}?prefix=rewindcluster&replication=3"
        self.coord_url, self.run_id = REDIS, run_id
        self.stop_file = tmp_path / "stop"
        self.stderr_path = tmp_path / "trainer.err"
        self._out_path = tmp_path / "trainer.out"
        self._out: IO[str] = self._out_path.open("w")
        self._err: IO[str] = self.stderr_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.test_kafka_cluster", self.log_url, self.coord_url,
             run_id, str(self.stop_file)], cwd=ROOT, stdout=self._out, stderr=self._err, text=True)

    def commits(self) -> list[Commit]:
        out = []
        for line in self._out_path.read_text().splitlines():
            if line.startswith("commit ") and line.count(" ") == 4:
                _, version, started, seconds, digest = line.split()
                out.append(Commit(int(version), float(started), float(seconds), digest))
        return out

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

    def stderr(self) -> str:
        return self.stderr_path.read_text()[-3000:]

    def finish(self) -> list[Commit]:
        self.stop_file.touch()
        try:
            self.proc.wait(120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._out.close()
            self._err.close()
        assert self.proc.returncode == 0, self.stderr()
        return self.commits()


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
    """Wait until killed JVMs have exited (it takes a moment; their parent, init, reaps them)."""
    for _ in range(200):
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            return
        time.sleep(0.05)


def _start(node: int | None = None) -> subprocess.Popen[str]:
    """Start restarting ``node`` (every node that is down if ``None``); ``_started`` waits."""
    args = [str(ROOT / "scripts" / "kafka"), "start", "--brokers", "3"]
    return subprocess.Popen(args + ([] if node is None else ["--node", str(node)]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


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


def _assert_all_sealed(trainer: Trainer, commits: list[Commit]) -> None:
    from eventlog import RunAddress
    from eventlog.fold.engine import index_control

    with RunAddress(trainer.log_url, trainer.coord_url, trainer.run_id).open_log() as log:
        sealed = sorted(index_control(log).seals)
    assert [c.version for c in commits] == list(range(1, len(commits) + 1))
    assert sealed == list(range(1, len(commits) + 1))


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
    yield
    _started(_start())


def test_failover_refreshes_metadata_before_each_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request to a dead leader times out until fresh metadata names the new one."""
    from confluent_kafka import KafkaError, KafkaException

    from eventlog import EventLogError
    from eventlog.kafka import calls as kafka_calls

    calls: list[str] = []

    def ask(timeout: float) -> int:
        calls.append(f"ask {timeout:g}")
        if calls.count("refresh") < 2:
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT))
        return 7

    def refresh(timeout: float) -> None:
        calls.append("refresh")

    assert kafka_calls.failover("reading offsets of t [0]", ask, refresh) == 7
    assert calls == ["ask 1", "refresh", "ask 2", "refresh", "ask 3"]

    calls.clear()
    monkeypatch.setattr(kafka_calls, "FAILOVER_S", 0.0)
    with pytest.raises(EventLogError, match=r"^reading offsets of t \[0\] \(no partition leader "
                       r"answered in 0 s of retries with fresh metadata\): _TIMED_OUT"):
        kafka_calls.failover("reading offsets of t [0]", ask, lambda timeout: None)


@pytest.mark.kafka_cluster
@pytest.mark.slow
def test_leader_kills_lose_nothing_and_commits_go_on(tmp_path: Path, cluster: None) -> None:
    run_id = f"c{os.urandom(5).hex()}"
    trainer = Trainer(tmp_path, run_id)
    control, tensors = f"rewindcluster.{run_id}.control", f"rewindcluster.{run_id}.tensors"
    notes: list[tuple[str, float]] = []
    reports: list[dict[str, object]] = []
    seen = len(trainer.wait_for(20, 120, "before the first kill"))
    restart = None
    for topic in (control, tensors):
        if restart is not None:  # the next kill must leave min.insync.replicas
            _started(restart)
            _wait_in_sync([control, tensors])
        leader = _partitions(topic)[0][0]
        pid, killed_at = _kill(leader), time.time()
        replay = _replay(trainer)  # started right after the kill, while the partition is leaderless
        assert time.time() - killed_at < 1.0
        _gone(pid)
        seen = len(trainer.wait_for(seen + 10, 120, f"after killing node {leader}, leader of {topic}"))
        restart = _start(leader)
        reports.append(_replayed(replay))
        notes.append((f"leader of {topic.rsplit('.', 1)[1]} [0] (node {leader})", killed_at))
    seen = len(trainer.wait_for(max(MIN_COMMITS, seen + 10), 120, "after the restarts"))
    commits = trainer.finish()
    for what, at in notes:
        print(f"commit latencies around the kill of the {what}: {_around(commits, at)}")
    _assert_all_sealed(trainer, commits)
    digests = {c.version: c.digest for c in commits}
    for report in reports:
        assert report["state_digest"] == digests[int(str(report["version"]))]
    assert not _slow(commits, COMMIT_BOUND_S), trainer.stderr()
    assert restart is not None
    _started(restart)


@pytest.mark.kafka_cluster
@pytest.mark.slow
def test_below_min_insync_replicas_commits_block_then_complete(tmp_path: Path, cluster: None) -> None:
    run_id = f"c{os.urandom(5).hex()}"
    trainer = Trainer(tmp_path, run_id)
    seen = len(trainer.wait_for(10, 120, "before the kills"))
    _gone(_kill(2), _kill(3))
    killed_at = time.monotonic()
    # At most the commit in flight at the kill completes; then they block, and say why.
    time.sleep(13)
    blocked = len(trainer.commits())
    assert blocked <= seen + 2, f"{blocked - seen} commits completed with 1 of 3 brokers up"
    assert "commit not acknowledged after" in trainer.stderr()
    assert "min.insync.replicas" in trainer.stderr()
    _started(_start(2))
    trainer.wait_for(blocked + 10, 120, "after one broker returned")
    print(f"10 commits after the return, {time.monotonic() - killed_at:.1f} s after the kills")
    restart = _start(3)
    commits = trainer.finish()
    _assert_all_sealed(trainer, commits)
    replayed = _replayed(_replay(trainer))
    assert replayed["version"] == len(commits)
    assert replayed["state_digest"] == commits[-1].digest
    _started(restart)


if __name__ == "__main__":
    train(sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4]))
