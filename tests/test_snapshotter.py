"""Snapshotter acceptance: crash safety, corruption fallback, bounded tail, retention,
truncation and the lease. Runs on every backend of the contract matrix."""

from __future__ import annotations

import dataclasses
import json
import mmap
import random
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from eventlog import FencedError, RunAddress, Target, TruncatedHistoryError
from eventlog.fold.engine import index_control
from eventlog.settings import override
from replayer.replay import replay, state_dicts
from rewind.recorder import Recorder
from snapshotter.catalog import markers
from snapshotter.policies import SnapshotInfo, every_versions, keep_all, keep_best, keep_every, keep_last
from snapshotter.service import Snapshotter, SnapshotterConfig
from snapshotter.store import SnapshotStore
from snapshotter.verify import FAIL, WARN, verify_run

from .conftest import make_address
from .faulthook import killing_at


@pytest.fixture
def run(backend: str, tmp_path: Path) -> RunAddress:
    base = make_address(backend, tmp_path)
    return dataclasses.replace(base, snapshots_url=f"file://{tmp_path / 'snapshots'}")


class Trainer:
    """A tiny model trained step by step, recorded by a Recorder; remembers its states."""

    def __init__(self, address: RunAddress, sizes: tuple[int, int, int] = (16, 32, 3)) -> None:
        torch.manual_seed(0)
        self.inputs = sizes[0]
        self.model = torch.nn.Sequential(torch.nn.Linear(sizes[0], sizes[1]),
                                         torch.nn.Linear(sizes[1], sizes[2]))
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.rec = Recorder(address, self.model, self.opt, rng=False, chunk_bytes=1024)
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        self.step = 0

    def train(self, steps: int, metric: callable = lambda s: float(s)) -> None:  # type: ignore[valid-type]
        for _ in range(steps):
            self.model(torch.randn(4, self.inputs)).pow(2).sum().backward()
            self.opt.step()
            self.opt.zero_grad()
            self.rec.commit(self.step, {"reward": metric(self.step)}, wait=True)
            self.states[self.step] = {k: v.clone() for k, v in self.model.state_dict().items()}
            self.step += 1

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """The optimizer's per-param states now, flat: ``"<param index>.<key>"``."""
        return {f"{i}.{k}": v.clone()
                for i, s in self.opt.state_dict()["state"].items() for k, v in s.items()}


def _model_at(address: RunAddress, target: Target) -> tuple[dict[str, torch.Tensor], object]:
    state, report = replay(address, target)
    return state_dicts(state)["model"], report


def _bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
                                        for k in a)


def _snapshotter(address: RunAddress, holder: str | None = None, **config: object) -> Snapshotter:
    assert address.snapshots_url
    return Snapshotter(address, SnapshotStore(address.snapshots_url),
                       SnapshotterConfig(**config), holder=holder)  # type: ignore[arg-type]


def _snapshot_in_child(address: RunAddress, point: str) -> subprocess.CompletedProcess[str]:
    """``rewind snapshot`` in a fresh process that SIGKILLs itself at ``point``.

    A real process, not a fork: a fork of this multi-threaded test process can inherit a lock
    held by another thread and hang. A restarted snapshotter keeps its identity (``--holder``),
    so it takes its own lease back at once."""
    cmd = [sys.executable, "-c", "from rewind.cli import main; main()", "snapshot",
           "--log", address.log_url, "--coord", address.coord_url, "--run", address.run_id,
           "--snapshots", address.snapshots_url or "", "--holder", "snap-1", "--keep-last", "100"]
    return subprocess.run(cmd, env=killing_at(point), capture_output=True, text=True, timeout=180)


KILL_POINTS = ["snapshot:begun", "snapshot:files:0", "snapshot:files:1", "snapshot:manifest",
               "snapshot:written"]


