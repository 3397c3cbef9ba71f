"""TRL with ``rewind.integrations.trl.RewindTRLCallback``: a ``GRPOTrainer`` run SIGKILLed
while it samples completions, between the micro-batches of a gradient accumulation, and
after a durable commit, resumed through ``train()``, logs the uninterrupted run's loss,
reward and gradient norm at every step after each resume (bit for bit), and ends bit-equal
to it (weights, optimizer, scheduler, RNGs). So do a run that trains several optimizer
steps on one generation of completions, which TRL buffers and does not save, and an
``RLOOTrainer`` run that does the same. An ``every`` that would commit inside such a
buffer is refused.

The model is a tiny GPT-2 built from a config, with a character-level tokenizer built in
the test (no downloads); completions are sampled by ``transformers`` generation on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rewind import ConfigError, RunAddress
from tests.forked import events, run_driver

#: One process imports torch, transformers and TRL once, then forks one child per run
#: segment (``tests.forked``). Each child appends to its own JSON-lines file: where
#: training began, each step's loss, reward and gradient norm (exact, hex), the kill it is
#: about to make, and, when it finishes, its commits and a digest of the final state.
ZYGOTE = r'''
import json, os, signal, sys, time, warnings
started = time.monotonic()
warnings.simplefilter("ignore", FutureWarning)
import torch
from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from transformers.utils import logging as hf_logging
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from rewind import RunAddress
from rewind.integrations.trl import RewindTRLCallback
from tests.forked import case_exits, case_streams, run_streams, trainer_digests
from tests.test_integration_trl import tiny_policy

cfg = json.loads(sys.argv[1])
hf_logging.set_verbosity_error()
PROMPTS = ["abc", "bcd", "cde", "def", "efg", "fgh", "gha", "hab"]


def reward(completions, **kw):
    return [float(c.count("a")) - 0.1 * len(c) for c in completions]


class Observer(TrainerCallback):
    """Logs each step; SIGKILLs its own process at the point it is told."""

    def __init__(self, out, kill, rewind):
        self.out, self.kill, self.rewind, self.commits = out, kill, rewind, []
        self.step, self.generating, self.forwards = 0, False, 0

    def write(self, **record):
        with open(self.out, "a") as f:
            f.write(json.dumps(record) + "\n")

    def at(self, hook):
        if self.kill == [hook, self.step]:
            if hook == "step_end_durable":
                self.rewind.last_commit.result()
            self.write(event="kill", hook=hook, step=self.step)
            os.kill(os.getpid(), signal.SIGKILL)

    def watch(self, model):
        """Kill on the third forward pass of a generate call (mid-sampling)."""
        generate = model.generate

        def generating(*args, **kwargs):
            self.generating, self.forwards = True, 0
            try:
                return generate(*args, **kwargs)
            finally:
                self.generating = False

        def forward(module, args):
            if self.generating:
                self.forwards += 1
                if self.forwards == 3:
                    self.at("generate")

        model.generate = generating
        model.register_forward_pre_hook(forward)

    def on_train_begin(self, args, state, control, **kw):
        self.step = state.global_step
        self.write(event="begin", step=state.global_step)

    def on_substep_end(self, args, state, control, **kw):
        self.at("substep_end")

    def on_step_end(self, args, state, control, **kw):
        self.step = state.global_step
        self.commits.append(self.rewind.last_commit)
        self.at("step_end")
        self.at("step_end_durable")

    def on_log(self, args, state, control, logs=None, **kw):
        if "loss" in logs:
            self.write(event="loss", step=state.global_step, loss=float(logs["loss"]).hex(),
                       reward=float(logs["reward"]).hex() if "reward" in logs else None,
                       grad_norm=float(logs["grad_norm"]).hex())


def segment(case, run, kill, out):
    torch.set_num_threads(1)  # the streams run side by side
    model, tokenizer = tiny_policy()  # dropout (0.1) draws from the RNGs as it trains
    config, trainer_class = (RLOOConfig, RLOOTrainer) if case.get("rloo") else (GRPOConfig, GRPOTrainer)
    args = config(
        output_dir=os.path.join(cfg["tmp"], "out"), per_device_train_batch_size=4,
        gradient_accumulation_steps=2, steps_per_generation=case["steps_per_generation"],
        num_generations=4, max_completion_length=6, max_steps=case["steps"], learning_rate=1e-2,
        max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
        seed=5, disable_tqdm=True, use_vllm=False, beta=0.0)
    db = f"sqlite://{os.path.join(cfg['tmp'], run + '.db')}"
    rewind = RewindTRLCallback(RunAddress(db, db, run))
    observer = Observer(out, kill, rewind)
    observer.watch(model)
    trainer = trainer_class(model=model, reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=tokenizer, callbacks=[rewind, observer])
    trainer.remove_callback(PrinterCallback)
    trainer.train(resume_from_checkpoint=rewind.checkpoint())
    final = trainer_digests(trainer)
    commits = [f.result() for f in observer.commits if f is not None]
    observer.write(event="final", digests=final, global_step=trainer.state.global_step,
                   commits=sorted({(c.step, c.encoding, c.residual_bytes) for c in commits}))


print(f"imports: {time.monotonic() - started:.1f}s", file=sys.stderr, flush=True)
codes = run_streams(cfg["tmp"], case_streams(cfg["tmp"], cfg["cases"]), segment)
print("EXITS " + json.dumps(case_exits(codes, cfg["cases"])), flush=True)
'''

#: 8 prompts, 2 a step (4 completions each, 2 micro-batches of 4 completions): 4 optimizer
#: steps an epoch. A kill ``[hook, k]`` comes after ``k`` optimizer steps: ``generate`` on the
#: third forward pass of the next step's sampling, ``substep_end`` after its first micro-batch.
CASES: dict[str, dict[str, Any]] = {
    # One generation a step (TRL's default): a commit every step.
    "grpo": {"steps_per_generation": None, "steps": 12, "block": 1,
             "kills": [["generate", 2], ["substep_end", 6], ["step_end_durable", 9]]},
    # One generation trains 2 optimizer steps (4 micro-batches): a commit every 2 steps. A kill
    # in the middle of a buffer resumes at its start and samples it again, as the run did.
    "buffered": {"steps_per_generation": 4, "steps": 12, "block": 2,
                 "kills": [["step_end", 5], ["generate", 6], ["substep_end", 9]]},
    # RLOOTrainer buffers its completions the same way.
    "rloo": {"rloo": True, "steps_per_generation": 4, "steps": 8, "block": 2,
             "kills": [["step_end", 3], ["generate", 4]]},
}


def tiny_policy() -> tuple[Any, Any]:
    """A 2-layer GPT-2 over 10 characters (``<pad>``, ``<eos>``, ``a``..``h``) and its
    character-level tokenizer, built from configs with the torch seed 0."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("abcdefgh")}}
    chars = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    chars.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=chars, pad_token="<pad>", eos_token="<eos>",
                                        padding_side="left")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(vocab), n_positions=32, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=1, eos_token_id=1, pad_token_id=0))
    return model, tokenizer


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_driver(ZYGOTE, tmp_path_factory.mktemp("trl"), CASES)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_killed_grpo_run_resumes_bit_exactly(runs: Path, name: str) -> None:
    """Each kill happened where it was told; every step logged after each resume has the
    uninterrupted run's loss, reward and gradient norm, and the final states are bit-equal."""
    case = CASES[name]
    block = case["block"]
    reference = events(runs / f"{name}-reference.jsonl")
    logged = {e["step"]: (e["loss"], e["reward"], e["grad_norm"]) for e in reference if e["event"] == "loss"}
    assert sorted(logged) == list(range(1, case["steps"] + 1))
    # Rewards vary (sampling matters); a step that trains on buffered completions logs none.
    rewards = [reward for _, reward, _ in logged.values()]
    assert len(set(rewards) - {None}) > 1 and rewards.count(None) == case["steps"] - case["steps"] // block
    ref_final = reference[-1]
    committed = [step for step, _, _ in ref_final["commits"]]
    assert committed == list(range(block, case["steps"] + 1, block))
    assert all(enc.startswith("predictive/AdamW") and residual == 0
               for _, enc, residual in ref_final["commits"][1:]), ref_final["commits"]

    began = 0
    for i, (hook, step) in enumerate([*case["kills"], [None, None]]):
        segment = events(runs / f"{name}-{i}.jsonl")
        start = segment[0]["step"]
        assert segment[0]["event"] == "begin"
        assert start % block == 0 and start >= began, (name, i, start)
        began = start
        for e in segment[1:-1]:
            if e["event"] == "loss":
                assert e["step"] > start
                assert (e["loss"], e["reward"], e["grad_norm"]) == logged[e["step"]], (name, i, e["step"])
        if hook is not None:
            assert segment[-1] == {"event": "kill", "hook": hook, "step": step}
            assert start <= step
    final = segment[-1]
    assert final["event"] == "final" and final["global_step"] == case["steps"]
    differ = sorted(k for k in ref_final["digests"].keys() | final["digests"].keys()
                    if ref_final["digests"].get(k) != final["digests"].get(k))
    assert not differ, (name, differ[:10])


