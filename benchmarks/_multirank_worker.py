"""One rank of ``python -m benchmarks --only multirank``, launched by torchrun (gloo, CPU).

FSDP2 (``fully_shard`` over a CPU ``DeviceMesh``) on the benchmark's Linear stack, AdamW and a
StepLR scheduler. Every rank, in order:

1. trains ``warmup_steps`` steps;
2. DCP: ``dcp_saves`` times one step, then ``dcp.save``; one step, then ``dcp.async_save``
   (its blocking time, and its total time until its future is done); each of these
   checkpoints is deleted once timed;
3. Rewind: ``Recorder(..., group=...)``, version 1 (FULL), then ``versions`` one-step
   versions, each ``commit()`` timed (blocking) and waited for (durable); rank 0 snapshots
   version ``1 + versions - tail`` in this process;
4. ``dcp.save`` of the newest version's state: the checkpoint ``dcp.load`` reads, and whose
   size bytes per commit are judged against;
5. recovery, in a fresh recorder (as a restarted job): ``restore()`` (the snapshot plus the
   ``tail``-version tail) and ``dcp.load``, interleaved, ``repeats`` times; then rank 0
   snapshots the newest version and the same again (the snapshot with no tail);
6. ``tail`` bare ``optimizer.step()`` calls, ``repeats`` times, with nothing recording.

Every timed call starts after a barrier. Each rank writes its figures to
``<out>/rank<r>.json``; ``benchmarks.multirank`` aggregates them. Its one argument is a JSON
file of the fields of ``WorkerConfig``.
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_loader as dcp_loader
from torch.distributed.checkpoint import state_dict_saver as dcp_saver
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from benchmarks.model import linear_stack, shape_for
from eventlog.backends import RunAddress
from rewind import Recorder
from snapshotter.service import Snapshotter, SnapshotterConfig
from snapshotter.store import SnapshotStore


@dataclass(frozen=True)
class WorkerConfig:
    """What ``benchmarks.multirank`` asks of every rank (see the module docstring)."""

    params: int
    warmup_steps: int
    versions: int
    tail: int
    repeats: int
    dcp_saves: int
    log_url: str
    run_id: str
    snapshots_url: str
    dcp_dir: str
    out: str
    batch: int = 8


class Trainer:
    """This rank's FSDP2 model, AdamW and scheduler, trained on its own random batches."""

    def __init__(self, params: int, batch: int, rank: int, world: int) -> None:
        width, layers = shape_for(params)
        torch.manual_seed(0)  # the same initial weights on every rank, then sharded
        self.model = linear_stack(width, layers)
        mesh = init_device_mesh("cpu", (world,))
        for mod in self.model:
            if isinstance(mod, torch.nn.Linear):
                fully_shard(mod, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1000, gamma=0.5)
        self.width, self.layers, self.batch = width, layers, batch
        self.data = torch.Generator().manual_seed(100 + rank)
        self.steps = 0

    def step(self) -> float:
        """One training step; returns the seconds of its ``optimizer.step()``."""
        x = torch.randn(self.batch, self.width, generator=self.data)
        loss = (self.model(x) - x.flip(-1)).pow(2).mean()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        t0 = time.perf_counter()
        self.optimizer.step()
        seconds = time.perf_counter() - t0
        self.scheduler.step()
        self.steps += 1
        return seconds

    def local_bytes(self) -> int:
        """Bytes of this rank's tensors: its local shards of the model and AdamW's state."""
        tensors = list(self.model.state_dict().values())
        tensors += [v for st in self.optimizer.state_dict()["state"].values() for v in st.values()]
        total = 0
        for t in tensors:
            if isinstance(t, torch.Tensor):
                local = t.to_local() if isinstance(t, DTensor) else t
                total += local.numel() * local.element_size()
        return total

    def dcp_state(self) -> dict[str, Any]:
        """The state as DCP takes it: ``get_state_dict`` of the model and the optimizer."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def dcp_load(self, path: Path, group: Any) -> None:
        """``dcp.load`` into the live state, then ``set_state_dict``, as a resuming job does."""
        state = self.dcp_state()
        dcp_loader.load(state, checkpoint_id=str(path), process_group=group)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])


def timed(fn: Any, *args: Any, **kwargs: Any) -> float:
    """Seconds of ``fn(*args, **kwargs)``, started after a barrier of every rank."""
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


def disk_bytes(root: Path) -> int:
    """Disk blocks under ``root`` (a segment file's holes take none)."""
    return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def snapshot(address: RunAddress) -> float:
    """A forced snapshot of the run's newest version, by a snapshotter in this process."""
    t0 = time.perf_counter()
    store = SnapshotStore(address.snapshots_url or "")
    with Snapshotter(address, store, SnapshotterConfig(workers=2)) as snap:
        done = snap.snapshot(force=True)
    if done is None:
        raise SystemExit("the snapshotter found no new version to snapshot")
    return time.perf_counter() - t0


def dcp_phase(cfg: WorkerConfig, tr: Trainer, group: Any, rank: int, out: dict[str, Any]) -> None:
    """``dcp.save`` and ``dcp.async_save``, each after one more step, ``dcp_saves`` times."""
    root = Path(cfg.dcp_dir)
    for i in range(cfg.dcp_saves):
        tr.step()
        gc.collect()
        out["dcp_save_s"].append(timed(lambda p=root / f"save-{i}": dcp_saver.save(
            tr.dcp_state(), checkpoint_id=str(p), process_group=group)))
        tr.step()
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        future = dcp_saver.async_save(tr.dcp_state(), checkpoint_id=str(root / f"async-{i}"),
                                      process_group=group)
        t1 = time.perf_counter()
        (future.upload_completion if isinstance(future, dcp_saver.AsyncSaveResponse) else future).result()
        t2 = time.perf_counter()
        out["dcp_async_blocking_s"].append(t1 - t0)
        out["dcp_async_total_s"].append(t2 - t0)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root / f"save-{i}", ignore_errors=True)
            shutil.rmtree(root / f"async-{i}", ignore_errors=True)