@pytest.mark.slow
def test_kill_mid_snapshot_never_uses_a_partial_snapshot(run: RunAddress) -> None:
    trainer = Trainer(run)
    trainer.train(3)
    with _snapshotter(run, "snap-1", retention=keep_last(100)) as snap:
        assert snap.snapshot(force=True) is not None
    good = {m.snapshot_id for m in markers(index_control(run.open_log())).values()}
    rng = random.Random(4)
    for _ in range(20):
        trainer.train(1)
        point = rng.choice(KILL_POINTS)
        child = _snapshot_in_child(run, point)
        assert child.returncode == -signal.SIGKILL, f"kill point {point} did not fire: {child.stderr}"
        model, report = _model_at(run, Target())
        assert _bit_equal(model, trainer.states[trainer.step - 1]), f"after kill at {point}"
        assert report.snapshot is not None and any(g in report.snapshot for g in good)
    findings = verify_run(run).findings
    orphans = [f for f in findings if f.status == WARN and "orphan" in f.detail]
    assert orphans and not [f for f in findings if f.status == FAIL]
    trainer.rec.close()


def test_corruption_is_named_and_recovery_falls_back(run: RunAddress) -> None:
    trainer = Trainer(run)
    store = SnapshotStore(run.snapshots_url or "")
    ids = []
    with _snapshotter(run, retention=keep_last(10)) as snap:
        for _ in range(4):
            trainer.train(3)
            ids.append(snap.snapshot(force=True).snapshot_id)  # type: ignore[union-attr]
    root = store.root / run.run_id
    damage = [
        ("flip a byte", ids[3], lambda d: _flip(d / "shard-0.safetensors"), "checksum"),
        ("truncate", ids[2], lambda d: _truncate(d / "shard-1.safetensors"), "truncated"),
        ("delete manifest", ids[1], lambda d: (d / "manifest.json").unlink(), "manifest"),
    ]
    for what, sid, harm, word in damage:
        harm(root / sid)
        findings = verify_run(run).findings
        bad = [f for f in findings if f.status == FAIL]
        assert len(bad) >= 1 and any(sid in f.subject and word in f.detail for f in bad), what
        model, report = _model_at(run, Target())
        assert _bit_equal(model, trainer.states[trainer.step - 1])
        assert sid in " ".join(s for s, _ in report.passed_over)  # the report says why
    assert report.snapshot is not None and ids[0] in report.snapshot
    trainer.rec.close()


