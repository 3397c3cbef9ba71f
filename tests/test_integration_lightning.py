"""The Lightning adapter: a ``Trainer.fit`` SIGKILLed at random points, mid-epoch included,
and resumed through ``RewindCallback`` ends bit-equal to the same fit never interrupted; and
a recorded fit is bit-equal, step by step, to the same fit with neither the callback nor
``ResumableLoader``."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from replayer.audit import history
from rewind import RunAddress

pytest.importorskip("lightning")

#: Small fits, each in its own process, SIGKILLed or run to the end. Importing lightning
#: costs far more than a fit, so one process imports it and forks a fresh child per fit
#: (the parent never trains: each child starts as a new process would). Each training step
#: logs its global step, the ids of its batch, a digest of the parameters it starts from and
#: the loss's bits; the dataset draws a torch
#: augmentation per sample and the step draws from numpy and ``random``, so every RNG is in
#: the loop. A child SIGKILLs itself inside the training step of global step ``kill_at``, or
#: else dumps its final state. The parent prints each child's exit status.
FITS = """
import hashlib, json, os, random, sys, traceback
import numpy as np
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from rewind import RunAddress
from rewind.integrations.lightning import ResumableLoader, RewindCallback

class Points(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randint(0, 2, (n,), generator=g)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return i, self.x[i] + 0.01 * torch.randn(8), self.y[i]

class Net(pl.LightningModule):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(32, 2))
    def training_step(self, batch, batch_idx):
        ids, x, y = batch
        x = x * (1 + 0.01 * float(np.random.rand()) + 0.01 * random.random())
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        params = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in self.parameters()))
        with open(self.cfg["losses"], "a") as f:
            f.write(json.dumps({"step": self.global_step, "epoch": self.current_epoch, "batch": batch_idx,
                                "ids": ids.tolist(), "params": params.hexdigest(),
                                "loss": loss.item().hex()}) + "\\n")
        if self.global_step == self.cfg["kill_at"]:
            # Commits are asynchronous: what was durable when the kill lands is what a resume
            # must not lose (under load, possibly nothing yet).
            rec = next(c for c in self.trainer.callbacks if isinstance(c, RewindCallback)).recorder
            if self.cfg.get("flush"):  # every commit made so far durable: a deterministic resume
                rec.flush()
            with open(self.cfg["losses"] + ".acked", "w") as f:
                f.write(str(rec.version))
            os.kill(os.getpid(), 9)
        return loss
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

def fit(cfg):
    torch.manual_seed(0); np.random.seed(0); random.seed(0)
    model = Net(cfg)
    callback = RewindCallback(RunAddress(cfg["url"], cfg["url"], cfg["run"]), every=cfg["every"])
    recorded = cfg.get("record", True)  # False: the same fit with no recorder at all
    trainer = pl.Trainer(max_epochs=cfg["epochs"], accelerator="cpu", devices=1,
                         callbacks=[callback] if recorded else [],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    data = Points(cfg["samples"])
    if cfg["sampler"] == "distributed":  # its permutation follows set_epoch, not the global RNG
        sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=3)
        loader = DataLoader(data, batch_size=cfg["batch"], sampler=sampler)
    elif cfg["sampler"] == "stateful":  # torchdata's loader, its own generator, 2 worker processes
        from torchdata.stateful_dataloader import StatefulDataLoader
        loader = StatefulDataLoader(data, batch_size=cfg["batch"], shuffle=True, num_workers=2,
                                    generator=torch.Generator().manual_seed(3))
    else:
        loader = DataLoader(data, batch_size=cfg["batch"], shuffle=True)
    trainer.fit(model, ResumableLoader(loader) if cfg["wrap"] else loader)
    opt, sched = trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler
    state = {f"model/{k}": v for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        state.update({f"optimizer/{i}/{k}": v for k, v in s.items()})
    state["rng/torch"] = torch.get_rng_state()
    state["rng/numpy"] = torch.from_numpy(np.random.get_state()[1].copy())
    state["rng/python"] = torch.tensor(random.getstate()[1])
    final = {k: v.reshape(-1).view(torch.uint8).numpy().tobytes().hex() for k, v in state.items()}
    final["scheduler"] = json.dumps(sched.state_dict(), sort_keys=True)
    final["optimizer/lr"] = opt.param_groups[0]["lr"].hex()
    final["global_step"] = trainer.global_step
    final["restored"] = None if not recorded or callback.restored.fresh else callback.restored.step
    with open(cfg["final"], "w") as f:
        json.dump(final, f)

for cfg in json.loads(sys.argv[1]):
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fit(cfg)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print("EXIT " + json.dumps(-os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)),
          flush=True)
