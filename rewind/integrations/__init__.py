"""Trainer integrations: one adapter per framework, each installed with its extra.

* ``rewind.integrations.sb3``: Stable-Baselines3 (``pip install "rewind[sb3]"``), a
  ``RewindCallback`` that records the algorithm, its environments and its replay buffer.
* ``rewind.integrations.hf``: the Hugging Face ``Trainer`` (``rewind[hf]``).
* ``rewind.integrations.trl``: TRL's online RL trainers, ``GRPOTrainer`` and ``RLOOTrainer``
  (``rewind[trl]``): the HF callback, with commits where the trainer's generated
  completions are used up.
* ``rewind.integrations.lightning``: Lightning (``rewind[lightning]``).

Each adapter resumes a killed run so that it continues as the uninterrupted run would have,
bit for bit.
"""
