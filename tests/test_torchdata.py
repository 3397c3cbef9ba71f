"""torchdata's ``StatefulDataLoader`` as a plain loop's data position
(``Recorder(..., sampler=loader)``): a loop SIGKILLed mid-epoch, after a durable commit and
with a commit in flight, resumes where the commit left the loader, with 0 and with 2 worker
processes (each worker's dataset state and the workers' base seed included). Every step
after each resume logs the uninterrupted run's loss, bit for bit, and the run ends bit-equal
to it (model, optimizer, global RNGs, the loader's own state). Loaders that cannot resume
exactly are refused with the reason when the ``Recorder`` is built. Inside the Lightning
adapter (as a ``ResumableLoader``), a shuffling ``StatefulDataLoader`` with 2 workers and its
own generator resumes a killed fit bit-exactly too."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from rewind import ConfigError, Recorder, RunAddress
from tests.forked import events, run_driver

#: The driver imports torch and torchdata once and forks one child per segment
#: (``tests.forked``); each child appends its records to its own JSON-lines file.
DRIVER = r'''
import json, os, signal, sys, warnings
warnings.simplefilter("ignore", UserWarning)
import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler
from rewind import Recorder, RunAddress
from tests.forked import case_exits, case_streams, digest, run_streams
from tests.test_torchdata import Noisy

cfg = json.loads(sys.argv[1])


def loader_of(case):
    data = Noisy()
    if case["workers"]:  # the loader's generator shuffles and seeds the workers
        return StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=case["workers"],
                                  generator=torch.Generator().manual_seed(3))
    sampler = RandomSampler(data, generator=torch.Generator().manual_seed(5))  # its own generator
    return StatefulDataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(3))


def segment(case, run, kill, out):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = loader_of(case)
    db = f"sqlite://{os.path.join(cfg['tmp'], run + '.db')}"
    log = open(out, "a")
    write = lambda **record: (log.write(json.dumps(record) + "\n"), log.flush())
    with Recorder(RunAddress(db, db, run), model=model, optimizer=opt, sampler=loader) as rec:
        start = rec.restore()
        step = 0 if start.fresh else start.step + 1
        write(event="begin", step=step)
        while step < case["steps"]:
            for x in loader:
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                write(event="loss", step=step, loss=loss.item().hex())
                done = rec.commit(step)
                if kill is not None and kill[1] == step:
                    if kill[0] == "durable":
                        done.result()
                    write(event="kill", hook=kill[0], step=step)
                    os.kill(os.getpid(), signal.SIGKILL)
                step += 1
    final = {}
    digest({"model": model.state_dict(), "optimizer": opt.state_dict(), "loader": loader.state_dict(),
            "rng": torch.get_rng_state()}, "", final)
    write(event="final", digests=final)


codes = run_streams(cfg["tmp"], case_streams(cfg["tmp"], cfg["cases"]), segment)
print("EXITS " + json.dumps(case_exits(codes, cfg["cases"])), flush=True)
'''

#: 24 samples, 4 a batch: 6 steps an epoch, 3 epochs. ``durable``: killed after step k's
#: commit is durable; ``inflight``: right after step k's commit is queued.
CASES: dict[str, dict[str, Any]] = {
    f"workers{n}": {"workers": n, "steps": 18, "steps_per_epoch": 6,
                    "kills": [["durable", 8], ["inflight", 15]]}
    for n in (0, 2)
}


class Noisy:
    """A map-style dataset that adds noise from its own generator to each sample; it has a
    ``state_dict``, so torchdata records its state in every worker."""

    def __init__(self) -> None:
        import torch

        self.x = torch.randn(24, 4, generator=torch.Generator().manual_seed(7))
        self.generator = torch.Generator().manual_seed(11)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        import torch

        return self.x[i] + 0.1 * torch.randn(4, generator=self.generator)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_a_killed_loop_resumes_mid_epoch_bit_exactly(runs: Path, name: str) -> None:
    case = CASES[name]
    reference = events(runs / f"{name}-reference.jsonl")
    losses = {e["step"]: e["loss"] for e in reference if e["event"] == "loss"}
    assert sorted(losses) == list(range(case["steps"]))
    began = []
    for i, kill in enumerate([*case["kills"], None]):
        segment = events(runs / f"{name}-{i}.jsonl")
        start = segment[0]["step"]
        began.append(start)
        for e in segment:
            if e["event"] == "loss":
                assert e["step"] >= start and e["loss"] == losses[e["step"]], (name, i, e["step"])
        if kill is not None:
            assert segment[-1] == {"event": "kill", "hook": kill[0], "step": kill[1]}
    # The first resume follows a durable commit; the second a commit that may be in flight.
    assert began[1] == case["kills"][0][1] + 1
    assert began[1] < began[2] <= case["kills"][1][1] + 1
    assert all(step % case["steps_per_epoch"] for step in began[1:]), began  # mid-epoch
    assert segment[-1]["digests"] == reference[-1]["digests"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_driver(DRIVER, tmp_path_factory.mktemp("torchdata"), CASES)


def _recorder(tmp_path: Path, loader: Any) -> Recorder:
    db = f"sqlite://{tmp_path / 'run.db'}"
    return Recorder(RunAddress(db, db, "refused"), model=None, sampler=loader)


def test_a_loader_that_draws_from_the_global_rng_is_refused(tmp_path: Path) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    with pytest.raises(ConfigError) as refused:
        _recorder(tmp_path, StatefulDataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2))
    assert str(refused.value) == (
        "Recorder(sampler=...): the StatefulDataLoader has no generator, so each iter() draws from the "
        "global torch RNG, and a resumed loop would draw once more: build it with "
        "generator=torch.Generator()")
    assert not (tmp_path / "run.db").exists()


def test_a_single_process_loader_shuffling_with_its_own_generator_is_refused(tmp_path: Path) -> None:
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    generator = torch.Generator().manual_seed(3)
    loader = StatefulDataLoader(Noisy(), batch_size=4, shuffle=True, generator=generator)
    with pytest.raises(ConfigError) as refused:
        _recorder(tmp_path, loader)
    assert str(refused.value) == (
        "Recorder(sampler=...): the StatefulDataLoader shuffles with its own generator and no worker "
        "processes, which torchdata does not restore exactly: give the sampler its own generator "
        "(sampler=RandomSampler(data, generator=torch.Generator()))")


@pytest.mark.slow
def test_a_stateful_loader_with_workers_resumes_a_lightning_fit_bit_exactly(tmp_path: Path) -> None:
    """Inside the Lightning adapter (wrapped as ``ResumableLoader``), a ``StatefulDataLoader``
    with 2 worker processes: a fit killed twice mid-epoch repeats the uninterrupted fit's
    batches and losses from each resume on, and ends bit-equal."""
    from tests.test_integration_lightning import _chain, _check_chain, _fits

    kills = [13, 26]
    chain = _chain(tmp_path, "stateful", kills, sampler="stateful")
    codes, stderr = _fits(chain)
    assert codes == [0, -signal.SIGKILL, -signal.SIGKILL, 0], stderr[-3000:]
    assert all(step % 10 for step in _check_chain(chain, kills)[1:])
