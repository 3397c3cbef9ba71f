"""Trainer integrations: one adapter per framework, each installed with its extra.

* ``rewind.integrations.sb3``: Stable-Baselines3 (``pip install "rewind[sb3]"``), a
  ``RewindCallback`` that records the algorithm, its environments and its replay buffer.
* ``rewind.integrations.hf``: the Hugging Face ``Trainer`` (``rewind[hf]``).
* ``rewind.integrations.lightning``: Lightning (``rewind[lightning]``).
* ``rewind.integrations.torchrl``: TorchRL (``rewind[torchrl]``), a ``RewindTorchRL`` that a
  training loop calls once per collector iteration; it records the collector's env, the loss
  module with its target networks, and the replay buffer's new rows.

They share ``rewind.integrations.base``: the same arguments (``run``, ``every``, ``extra``,
``snapshots``, ``settings``, ``predictive``) and one rule for when a commit is due
(``Cadence``). Each adapter resumes a killed run so that it continues as the uninterrupted
run would have, bit for bit.
"""
