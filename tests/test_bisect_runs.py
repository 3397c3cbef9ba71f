"""``rewind bisect`` on pairs of real runs, built by the integration and multi-rank harnesses:

* an HF ``Trainer`` run SIGKILLed and resumed, against the same run uninterrupted: identical
  (its trainer state's keys come back in another order; its ``total_flos`` is a measurement);
* two SB3 runs of one seed: identical (their ``Monitor`` started at other wall-clock times),
  and ``--strict`` names only those times;
* a run recorded at 4 ranks and resharded to 2, against one that stayed at 4: where they
  part, told briefly at the global level (whole tensors, no departed rank's leftovers)."""

from __future__ import annotations

import json
import multiprocessing
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest

from eventlog import RunAddress
from eventlog.fold.engine import fold_control, index_control
from tests.test_bisect import in_process, rewind
from tests.test_integration_hf import ZYGOTE
from tests.test_integration_sb3 import _run
from tests.test_multirank import Jobs

pytestmark = pytest.mark.slow


def bisect(capsys: pytest.CaptureFixture[str], a: str, b: str, *args: str) -> tuple[int, dict[str, Any], str]:
    """``rewind bisect A B`` as text through the installed command, and as JSON in this process."""
    text = rewind("bisect", a, b, *args)
    status, out = in_process(capsys, "bisect", a, b, "--json", *args)
    assert status == text.returncode, text.stderr
    doc: dict[str, Any] = json.loads(out)
    return status, doc, text.stdout


def small_state(spec: str, name: str) -> bytes:
    """Small state ``name`` of a run's newest version, as recorded (msgpack)."""
    url, _, run = spec.rpartition("#")
    with RunAddress(url, url, run, read_only=True).open_log() as log:
        idx = index_control(log)
        return fold_control(log, idx, idx.latest_version()).states[name]


def test_an_hf_run_killed_and_resumed_is_identical_to_the_run_uninterrupted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    case = {"accumulate": 1, "epochs": 1, "seedable_sampler": True, "eval_steps": 0,
            "kills": [["step_end_durable", 4]]}
    cfg = {"tmp": str(tmp_path), "cases": {"hf": case}}
    done = subprocess.run([sys.executable, "-c", ZYGOTE, json.dumps(cfg)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert '"hf": [0, -9, 0, 0]' in done.stdout  # the reference; killed once, resumed, refused
    ref, resumed = f"sqlite://{tmp_path}/hf-reference.db#hf-reference", f"sqlite://{tmp_path}/hf.db#hf"
    # What the seals see: after the resume, the trainer state's control args in another key order.
    trees = [msgpack.unpackb(small_state(spec, "trainer")) for spec in (ref, resumed)]
    order = [list(tree["stateful_callbacks"]["TrainerControl"]["args"]) for tree in trees]
    assert order[0] != order[1] and sorted(order[0]) == sorted(order[1])

    status, doc, text = bisect(capsys, ref, resumed)
    assert status == 0, text
    assert doc["status"] == "identical" and doc["replayed"] == {}
    assert doc["measured_steps"] >= 1  # total_flos: the resumed run counts from the last log
    assert [m["name"] for m in doc["measurements"]] == ["trainer"]
    assert doc["measurements"][0]["paths"][0].startswith("total_flos: ")
    assert "identical: every common step has equal states (12 common steps" in " ".join(text.split())

    # --strict counts total_flos, and only that: the key order is no difference at all.
    status, doc, text = bisect(capsys, ref, resumed, "--strict")
    assert status == 1
    assert (doc["step"], doc["previous_step"]) == (5, 4)
    assert [(s["name"], [p.split(":")[0] for p in s["paths"]]) for s in doc["small_states"]] == [
        ("trainer", ["total_flos"])]
    assert doc["tensors"] == [] and doc["measurements"] == []
    assert "small state trainer differs: total_flos: " in text


def test_two_sb3_runs_of_one_seed_are_identical_whatever_their_wall_clock(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests.test_integration_sb3"])
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    for run in ("a", "b"):
        cfg = {"algo": "ppo", "every": 1, "record": True, "url": url, "run": run, "kill_at": -1, "seg": 0,
               "out": str(tmp_path / f"{run}.json"), "losses": str(tmp_path / f"{run}.jsonl")}
        assert _run(ctx, cfg) == 0
    assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()  # trained alike
    assert small_state(f"{url}#a", "environments") != small_state(f"{url}#b", "environments")

    status, doc, text = bisect(capsys, f"{url}#a", f"{url}#b")
    assert status == 0, text
    assert doc["status"] == "identical" and doc["measured_steps"] == doc["common_steps"] == 21
    found = {m["name"]: m["paths"] for m in doc["measurements"]}
    assert sorted(found) == ["environments", "progress"]
    assert found["environments"][0] == "envs[0][0].attrs.episode_times[*] (24 values)"
    assert found["environments"][1].startswith("envs[0][0].attrs.t_start: ")
    assert found["progress"] == ["ep_info_buffer[*].t (24 values)"]
    assert "measurements that differ at step 640 (not counted; --strict counts them):" in text

    status, doc, text = bisect(capsys, f"{url}#a", f"{url}#b", "--strict")
    assert status == 1 and doc["status"] == "differ-from-start" and doc["tensors"] == []
    [env] = doc["small_states"]
    assert env["name"] == "environments" and env["paths"][0].startswith("envs[0][0].attrs.t_start: ")
    assert "in small states only" in " ".join(text.split()) and "initialization or config" not in text


def test_a_resharded_multirank_run_is_compared_gathered(
        tmp_path: Path, pytestconfig: pytest.Config, capsys: pytest.CaptureFixture[str]) -> None:
    jobs = Jobs(tmp_path, pytestconfig)
    resharded = RunAddress(f"sqlite://{tmp_path / 'r.db'}", f"sqlite://{tmp_path / 'r.db'}", "r")
    stayed = RunAddress(f"sqlite://{tmp_path / 's.db'}", f"sqlite://{tmp_path / 's.db'}", "s")
    jobs.add("at4", resharded, nproc=4, steps=6)
    jobs.add("at2", resharded, nproc=2, steps=8)  # restores step 6 at 2 ranks, goes on to 8
    jobs.add("stayed", stayed, nproc=4, steps=8)
    jobs.run()
    for name in ("at4", "at2", "stayed"):
        jobs.ok(name)

    a, b = f"{resharded.log_url}#r", f"{stayed.log_url}#s"
    status, doc, text = bisect(capsys, a, b)
    assert status == 1
    # Half the ranks draw half the data from step 7 on.
    assert (doc["step"], doc["previous_step"], doc["world"]) == (7, 6, [2, 4])
    tensors = {t["name"]: t for t in doc["tensors"]}
    assert set(tensors) == {f"model/{k}.{p}" for k in (0, 2, 4) for p in ("weight", "bias")} | {
        f"optimizer/state/{i}/{m}" for i in range(6) for m in ("exp_avg", "exp_avg_sq")}
    first = tensors["model/0.weight"]
    assert (first["shape"], first["differing"], first["numel"]) == ([6, 8], 48, 48)
    assert doc["small_states"] == []  # ranks 0 and 1 drew alike; ranks 2 and 3 are not compared
    assert doc["layout"] == ["world size: 2 vs 4"]
    assert "ranks 2, 3 only in B's world: their own states are not compared" in doc["notes"]
    lines = text.splitlines()
    assert len(lines) < 40 and not [ln for ln in lines if re.search(r"\brank\d+/", ln)], text
