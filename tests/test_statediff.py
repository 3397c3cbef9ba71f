"""``replayer.statediff``: small states compared as decoded values (unit tests of the one
component; the runs it serves are in ``tests/test_bisect_runs.py``)."""

from __future__ import annotations

import numpy as np
import torch

from eventlog import statecodec
from replayer.statediff import grouped, state_digest, states_diff, tree_diff


def test_key_order_is_no_difference_but_a_value_is() -> None:
    a = {"args": {"should_save": False, "should_log": True}, "step": 3}
    b = {"step": 3, "args": {"should_log": True, "should_save": False}}
    assert statecodec.pack(a) != statecodec.pack(b)
    assert state_digest(a) == state_digest(b)
    assert states_diff("trainer", statecodec.pack(a), statecodec.pack(b)).paths == []
    c = {**b, "args": {"should_log": False, "should_save": False}}
    assert state_digest(a) != state_digest(c)
    assert tree_diff(a, c).paths == ["args.should_log: True -> False"]


def test_leaves_compare_by_type_and_bits() -> None:
    assert state_digest({"x": float("nan")}) == state_digest({"x": float("nan")})
    assert tree_diff({"x": 0.0}, {"x": -0.0}).paths == ["x: 0.0 -> -0.0"]
    assert tree_diff({"x": [1, 2]}, {"x": (1, 2)}).paths == ["x: [1, 2] -> (1, 2)"]
    assert tree_diff({"x": 1}, {"x": True}).paths == ["x: 1 -> True"]
    t = torch.arange(4, dtype=torch.float32)
    assert tree_diff({"t": t}, {"t": t.clone()}).paths == []
    assert tree_diff({"t": t}, {"t": t + 1}).paths == ["t: differs (4 elements)"]
    wider = tree_diff({"a": np.zeros(3)}, {"a": np.zeros(3, dtype=np.float32)})
    assert wider.paths == ["a: differs (3 elements)"]


def test_measurements_are_apart_unless_strict() -> None:
    monitor = {"t_start": 1.0, "episode_times": [0.5, 0.9], "episode_returns": [9.0, 10.0], "total_steps": 19}
    later = {**monitor, "t_start": 2.5, "episode_times": [0.7, 1.1]}
    assert state_digest(monitor) == state_digest(later)
    assert state_digest(monitor, strict=True) != state_digest(later, strict=True)
    diff = tree_diff({"envs": [[monitor]]}, {"envs": [[later]]})
    assert diff.paths == []
    assert grouped(diff.measured) == ["envs[0][0].episode_times[*] (2 values)",
                                      "envs[0][0].t_start: 1.0 -> 2.5"]
    assert tree_diff(monitor, later, strict=True).paths == [
        "episode_times[0]: 0.5 -> 0.7", "episode_times[1]: 0.9 -> 1.1", "t_start: 1.0 -> 2.5"]
    # An episode record's ``t``, and HF's ``total_flos``; a ``t`` elsewhere is state.
    assert state_digest({"r": 9.0, "l": 9, "t": 0.1}) == state_digest({"r": 9.0, "l": 9, "t": 0.2})
    assert state_digest({"t": 0.1}) != state_digest({"t": 0.2})
    hf = {"global_step": 5, "max_steps": 12, "total_flos": 1.0}
    assert state_digest(hf) == state_digest({**hf, "total_flos": 2.0})
    # A measurement's value differs, but one that is not there at all is state.
    assert tree_diff({"x": 1, **hf}, {**hf}).paths == ["x: only in A"]
