"""Test support for the framework integrations: a training child process run to the end or
SIGKILLed at a point it chooses, resumed after each kill, and compared with the same run
never interrupted (final digests and every resumed segment's losses).

A child is a module-level function ``child(cfg)``. It writes to ``cfg["out"]`` a JSON dict of
digests when it ends, to ``cfg["out"] + ".restored"`` what its resume found
(``{"fresh": bool, "t": int, ...}``), appends ``{"seg", "t", "train"}`` rows to
``cfg["losses"]``, and kills itself where ``cfg["kill_at"]`` says (``-1``: never).
"""

from __future__ import annotations

import json
import multiprocessing
import signal
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eventlog import RunAddress, serde
from eventlog.events import TensorDelta

Child = Callable[[dict[str, Any]], None]


def forkserver(preload: str) -> multiprocessing.context.ForkServerContext:
    """A context whose children fork from one server that imported ``preload`` once (torch and
    the framework with it, no torch work before the fork): each child a fresh process."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([preload])
    return ctx


@contextmanager
def reporting(cfg: dict[str, Any]) -> Iterator[None]:
    """In a child: an exception's traceback goes to ``cfg["out"] + ".error"`` for the parent."""
    try:
        yield
    except BaseException:
        Path(cfg["out"] + ".error").write_text(traceback.format_exc())
        raise


def run_child(ctx: multiprocessing.context.ForkServerContext, child: Child,
              cfg: dict[str, Any]) -> int | None:
    """Run ``child(cfg)`` in a fresh process; fail with its traceback if it raised."""
    proc = ctx.Process(target=child, args=(cfg,))
    proc.start()
    proc.join(300)
    error = Path(cfg["out"] + ".error")
    assert not error.exists(), error.read_text()
    return proc.exitcode


def losses(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def kill_chain(ctx: multiprocessing.context.ForkServerContext, child: Child, tmp_path: Path,
               base: dict[str, Any], kills: list[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run the uninterrupted reference, then the run killed at ``kills`` and resumed after
    each; assert the final states bit-equal and every resumed segment's losses equal the
    reference's. Returns what each resume restored, and the reference losses."""
    ref = {**base, "record": False, "kill_at": -1, "seg": 0, "out": str(tmp_path / "ref.json"),
           "losses": str(tmp_path / "ref.jsonl")}
    assert run_child(ctx, child, ref) == 0
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    restored = []
    for seg, kill_at in enumerate([*kills, -1]):
        cfg = {**base, "record": True, "url": url, "run": "r", "kill_at": kill_at, "seg": seg,
               "out": str(tmp_path / f"seg{seg}.json"), "losses": str(tmp_path / "run.jsonl")}
        code = run_child(ctx, child, cfg)
        assert code == (0 if kill_at == -1 else -signal.SIGKILL), f"segment {seg} exited with {code}"
        restored.append(json.loads(Path(cfg["out"] + ".restored").read_text()))
    final = json.loads((tmp_path / f"seg{len(kills)}.json").read_text())
    reference = json.loads((tmp_path / "ref.json").read_text())
    differ = sorted(k for k in reference.keys() | final.keys() if final.get(k) != reference.get(k))
    assert not differ, f"the resumed run's final state differs from the uninterrupted run's: {differ}"

    expected = {row["t"]: row["train"] for row in losses(tmp_path / "ref.jsonl")}
    rows = losses(tmp_path / "run.jsonl")
    for seg, kill_at in enumerate(kills):
        # Everything the next process logged, from where it resumed to its own kill (or the end).
        after = [r for r in rows if r["seg"] == seg + 1]
        assert after, f"nothing was trained after kill {seg} at {kill_at}"
        wrong = [r["t"] for r in after if r["train"] != expected[r["t"]]]
        assert not wrong, f"after kill {seg} at {kill_at}, the losses at {wrong} differ from the reference's"
    assert max(r["t"] for r in rows) == max(expected), "the resumed run did not reach the end"
    return restored, list(expected.values())


def buffer_bytes(url: str, run: str, prefix: str = "replay_buffer/") -> dict[int, int]:
    """Payload bytes of the tensor events whose names start with ``prefix``, by version."""
    sizes: dict[int, int] = {}
    with RunAddress(url, url, run).open_log() as log:
        for shard in range(log.shard_count() or 0):
            for record in log.scan(shard):
                env = serde.decode(record.value)
                if isinstance(env.body, TensorDelta) and env.body.name.startswith(prefix):
                    sizes[env.version] = sizes.get(env.version, 0) + len(env.body.payload)
    return sizes