@pytest.mark.slow
def test_an_every_inside_a_buffer_of_completions_is_refused(tmp_path: Path) -> None:
    """Commits every step while one generation trains 2 steps: refused before any step."""
    import warnings

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rewind.integrations.trl import RewindTRLCallback

    warnings.simplefilter("ignore", FutureWarning)
    model, tokenizer = tiny_policy()
    db = f"sqlite://{tmp_path / 'run.db'}"
    rewind = RewindTRLCallback(RunAddress(db, db, "every"), every=1)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                      gradient_accumulation_steps=2, steps_per_generation=4, num_generations=4,
                      max_completion_length=4, max_steps=2, report_to=[], use_cpu=True, bf16=False,
                      save_strategy="no", disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, train_dataset=Dataset.from_dict({"prompt": ["ab", "cd"]}),
                          processing_class=tokenizer, callbacks=[rewind])
    with pytest.raises(ConfigError) as refused:
        trainer.train(resume_from_checkpoint=rewind.checkpoint())
    assert str(refused.value) == (
        "RewindTRLCallback(every=1): the trainer uses one generation of completions for 2 optimizer steps "
        "(steps_per_generation=4, num_iterations=1, gradient_accumulation_steps=2), and a resume cannot "
        "rebuild it mid-way: commit every 2 steps or a multiple of it")
    assert trainer.state.global_step == 0
