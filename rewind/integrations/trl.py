"""TRL: ``RewindTRLCallback`` records an online RL run of TRL (``GRPOTrainer``,
``RLOOTrainer``) and resumes it bit for bit, the sampling of its completions included.

Use::

    rewind = RewindTRLCallback("my-run")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=prompts,
                          processing_class=tokenizer, callbacks=[rewind])
    trainer.train(resume_from_checkpoint=rewind.checkpoint())

TRL's trainers are Hugging Face ``Trainer`` subclasses: this is the HF ``RewindCallback``
(``rewind.integrations.hf``), and a version holds what it records there (model, optimizer,
scheduler, trainer state, data position, every RNG, ``extra`` objects). What TRL adds:

* Sampling. ``transformers`` generation draws the completions from the global torch RNG,
  which a version records as it was when the step began: a resumed step generates the
  same completions, gets the same rewards and advantages, and logs the same loss and
  reward as the uninterrupted run.
* Buffered completions. The trainer generates once per ``steps_per_generation`` micro-batches
  and trains ``num_iterations`` times on them, slice by slice, across optimizer steps; TRL
  does not save that buffer, and on its own resume it generates afresh. So the callback
  commits only at optimizer steps where the buffer is used up (and at the last step):
  ``every`` defaults to the smallest such count, and a resume generates exactly where the
  uninterrupted run did. With the default ``steps_per_generation``
  (``gradient_accumulation_steps``) and ``num_iterations`` 1, that is every step.

Refused when training begins (a ``ConfigError``, before any step): an ``every`` whose commits
fall inside a buffer of completions; generation by vLLM (``use_vllm=True``: the sampling
happens in another process, whose RNG is not recorded); ``use_adaptive_entropy=True``
(its coefficient is trainer state no event gives). Not recorded: a reference model
(``beta`` > 0), which the trainer builds from the initial model as it starts, the same in
a resumed run as long as the script builds the same initial model; and ``log_history``
(HF limits). The metrics the trainer averages between two logs (``logging_steps`` above 1)
start afresh after a resume, as after TRL's own: every logged value is the uninterrupted
run's when ``logging_steps`` divides ``every``. ``RLOOTrainer`` buffers its completions as
``GRPOTrainer`` does and gets the same rule. Offline
trainers (``DPOTrainer``, ``SFTTrainer``, ``RewardTrainer``) draw no completions: the HF
``RewindCallback`` records them as it records any ``Trainer``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from transformers import TrainerControl, TrainerState, TrainingArguments

from eventlog.backends import RunAddress
from eventlog.capture import Stateful
from eventlog.errors import ConfigError
from eventlog.settings import Settings
from rewind.integrations.base import Cadence
from rewind.integrations.hf import RewindCallback
from rewind.snapshots import Snapshots
from snapshotter.policies import Trigger

__all__ = ["RewindTRLCallback", "steps_per_buffer"]


def steps_per_buffer(args: TrainingArguments) -> int:
    """The fewest optimizer steps after which a TRL trainer's buffer of completions is used
    up (1 for a trainer that buffers none)."""
    per_generation = getattr(args, "steps_per_generation", None)
    if per_generation is None:
        return 1
    generate_every = int(per_generation) * int(getattr(args, "num_iterations", 1))
    accumulate = int(args.gradient_accumulation_steps)
    return generate_every // math.gcd(generate_every, accumulate)


class RewindTRLCallback(RewindCallback):
    """The HF ``RewindCallback`` for TRL's online trainers (module docs).

    ``every``: commit every that many optimizer steps (and at the last); ``None``, the
    default, commits each time the trainer's buffer of completions is used up. The other
    arguments are the HF callback's.
    """

    owner = "RewindTRLCallback"

    def __init__(
        self,
        run: RunAddress | str,
        *,
        every: int | None = None,
        extra: Mapping[str, Stateful] | None = None,
        snapshots: Snapshots | Trigger | None = None,
        settings: Settings | None = None,
        predictive: bool = True,
    ) -> None:
        super().__init__(run, every=1 if every is None else every, extra=extra, snapshots=snapshots,
                         settings=settings, predictive=predictive)
        self._asked_every = every

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        refusal = self._refusal(args)
        if refusal is not None:
            self._remove_resume_dir()
            raise ConfigError(refusal)
        if self._asked_every is None:
            self.cadence = Cadence(steps_per_buffer(args), self.owner, self.unit)
        super().on_train_begin(args, state, control, **kwargs)

    def _refusal(self, args: TrainingArguments) -> str | None:
        """Why this run cannot be resumed exactly (``None``: it can)."""
        if getattr(args, "use_vllm", False):
            return ("RewindTRLCallback: use_vllm=True samples completions in another process, whose RNG "
                    "is not recorded: generate with transformers (use_vllm=False)")
        if getattr(args, "use_adaptive_entropy", False):
            return ("RewindTRLCallback: use_adaptive_entropy=True keeps a coefficient the callback cannot "
                    "record: use a fixed entropy_coef")
        block, asked = steps_per_buffer(args), self._asked_every
        if asked is None or asked % block == 0:
            return None
        per_generation = getattr(args, "steps_per_generation", None)
        iterations, accumulate = getattr(args, "num_iterations", 1), args.gradient_accumulation_steps
        return (f"RewindTRLCallback(every={asked}): the trainer uses one generation of completions for "
                f"{block} optimizer steps (steps_per_generation={per_generation}, "
                f"num_iterations={iterations}, gradient_accumulation_steps={accumulate}), "
                f"and a resume cannot rebuild it mid-way: commit every {block} steps or a multiple of it")