"""

EPOCHS, BATCHES = 4, 10


def _fits(cfgs: list[dict[str, object]]) -> tuple[list[int], str]:
    """Run the fits one after the other; returns each one's exit status (-9: SIGKILLed) and
    their standard error."""
    proc = subprocess.run([sys.executable, "-c", FITS, json.dumps(cfgs)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = [json.loads(ln[len("EXIT "):]) for ln in proc.stdout.splitlines() if ln.startswith("EXIT ")]
    assert len(codes) == len(cfgs), proc.stderr[-3000:]
    return codes, proc.stderr


def _steps(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _chain(tmp_path: Path, name: str, kills: list[int], **settings: object) -> list[dict[str, object]]:
    """The uninterrupted fit, then a fit killed at each of ``kills`` resumed by the next."""
    base = {"samples": 4 * BATCHES, "batch": 4, "epochs": EPOCHS, "every": 3, "sampler": "random",
            "wrap": True, **settings}
    ref = {**base, "url": f"sqlite://{tmp_path / name}-ref.db", "run": "ref", "kill_at": -1,
           "losses": str(tmp_path / f"{name}-ref.jsonl"), "final": str(tmp_path / f"{name}-ref.json")}
    return [ref, *({**base, "url": f"sqlite://{tmp_path / name}.db", "run": name, "kill_at": kill_at,
                    "losses": str(tmp_path / f"{name}{i}.jsonl"), "final": str(tmp_path / f"{name}.json")}
                   for i, kill_at in enumerate([*kills, -1]))]


def _check_chain(cfgs: list[dict[str, object]], kills: list[int], total: int = EPOCHS * BATCHES) -> list[int]:
    """Assert each resumed fit repeated the uninterrupted one from its restored step on, and
    ended bit-equal (after ``total`` steps); returns the step each fit of the chain started at."""
    ref, *chain = cfgs
    expected = {s["step"]: s for s in _steps(Path(str(ref["losses"])))}
    assert sorted(expected) == list(range(total))  # type: ignore[type-var]
    firsts = []
    for i, cfg in enumerate(chain):
        logged = _steps(Path(str(cfg["losses"])))
        # Each fit trains from the step after the commit it restored, skipping and repeating
        # no batch, on the batch and with the loss bits of the uninterrupted fit.
        first = int(str(logged[0]["step"]))
        assert [s["step"] for s in logged] == list(range(first, first + len(logged)))
        assert logged == [expected[s["step"]] for s in logged]
        if i:
            acked = int(Path(str(chain[i - 1]["losses"]) + ".acked").read_text())
            assert first <= kills[i - 1] and (first > 0 or acked == 0), \
                f"fit {i} resumed at step {first}, killed at {kills[i - 1]} with version {acked} durable"
        if cfg["kill_at"] != -1:
            assert logged[-1]["step"] == cfg["kill_at"]
        firsts.append(first)
    final, want = (json.loads(Path(str(c["final"])).read_text()) for c in (chain[-1], ref))
    assert (final.pop("restored"), want.pop("restored")) == (firsts[-1], None)
    assert final.keys() == want.keys() and final["global_step"] == total
    assert [k for k in want if final[k] != want[k]] == []
    return firsts


@pytest.mark.slow
def test_fits_killed_at_random_steps_resume_bit_equal(tmp_path: Path) -> None:
    """Five SIGKILLs at seeded random steps, at least three mid-epoch, each followed by a
    resume through the callback: every step after a resume trains on the batch and with the
    loss the uninterrupted fit had there, and the final state (parameters, optimizer,
    scheduler, every RNG) is bit-equal. Two more with a ``set_epoch`` sampler, and a plain
    ``DataLoader`` refused with the fix in the message."""
    # One kill in each fifth of the fit, at a random step of it.
    rng = random.Random(24)
    kills = [rng.randrange(8 * i + 2, 8 * i + 8) for i in range(5)]
    shuffled = _chain(tmp_path, "shuffled", kills)
    distributed = _chain(tmp_path, "distributed", [17, 33], sampler="distributed")
    again = {**shuffled[-1], "losses": str(tmp_path / "again.jsonl"), "final": str(tmp_path / "again.json")}
    plain = {**shuffled[0], "run": "plain", "wrap": False}
    codes, stderr = _fits([*shuffled, *distributed, again, plain])
    killed = -signal.SIGKILL
    assert codes == [0, *[killed] * 5, 0, 0, killed, killed, 0, 0, 1], stderr[-3000:]
    firsts = _check_chain(shuffled, kills)
    # At least three resumes continued in the middle of an epoch.
    assert sum(1 for step in firsts[1:] if step % BATCHES) >= 3, firsts
    assert all(step % BATCHES for step in _check_chain(distributed, [17, 33])[1:])
    # Fitting the finished run again restores its final commit and trains no step.
    assert not Path(str(again["losses"])).exists()
    ended, ref = (json.loads(Path(str(c["final"])).read_text()) for c in (again, shuffled[0]))
    assert ended.pop("restored") == EPOCHS * BATCHES and ref.pop("restored") is None
    assert ended == ref
    assert ("ConfigError: RewindCallback: the training dataloader is a DataLoader; wrap it as "
            "ResumableLoader(loader) so a resume continues on the exact next batch") in stderr


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["random", "distributed"])
def test_a_recorded_fit_is_bit_equal_to_the_same_fit_without_a_recorder(tmp_path: Path, sampler: str) -> None:
    """Recording changes nothing: a fit through ``ResumableLoader`` and ``RewindCallback``
    trains every step on the batch, from the parameters and with the loss bits of the same
    fit with the bare ``DataLoader`` and no callback, and ends bit-equal (every RNG included)."""
    recorded, *_ = _chain(tmp_path, "recorded", [], sampler=sampler)
    bare = {**recorded, "record": False, "wrap": False, "losses": str(tmp_path / "bare.jsonl"),
            "final": str(tmp_path / "bare.json")}
    codes, stderr = _fits([recorded, bare])
    assert codes == [0, 0], stderr[-3000:]
    steps = [_steps(Path(str(c["losses"]))) for c in (recorded, bare)]
    assert len(steps[0]) == EPOCHS * BATCHES
    assert [i for i, (a, b) in enumerate(zip(*steps, strict=True)) if a != b] == []
    finals = [json.loads(Path(str(c["final"])).read_text()) for c in (recorded, bare)]
    assert [k for k in finals[1] if finals[0][k] != finals[1][k]] == []


def _version_steps(cfg: dict[str, object]) -> list[list[int]]:
    """The steps of the run's sealed versions, a list per writer session (a resume starts one)."""
    url = str(cfg["url"])
    _, rows = history(RunAddress(url, url, str(cfg["run"])))
    sessions: list[list[int]] = []
    for row in rows:
        if row.kind == "recovery" or not sessions:
            sessions.append([])
        if row.kind == "version":
            sessions[-1].append(row.step)
    return sessions


