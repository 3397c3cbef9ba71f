"""The benchmark's training state: a stack of Linear layers with Adam, a scheduler and RNGs.

``Workload(size)`` builds a model of about ``size`` fp32 parameters (``--size 100M`` is the
default), trains it with real Adam steps, and gives the baselines what they need: the same
state as a ``torch.save`` tree (loadable with ``weights_only=True``), its raw byte count,
and a preallocated per-tensor memory copy (the physical floor of any commit).
"""

from __future__ import annotations

import functools
import os
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from torch.optim.adam import adam as functional_adam

from eventlog.capture import flatten


def parse_size(text: str) -> int:
    """``100M``, ``25M``, ``5m``, ``1.5G``, ``800k`` or a plain integer -> parameter count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise ValueError(f"bad size {text!r}: use e.g. 100M, 25M, 5M")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


def shape_for(params: int) -> tuple[int, int]:
    """``(width, layers)`` of a Linear stack with about ``params`` parameters."""
    width = 2048 if params >= 20_000_000 else 1024 if params >= 2_000_000 else 256
    per_layer = width * width + width
    return width, max(1, round(params / per_layer))


def linear_stack(width: int, layers: int) -> torch.nn.Sequential:
    """``layers`` Linear layers of ``width`` x ``width`` with Tanh between them, initialised
    from torch's global RNG (the caller seeds it)."""
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i + 1 < layers:
            mods.append(torch.nn.Tanh())
    return torch.nn.Sequential(*mods)