def test_a_snapshot_whose_bits_do_not_rebuild_its_seal_is_passed_over(
        run: RunAddress, monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot file that passes its checksum but holds other bits than the sealed state
    (a snapshotter bug: what it wrote is what it meant to write, but wrong) is named and
    passed over, and the replay falls back to the older snapshot plus a longer tail."""
    from snapshotter import store as store_module

    trainer, ids = _two_snapshots_and_a_tail(run)
    parse = store_module.load_shard_file

    def misparse(data: object, shard: int, where: str) -> dict:
        tensors = parse(data, shard, where)  # type: ignore[arg-type]
        if ids[1] in where and shard == 1:
            first = next(t for t in tensors.values() if t.bits.size)
            first.bits[0] ^= 0x01  # one bit of shard 1, in the newest snapshot only
        return tensors

    monkeypatch.setattr(store_module, "load_shard_file", misparse)
    model, report = _model_at(run, Target())
    assert _bit_equal(model, trainer.states[trainer.step - 1])
    reasons = dict(report.passed_over)  # type: ignore[attr-defined]
    assert reasons.keys() == {ids[1]}
    assert "shard 1 does not rebuild the sealed state of version 6" in reasons[ids[1]]
    assert report.snapshot is not None and ids[0] in report.snapshot  # type: ignore[attr-defined]
    trainer.rec.close()


def _two_snapshots_and_a_tail(run: RunAddress) -> tuple[Trainer, list[str]]:
    """A trainer with snapshots of versions 3 and 6, and two versions after them."""
    trainer = Trainer(run)
    ids = []
    with _snapshotter(run) as snap:
        for _ in range(2):
            trainer.train(3)
            ids.append(snap.snapshot(force=True).snapshot_id)  # type: ignore[union-attr]
    trainer.train(2)
    return trainer, ids


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_tail_is_bounded_by_the_snapshot_cadence(run: RunAddress) -> None:
    trainer = Trainer(run)
    n = 5
    with _snapshotter(run, trigger=every_versions(n), retention=keep_last(100)) as snap:
        for _ in range(23):
            trainer.train(1)
            snap.snapshot()
            _, report = _model_at(run, Target())
            assert report.tail_versions <= n  # type: ignore[attr-defined]
    for step in range(0, 23, 4):
        model, report = _model_at(run, Target("step", step))
        assert _bit_equal(model, trainer.states[step]) and report.tail_versions <= n  # type: ignore[attr-defined]
    trainer.rec.close()


def test_the_snapshot_cadence_the_readme_states(tmp_path: Path) -> None:
    """A single-process recorder snapshots exactly on ``every_versions(10)``: 10, 20, 30. A
    snapshotter that follows the log snapshots the newest version it finds once one is due
    and counts on from it: looking after 12, 25, 38 and 48 versions, it writes exactly those."""
    from rewind import Snapshots

    recorded = dataclasses.replace(make_address("embedded", tmp_path / "a"),
                                   snapshots_url=f"file://{tmp_path / 'a' / 'snapshots'}")
    model = torch.nn.Linear(2, 1)
    snapshots = Snapshots(every_versions(10), keep=keep_all())
    with Recorder(recorded, model, rng=False, snapshots=snapshots) as rec:
        for step in range(35):
            with torch.no_grad():
                model.weight.add_(1.0)
            rec.commit(step, wait=True)
    with recorded.open_log() as log:
        assert sorted(m.version for m in markers(index_control(log)).values() if m.end) == [10, 20, 30]

    followed = dataclasses.replace(make_address("embedded", tmp_path / "b"),
                                   snapshots_url=f"file://{tmp_path / 'b' / 'snapshots'}")
    trainer = Trainer(followed)
    with _snapshotter(followed, trigger=every_versions(10), retention=keep_all()) as snap:
        written = []
        for sealed_meanwhile in (12, 13, 13, 10, 9):
            trainer.train(sealed_meanwhile)
            result = snap.snapshot()
            written.append(None if result is None else result.version)
    trainer.rec.close()
    assert written == [12, 25, 38, 48, None]


def test_retention_policies_compose() -> None:
    infos = [SnapshotInfo(f"s{v}", v, v * 10, {"reward": float((v * 37) % 101)}) for v in range(1, 301)]
    policy = keep_last(3) | keep_best(2, "reward") | keep_every(1000)
    kept = policy.keep(infos)
    best = sorted(infos, key=lambda i: (-i.metrics["reward"], -i.version))[:2]  # ties: newest
    expected = {"s298", "s299", "s300"} | {b.snapshot_id for b in best} | {
        f"s{v}" for v in (1, 100, 200)}  # first snapshot at or after each 1000 steps
    assert kept == expected
    assert (keep_last(5) & keep_best(3, "reward", "min")).keep(infos) == {"s300"}  # newest always


def test_retention_in_service_over_300_versions(tmp_path: Path) -> None:
    # Retention is backend independent, so this 300-version run uses the embedded backend.
    run = dataclasses.replace(make_address("embedded", tmp_path),
                              snapshots_url=f"file://{tmp_path / 'snapshots'}")
    trainer = Trainer(run)
    config = dict(trigger=every_versions(10), retention=keep_last(2) | keep_best(2, "reward"))
    with _snapshotter(run, **config) as snap:
        for _ in range(30):
            trainer.train(10, metric=lambda s: float(-abs(s - 95)))  # best near step 95
            snap.snapshot()
    store = SnapshotStore(run.snapshots_url or "")
    kept = {int(sid[1:11]) for sid in store.list(run.run_id)}
    assert kept == {290, 300, 100, 90}  # last two, and the two best (steps 99 and 89)
    trainer.rec.close()


def test_truncation_bounds_the_log_and_names_the_oldest_reachable(run: RunAddress) -> None:
    trainer = Trainer(run)
    sizes = []
    with _snapshotter(run, trigger=every_versions(5), retention=keep_last(2),
                      history="since-oldest-snapshot") as snap:
        for _ in range(8):
            trainer.train(5)
            snap.snapshot()
            with run.open_log() as log:
                sizes.append(sum(log.end_offset(p) - log.start_offset(p) for p in log.partitions()))
    assert max(sizes[3:]) <= sizes[2] * 1.2  # stops growing once retention kicks in
    model, _ = _model_at(run, Target())
    assert _bit_equal(model, trainer.states[trainer.step - 1])
    with pytest.raises(TruncatedHistoryError, match="oldest reachable: version 35, step 34"):
        replay(run, Target("step", 3))
    trainer.rec.close()


def test_only_the_lease_holder_publishes(run: RunAddress) -> None:
    trainer = Trainer(run)
    trainer.train(2)
    first = _snapshotter(run)
    second = _snapshotter(run)
    first.acquire()
    with pytest.raises(FencedError, match="does not hold the lease"):
        second.snapshot(force=True)
    assert first.snapshot(force=True) is not None
    published = [m for m in markers(index_control(run.open_log())).values() if m.end]
    assert len(published) == 1 and published[0].end.fencing_token == first._token  # type: ignore[union-attr]
    first.release()
    second.release()
    trainer.rec.close()


def test_a_replay_to_a_snapshots_own_version_maps_it_and_never_writes_it(run: RunAddress) -> None:
    """With no tail to step through, the snapshot's files are mapped privately, not copied:
    the state is the snapshot's bits, a write into it stays in this process, and a damaged
    file is still refused by its checksum (then the older snapshot serves, plus a tail)."""
    import hashlib

    trainer = Trainer(run)
    with _snapshotter(run) as snap:
        trainer.train(3)
        first = snap.snapshot(force=True)
        trainer.train(2)
        newest = snap.snapshot(force=True)
    assert first is not None and newest is not None
    files = sorted(Path(run.snapshots_url[len("file://"):]).rglob(f"{newest.snapshot_id}/shard-*"))
    digests = [hashlib.sha256(f.read_bytes()).hexdigest() for f in files]
    state, report = replay(run, Target("version", newest.version))
    assert report.tail_versions == 0 and newest.snapshot_id in (report.snapshot or "")
    assert _bit_equal(state_dicts(state)["model"], trainer.states[trainer.step - 1])
    bits = next(t.bits for s in state.shards for t in s.tensors.values() if t.bits.size)
    owner = bits
    while isinstance(owner, np.ndarray | memoryview):
        owner = owner.base if isinstance(owner, np.ndarray) else owner.obj
    assert isinstance(owner, mmap.mmap)  # a map of the file, not a copy
    bits[:] = 0xFF  # the state is writable, privately
    with override(snapshot_map=False):  # REWIND_SNAPSHOT_MAP=0: read, as under a tail
        read_state, _ = replay(run, Target("version", newest.version))
        read_bits = next(t.bits for s in read_state.shards for t in s.tensors.values() if t.bits.size)
        read_owner = read_bits
        while isinstance(read_owner, np.ndarray | memoryview):
            read_owner = read_owner.base if isinstance(read_owner, np.ndarray) else read_owner.obj
        assert not isinstance(read_owner, mmap.mmap)
        assert _bit_equal(state_dicts(read_state)["model"], trainer.states[trainer.step - 1])
    assert [hashlib.sha256(f.read_bytes()).hexdigest() for f in files] == digests
    _flip(files[0])
    state, report = replay(run, Target("version", newest.version))
    assert dict(report.passed_over)[newest.snapshot_id].endswith("fails its xxh3 checksum")
    assert first.snapshot_id in (report.snapshot or "") and report.tail_versions == 2
    assert _bit_equal(state_dicts(state)["model"], trainer.states[trainer.step - 1])
    trainer.rec.close()


def _damage(folder: Path, kind: str) -> None:
    """Damage a snapshot's files in a way only their checksums catch at load: a byte of
    tensor data, a tensor's name in a safetensors header, or the sign of Adam's step count."""
    if kind == "data":
        _flip(folder / "shard-0.safetensors")
        return
    for path in sorted(folder.glob("shard-*.safetensors")):
        data = bytearray(path.read_bytes())
        hlen = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + hlen])
        names = [n for n in header if n != "__metadata__" and (kind == "name" or n.endswith("/step"))]
        if not names:
            continue
        if kind == "name":  # same length, still valid JSON: the header parses
            at = data.index(f'"{names[0]}"'.encode(), 8) + len(names[0])
            data[at] = ord("Z") if data[at] != ord("Z") else ord("Y")
        else:
            start, _ = header[names[0]]["data_offsets"]
            data[8 + hlen + start + 3] ^= 0x80  # float32 little-endian: the sign bit
        path.write_bytes(bytes(data))
        return
    raise AssertionError(f"no tensor to damage ({kind}) in {folder}")


@pytest.mark.parametrize("damage", ["data", "name", "step"])
def test_a_replay_leaves_snapshot_checks_to_the_seal_and_checks_them_on_a_mismatch(
        run: RunAddress, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    """A batched replay does not hash the snapshot's shard files, nor their digests at load:
    the target's seal covers those bits. When the seal does not match, or the unchecked
    bits fail the fold some other way, it loads again with every check, which names the
    damaged file and passes it over for an older snapshot."""
    from eventlog.fold.apply import ShardState

    trainer, ids = _two_snapshots_and_a_tail(run)
    hashed: list[str] = []
    verified = SnapshotStore._verified

    def spy(buf, snapshot_id, path, entry, digest=None):  # type: ignore[no-untyped-def]
        hashed.append(entry.name)
        return verified(buf, snapshot_id, path, entry, digest)

    digests = []
    shard_digest = ShardState.digest

    def count(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        digests.append(self.shard)
        return shard_digest(self, *args, **kwargs)

    monkeypatch.setattr(SnapshotStore, "_verified", staticmethod(spy))
    monkeypatch.setattr(ShardState, "digest", count)
    for target, step in ((Target(), trainer.step - 1), (Target.parse("version=6"), 5)):
        hashed.clear()
        digests.clear()
        model, report = _model_at(run, target)
        assert _bit_equal(model, trainer.states[step])
        assert report.snapshot is not None and ids[1] in report.snapshot
        assert hashed == ["small.msgpack"]  # no shard file hashed
        assert sorted(digests) == [0, 1]  # one digest per shard: the seal's

    _damage(SnapshotStore(run.snapshots_url or "").root / run.run_id / ids[1], damage)
    for target, step in ((Target(), trainer.step - 1), (Target.parse("version=6"), 5)):
        hashed.clear()
        model, report = _model_at(run, target)
        assert _bit_equal(model, trainer.states[step])
        reasons = dict(report.passed_over)  # type: ignore[attr-defined]
        assert reasons.keys() == {ids[1]} and "fails its xxh3 checksum" in reasons[ids[1]]
        assert report.snapshot is not None and ids[0] in report.snapshot
        assert "shard-0.safetensors" in hashed  # the second load checked the files
    trainer.rec.close()


# ---------------------------------------------------------------- the snapshotter service, as run
REWIND = shutil.which("rewind")


def _address_args(address: RunAddress) -> list[str]:
    return ["--log", address.log_url, "--coord", address.coord_url, "--run", address.run_id,
            "--snapshots", address.snapshots_url or ""]


def _service(address: RunAddress, *args: str) -> subprocess.Popen[str]:
    """``rewind snapshotter`` on ``address``, a real process (output in pipes)."""
    assert REWIND, "the rewind console script is not installed (pip install -e .)"
    return subprocess.Popen([REWIND, "snapshotter", *_address_args(address), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _lease_taken(address: RunAddress, timeout: float = 60) -> None:
    """Wait until some snapshotter took the run's lease (its first fencing token)."""
    deadline = time.monotonic() + timeout
    with address.open_coordinator() as coord:
        while coord.lease_token(f"rewind:{address.run_id}:snapshotter") == 0:
            assert time.monotonic() < deadline, f"no snapshotter took the lease in {timeout} s"
            time.sleep(0.1)


def _published(address: RunAddress) -> list[str]:
    with address.open_log() as log:
        return [m.snapshot_id for m in markers(index_control(log)).values() if m.end is not None]


def _finished_run(address: RunAddress, steps: int = 3) -> None:
    trainer = Trainer(address)
    trainer.train(steps)
    trainer.rec.close()


def test_a_new_snapshotter_waits_out_the_lease_of_a_killed_one(run: RunAddress) -> None:
    """After ``kill -9`` of a snapshotter, a new one (another holder id) says whose lease it
    waits for and until when, takes it over once it expired, and snapshots."""
    _finished_run(run)
    first = _service(run)
    _lease_taken(run)
    first.kill()
    first.communicate(timeout=30)
    t0 = time.monotonic()
    second = _service(run, "--every-versions", "1", "--max-snapshots", "1")
    out, err = second.communicate(timeout=180)
    seconds = time.monotonic() - t0
    assert second.returncode == 0, err
    assert re.search(rf"waiting for the lease of run '{run.run_id}' held by snapshotter-\w+ to expire at "
                     r"\d\d:\d\d:\d\d UTC \(\d+ s\)", err), err
    assert "took over the lease" in out and len(_published(run)) == 1, out
    assert seconds < SnapshotterConfig().lease_ttl_s + 20


def test_sigterm_stops_a_snapshotter_and_releases_its_lease(run: RunAddress) -> None:
    _finished_run(run)
    first = _service(run)
    _lease_taken(run)
    first.send_signal(signal.SIGTERM)
    out, err = first.communicate(timeout=60)
    assert first.returncode == 0, (first.returncode, err)
    assert "stopped (SIGTERM); its lease is released" in out
    with run.open_coordinator() as coord:
        assert coord.lease_holder(f"rewind:{run.run_id}:snapshotter") is None
    t0 = time.monotonic()
    second = _service(run, "--every-versions", "1", "--max-snapshots", "1")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0 and "waiting for the lease" not in err, err
    assert time.monotonic() - t0 < 15 and len(_published(run)) == 1


def test_an_idle_snapshotter_says_what_it_waits_for(run: RunAddress) -> None:
    """On a finished run with nothing due, it says at once, then as a warning once idle for
    10 s, which version (or how much time) the next snapshot waits for."""
    _finished_run(run)
    service = _service(run, "--every-versions", "100", "--keep-last", "3")
    try:
        assert service.stdout is not None
        said, _, _ = select.select([service.stdout], [], [], 60)
        first = service.stdout.readline() if said else "(nothing in 60 s)"
        assert f"waiting for version 100 or 600 s more to snapshot run '{run.run_id}' (its newest " \
               "version is 3; no snapshot yet)" in first, first
        time.sleep(13)  # past the 10 s after which a wait warns
    finally:
        service.send_signal(signal.SIGTERM)
        _, err = service.communicate(timeout=60)
    assert re.search(r"waiting for version 100 or \d+ s more to snapshot run .* \(1\d s so far\)", err), err


def _snapshot_cli(address: RunAddress, *args: str) -> subprocess.CompletedProcess[str]:
    assert REWIND, "the rewind console script is not installed (pip install -e .)"
    return subprocess.run([REWIND, "snapshot", *_address_args(address), *args],
                          capture_output=True, text=True, timeout=180)


def test_keep_best_needs_a_mode_and_retention_names_what_it_deletes(run: RunAddress) -> None:
    trainer = Trainer(run)
    ids = []
    for _ in range(3):
        trainer.train(1)  # rewards 0, 1, 2
        made = _snapshot_cli(run)
        assert made.returncode == 0, made.stderr
        ids.append(_published(run)[-1])
    trainer.rec.close()
    # Which loss is best is not guessed: refused before anything is written or deleted.
    refused = _snapshot_cli(run, "--keep-best", "reward")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: ConfigError: "), refused.stderr
    assert "'reward' does not say which reward is best: use reward:1:max (keep the highest) or " \
           "reward:1:min (keep the lowest)" in refused.stderr
    assert _published(run) == ids
    kept = _snapshot_cli(run, "--keep-best", "reward:1:min")  # nothing new: retention only
    assert kept.returncode == 0, kept.stderr
    assert f"deleted snapshot {ids[1]} (version 2, step 1)" in kept.stdout, kept.stdout
    store = SnapshotStore(run.snapshots_url or "")
    assert set(store.list(run.run_id)) == {ids[0], ids[2]}