@pytest.mark.slow
def test_a_commit_due_on_an_epochs_last_batch_is_made_on_the_next_batch(tmp_path: Path) -> None:
    """8 batches an epoch, 2 epochs: a commit due at step 8, the first epoch's last batch (not
    a commit point: the epoch's end follows it), is made on the next batch, step 9, not
    dropped, and the schedule goes on from the multiples (every_n_steps=4: 4, 9, 12, 16;
    every_n_steps=8: 9, 16, the last one ``on_train_end``'s). A fit killed after that commit
    resumes from step 9, at the start of the second epoch, and ends bit-equal."""
    small = {"samples": 32, "batch": 4, "epochs": 2, "flush": True}
    four = _chain(tmp_path, "four", [11], every=4, **small)
    eight = _chain(tmp_path, "eight", [13], every=8, **small)
    codes, stderr = _fits([*four, *eight])
    killed = -signal.SIGKILL
    assert codes == [0, killed, 0, 0, killed, 0], stderr[-3000:]
    for chain, kill, steps in ((four, 11, [4, 9, 12, 16]), (eight, 13, [9, 16])):
        assert _version_steps(chain[0]) == [steps]
        # The killed fit had made every commit due before step ``kill`` durable; the resume
        # restored the one at step 9 and made the rest.
        assert _version_steps(chain[1]) == [[s for s in steps if s <= kill], [s for s in steps if s > kill]]
        assert _check_chain(chain, [kill], total=16) == [0, 9]


def test_an_iterator_never_advanced_draws_nothing_and_one_that_cannot_be_taken_back_is_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``iter()`` twice on a ``ResumableLoader`` (Lightning's check, then its fit) leaves the
    RNGs where one ``iter()`` on the bare ``DataLoader`` leaves them, and yields the same
    batches; when random numbers were drawn between the two, the first one's draw cannot be
    taken back, and a WARNING says so."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from rewind.integrations.lightning import ResumableLoader

    def loader() -> DataLoader[tuple[torch.Tensor, ...]]:
        return DataLoader(TensorDataset(torch.arange(8)), batch_size=2, shuffle=True)

    def run(wrapped: bool, draw_between: bool) -> tuple[list[list[int]], torch.Tensor]:
        torch.manual_seed(3)
        data = ResumableLoader(loader()) if wrapped else loader()
        if wrapped:
            iter(data)
        if draw_between:
            torch.rand(1)
        batches = [b[0].tolist() for b in data]
        return batches, torch.get_rng_state()

    bare_batches, bare_rng = run(wrapped=False, draw_between=False)
    batches, rng = run(wrapped=True, draw_between=False)
    assert batches == bare_batches and torch.equal(rng, bare_rng)
    assert not caplog.records
    run(wrapped=True, draw_between=True)
    assert [r.getMessage() for r in caplog.records] == [
        "ResumableLoader: an iterator that was never used drew random numbers that cannot be taken back "
        "(more were drawn since): this fit draws one more seed than the same fit with the bare loader"]
