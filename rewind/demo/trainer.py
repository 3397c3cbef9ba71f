"""The demo's trainer process: PPO updates, each committed to Rewind, resumed after a crash.

Internal entry point of ``rewind demo`` and of the crash tests, not a user command::

    python -m rewind.demo.trainer --run-dir DIR [--record] [--kill-at K] [--digest-file F] ...

With ``--record`` the run is recorded (``--log``/``--coord``/``--run``, default the embedded
log ``DIR/rewind.db``), a restart resumes after the newest committed update through
``Recorder.restore()``, and what it restored is written to ``DIR/restore.json``.
``--digest-file`` gets one JSON line ``{"step": u, "digest": ...}`` per completed update.
``--kill-at K`` SIGKILLs the process during update K, after computing it and before
committing it: the worst moment, since the work is lost and must be redone bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eventlog import RunAddress
from eventlog.errors import ConfigError, RewindError
from rewind.demo.ppo import PPOConfig, PPOTrainer
from rewind.recorder import Recorder
from rewind.snapshots import Snapshots
from snapshotter.policies import every_versions, keep_last

#: Snapshots the demo keeps (older ones are deleted by retention).
KEEP_SNAPSHOTS = 3


@contextmanager
def recording(trainer: PPOTrainer, address: RunAddress, snapshot_every: int = 0) -> Iterator[Recorder]:
    """A ``Recorder`` of every piece of the trainer's state, closed on exit.

    With ``snapshot_every`` > 0, the recorder snapshots the run every that many versions
    (keeping the last ``KEEP_SNAPSHOTS``); a restore starts from the newest valid snapshot
    plus the log tail either way.
    """
    snapshots = (Snapshots(every_versions(snapshot_every), keep=keep_last(KEEP_SNAPSHOTS),
                           store=address.snapshots_url) if snapshot_every > 0 else None)
    rec = Recorder(address, model=trainer.model, optimizer=trainer.optimizer,
                   scheduler=trainer.scheduler, sampler=trainer.sampler, rng=True,
                   extra={"env": trainer.env}, snapshots=snapshots)
    try:
        yield rec
    finally:
        rec.close()


@dataclass(frozen=True)
class RunResult:
    """What one trainer process did."""

    first_update: int  # the first update run here (0 for a fresh run)
    updates_run: int
    final_digest: str
    seconds: float


def _append_digest(path: Path, step: int, digest: str) -> None:
    # Open/append/close per line: the line is in the OS page cache before a SIGKILL, so the
    # parent can trust the file.
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps({"step": step, "digest": digest}) + "\n")


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # atomic: a reader never sees half a file


def _hard_kill() -> None:
    """Die like a crashed trainer: no finally blocks, no atexit, no flushing."""
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _train(trainer: PPOTrainer, start: int, rec: Recorder | None, kill_at: int | None,
           digest_file: Path | None, emit: Callable[[str], None]) -> int:
    """Run updates ``start`` .. ``config.updates - 1``, committing each before the next."""
    for u in range(start, trainer.config.updates):
        t0 = time.perf_counter()
        metrics = trainer.run_update(u)
        if u == kill_at:
            emit(f"kill_at={kill_at}: SIGKILL before committing update {u}")
            _hard_kill()
        if rec is not None:
            rec.commit(step=u, metrics=metrics, wait=True)
        if digest_file is not None:
            _append_digest(digest_file, u, trainer.state_digest())
        emit(f"update {u:4d}  return {metrics['episode_return_mean']:7.1f}  "
             f"loss {metrics['loss']:8.4f}  kl {metrics['approx_kl']:.4f}  "
             f"lr {metrics['lr']:.2e}  {time.perf_counter() - t0:5.3f}s")
    return max(0, trainer.config.updates - start)


def run(config: PPOConfig, run_dir: Path, address: RunAddress | None = None, *, snapshot_every: int = 0,
        kill_at: int | None = None, digest_file: Path | None = None,
        emit: Callable[[str], None] = lambda _msg: None) -> RunResult:
    """Train ``config.updates`` updates; with an ``address``, record them and resume first."""
    # The trainer is built (and the global RNGs seeded) before the restore, so the restore
    # overwrites the seeded state instead of being overwritten by it.
    trainer = PPOTrainer(config)
    t0 = time.perf_counter()
    try:
        if address is None:
            done = _train(trainer, 0, None, kill_at, digest_file, emit)
            return RunResult(0, done, trainer.state_digest(), time.perf_counter() - t0)
        with recording(trainer, address, snapshot_every) as rec:
            resumed = rec.restore()
            start = 0 if resumed.step is None else resumed.step + 1
            _write_json(run_dir / "restore.json", {
                "step": resumed.step, "version": resumed.version, "applied": resumed.applied,
                "skipped": resumed.skipped, "seconds": resumed.seconds, "source": resumed.source,
            })
            emit("fresh run" if resumed.fresh else f"resuming after update {resumed.step}")
            done = _train(trainer, start, rec, kill_at, digest_file, emit)
        return RunResult(start, done, trainer.state_digest(), time.perf_counter() - t0)
    finally:
        trainer.close()


def check_run_dir_config(run_dir: Path, config: PPOConfig) -> None:
    """Record the config in ``run_dir``; refuse to continue a run with a different one."""
    path = run_dir / "ppo_config.json"
    if not path.exists():
        _write_json(path, config.to_dict())
        return
    try:
        saved = PPOConfig.from_dict(json.loads(path.read_text(encoding="utf-8")), str(path))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path} is not a PPO config: {exc}") from None
    diff = [f"{f.name}: run has {getattr(saved, f.name)!r}, asked {getattr(config, f.name)!r}"
            for f in dataclasses.fields(PPOConfig) if getattr(saved, f.name) != getattr(config, f.name)]
    if diff:
        raise ConfigError(f"{path} belongs to a different config ({', '.join(diff)})")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rewind.demo.trainer",
                                description="The `rewind demo` trainer (internal entry point).")
    p.add_argument("--run-dir", required=True, type=Path, help="directory of this run")
    p.add_argument("--updates", type=int, default=PPOConfig.updates)
    p.add_argument("--seed", type=int, default=PPOConfig.seed)
    p.add_argument("--rollout-steps", type=int, default=PPOConfig.rollout_steps)
    p.add_argument("--epochs", type=int, default=PPOConfig.epochs)
    p.add_argument("--record", action="store_true", help="record the run with Rewind")
    p.add_argument("--log", help="log URL (default: sqlite://RUN_DIR/rewind.db)")
    p.add_argument("--coord", help="coordinator URL (default: the log URL)")
    p.add_argument("--run", default="ppo", help="run id")
    p.add_argument("--snapshot-every", type=int, default=0, help="snapshot every N versions (0: off)")
    p.add_argument("--kill-at", type=int, help="SIGKILL during update K, before it is committed")
    p.add_argument("--digest-file", type=Path, help="append one JSON line of state digest per update")
    p.add_argument("--quiet", action="store_true", help="no per-update lines")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the trainer process; returns its exit status (2 and one line on a Rewind error)."""
    args = _parser().parse_args(argv)
    run_dir: Path = args.run_dir
    try:
        config = PPOConfig(seed=args.seed, updates=args.updates, rollout_steps=args.rollout_steps,
                           epochs=args.epochs)
        run_dir.mkdir(parents=True, exist_ok=True)
        check_run_dir_config(run_dir, config)
        address = None
        if args.record:
            log_url = args.log or f"sqlite://{(run_dir / 'rewind.db').resolve()}"
            address = RunAddress(log_url, args.coord or log_url, args.run,
                                 f"file://{(run_dir / 'snapshots').resolve()}")
        # CPU kernels split reductions by thread count, so the result bits may depend on it:
        # a pinned count makes a resumed run on another host land on the same bits.
        torch.set_num_threads(config.num_threads)
        result = run(config, run_dir, address, snapshot_every=args.snapshot_every,
                     kill_at=args.kill_at, digest_file=args.digest_file,
                     emit=(lambda _msg: None) if args.quiet else (lambda msg: print(msg, flush=True)))
    except RewindError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"done: {result.updates_run} updates from {result.first_update} in {result.seconds:.2f}s, "
          f"digest {result.final_digest[:16]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
