"""``rewind bisect A B``: two runs of one seeded trainer, the second changed at step K in one
way each; bisect names step K and what differs there, through the installed command."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from eventlog import RunAddress
from replayer.bisect import bisect
from rewind.cli import run
from rewind.recorder import Recorder

# Its module-scoped fixture is built once: every test of the file on one xdist worker.
pytestmark = pytest.mark.xdist_group("test_bisect")

STEPS, K, LR, NEW_LR, NUDGE = 12, 7, 0.01, 0.02, 0.25
LONG = ("an_encoder_block_with_a_rather_long_descriptive_name", "decoder_projection_layer")
REWIND = shutil.which("rewind")


class Control:
    """A ``Stateful`` whose flags come back in another key order from step ``reorder_from``
    on, as a resumed HF trainer's ``TrainerControl`` args do."""

    def __init__(self, reorder_from: int | None) -> None:
        self.step, self.reorder_from = 0, reorder_from

    def state_dict(self) -> dict[str, Any]:
        flags = {"should_log": self.step % 2 == 0, "should_save": False, "step": self.step}
        if self.reorder_from is not None and self.step >= self.reorder_from:
            flags = dict(sorted(flags.items(), reverse=True))
        return {"args": flags}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["args"]["step"])


def train(root: Path, run: str, *, seed: int = 0, perturb_at: int | None = None,
          draw_at: int | None = None, lr_from: int | None = None, threads: int | None = None,
          names: tuple[str, str] = ("0", "2"), reorder_from: int | None = None) -> str:
    """A seeded trainer (steps 1..STEPS, so version == step); returns its bisect spec.
    ``names``: its two layers' names; ``reorder_from``: record a ``Control`` too."""
    url = f"sqlite://{root / run}.db"
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        first = torch.nn.Linear(6, 5)
        model = torch.nn.Sequential(OrderedDict([(names[0], first), ("1", torch.nn.Tanh()),
                                                 (names[1], torch.nn.Linear(5, 3))]))
        opt = torch.optim.Adam(model.parameters(), lr=LR)
        control = Control(reorder_from)
        extra = {"control": control} if reorder_from is not None else None
        with Recorder(RunAddress(url, url, run), model, opt, chunk_bytes=64, extra=extra) as rec:
            for step in range(1, STEPS + 1):
                control.step = step
                if step == draw_at:
                    torch.rand(1)  # one extra draw: the batch below comes out different
                if step == lr_from:
                    for group in opt.param_groups:
                        group["lr"] = NEW_LR
                opt.zero_grad()
                model(torch.randn(4, 6)).pow(2).mean().backward()
                opt.step()
                if step == perturb_at:
                    with torch.no_grad():
                        first.weight[1, 2] += NUDGE
                rec.commit(step, {"loss": float(step)}, wait=True)
    finally:
        torch.set_num_threads(before)
    return f"{url}#{run}"


def other_threads() -> int:
    return 1 if torch.get_num_threads() != 1 else 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("bisect")
    yield {
        "a": train(root, "a"),
        "same": train(root, "same"),
        "perturbed": train(root, "perturbed", perturb_at=K, threads=other_threads()),
        "drawn": train(root, "drawn", draw_at=K),
        "lr": train(root, "lr", lr_from=K),
        "seed": train(root, "seed", seed=1),
        "long": train(root, "long", names=LONG),
        "nudged": train(root, "nudged", names=LONG, perturb_at=K),
        "keys": train(root, "keys", reorder_from=STEPS + 1),
        "reordered": train(root, "reordered", reorder_from=K),
    }


def rewind(*args: str) -> subprocess.CompletedProcess[str]:
    """The installed console script (each start imports torch: used for the exit codes)."""
    assert REWIND is not None, "the rewind console script is not installed"
    return subprocess.run([REWIND, *args], capture_output=True, text=True, timeout=300)


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """The same command line run in this process: its exit status and stdout."""
    capsys.readouterr()
    status = run(list(args))
    return status, capsys.readouterr().out