def record(cfg: WorkerConfig, tr: Trainer, address: RunAddress, rank: int, out: dict[str, Any]) -> None:
    """Version 1 (FULL), then ``versions`` one-step versions; rank 0 snapshots one of them."""
    snapshot_at = 1 + cfg.versions - cfg.tail
    with Recorder(address, model=tr.model, optimizer=tr.optimizer, scheduler=tr.scheduler,
                  group=dist.group.WORLD) as rec:
        for i in range(cfg.versions + 1):
            if i:
                out["optimizer_step_s"].append(tr.step())
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            future = rec.commit(tr.steps, {"i": float(i)})
            t1 = time.perf_counter()
            res = future.result()
            t2 = time.perf_counter()
            out["blocking_s"].append(t1 - t0)
            out["durable_s"].append(t2 - t0)
            out["raw_bytes"].append(res.raw_bytes)
            out["encoded_bytes"].append(res.encoded_bytes)
            out["versions"].append(res.version)
            if res.version == snapshot_at:
                if rank == 0:
                    out["snapshot_s"] = snapshot(address)
                dist.barrier()  # the next version's timings start after the snapshot
        out["head_version"] = rec.version


def recover(cfg: WorkerConfig, tr: Trainer, address: RunAddress, group: Any, rank: int,
            out: dict[str, Any]) -> None:
    """``restore()`` and ``dcp.load``, interleaved: the snapshot plus the tail, then (once rank
    0 has snapshotted the newest version) the snapshot with no tail."""
    checkpoint = Path(cfg.dcp_dir) / "newest"
    with Recorder(address, model=tr.model, optimizer=tr.optimizer, scheduler=tr.scheduler,
                  group=dist.group.WORLD) as rec:
        for key, tail in (("restore_tail_s", cfg.tail), ("restore_snapshot_s", 0)):
            if tail == 0:
                if rank == 0:
                    out["snapshot_newest_s"] = snapshot(address)
                dist.barrier()
            for _ in range(cfg.repeats):
                dist.barrier()
                t0 = time.perf_counter()
                got = rec.restore()
                out[key].append(time.perf_counter() - t0)
                # restore()'s staging thread (the base's own bits, a staging set) ends here, so
                # DCP's load below shares the cores with nothing; how long it went on is shown.
                t1 = time.perf_counter()
                rec.flush()
                out[key.removesuffix("_s") + "_ahead_s"].append(time.perf_counter() - t1)
                if got.version != out["head_version"] or got.tail != tail:
                    raise SystemExit(f"rank {rank}: restore() rebuilt version {got.version} with a "
                                     f"{got.tail}-version tail; expected version {out['head_version']} "
                                     f"with a {tail}-version tail")
                gc.collect()
                out["dcp_load_s"].append(timed(tr.dcp_load, checkpoint, group))
                gc.collect()


def bare_steps(cfg: WorkerConfig, tr: Trainer, out: dict[str, Any]) -> None:
    """``tail`` bare ``optimizer.step()`` calls (on the last step's gradients), ``repeats`` times."""
    tr.step()  # fresh gradients

    def steps() -> None:
        for _ in range(cfg.tail):
            tr.optimizer.step()

    for _ in range(cfg.repeats):
        out["bare_steps_s"].append(timed(steps))


def main() -> int:
    cfg = WorkerConfig(**json.loads(Path(sys.argv[1]).read_text()))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # DCP's collectives on a group of their own, as Rewind's agreement has: async_save's
    # thread then never interleaves with FSDP's collectives on the default group.
    group = dist.new_group(backend="gloo")
    tr = Trainer(cfg.params, cfg.batch, rank, world)
    out: dict[str, Any] = {key: [] for key in (
        "dcp_save_s", "dcp_async_blocking_s", "dcp_async_total_s", "optimizer_step_s", "blocking_s",
        "durable_s", "raw_bytes", "encoded_bytes", "versions", "restore_tail_s", "restore_snapshot_s",
        "restore_tail_ahead_s", "restore_snapshot_ahead_s", "dcp_load_s", "bare_steps_s")}
    out.update(rank=rank, world=world, width=tr.width, layers=tr.layers,
               params=sum(p.numel() for p in tr.model.parameters()))
    t0 = time.perf_counter()
    for _ in range(cfg.warmup_steps):
        tr.step()
    out["warmup_s"] = time.perf_counter() - t0
    out["local_state_bytes"] = tr.local_bytes()

    dcp_phase(cfg, tr, group, rank, out)
    address = RunAddress(cfg.log_url, cfg.log_url, cfg.run_id, cfg.snapshots_url)
    record(cfg, tr, address, rank, out)
    newest = Path(cfg.dcp_dir) / "newest"
    out["dcp_save_newest_s"] = timed(lambda: dcp_saver.save(tr.dcp_state(), checkpoint_id=str(newest),
                                                      process_group=group))
    dist.barrier()
    if rank == 0:
        out["dcp_checkpoint_bytes"] = disk_bytes(newest)
        out["log_bytes"] = disk_bytes(Path(cfg.log_url.removeprefix("sqlite://")).parent)
    recover(cfg, tr, address, group, rank, out)
    bare_steps(cfg, tr, out)
    (Path(cfg.out) / f"rank{rank}.json").write_text(json.dumps(out) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
