"""Hugging Face ``Trainer`` with ``rewind.integrations.hf.RewindCallback``: a run SIGKILLed
at seeded random points (mid-epoch, at an epoch's end, between the micro-batches of a
gradient accumulation) and resumed through ``train()`` ends bit-equal to the same run never
interrupted (parameters, optimizer, scheduler, RNGs), and logs the same loss at every step
after each kill, with evaluations during training and with either sampler the trainer
builds. So does a run whose data collator draws random numbers (from its own generator,
recorded as an ``extra``, or from the global RNGs), although the trainer's dataloader
collates a batch ahead of the step that trains it. A finished run started again trains
nothing. Every step is recorded by the predictive codec with an exact prediction, and a
``train()`` that forgets to resume a recorded run is refused."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from replayer.audit import history
from rewind import ConfigError, RewindError, RunAddress
from tests.forked import events as _events

#: One process imports torch and transformers once, then forks one child per run segment
#: (a child is a whole process: a SIGKILL leaves its recorder's commits where they were).
#: Each child appends its events to its own JSON-lines file: where training began, each
#: step's loss and gradient norm (exact, hex), and, when it finishes, the commits' codecs
#: and a digest of every tensor and RNG of the final state.
ZYGOTE = r'''
import json, os, random, signal, sys, time
started = time.monotonic()
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback
from transformers.utils import logging as hf_logging
from rewind import RewindError, RunAddress
from rewind.integrations.hf import RewindCallback
from tests.forked import case_exits, case_streams, digest, run_streams, segment_file, trainer_digests

cfg = json.loads(sys.argv[1])
hf_logging.set_verbosity_error()
GPT2LMHeadModel.__name__  # imports the model's module here, once, not in every child


class Masking:
    """A collator that hides a random quarter of the labels: drawn from its own generator
    (a ``Stateful`` the run records as an extra) or from the global torch and ``random`` RNGs."""

    def __init__(self, source):
        self.source, self.generator = source, torch.Generator().manual_seed(11)

    def __call__(self, features):
        ids = torch.stack([f["input_ids"] for f in features])
        if self.source == "own":
            hide = torch.rand(ids.shape, generator=self.generator) < 0.25
        else:
            hide = (torch.rand(ids.shape) < 0.15) | torch.tensor(
                [[random.random() < 0.1 for _ in row] for row in ids.tolist()])
        return {"input_ids": ids, "labels": ids.masked_fill(hide, -100)}

    def state_dict(self):
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state):
        self.generator.set_state(state["generator"])


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (24, 8), generator=torch.Generator().manual_seed(7))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Observer(TrainerCallback):
    def __init__(self, out, kill, rewind):
        self.out, self.kill, self.rewind, self.commits = out, kill, rewind, []

    def write(self, **record):
        with open(self.out, "a") as f:
            f.write(json.dumps(record) + "\n")

    def at(self, hook, state):
        if self.kill == [hook, state.global_step]:
            if hook == "step_end_durable":
                self.rewind.last_commit.result()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_begin(self, args, state, control, **kw):
        self.write(event="begin", step=state.global_step)

    def on_step_begin(self, args, state, control, **kw):
        self.at("step_begin", state)

    def on_substep_end(self, args, state, control, **kw):
        self.at("substep_end", state)

    def on_step_end(self, args, state, control, **kw):
        self.commits.append(self.rewind.last_commit)
        self.at("step_end", state)
        self.at("step_end_durable", state)

    def on_log(self, args, state, control, logs=None, **kw):
        if "loss" in logs:
            self.write(event="loss", step=state.global_step, loss=float(logs["loss"]).hex(),
                       grad_norm=float(logs["grad_norm"]).hex())


def segment(case, run, kill, out):
    torch.set_num_threads(1)  # the streams run side by side
    torch.manual_seed(0)  # the model's initial weights; dropout (0.1) draws from the RNGs
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0,
                                       tie_word_embeddings=False))
    args = TrainingArguments(
        output_dir=os.path.join(cfg["tmp"], "out"), per_device_train_batch_size=2,
        gradient_accumulation_steps=case["accumulate"], num_train_epochs=case["epochs"],
        max_steps=case.get("max_steps", -1),
        learning_rate=3e-3, warmup_steps=3, max_grad_norm=0.5, logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, seed=5, disable_tqdm=True,
        accelerator_config={"use_seedable_sampler": case["seedable_sampler"]},
        eval_strategy="steps" if case["eval_steps"] else "no", eval_steps=case["eval_steps"] or None)
    db = f"sqlite://{os.path.join(cfg['tmp'], run + '.db')}"
    collator = Masking(case["collator"]) if case.get("collator") else None
    extra = {"collator": collator} if case.get("collator") == "own" else None
    rewind = RewindCallback(RunAddress(db, db, run), extra=extra)
    observer = Observer(out, kill, rewind)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(),
                      data_collator=collator, callbacks=[rewind, observer])
    trainer.remove_callback(PrinterCallback)
    try:
        trainer.train(resume_from_checkpoint=None if kill == "no_resume" else rewind.checkpoint())
    except RewindError as exc:
        observer.write(event="error", message=str(exc))
        return
    final = trainer_digests(trainer)
    sampler = trainer.callback_handler.train_dataloader.batch_sampler.sampler
    if sampler.generator is not None:
        digest(sampler.generator.get_state(), "sampler", final)
    if collator is not None:
        digest(collator.state_dict(), "collator", final)
    commits = [f.result() for f in observer.commits]
    observer.write(event="final", digests=final, global_step=trainer.state.global_step,
                   committed=rewind.last_commit is not None,
                   commits=[[c.step, c.encoding, c.residual_bytes] for c in commits])


print(f"imports: {time.monotonic() - started:.1f}s", file=sys.stderr, flush=True)
# Four streams at once, each with its own log: every case's reference, and its chain of
# segments (each resumes the one killed before it).
streams = case_streams(cfg["tmp"], cfg["cases"])
for name, case in cfg["cases"].items():
    if case.get("again"):  # the finished run's command, run again
        streams[name].append((case, name, "again", segment_file(cfg["tmp"], name, "again")))
    # Then train() on the finished run, forgetting resume_from_checkpoint: refused.
    streams[name].append((case, name, "no_resume", segment_file(cfg["tmp"], name, "no_resume")))
codes = run_streams(cfg["tmp"], streams, segment)
print("EXITS " + json.dumps(case_exits(codes, cfg["cases"])), flush=True)
'''


def _cases() -> dict[str, dict[str, Any]]:
    """Seeded kill points. A commit is asynchronous (at most two are in flight), so a kill
    at step ``k`` resumes from step ``k-2`` to ``k``; mid-epoch kills are placed where that
    whole range is mid-epoch. One kill waits for its commit to be durable, at an epoch's end."""
    rng = random.Random(24)
    return {
        # 12 optimizer steps an epoch, 24 in all; an evaluation every 4 (it draws from the
        # global RNG as its dataloader starts).
        "plain": {"accumulate": 1, "epochs": 2, "steps_per_epoch": 12, "seedable_sampler": True,
                  "eval_steps": 4, "kills": [
            ["step_end", rng.randint(4, 10)], ["step_end_durable", 12],
            ["step_begin", rng.randint(16, 22)]]},
        # 2 micro-batches a step: 6 optimizer steps an epoch, 12 in all. A plain
        # RandomSampler: each epoch's order is drawn from the global RNG as it begins.
        "accumulate": {"accumulate": 2, "epochs": 2, "steps_per_epoch": 6, "seedable_sampler": False,
                       "eval_steps": 0, "kills": [
            ["substep_end", rng.choice([4, 5])], ["step_end", rng.choice([10, 11])]]},
    }


