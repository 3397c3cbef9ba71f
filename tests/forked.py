"""Crash-test runs in forked children, for the framework integrations' tests.

A test's driver process imports torch and the framework once, then forks one child per
run segment: a child is a whole process, so a SIGKILL leaves its recorder's commits where
they were. ``run_streams`` runs several chains of segments side by side (each chain one
after the other, each segment resuming the one killed before it) and returns every
segment's exit code (``-9`` for a SIGKILL). ``digest`` names every tensor and value of a
state tree by a hash, to compare two runs' final states bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def digest(tree: Any, path: str, out: dict[str, str]) -> None:
    """Put a hash of every tensor and array in ``tree`` (by path) into ``out``, and the repr of
    every other leaf."""
    import numpy as np
    import torch

    if isinstance(tree, torch.Tensor):
        t = tree.detach().cpu().contiguous()
        out[path] = f"{t.dtype}{list(t.shape)}:" + hashlib.sha256(t.numpy().tobytes()).hexdigest()
    elif isinstance(tree, np.ndarray):
        out[path] = hashlib.sha256(tree.tobytes()).hexdigest()
    elif isinstance(tree, dict):
        for k, v in tree.items():
            digest(v, f"{path}/{k}", out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            digest(v, f"{path}/{i}", out)
    else:
        out[path] = repr(tree)


def trainer_digests(trainer: Any) -> dict[str, str]:
    """The digests of a Hugging Face ``Trainer``'s model, optimizer and scheduler, and of the
    global torch, numpy and ``random`` RNGs."""
    import random

    import numpy as np
    import torch

    out: dict[str, str] = {}
    digest(trainer.model.state_dict(), "model", out)
    digest(trainer.optimizer.state_dict(), "optimizer", out)
    digest(trainer.lr_scheduler.state_dict(), "scheduler", out)
    digest({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
           "rng", out)
    return out


def spawn(fn: Callable[[], None]) -> int:
    """Run ``fn`` in a forked child; its exit code is 0 when it returns, 1 when it raises."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def wait(pid: int) -> int:
    """A child's exit code, or minus the signal that ended it."""
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _stream(tmp: str, name: str, segments: Sequence[Sequence[Any]], segment: Callable[..., None]) -> None:
    """Run segments one after the other, each in its own child; their exit codes to a file."""
    exits = []
    for args in segments:
        began = time.monotonic()
        exits.append(wait(spawn(lambda args=args: segment(*args))))
        print(f"{name}: {time.monotonic() - began:.1f}s", file=sys.stderr, flush=True)
    Path(tmp, f"{name}.exits").write_text(json.dumps(exits))


def case_streams(tmp: str, cases: Mapping[str, Mapping[str, Any]]) -> dict[str, list[tuple[Any, ...]]]:
    """For each case, two streams of ``(case, run, kill, out)`` segments: its uninterrupted
    reference (``NAME-reference``), and its chain (``NAME``): one segment per kill in
    ``case["kills"]``, then one that runs to the end. Segment ``i`` of a chain writes to
    ``NAME-i.jsonl``, the reference to ``NAME-reference.jsonl``."""
    streams: dict[str, list[tuple[Any, ...]]] = {}
    for name, case in cases.items():
        reference = f"{name}-reference"
        streams[reference] = [(case, reference, None, segment_file(tmp, name, "reference"))]
        streams[name] = [(case, name, kill, segment_file(tmp, name, str(i)))
                         for i, kill in enumerate([*case["kills"], None])]
    return streams


def segment_file(tmp: str, name: str, segment: str) -> str:
    """Where a case's segment writes its records."""
    return os.path.join(tmp, f"{name}-{segment}.jsonl")


def run_streams(tmp: str, streams: Mapping[str, Sequence[Sequence[Any]]],
                segment: Callable[..., None]) -> dict[str, list[int]]:
    """Run every stream at once, each in its own child, and return each one's exit codes."""
    pids = [spawn(lambda name=name, segments=segments: _stream(tmp, name, segments, segment))
            for name, segments in streams.items()]
    assert all(wait(pid) == 0 for pid in pids)
    return {name: json.loads(Path(tmp, f"{name}.exits").read_text()) for name in streams}


def case_exits(codes: Mapping[str, list[int]], cases: Mapping[str, Any]) -> dict[str, list[int]]:
    """Each case's exit codes from ``run_streams`` on ``case_streams``: its reference's, then
    its chain's."""
    return {name: codes[f"{name}-reference"] + codes[name] for name in cases}


def events(path: Path) -> list[dict[str, Any]]:
    """The JSON-lines records a segment wrote."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_driver(script: str, tmp: Path, cases: Mapping[str, Mapping[str, Any]]) -> Path:
    """Run a driver (``python -c script '{"tmp": ..., "cases": ...}'``) that prints each case's
    exit codes (``case_exits``) on a line ``EXITS {...}``; check each reference and each chain's
    last segment exited 0 and every other segment was SIGKILLed. Returns ``tmp``."""
    cfg = {"tmp": str(tmp), "cases": cases}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(cfg)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    exits = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("EXITS "))[6:])
    for name, case in cases.items():
        assert exits[name] == [0, *[-signal.SIGKILL] * len(case["kills"]), 0], done.stderr[-3000:]
    return tmp
