"""Multi-rank jobs that ``tests/test_multirank.py`` runs: a small trainer per rank (gloo, CPU)
and a launcher that runs a list of jobs, one after the other, in one process.

The launcher runs each job through ``torch.distributed.launcher.api.elastic_launch``, the
launcher ``torchrun`` itself runs. Its workers are forked from a fork server that imported
torch and this module once, so they start without importing them again; not from the
launcher itself, whose elastic agent runs threads (a child forked from a process with threads
inherits the locks they held: one forked while another thread was resolving an address hung
in ``getaddrinfo`` before it joined the process group). A job with ``kills`` runs in rounds:
each kill ends a round, and the whole job is launched again (a fresh rendezvous, as a
restarted torchrun job), up to a last round without a kill.
``python tests/multirank_trainer.py <jobs.json>``: a JSON list of
``{"name", "nproc", "cfg"}``; it writes ``<jobs.json>.out``, each round's outcome (``name``,
``round``, ``ok``, ``error``, ``seconds``). A rank still running ``hang_s``
seconds (``cfg``, default 240) into its round writes every thread's stack to
``<out>/hang<k>-rank<r>.txt`` and exits 1, so a hang fails the test in bounded time and says
where it was. On SIGUSR1 (the test's own timeout), each rank writes its stacks to the same
file, and the launcher (with the elastic agent's threads) to ``hang-launcher.txt`` beside
``<jobs.json>``.

The trainer (``train(cfg)``): FSDP2 (``fully_shard`` over a CPU ``DeviceMesh``) or DDP,
AdamW, a step scheduler, a per-rank sampler and the global RNGs, recorded with
``Recorder(..., group=...)``. It restores at start, trains to ``steps`` committing each step,
and writes its final state's bits to ``<out>/rank<r>.msgpack``. ``cfg``: ``log``, ``coord``,
``run``, ``out``, ``steps``, ``mode`` (fsdp|ddp), ``snapshots``, ``snapshot_every``,
``full`` (rank 0 also writes the gathered full model and optimizer tensors right after the
restore, ``full-restored.msgpack``, and at the end, ``full-final.msgpack``), and faults.
After each restore rank 0 writes ``round<k>.json``: the step restored, the records no seal
names (``orphans``, their count per version) and the sealed versions; and every rank
``restore<k>-rank<r>.json``: the version it restored, the version of the snapshot it started
from and the events it applied.

Faults (test-only, by monkeypatching here, never in the product), ``kills``: one per round:
``step:R:N``: rank R SIGKILLs itself right after training step N (before committing it);
``after:R:N``: right after the round's N-th training step (before committing it);
``emit:R:K:N``: inside rank R's K-th log transaction of the round, before its N-th event
(or its first event after that point, when that transaction has fewer events);
``part:R:K``: once rank R's part of its K-th commit of the round is durable, before the
agreement (so rank 0 never seals that version);
``perturb=R:N``: rank R nudges one replicated weight after step N (DDP replica drift).
``random_kills`` draws a list of kills from a seeded RNG, for a job of as many rounds.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing
import os
import random
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.distributed.tensor import DTensor

import rewind
from eventlog.backends import RunAddress
from eventlog.commit.append import EventAppender
from eventlog.commit.pipeline import CommitPipeline
from eventlog.fold.engine import events, index_control
from rewind import distributed as rdist
from snapshotter.service import Snapshotter, SnapshotterConfig
from snapshotter.store import SnapshotStore

IN, OUT = 8, 4


def tiny_model() -> torch.nn.Sequential:
    """The same initial weights on every rank; 6 and 5 rows shard unevenly over 4 ranks."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(IN, 6), torch.nn.ReLU(), torch.nn.Linear(6, 5),
                               torch.nn.ReLU(), torch.nn.Linear(5, OUT))


