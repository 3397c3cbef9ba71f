"""Trainer integrations: one adapter per framework, each installed with its extra.

* ``rewind.integrations.sb3``: Stable-Baselines3 (``pip install "rewind[sb3]"``), a
  ``RewindCallback`` that records the algorithm, its environments and its replay buffer.
* ``rewind.integrations.hf``: the Hugging Face ``Trainer`` (``rewind[hf]``).
* ``rewind.integrations.lightning``: Lightning (``rewind[lightning]``).

They share ``rewind.integrations.base``: the same arguments (``run``, ``every``, ``extra``,
``snapshots``, ``settings``, ``predictive``) and one rule for when a commit is due
(``Cadence``). Each adapter resumes a killed run so that it continues as the uninterrupted
run would have, bit for bit.
"""
