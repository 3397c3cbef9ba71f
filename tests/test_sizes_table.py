"""``python -m benchmarks --sizes``: each process's memory is judged against its target."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from benchmarks import sizes


@pytest.mark.parametrize(("ratio", "verdict"), [(1.10, True), (1.40, False), (None, None)])
def test_the_weights_followers_first_sync_is_a_judged_row(ratio: float | None, verdict: bool | None) -> None:
    size = {"params": 25_000_000, "scenarios": {}, "memory": {},
            "follower": {} if ratio is None else {"peak_ratio": ratio}}
    size["targets"] = sizes.judge(size)
    target = size["targets"]["follower_memory"]
    assert (target["pass"], target["limit"]) == (verdict, 1.25)

    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(sizes.table({"sizes": {"25M": size}}))
    line = next(x for x in out.getvalue().splitlines() if "weights follower" in x)
    expected = {True: "1.10x PASS", False: "1.40x FAIL", None: "- n/a"}[verdict]
    assert expected in line and "<= 1.25x" in line