class Sampler:
    """A per-rank shuffling sampler over ``n`` indices; its cursor is its state."""

    def __init__(self, n: int, batch: int, seed: int) -> None:
        self.n, self.batch, self.seed = n, batch, seed
        self.epoch, self.pos = 0, 0

    def next(self) -> torch.Tensor:
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        idx = perm[self.pos:self.pos + self.batch]
        self.pos += self.batch
        if self.pos + self.batch > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
        return idx

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_faults(kill: str, rank: int) -> None:
    """Arm the kill point on this rank (see the module docstring)."""
    if not kill:
        return
    kind, who, *at = kill.split(":")
    if int(who) != rank:
        return
    if kind == "emit":
        k, n = int(at[0]), int(at[1])
        made, transaction, call = [0], CommitPipeline.transaction, EventAppender.__call__

        @contextlib.contextmanager
        def counted_transaction(self: Any, *a: Any, **kw: Any) -> Iterator[Any]:
            made[0] += 1
            with transaction(self, *a, **kw) as emit:
                emit._fault = [made[0], 0]
                yield emit

        def counted_call(self: Any, *a: Any, **kw: Any) -> None:
            fault = getattr(self, "_fault", None)  # None: not a commit's transaction
            if fault is not None:
                if fault >= [k, n]:  # lexicographic: transaction k's event n, or the next one
                    _kill()
                fault[1] += 1
            call(self, *a, **kw)

        CommitPipeline.transaction = counted_transaction  # type: ignore[method-assign]
        EventAppender.__call__ = counted_call  # type: ignore[method-assign]
    elif kind == "part":
        k = int(at[0])
        packed, pack = [0], rdist.PartReport.pack

        def counted_pack(self: Any) -> bytes:
            packed[0] += 1
            if packed[0] == k:
                _kill()
            return pack(self)

        rdist.PartReport.pack = counted_pack  # type: ignore[method-assign]


#: The most commits a random kill lets a round make before it fires.
KILL_WITHIN = 3


