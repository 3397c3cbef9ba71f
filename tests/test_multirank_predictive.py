"""The predictive codec on a multi-rank run (2-rank FSDP2 + AdamW, ``tests/multirank_trainer.py``):
each rank's part of a version holds its local shards' gradients, its steps and residuals;
every version replays bit-equal, a full fold and each rank's own fold alike; a job stopped
and restored (each rank folding its own shards) ends bit-equal to one that ran through; and
the parts are smaller than XOR deltas of the same job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest

from eventlog.backends import RunAddress
from eventlog.events import CommitSealed, OptimizerStep, TensorDelta
from eventlog.fold.engine import events, index_control
from eventlog.target import Target
from replayer.replay import replay
from tests.conftest import make_address

# Its module-scoped fixture is built once: every test of the file on one xdist worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_multirank_predictive")]

TRAINER = Path(__file__).with_name("multirank_trainer.py")
STEPS = 5
WORLD = 2
SHARDS = 2  # per rank, as the trainer records


def _run(root: Path, jobs: list[tuple[str, RunAddress, dict[str, Any]]], env: dict[str, str],
         nproc: int = WORLD) -> None:
    specs = [{"name": name, "nproc": nproc, "cfg": {
        "log": a.log_url, "coord": a.coord_url, "run": a.run_id, "out": str(root / name), **cfg}}
        for name, a, cfg in jobs]
    path = root / "jobs.json"
    path.write_text(json.dumps(specs))
    done = subprocess.run([sys.executable, str(TRAINER), str(path)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    outcome = json.loads(path.with_name("jobs.json.out").read_text())
    assert all(r["ok"] for r in outcome), [r["error"] for r in outcome if not r["ok"]]


def _ranks(out: Path, world: int = WORLD) -> list[dict[str, Any]]:
    return [msgpack.unpackb((out / f"rank{r}.msgpack").read_bytes(), raw=False) for r in range(world)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mrpredict")
    for name in ("p", "s", "x", "t2", "t4"):
        (root / name).mkdir()
    through = make_address("embedded", root / "p", "p")
    split = make_address("embedded", root / "s", "s")
    _run(root, [("through", through, {"steps": STEPS}), ("first", split, {"steps": 3}),
                ("rest", split, {"steps": STEPS})], {})
    xor_root = root / "xor"
    xor_root.mkdir()
    xor = make_address("embedded", root / "x", "x")
    _run(xor_root, [("xor", xor, {"steps": STEPS})], {"REWIND_PREDICT_MAX_STEPS": "0"})
    # Chunks of 64 bytes: a 3-row shard's gradient is two chunks, stepped tile by tile.
    tiled = make_address("embedded", root / "t2", "t2")
    _run(root, [("tiled", tiled, {"steps": 3})], {"REWIND_CHUNK_BYTES": "64"})
    # 6 rows over 4 ranks: rank 3 holds none of the first layer's.
    four = make_address("embedded", root / "t4", "t4")
    _run(root, [("four", four, {"steps": 3})], {"REWIND_CHUNK_BYTES": "32"}, nproc=4)
    return {"root": root, "through": through, "split": split, "xor": xor, "xor_root": xor_root,
            "tiled": tiled, "four": four}


def _seals(address: RunAddress) -> dict[int, CommitSealed]:
    with address.open_log() as log:
        return {v: s.seal for v, s in sorted(index_control(log).seals.items())}


def test_each_ranks_part_is_predictive_after_the_first_version(runs: dict[str, Any]) -> None:
    seals = _seals(runs["through"])
    assert sorted(seals) == list(range(1, STEPS + 1))
    assert seals[1].encoding.startswith("xor-delta (multi-rank, 2 ranks: rank 0: xor-delta/blosc2-zstd "
                                        "(not predictive: the layout changed"), seals[1].encoding
    for v in range(2, STEPS + 1):
        assert seals[v].encoding == (
            "predictive (multi-rank, 2 ranks: "
            "rank 0: predictive/AdamW x1 + gradients/none + residual/blosc2-zstd; "
            "rank 1: predictive/AdamW x1 + gradients/none + residual/blosc2-zstd)"), seals[v].encoding
    # Each rank's shards hold its own steps: its local gradients, then one step per shard
    # that holds a param, naming only the rank's tensors.
    with runs["through"].open_log() as log:
        for rank in range(WORLD):
            steps: dict[int, int] = {}
            grads: dict[int, int] = {}
            for shard in range(rank * SHARDS, (rank + 1) * SHARDS):
                for _, _, env in events(log, shard):
                    body = env.body
                    if isinstance(body, OptimizerStep):
                        steps[env.version] = steps.get(env.version, 0) + 1
                        mine = f"rank{rank}/"
                        assert all(n.startswith(mine + "model/") for n in body.params), body.params
                        assert all(p.startswith(mine + "optimizer/state/") for p in body.states), body.states
                        assert body.optimizer == "AdamW"
                    elif isinstance(body, TensorDelta) and body.encoding == TensorDelta.GRAD:
                        assert body.name.startswith(f"rank{rank}/model/"), body.name
                        grads[env.version] = grads.get(env.version, 0) + 1
            assert sorted(steps) == sorted(grads) == list(range(2, STEPS + 1)), (rank, steps, grads)


@pytest.mark.parametrize(("name", "world", "steps"), [("through", 2, STEPS), ("tiled", 2, 3), ("four", 4, 3)])
def test_every_version_replays_bit_equal_in_full_and_rank_by_rank(runs: dict[str, Any], name: str, world: int,
                                                                  steps: int) -> None:
    address = runs[name]
    seals = _seals(address)
    assert all(seals[v].encoding.startswith(f"predictive (multi-rank, {world} ranks: ")
               and seals[v].encoding.count("predictive/AdamW x1") == world for v in range(2, steps + 1))
    for v in range(1, steps + 1):  # each fold checks every shard's digest against the seal
        state, _ = replay(address, Target("version", v), use_snapshots=False)
        assert state.version == v
    final = {n: t.bits.tobytes() for s in state.shards for n, t in s.tensors.items()}
    for rank, got in enumerate(_ranks(runs["root"] / name, world)):
        own = range(rank * SHARDS, (rank + 1) * SHARDS)

        def own_shards(_layout: object, _small: object, own: range = own) -> range:
            return own

        mine, _ = replay(address, use_snapshots=False, shards=own_shards)
        folded = {n: t.bits.tobytes() for s in mine.shards for n, t in s.tensors.items()}
        checked = 0
        for key, bits in got.items():
            parts = key.split("/")
            logged = (f"rank{rank}/{key}" if parts[0] == "model"
                      else f"rank{rank}/optimizer/state/{parts[1]}/{parts[2]}" if len(parts) == 3 else None)
            if logged is not None:
                assert final[logged] == folded[logged] == bits, logged
                checked += 1
        assert checked == 6 + 3 * 6  # 6 params; each one's exp_avg, exp_avg_sq and step


def test_a_restored_job_ends_bit_equal_to_one_that_ran_through(runs: dict[str, Any]) -> None:
    root = runs["root"]
    restored = [json.loads((root / "rest" / f"restore0-rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["version"] for r in restored] == [3, 3]
    assert _ranks(root / "rest") == _ranks(root / "through")
    assert all(s.encoding.startswith("predictive ") for v, s in _seals(runs["split"]).items() if v > 1)


def test_predictive_parts_are_smaller_than_xor_deltas(runs: dict[str, Any]) -> None:
    xor, pred = _seals(runs["xor"]), _seals(runs["through"])
    assert all(s.encoding.startswith("xor-delta ") for s in xor.values())
    assert _ranks(runs["xor_root"] / "xor") == _ranks(runs["root"] / "through")
    tail = range(2, STEPS + 1)
    print("encoded bytes per version after the first: predictive",
          [pred[v].encoded_bytes for v in tail], "xor", [xor[v].encoded_bytes for v in tail])
    assert sum(pred[v].encoded_bytes for v in tail) < sum(xor[v].encoded_bytes for v in tail)
