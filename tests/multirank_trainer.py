"""A small multi-rank trainer that ``tests/test_multirank.py`` launches with torchrun (gloo, CPU).

FSDP2 (``fully_shard`` over a CPU ``DeviceMesh``) or DDP, AdamW, a step scheduler, a per-rank
sampler, and the global RNGs: every rank records with ``Recorder(..., group=...)``, restores
at start, trains to ``--steps`` committing each step, then writes its final state's bits to
``<out>/rank<r>.msgpack`` for the test to compare. Its one argument is a JSON file: ``log``,
``coord``, ``run``, ``out``, ``steps``, ``mode`` (fsdp|ddp), and the faults below.

Faults (test-only, by monkeypatching here, never in the product):
``kill=step:R:N``: rank R SIGKILLs itself right after training step N (before committing it);
``kill=emit:R:K:N``: inside rank R's K-th log transaction, before its N-th event;
``kill=part:R:K``: once rank R's part of its K-th commit is durable, before the agreement
(so rank 0 never seals that version);
``perturb=R:N``: rank R nudges one replicated weight after step N (DDP replica drift).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch
import torch.distributed as dist

import rewind
from eventlog.backends import RunAddress
from rewind import distributed as rdist
from rewind import recorder as rrec


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
    """Arm the ``--kill`` point on this rank (see the module docstring)."""
    if not kill:
        return
    kind, who, *at = kill.split(":")
    if int(who) != rank:
        return
    if kind == "emit":
        k, n = int(at[0]), int(at[1])
        made, init, call = [0], rrec._Emitter.__init__, rrec._Emitter.__call__

        def counted_init(self: Any, *a: Any, **kw: Any) -> None:
            made[0] += 1
            self._fault = [made[0], 0]
            init(self, *a, **kw)

        def counted_call(self: Any, *a: Any, **kw: Any) -> None:
            if self._fault == [k, n]:
                _kill()
            self._fault[1] += 1
            call(self, *a, **kw)

        rrec._Emitter.__init__ = counted_init  # type: ignore[method-assign]
        rrec._Emitter.__call__ = counted_call  # type: ignore[method-assign]
    elif kind == "part":
        k = int(at[0])
        packed, pack = [0], rdist.PartReport.pack

        def counted_pack(self: Any) -> bytes:
            packed[0] += 1
            if packed[0] == k:
                _kill()
            return pack(self)

        rdist.PartReport.pack = counted_pack  # type: ignore[method-assign]


def final_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
                sampler: Sampler) -> dict[str, Any]:
    """Every piece of this rank's state as bytes or plain values (DTensors as local shards)."""
    def bits(t: torch.Tensor) -> bytes:
        local = t.to_local() if isinstance(t, rdist.DTensor) else t
        return bytes(local.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    out: dict[str, Any] = {f"model/{k}": bits(v) for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    for i, st in opt["state"].items():
        for k, v in st.items():
            out[f"optimizer/{i}/{k}"] = bits(v) if isinstance(v, torch.Tensor) else v
    out["optimizer/groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    out["scheduler"] = {k: v for k, v in scheduler.state_dict().items() if not callable(v)}
    out["sampler"] = sampler.state_dict()
    out["rng/torch"] = bytes(torch.get_rng_state().numpy().tobytes())
    np_state = np.random.get_state()
    out["rng/numpy"] = [np_state[0], bytes(np_state[1].tobytes()), *np_state[2:]]
    out["rng/python"] = [list(random.getstate()[1]), random.getstate()[0]]
    return out


def main() -> int:
    # One JSON argument: torchrun's own parser would take ``--log`` and the like for its options.
    cfg = {"steps": 10, "mode": "fsdp", "kill": "", "perturb": "", "snapshots": "", "snapshot_every": 0,
           **json.loads(Path(sys.argv[1]).read_text())}
    args = argparse.Namespace(**cfg)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(1234 + rank)
    np.random.seed(99 + rank)
    random.seed(7 + rank)

    torch.manual_seed(0)  # the same initial weights on every rank
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.ReLU(),
        torch.nn.Linear(8, 4))
    torch.manual_seed(1234 + rank)
    if args.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    data_x = torch.randn(96, 16, generator=torch.Generator().manual_seed(5))
    data_w = torch.randn(16, 4, generator=torch.Generator().manual_seed(6))
    sampler = Sampler(len(data_x), 8, seed=rank)

    snapshots = None
    if args.snapshots:
        snapshots = rewind.Snapshots(rewind.every_versions(args.snapshot_every), store=args.snapshots)
    install_faults(args.kill, rank)
    rec = rewind.Recorder(RunAddress(args.log, args.coord, args.run), model=model, optimizer=optimizer,
                          scheduler=scheduler, sampler=sampler, shards=2, snapshots=snapshots,
                          group=dist.group.WORLD)
    restored = rec.restore()
    print(f"rank {rank}: {restored}", flush=True)
    start = (restored.step or 0) + 1
    try:
        for step in range(start, args.steps + 1):
            idx = sampler.next()
            x = data_x[idx] + 0.01 * torch.randn(len(idx), 16)
            x = x * float(1.0 + 0.01 * np.random.rand()) * (1.0 + 0.01 * random.random())
            loss = torch.nn.functional.mse_loss(model(x), x @ data_w)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if args.kill == f"step:{rank}:{step}":
                _kill()
            if args.perturb == f"{rank}:{step}":
                with torch.no_grad():
                    next(model.parameters()).view(-1)[0] += 1e-3
            rec.commit(step, {"loss": float(loss)})
        rec.flush()
    except rewind.RewindError as exc:
        (Path(args.out) / f"error-rank{rank}.txt").write_text(str(exc))
        print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
        return 3
    finally:
        rec.close()
    state = final_state(model, optimizer, scheduler, sampler)
    (Path(args.out) / f"rank{rank}.msgpack").write_bytes(msgpack.packb(state, use_bin_type=True))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