def _run(tmp_path: Path, cases: dict[str, dict[str, Any]]) -> dict[str, list[int]]:
    """Run every case's reference and chain of segments; returns each case's exit codes
    (reference, segments), after checking each chain was killed where it was told."""
    cfg = {"tmp": str(tmp_path), "cases": cases}
    done = subprocess.run([sys.executable, "-c", ZYGOTE, json.dumps(cfg)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    exits: dict[str, list[int]] = json.loads(
        next(ln for ln in done.stdout.splitlines() if ln.startswith("EXITS "))[6:])
    for name, case in cases.items():
        again = [0] if case.get("again") else []
        killed = [-signal.SIGKILL] * len(case["kills"])
        assert exits[name] == [0, *killed, 0, *again, 0], done.stderr[-3000:]
    return exits


@pytest.mark.slow
def test_a_killed_trainer_resumes_bit_exactly_through_train(tmp_path: Path) -> None:
    cases = _cases()
    _run(tmp_path, cases)
    resumed_at = {name: _check(tmp_path, name, case) for name, case in cases.items()}
    mid_epoch = [(name, step) for name, case in cases.items() for step in resumed_at[name]
                 if step % case["steps_per_epoch"] != 0]
    assert len(mid_epoch) >= 3, resumed_at
    _check_hf_export(tmp_path, "plain")


#: Runs whose data collator draws random numbers, and a run that ends mid-epoch.
DRIFT_CASES: dict[str, dict[str, Any]] = {
    # The collator draws from its own generator, recorded as an extra; evaluations (which
    # collate with it too) every 4 steps. The first kill comes after step 9's commit is
    # durable, mid-epoch: the loader had collated step 10's batch before that commit.
    "own_collator": {"accumulate": 1, "epochs": 2, "steps_per_epoch": 12, "seedable_sampler": True,
                     "eval_steps": 4, "collator": "own",
                     "kills": [["step_end_durable", 9], ["step_begin", 20]]},
    # The collator draws from the global torch and ``random`` RNGs, with 2 micro-batches a step.
    "global_collator": {"accumulate": 2, "epochs": 2, "steps_per_epoch": 6, "seedable_sampler": False,
                        "eval_steps": 0, "collator": "global",
                        "kills": [["step_end_durable", 3], ["substep_end", 9]]},
    # max_steps ends the run at step 16, in the middle of the second epoch; then the same
    # command runs again on the finished run. (A plain RandomSampler: accelerate's seedable
    # one creates its generator only when it is first iterated.)
    "max_steps": {"accumulate": 1, "epochs": 2, "steps_per_epoch": 12, "max_steps": 16,
                  "seedable_sampler": False, "eval_steps": 0, "kills": [["step_end_durable", 14]],
                  "again": True},
}


@pytest.fixture(scope="module")
def drift_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp_path = tmp_path_factory.mktemp("drift")
    _run(tmp_path, DRIFT_CASES)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("name", ["own_collator", "global_collator"])
def test_a_collator_that_draws_random_numbers_resumes_bit_exactly(drift_runs: Path, name: str) -> None:
    """Killed after a mid-epoch commit, resumed: every later step logs the uninterrupted
    run's loss, and the run ends bit-equal, the collator's generator included."""
    case = DRIFT_CASES[name]
    began = _check(drift_runs, name, case)
    assert all(step % case["steps_per_epoch"] for step in began), began
    assert began[0] == case["kills"][0][1]


@pytest.mark.slow
def test_a_finished_run_started_again_trains_nothing(drift_runs: Path) -> None:
    """The finished run's command again (it stopped at max_steps, mid-epoch): train()
    returns having trained no step and committed nothing, and the run's state is bit-equal
    to the uninterrupted run's."""
    _check(drift_runs, "max_steps", DRIFT_CASES["max_steps"])
    events = _events(drift_runs / "max_steps-again.jsonl")
    assert [e["event"] for e in events] == ["begin", "final"]
    final, reference = events[-1], _events(drift_runs / "max_steps-reference.jsonl")[-1]
    assert (final["global_step"], final["committed"], final["commits"]) == (16, False, [])
    assert final["digests"] == reference["digests"]


LOAD = """
import hashlib, json, sys
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(json.dumps({"class": type(model).__name__, "n_embd": model.config.n_embd, "digests": {
    f"model/{k}": f"{t.dtype}{list(t.shape)}:" + hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
    for k, t in model.state_dict().items()}}))
"""


def _check_hf_export(tmp_path: Path, name: str) -> None:
    """The resumed run's export as an HF directory (no config hook) loads with
    ``from_pretrained``: the recorded config, and weights bit-equal to the trained model's."""
    db = f"sqlite://{tmp_path / (name + '.db')}"
    out = tmp_path / f"{name}-hf"
    done = subprocess.run(["rewind", "export", "--log", db, "--run", name, "--format", "hf",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = subprocess.run([sys.executable, "-c", LOAD, str(out)], capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    got = json.loads(loaded.stdout.splitlines()[-1])
    assert (got["class"], got["n_embd"]) == ("GPT2LMHeadModel", 16)
    want = {k: v for k, v in _events(tmp_path / f"{name}-reference.jsonl")[-1]["digests"].items()
            if k.startswith("model/")}
    assert got["digests"] == want


def _check(tmp_path: Path, name: str, case: dict[str, Any]) -> list[int]:
    """Check one case's segments against its reference; returns the steps they resumed at."""
    kills = case["kills"]
    reference = _events(tmp_path / f"{name}-reference.jsonl")
    losses = {e["step"]: (e["loss"], e["grad_norm"]) for e in reference if e["event"] == "loss"}
    total = case.get("max_steps", case["epochs"] * case["steps_per_epoch"])
    assert sorted(losses) == list(range(1, total + 1))
    # Clipping is at work (the norm logged is the one before clipping to 0.5), and the
    # recorder's step hook sees the clipped gradients: its replay of each step is exact.
    assert any(float.fromhex(norm) > 0.5 for _, norm in losses.values())
    ref_final = reference[-1]
    assert [c[0] for c in ref_final["commits"]] == list(range(1, total + 1))
    assert all(enc.startswith("predictive/AdamW") and residual == 0
               for _, enc, residual in ref_final["commits"][1:]), ref_final["commits"]

    began: list[int] = []
    logged: set[int] = set()
    for i in range(len(kills) + 1):
        events = _events(tmp_path / f"{name}-{i}.jsonl")
        assert events[0]["event"] == "begin"
        start = events[0]["step"]
        if i == 0:
            assert start == 0
        else:
            hook, killed_at = kills[i - 1]
            assert began[-1] < start <= killed_at, (name, i, began, start)
            if hook == "step_end_durable":
                assert start == killed_at
        began.append(start)
        # Every step logged after the resume point is the reference's, bit for bit.
        for e in events:
            if e["event"] == "loss":
                assert e["step"] > start
                assert (e["loss"], e["grad_norm"]) == losses[e["step"]], (name, i, e["step"])
                logged.add(e["step"])
    # A step's loss is logged after its step end: a kill there loses it if the run resumed
    # after that step.
    assert set(losses) - logged <= {step for hook, step in kills if hook.startswith("step_end")}
    final = events[-1]
    assert final["event"] == "final"
    differ = sorted(k for k in ref_final["digests"].keys() | final["digests"].keys()
                    if ref_final["digests"].get(k) != final["digests"].get(k))
    assert not differ, (name, differ[:10])
    assert all(enc.startswith("predictive/AdamW") and residual == 0 for _, enc, residual in final["commits"])
    [refused] = [e for e in _events(tmp_path / f"{name}-no_resume.jsonl") if e["event"] != "begin"]
    assert refused == {"event": "error", "message": (
        f"run {name!r} is at step {total}, but train() begins at step 0: resume with "
        "trainer.train(resume_from_checkpoint=callback.checkpoint())")}
    return began[1:]


def _trainer(tmp_path: Path, callback: Any, *, max_steps: int, workers: int = 0, collator: Any = None,
             late: bool = False) -> Any:
    """A tiny GPT-2 ``Trainer`` on 4 samples, 2 a batch (2 steps an epoch). ``late``: the
    callback is added after the trainer is built, not passed to it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2))
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(7))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                             max_steps=max_steps, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=workers)
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator,
                      callbacks=[] if late else [callback])
    if late:
        trainer.add_callback(callback)
    return trainer


def _callback(tmp_path: Path, run: str, **options: Any) -> Any:
    """A ``RewindCallback`` recording ``run`` in an embedded log under ``tmp_path``."""
    from rewind.integrations.hf import RewindCallback

    db = f"sqlite://{tmp_path / 'run.db'}"
    return RewindCallback(RunAddress(db, db, run), **options)


def _refusal(trainer: Any, callback: Any, error: type[Exception]) -> str:
    """The message ``train()`` on ``callback.checkpoint()`` fails with."""
    with pytest.raises(error) as refused:
        trainer.train(resume_from_checkpoint=callback.checkpoint())
    return str(refused.value)


class _OwnRng:
    """A collator with its own generator (it masks no label: its draws only move it)."""

    def __init__(self) -> None:
        import torch
        self.generator = torch.Generator().manual_seed(11)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        import torch
        torch.rand(1, generator=self.generator)
        ids = torch.stack([f["input_ids"] for f in features])
        return {"input_ids": ids, "labels": ids}

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


@pytest.mark.slow
def test_a_recorded_collator_in_worker_processes_is_refused(tmp_path: Path) -> None:
    """A collator recorded as an extra but run in dataloader workers (its state there cannot
    be seen) is refused when training begins, before any step."""
    collator = _OwnRng()
    rewind = _callback(tmp_path, "workers", extra={"collator": collator})
    trainer = _trainer(tmp_path, rewind, max_steps=2, workers=2, collator=collator)
    assert _refusal(trainer, rewind, ConfigError) == (
        "RewindCallback(extra=...): 'collator' is the data collator, which runs in 2 dataloader worker "
        "processes, where its state cannot be recorded: train with dataloader_num_workers=0")
    assert trainer.state.global_step == 0


@pytest.mark.slow
def test_a_finished_run_is_not_trained_further_by_a_callback_added_late(tmp_path: Path) -> None:
    """A callback added with ``add_callback`` does not see the trainer's arguments, so
    ``checkpoint()`` cannot tell the trainer the run is finished: started again on a run that
    ended mid-epoch, train() is refused before it trains a step, and the run stays at its end."""
    first = _callback(tmp_path, "late")
    _trainer(tmp_path, first, max_steps=3, late=True).train(resume_from_checkpoint=first.checkpoint())
    again = _callback(tmp_path, "late")
    trainer = _trainer(tmp_path, again, max_steps=3, late=True)
    assert _refusal(trainer, again, RewindError) == (
        "run 'late' is finished (step 3 of 3) but the trainer is about to train another epoch: pass the "
        "callback as Trainer(callbacks=[...]) so checkpoint() sees its arguments")
    assert trainer.state.global_step == 3
    _, rows = history(again.address)
    assert [row.step for row in rows if row.kind == "version"] == [1, 2, 3]
