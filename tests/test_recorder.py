"""Recorder behaviours a trainer relies on (embedded backend; the contract suite covers both)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eventlog import RunAddress, Target
from eventlog.fold.engine import index_control, rebuild
from rewind.recorder import Recorder


def _address(tmp_path: Path, run: str = "r") -> RunAddress:
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    return RunAddress(url, url, run)


def test_layout_may_grow_when_optimizer_state_appears(tmp_path: Path) -> None:
    """Committing before the first optimizer step is allowed: Adam's moments appear later."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    with Recorder(_address(tmp_path), model, opt) as rec:
        rec.commit(0, wait=True)  # no optimizer state yet
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        rec.commit(1, wait=True)
    with _address(tmp_path).open_log() as log:
        idx = index_control(log)
        assert len(idx.run_started) == 2  # the layout was re-announced when it grew
        v1 = rebuild(log, Target("version", 1))
        assert not any("exp_avg" in n for n in v1.tensors())
        v2 = rebuild(log, Target("version", 2))
        assert any("exp_avg" in n for n in v2.tensors())
    fresh_model = torch.nn.Linear(8, 4)
    fresh_opt = torch.optim.Adam(fresh_model.parameters())
    with Recorder(_address(tmp_path), fresh_model, fresh_opt) as rec:
        assert rec.restore().version == 2
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_unchanged_state_costs_no_tensor_events(tmp_path: Path) -> None:
    model = torch.nn.Linear(64, 64)
    with Recorder(_address(tmp_path), model, rng=False) as rec:
        first = rec.commit(0, wait=True).result()
        second = rec.commit(1, wait=True).result()
    assert first.encoded_bytes > 0
    assert second.encoded_bytes == 0 and second.events == 1  # only the seal


def test_async_commits_queue_up_and_are_all_durable_after_flush(tmp_path: Path) -> None:
    model = torch.nn.Linear(256, 256)
    with Recorder(_address(tmp_path), model, rng=False, max_inflight=2) as rec:
        futures = []
        for step in range(8):
            with torch.no_grad():
                model.weight.add_(0.01)
            futures.append(rec.commit(step))
        rec.flush()
        assert [f.result().version for f in futures] == list(range(1, 9))
    with _address(tmp_path).open_log() as log:
        assert sorted(index_control(log).seals) == list(range(1, 9))


def test_restore_of_a_new_run_is_fresh(tmp_path: Path) -> None:
    with Recorder(_address(tmp_path, "never-written"), torch.nn.Linear(2, 2)) as rec:
        result = rec.restore()
    assert result.fresh and result.version == 0


def test_extra_state_names_are_checked(tmp_path: Path) -> None:
    class Env:
        def state_dict(self) -> dict[str, int]:
            return {"t": 1}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    with pytest.raises(Exception, match="reserved or used twice"):
        Recorder(_address(tmp_path), torch.nn.Linear(2, 2), extra={"model": Env()})