def bisect_json(a: str, b: str, status: int,
                capsys: pytest.CaptureFixture[str] | None = None) -> dict[str, Any]:
    """``rewind bisect A B --json``: installed, or in this process given ``capsys``."""
    if capsys is None:
        result = rewind("bisect", a, b, "--json")
        code, out = result.returncode, result.stdout + result.stderr
    else:
        code, out = in_process(capsys, "bisect", a, b, "--json")
    assert code == status, out
    doc: dict[str, Any] = json.loads(out)
    assert doc["command"] == "bisect" and doc["ok"] is (status == 0)
    return doc


def test_identical_runs_exit_0(runs: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    status, out = in_process(capsys, "bisect", runs["a"], runs["same"])
    assert status == 0
    assert "identical: every common step has the same state digest (12 common steps" in out
    doc = bisect_json(runs["a"], runs["same"], 0)
    assert doc["status"] == "identical" and doc["step"] is None and doc["replayed"] == {}


def test_small_states_equal_as_values_are_identical_whatever_their_key_order(
        runs: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    result = rewind("bisect", runs["keys"], runs["reordered"])
    assert result.returncode == 0, result.stdout + result.stderr
    said = " ".join(result.stdout.split())
    assert "identical: every common step has equal states (12 common steps" in said
    assert f"{STEPS - K + 1} common steps with other small-state bytes hold equal values" in said
    doc = bisect_json(runs["keys"], runs["reordered"], 0, capsys)
    assert (doc["encoded_steps"], doc["differing_steps"], doc["replayed"]) == (STEPS - K + 1, 0, {})


def test_a_perturbed_weight_is_named_with_its_one_element_and_difference(
        runs: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    doc = bisect_json(runs["a"], runs["perturbed"], 1)
    assert doc["status"] == "diverged"
    assert (doc["step"], doc["version_a"], doc["version_b"], doc["previous_step"]) == (K, K, K, K - 1)
    assert doc["differing_steps"] == STEPS - K + 1
    (tensor,) = doc["tensors"]
    assert (tensor["name"], tensor["differing"], tensor["numel"]) == ("model/0.weight", 1, 30)
    assert math.isclose(tensor["max_abs_diff"], NUDGE, rel_tol=1e-5)
    assert doc["shards"] == [tensor["shard"]] and doc["small_states"] == []
    step = doc["optimizer_step"]
    assert step["gradients_equal"] and step["optimizer_result_equal"]
    assert "changed outside the optimizer step" in step["verdict"]
    # The run was recorded with another thread count: its fingerprint says so.
    assert doc["environment"] == {"num_threads": [torch.get_num_threads(), other_threads()]}
    # Only the version before the divergence and the divergent one were replayed.
    assert doc["replayed"] == {"a": [K - 1, K], "perturbed": [K - 1, K]}
    assert doc["seals_compared"] <= math.ceil(math.log2(STEPS)) + 1

    status, text = in_process(capsys, "bisect", runs["a"], runs["perturbed"])
    assert status == 1
    assert f"diverged at step {K} (version {K} in A, {K} in B)" in text
    assert "model/0.weight" in text and "1 of 30" in text
    assert f"environment: num_threads {torch.get_num_threads()} (A) vs {other_threads()} (B)" in text


def test_an_extra_random_draw_names_the_rng_stream_and_the_tensors_it_reached(
        runs: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    doc = bisect_json(runs["a"], runs["drawn"], 1, capsys)
    assert doc["step"] == K
    assert doc["small_states"] == [
        {"name": "rng", "kind": "RngAdvance", "paths": ["torch: differs (5056 elements)"], "more": 0,
         "total": 1}]
    reached = {t["name"] for t in doc["tensors"]}
    assert {"model/0.weight", "model/0.bias", "model/2.weight", "model/2.bias"} <= reached
    step = doc["optimizer_step"]
    assert not step["gradients_equal"] and step["verdict"].startswith("gradients differ")
    assert {g["name"] for g in step["gradients"]} == {"model/0.weight", "model/0.bias", "model/2.weight",
                                                      "model/2.bias"}
    assert doc["hyperparameters"] == [] and doc["environment"] == {}
    assert "RNG streams differ (rng): torch" in in_process(capsys, "bisect", runs["a"], runs["drawn"])[1]


def test_a_new_learning_rate_shows_equal_gradients_and_the_hyperparameter(
        runs: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    doc = bisect_json(runs["a"], runs["lr"], 1, capsys)
    assert doc["step"] == K
    step = doc["optimizer_step"]
    assert step["gradients_equal"] and not step["optimizer_result_equal"]
    assert step["verdict"].startswith("gradients equal, optimizer result differs")
    assert doc["hyperparameters"] == [f"group 0 lr: {LR} -> {NEW_LR}"]
    # Adam's moments do not depend on the learning rate: only the weights differ.
    assert {t["name"] for t in doc["tensors"]} == {"model/0.weight", "model/0.bias", "model/2.weight",
                                                   "model/2.bias"}
    text = in_process(capsys, "bisect", runs["a"], runs["lr"])[1]
    assert "gradients equal, optimizer result differs" in text
    assert f"hyperparameter: group 0 lr: {LR} -> {NEW_LR}" in text


def test_runs_that_differ_from_the_start_are_reported_so(runs: dict[str, str],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    doc = bisect_json(runs["a"], runs["seed"], 1, capsys)
    assert doc["status"] == "differ-from-start" and doc["step"] == 1 and doc["previous_step"] is None
    assert any("different initialization or config" in n for n in doc["notes"])
    assert doc["replayed"] == {"a": [1], "seed": [1]}
    assert "differ from the start" in in_process(capsys, "bisect", runs["a"], runs["seed"])[1]


def test_the_report_fits_80_columns_when_piped(runs: dict[str, str]) -> None:
    assert REWIND is not None
    for pair, name, counts in ((("a", "drawn"), "model/2.bias", "3 of 3"),
                               (("long", "nudged"), f"model/{LONG[0]}.weight", "1 of 30")):
        result = subprocess.run([REWIND, "bisect", *(runs[r] for r in pair)], capture_output=True, text=True,
                                timeout=300, env={**os.environ, "COLUMNS": "80"})
        assert result.returncode == 1, result.stderr
        lines = result.stdout.splitlines()
        assert max(map(len, lines)) <= 80, result.stdout
        # A table's row is whole: a tensor's name, on the row or alone below it, and its counts.
        rows = [i for i, ln in enumerate(lines) if ln.split() and ln.split()[-1] == name]
        whole = [f" {counts} " in lines[i] or (lines[i].strip() == name and f" {counts} " in lines[i - 1])
                 for i in rows]
        assert whole and all(whole), result.stdout


def test_a_bad_run_is_one_error_line_and_exit_2(runs: dict[str, str], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    result = rewind("bisect", runs["a"], f"sqlite://{tmp_path}/nothing.db#x")
    assert result.returncode == 2 and result.stdout == "", result.stdout + result.stderr
    assert result.stderr.startswith("error: RunNotFoundError: no Rewind log at ")
    assert len(result.stderr.splitlines()) == 1
    for spec, says in (("sqlite:///x.db", "name the run after the log URL, as LOG_URL#RUN"),
                       (str(tmp_path / "no-dir"), "no Rewind run in")):
        capsys.readouterr()
        assert run(["bisect", runs["a"], spec]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and says in captured.err and len(captured.err.splitlines()) == 1


def test_the_library_reads_only_seals_for_identical_runs(runs: dict[str, str]) -> None:
    def address(spec: str) -> RunAddress:
        url, _, run = spec.rpartition("#")
        return RunAddress(url, url, run, read_only=True)

    phases: list[str] = []
    report = bisect(address(runs["a"]), address(runs["lr"]), on_phase=phases.append)
    assert report.step == K and report.replayed == {"a": [K - 1, K], "lr": [K - 1, K]}
    assert phases[0] == "reading the seals" and f"replaying lr on to version {K}" in phases
    phases.clear()
    assert bisect(address(runs["a"]), address(runs["same"]), on_phase=phases.append).identical
    assert phases == ["reading the seals"]
