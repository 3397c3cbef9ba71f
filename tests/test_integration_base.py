"""What the three framework adapters share (``rewind.integrations.base``): the same
arguments, one rule for when a commit is due, and ``extra`` objects whose tensors are logged
as deltas and restored bit-equal, with the real SB3 and Lightning."""

from __future__ import annotations

import copy
import inspect
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from eventlog import ConfigError, RunAddress, serde
from eventlog.capture import INLINE_TENSOR_BYTES
from eventlog.events import TensorDelta
from rewind.integrations.base import Cadence

pytestmark = [pytest.mark.slow]

SHARED = ("run", "every", "extra", "snapshots", "settings", "predictive")


def _adapters() -> list[type]:
    from rewind.integrations import hf, lightning, sb3

    return [sb3.RewindCallback, hf.RewindCallback, lightning.RewindCallback]


def test_the_three_adapters_take_the_same_arguments() -> None:
    for adapter in _adapters():
        params = inspect.signature(adapter).parameters
        assert all(name in params for name in SHARED), (adapter.__module__, list(params))
        assert params["every"].kind is inspect.Parameter.KEYWORD_ONLY, adapter.__module__
        assert params["every"].default in (1, None) and params["extra"].default is None
        with pytest.raises(ConfigError, match=r"RewindCallback\(every=0\): commit every 1 or more"):
            adapter("r", every=0)
        own = "progress" if "sb3" in adapter.__module__ else "trainer"
        with pytest.raises(ConfigError, match=f"'{own}' is the callback's own"):
            adapter("r", extra={own: torch.nn.Linear(1, 1)})


def test_lightnings_old_every_n_steps_still_works_and_says_so() -> None:
    from rewind.integrations.lightning import RewindCallback

    with pytest.warns(DeprecationWarning, match="use every="):
        positional = RewindCallback("r", 4)
    with pytest.warns(DeprecationWarning, match="use every="):
        keyword = RewindCallback("r", every_n_steps=5)
    assert (positional.every, keyword.every, keyword.every_n_steps) == (4, 5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert RewindCallback("r", every=3).every == 3
    with pytest.raises(ConfigError, match="not every_n_steps= as well"):
        RewindCallback("r", 4, every=4)


@pytest.mark.parametrize(("every", "points", "commits"), [
    (4, range(1, 17), [4, 8, 12, 16]),
    (4, [s for s in range(1, 17) if s != 8], [4, 9, 12, 16]),  # 8 is no commit point: the next one is
    (8, [s for s in range(1, 17) if s != 8], [9, 16]),
    (3, [1, 2, 7, 8, 9, 10], [7, 9]),  # 3 and 6 are missed together: one commit, at 7
])
def test_a_commit_is_due_at_the_first_commit_point_at_or_after_each_multiple(
        every: int, points: list[int], commits: list[int]) -> None:
    cadence, made = Cadence(every, "RewindCallback", "steps"), []
    for at in points:
        if cadence.due(at):
            made.append(at)
            cadence.committed(at)
    assert made == commits
    resumed = Cadence(every, "RewindCallback", "steps")
    resumed.reset(commits[0])  # a resume counts from the restored version
    following = (commits[0] // every + 1) * every  # the next multiple after the restored count
    assert next(at for at in points if resumed.due(at)) == next(at for at in points if at >= following)


class _Target:
    """A user's object holding a network: a target network or an EMA of the weights."""

    def __init__(self, net: torch.nn.Module) -> None:
        self.net = copy.deepcopy(net)
        self.updates = 0

    def update(self, online: torch.nn.Module) -> None:
        with torch.no_grad():
            for t, o in zip(self.net.parameters(), online.parameters(), strict=True):
                t.mul_(0.5).add_(o, alpha=0.5)
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.updates = state["updates"]


def _bits(net: torch.nn.Module) -> dict[str, bytes]:
    return {k: v.reshape(-1).view(torch.uint8).numpy().tobytes() for k, v in net.state_dict().items()}


def _extra_tensors(url: str, run: str, name: str) -> set[str]:
    """The names of the tensor events the run logged for ``extra`` object ``name``."""
    with RunAddress(url, url, run).open_log() as log:
        events = [serde.decode(r.value) for p in range(log.shard_count() or 0) for r in log.read(p)]
    return {e.body.name for e in events
            if isinstance(e.body, TensorDelta) and e.body.name.startswith(f"{name}/")}


def _big(net: torch.nn.Module, prefix: str) -> set[str]:
    """The log names of ``net``'s tensors that go to the shards (small ones stay inline)."""
    return {f"{prefix}/{k}" for k, v in net.state_dict().items()
            if v.numel() * v.element_size() >= INLINE_TENSOR_BYTES}


def test_sb3_records_and_restores_an_extra_objects_tensors(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback, CallbackList

    from rewind.integrations.sb3 import RewindCallback

    monkeypatch.setenv("SB3_LOGDIR", str(tmp_path / "sb3"))
    torch.set_num_threads(1)
    url = f"sqlite://{tmp_path / 'rewind.db'}"

    def make() -> PPO:
        return PPO("MlpPolicy", "CartPole-v1", n_steps=16, batch_size=16, n_epochs=1, seed=0, device="cpu")

    class Follow(BaseCallback):
        def __init__(self, target: _Target) -> None:
            super().__init__()
            self.target = target

        def _on_rollout_end(self) -> None:
            self.target.update(self.model.policy)

        def _on_step(self) -> bool:
            return True

    model = make()
    target = _Target(model.policy)
    with RewindCallback(RunAddress(url, url, "sb3"), every=2, extra={"target": target}) as rewind:
        model.learn(64, callback=CallbackList([Follow(target), rewind]))
    assert _extra_tensors(url, "sb3", "target") == _big(target.net, "target/net") != set()
    again = _Target(make().policy)
    with RewindCallback(RunAddress(url, url, "sb3"), extra={"target": again}) as rewind:
        rewind.restore(make())
        assert rewind.restored is not None and rewind.restored.step == 64
    assert again.updates == target.updates == 4 and _bits(again.net) == _bits(target.net)


def test_lightning_records_and_restores_an_extra_objects_tensors(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from rewind.integrations.lightning import ResumableLoader, RewindCallback

    class Net(pl.LightningModule):
        def __init__(self, target: _Target | None = None) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(64, 64)
            self.target = target

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def on_train_batch_end(self, *args: Any) -> None:
            if self.target is not None:
                self.target.update(self.layer)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(net: Net, callback: RewindCallback, steps: int) -> None:
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(32, 64), torch.randn(32, 64))
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", callbacks=[callback], logger=False,
                             enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False)
        trainer.fit(net, ResumableLoader(DataLoader(data, batch_size=8, shuffle=True)))

    url = f"sqlite://{tmp_path / 'rewind.db'}"
    torch.manual_seed(1)
    net = Net()
    net.target = _Target(net.layer)
    fit(net, RewindCallback(RunAddress(url, url, "pl"), every=2, extra={"target": net.target}), steps=6)
    assert _extra_tensors(url, "pl", "target") == {"target/net/weight"}  # the bias stays inline
    again = Net()
    again.target = _Target(again.layer)
    callback = RewindCallback(RunAddress(url, url, "pl"), extra={"target": again.target})
    fit(again, callback, 6)  # a finished run: restored, trains no more
    assert callback.restored is not None and callback.restored.step == 6
    assert again.target.updates == net.target.updates == 6
    assert _bits(again.target.net) == _bits(net.target.net)