@dataclass
class Workload:
    """A model, Adam, a scheduler and a fixed data stream, trained step by step."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    width: int
    layers: int
    dtype: torch.dtype
    batch: int
    steps_done: int = 0
    train_seconds: float = 0.0
    #: Seconds of each ``optimizer.step()`` alone: the least any replay of a version costs.
    optimizer_step_s: list[float] = field(default_factory=list)

    @classmethod
    def build(cls, params: int, *, dtype: torch.dtype = torch.float32, seed: int = 0,
              batch: int = 8, lr: float = 1e-4) -> Workload:
        """A fresh workload of about ``params`` parameters (every RNG seeded)."""
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        width, layers = shape_for(params)
        model = linear_stack(width, layers).to(dtype)
        try:  # fused CPU Adam: the same update, about 3x faster than foreach on 2 cores
            opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
        except (RuntimeError, TypeError):
            opt = torch.optim.Adam(model.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)
        return cls(model, opt, sched, width, layers, dtype, batch)

    @property
    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def step(self, n: int = 1) -> None:
        """``n`` real training steps (forward, backward, Adam, scheduler, RNG draws)."""
        t0 = time.perf_counter()
        for _ in range(n):
            x = torch.randn(self.batch, self.width, dtype=self.dtype)
            loss = (self.model(x) - x.flip(-1)).pow(2).mean()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            t1 = time.perf_counter()
            self.optimizer.step()
            self.optimizer_step_s.append(time.perf_counter() - t1)
            self.scheduler.step()
            np.random.random()  # the numpy and python RNGs advance too, as in an RL loop
            random.random()
            self.steps_done += 1
        self.train_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ the baselines' view
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the state (model + optimizer), as the recorder names them."""
        out, _ = flatten("model", self.model.state_dict())
        opt, _ = flatten("optimizer", self.optimizer.state_dict())
        out.update(opt)
        return out

    def raw_bytes(self) -> int:
        """Bytes of tensor bits in the state (what a commit copies out)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def checkpoint(self) -> dict[str, Any]:
        """The same state as a ``torch.save`` tree that ``torch.load(weights_only=True)`` reads."""
        np_state = cast(tuple[Any, ...], np.random.get_state())  # the legacy form: a tuple
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
                          *np_state[2:]),
                "python": random.getstate(),
            },
        }


def save_checkpoint(work: Workload, path: str, *, fsync: bool) -> float:
    """``torch.save`` the state to ``path`` (and fsync it); returns the seconds it blocked."""
    t0 = time.perf_counter()
    tree = work.checkpoint()
    with open(path, "wb") as f:
        torch.save(tree, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t0


class BusScaling:
    """How much a second core adds to memory-bound work on this machine: two threads each
    copying their own buffers, against one thread copying both (all pages touched first).
    A replay streams gigabytes of records and state; this ratio caps what a second worker
    can gain on that part of its work."""

    def __init__(self, nbytes: int = 256 * 1024 * 1024) -> None:
        self._src = [np.ones(nbytes, dtype=np.uint8) for _ in range(2)]
        self._dst = [np.ones(nbytes, dtype=np.uint8) for _ in range(2)]  # touched, unlike zeros

    def _copy(self, i: int) -> None:
        np.copyto(self._dst[i], self._src[i])  # numpy releases the GIL for the copy

    def __call__(self) -> float:
        """The speedup of 2 threads over 1 for one round of copies."""
        return _speedup(self._copy)


class AdamScaling:
    """How much a second core adds to the replay's arithmetic on this machine: torch's fused
    Adam (the benchmark trainer's optimizer, so the kernel its replays run) tile by tile, as
    a batched replay runs it (``steps`` steps on each 4 MiB tile before the next), by two
    threads on their own tensors against one thread doing both. No Rewind code runs here,
    so this ratio caps what a second replay worker can gain on its optimizer steps."""

    def __init__(self, numel: int = 16 * 1024 * 1024, steps: int = 10, tile: int = 1024 * 1024) -> None:
        gen = torch.Generator().manual_seed(0)
        self._steps, self._tile, self._rounds = steps, tile, 0
        self._sets = [
            ([torch.randn(numel, generator=gen)], [torch.randn(numel, generator=gen) * 1e-3],
             [torch.zeros(numel)], [torch.zeros(numel)])
            for _ in range(2)
        ]

    def _run(self, i: int) -> None:
        (p,), (g,), (m,), (v,) = self._sets[i]
        for start in range(0, p.numel(), self._tile):
            tile = slice(start, start + self._tile)
            step = [torch.tensor(0.0)]
            for _ in range(self._steps):
                functional_adam([p[tile]], [g[tile]], [m[tile]], [v[tile]], [], step,
                                fused=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-4,
                                weight_decay=0.0, eps=1e-8, maximize=False)

    def __call__(self) -> float:
        """The speedup of 2 threads over 1 for one round of steps (torch at one thread per
        worker, as a replay sets it)."""
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        self._rounds += 1
        try:
            # Which side runs first alternates, so neither always meets a warmer cache.
            return _speedup(self._run, two_first=self._rounds % 2 == 0)
        finally:
            torch.set_num_threads(before)


def _speedup(work: Callable[[int], None], two_first: bool = False) -> float:
    """How much faster ``work(0)`` and ``work(1)`` run on two threads at once than one after
    the other on this thread."""
    jobs = [functools.partial(work, 0), functools.partial(work, 1)]
    if two_first:
        t2 = timed_in_threads(jobs, True)
        return timed_in_threads(jobs, False) / t2
    t1 = timed_in_threads(jobs, False)
    return t1 / timed_in_threads(jobs, True)


def timed_in_threads(jobs: Sequence[Callable[[], None]], parallel: bool) -> float:
    """Wall seconds to run ``jobs``: one after the other on this thread, or each on its own
    thread at once."""
    t0 = time.perf_counter()
    if not parallel:
        for job in jobs:
            job()
    else:
        threads = [threading.Thread(target=job) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return time.perf_counter() - t0


class MemcpyFloor:
    """Per-tensor ``copy_`` of the state into preallocated buffers: the physical floor."""

    def __init__(self, work: Workload) -> None:
        self._work = work
        self._bufs = {n: torch.empty_like(t) for n, t in work.tensors().items()}

    def __call__(self) -> float:
        t0 = time.perf_counter()
        for name, t in self._work.tensors().items():
            self._bufs[name].copy_(t)
        return time.perf_counter() - t0
