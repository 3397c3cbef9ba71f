"""The ``demo`` command: PPO on CartPole, SIGKILLed, recovered, compared."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from rewind.cli.common import CHECK_FAILED, OK, AsJson, CoordUrl, LogUrl, RunId, console, err
from rewind.cli.output import emit_json, say


def demo(
    run_dir: Annotated[Path | None, typer.Option(
        "--run-dir", help="where the demo writes (default: rewind-demo, or rewind-demo-kafka)")] = None,
    updates: Annotated[int, typer.Option(min=1, help="PPO updates")] = 60,
    seed: int = 0,
    kill_at: Annotated[int | None, typer.Option(
        "--kill-at", help="update to SIGKILL in (default: random)")] = None,
    json_out: AsJson = False,
    log: LogUrl = None,
    coord: CoordUrl = None,
    run: RunId = None,
) -> int:
    """Record PPO on CartPole, SIGKILL it, recover from the log, compare with an uninterrupted run."""
    from rewind.demo import run_demo

    result = run_demo(run_dir, updates=updates, seed=seed, kill_at=kill_at, log=log,
                      coord=coord, run=run, console=err if json_out else console)
    if json_out:
        emit_json("demo", result.bit_exact, **dataclasses.asdict(result))
    else:
        say(f"bit-exact: {'yes' if result.bit_exact else 'no'}")
    return OK if result.bit_exact else CHECK_FAILED