def random_kills(count: int, world: int, seed: int) -> list[str]:
    """``count`` kills (one per round, see the module docstring) drawn from ``random.Random(seed)``,
    each on a random rank at a random point of a round's first ``KILL_WITHIN`` commits: at
    least 2 in 5 (rounded up) inside a commit (``emit`` or ``part``), the others of any kind.
    Every kill fires in a job of more than ``count * (KILL_WITHIN + 1)`` steps (an ``emit``
    past its transaction's last event fires in the next one). Prints the seed and the draw,
    so a failing draw can be run again."""
    rng = random.Random(seed)
    must = set(rng.sample(range(count), -(-2 * count // 5)))
    kills = []
    for i in range(count):
        rank, commit = rng.randrange(world), rng.randint(1, KILL_WITHIN)
        kind = rng.choice(["emit", "part"] if i in must else ["after", "emit", "part"])
        if kind == "after":
            kills.append(f"after:{rank}:{commit}")
        elif kind == "part":
            kills.append(f"part:{rank}:{commit}")
        else:
            # Rank 0 writes two transactions per commit (its part, then the seal), the others one.
            txn = 2 * commit - rng.randrange(2) if rank == 0 else commit
            kills.append(f"emit:{rank}:{txn}:{rng.randrange(4)}")
    print(f"multirank random kills: seed {seed}, {world} ranks: {kills}", flush=True)
    return kills


def _bits(t: torch.Tensor) -> bytes:
    local = t.to_local() if isinstance(t, DTensor) else t
    return bytes(local.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def final_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                sampler: Sampler) -> dict[str, Any]:
    """Every piece of this rank's state as bytes or plain values (DTensors as local shards)."""
    out: dict[str, Any] = {f"model/{k}": _bits(v) for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    for i, st in opt["state"].items():
        for k, v in st.items():
            out[f"optimizer/{i}/{k}"] = _bits(v) if isinstance(v, torch.Tensor) else v
    out["optimizer/groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    out["scheduler"] = {k: v for k, v in scheduler.state_dict().items() if not callable(v)}
    out["sampler"] = sampler.state_dict()
    out["rng/torch"] = bytes(torch.get_rng_state().numpy().tobytes())
    np_state: Any = np.random.get_state()
    out["rng/numpy"] = [np_state[0], bytes(np_state[1].tobytes()), *np_state[2:]]
    out["rng/python"] = [list(random.getstate()[1]), random.getstate()[0]]
    return out


def full_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, bytes]:
    """The gathered full model and optimizer tensors' bits (a collective: every rank calls it)."""
    def full(t: torch.Tensor) -> bytes:
        return _bits(t.full_tensor() if isinstance(t, DTensor) else t)

    out = {f"model/{k}": full(v) for k, v in model.state_dict().items()}
    for i, st in optimizer.state_dict()["state"].items():
        out.update({f"optimizer/{i}/{k}": full(v) for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def unsealed_records(address: RunAddress) -> tuple[dict[int, int], list[int]]:
    """How many records the tensor shards hold of each version newer than the newest sealed
    one, and the sealed versions."""
    with address.open_log() as log:
        try:
            seals = sorted(index_control(log).seals)
        except rewind.RunNotFoundError:  # nothing sealed yet (a crash in the first commit)
            seals = []
        sealed = max(seals, default=0)
        orphans: dict[int, int] = {}
        for shard in range(log.shard_count() or 0):
            for _, _, env in events(log, shard):
                if env.version > sealed:
                    orphans[env.version] = orphans.get(env.version, 0) + 1
        return orphans, seals


def train(cfg: dict[str, Any]) -> None:
    """One rank of a job (see the module docstring); exits 3 on a ``RewindError``."""
    cfg = {"steps": 6, "mode": "fsdp", "kills": [], "perturb": "", "snapshots": "", "snapshot_every": 0,
           "full": False, **cfg}
    out = Path(cfg["out"])
    round_ = int(cfg.get("round", 0))
    kill = cfg["kills"][round_] if round_ < len(cfg["kills"]) else ""
    # Armed before the process group: a rank that never joins it is bounded and named too.
    hang = (out / f"hang{round_}-rank{os.environ['RANK']}.txt").open("w")
    faulthandler.dump_traceback_later(float(cfg.get("hang_s", 240)), exit=True, file=hang)
    faulthandler.register(signal.SIGUSR1, file=hang, all_threads=True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model: torch.nn.Module = tiny_model()
    torch.manual_seed(1234 + rank)
    np.random.seed(99 + rank)
    random.seed(7 + rank)
    if cfg["mode"] == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.children():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    data_x = torch.randn(48, IN, generator=torch.Generator().manual_seed(5))
    data_w = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(6))
    sampler = Sampler(len(data_x), 8, seed=rank)

    snapshots = None
    if cfg["snapshots"]:
        snapshots = rewind.Snapshots(rewind.every_versions(cfg["snapshot_every"]), store=cfg["snapshots"])
    install_faults(kill, rank)
    address = RunAddress(cfg["log"], cfg["coord"], cfg["run"])
    rec = rewind.Recorder(address, model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler,
                          shards=int(cfg.get("shards", 2)), snapshots=snapshots, group=dist.group.WORLD)
    try:
        restored = rec.restore()
        (out / f"restore{round_}-rank{rank}.json").write_text(json.dumps(
            {"version": restored.version, "snapshot_version": restored.snapshot_version,
             "applied": restored.applied}))
        if rank == 0:
            orphans, sealed = unsealed_records(address)
            (out / f"round{round_}.json").write_text(json.dumps(
                {"step": restored.step, "orphans": orphans, "sealed": sealed}))
        if cfg["full"]:
            full = full_tensors(model, optimizer)
            if rank == 0:
                (out / "full-restored.msgpack").write_bytes(msgpack.packb(full, use_bin_type=True))
        dist.barrier()  # no rank commits before rank 0 has looked at the log
        for step in range((restored.step or 0) + 1, cfg["steps"] + 1):
            idx = sampler.next()
            x = data_x[idx] + 0.01 * torch.randn(len(idx), IN)
            x = x * float(1.0 + 0.01 * np.random.rand()) * (1.0 + 0.01 * random.random())
            loss = torch.nn.functional.mse_loss(model(x), x @ data_w)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            scheduler.step()
            if kill in (f"step:{rank}:{step}", f"after:{rank}:{step - (restored.step or 0)}"):
                _kill()
            if cfg["perturb"] == f"{rank}:{step}":
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] += 1e-3
            # A failed commit is raised by the next call on each rank, which need not be the
            # same call on both: a drifting job waits, so every rank raises it at this commit.
            rec.commit(step, {"loss": loss.item()}, wait=bool(cfg["perturb"]))
        rec.flush()
        if cfg.get("restore_again"):
            restore_again(rec, address, model, optimizer, out / f"again-rank{rank}.json")
            # One more version, encoded against the restored base.
            loss = torch.nn.functional.mse_loss(model(data_x[:8]), data_x[:8] @ data_w)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            rec.commit(cfg["steps"] + 1, wait=True)
    except rewind.RewindError as exc:
        (out / f"error-rank{rank}.txt").write_text(str(exc))
        # The agent stops every worker once one exits failed: none exits before all have written.
        with contextlib.suppress(Exception):
            dist.barrier()
        sys.exit(3)
    finally:
        rec.close()
    state = final_state(model, optimizer, scheduler, sampler)
    (out / f"rank{rank}.msgpack").write_bytes(msgpack.packb(state, use_bin_type=True))
    if cfg["full"]:
        full = full_tensors(model, optimizer)
        if rank == 0:
            (out / "full-final.msgpack").write_bytes(msgpack.packb(full, use_bin_type=True))
    dist.barrier()
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


def _locals(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The local tensors of the parameters and of the optimizer's tensor states."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t
    return [local(p) for p in model.parameters()] + [
        local(v) for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


def restore_again(rec: rewind.Recorder, address: RunAddress, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Snapshot the last version, scribble over the trained state, ``restore()`` it into the
    same objects, and write whether every parameter and moment kept its storage and got its
    bits back, and the tail the restore replayed."""
    if dist.get_rank() == 0:  # the newest version snapshotted: each rank maps its snapshot file
        with Snapshotter(address, SnapshotStore(rewind.Snapshots().store_url(address)),
                         SnapshotterConfig()) as snap:
            snap.snapshot(force=True)
    dist.barrier()
    before = full_tensors(model, optimizer)
    ptrs = [t.data_ptr() for t in _locals(model, optimizer)]
    with torch.no_grad():
        for t in _locals(model, optimizer):
            t.add_(1)
    got = rec.restore()
    path.write_text(json.dumps({"same_storage": [t.data_ptr() for t in _locals(model, optimizer)] == ptrs,
                                "equal": full_tensors(model, optimizer) == before, "tail": got.tail}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_jobs(path: Path) -> None:
    """Run every job of ``path`` in turn; write their outcomes to ``<path>.out``."""
    results = []
    # The test sends SIGUSR1 to every process of the session when its time runs out.
    stacks = path.with_name("hang-launcher.txt").open("w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    # Named, not left to the default ``__main__``: the fork server of Python 3.11 and 3.12
    # looks for a preparation key that is never set, and would preload nothing. fully_shard
    # imports torch._dynamo on its first call, in every rank of every round unless preloaded.
    multiprocessing.set_forkserver_preload(["tests.multirank_trainer", "torch._dynamo"])
    for job in json.loads(path.read_text()):
        Path(job["cfg"]["out"]).mkdir(parents=True, exist_ok=True)
        for round_ in range(len(job["cfg"].get("kills", ())) + 1):
            config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=int(job["nproc"]),
                                  run_id=f"{job['name']}-{round_}", rdzv_backend="c10d",
                                  rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
                                  monitor_interval=0.05, start_method="forkserver")
            t0, error = time.perf_counter(), ""
            try:
                elastic_launch(config, train)({**job["cfg"], "round": round_})
            except Exception:  # this round's outcome; the next round or job still runs
                error = traceback.format_exc(limit=3)[-3000:]
            results.append({"name": job["name"], "round": round_, "ok": not error, "error": error,
                            "seconds": round(time.perf_counter() - t0, 1)})
            path.with_name(path.name + ".out").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    run_jobs(Path(sys.argv[1]))
