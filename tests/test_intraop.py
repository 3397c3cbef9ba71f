"""The recorder's background torch work gives the training thread no extra OpenMP threads
to wait for (``eventlog.intraop``): with the OpenMP backend, each thread that runs a
parallel op keeps a team of its own, and more OpenMP threads than cores make every parallel
op of the trainer wait for its workers to be woken."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from eventlog import intraop

ROOT = Path(__file__).resolve().parents[1]

# In a fresh process: train a model big enough that the predictive codec's steps run as
# parallel ops, record 4 versions, and count the process's threads against Python's own.
PROBE = """
import os, sys, threading
import torch
from eventlog import RunAddress
from rewind import Recorder

def os_threads():
    return len(os.listdir("/proc/self/task"))

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(), torch.nn.Linear(512, 512))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
def step():
    opt.zero_grad(set_to_none=True)
    model(torch.randn(64, 512)).square().mean().backward()
    opt.step()
step()  # the training thread's own OpenMP team exists before the recorder starts
threads = torch.get_num_threads()
before = os_threads() - threading.active_count()
url = f"sqlite://{sys.argv[1]}/rewind.db"
encodings = []
with Recorder(RunAddress(url, url, "intraop"), model, opt) as rec:
    for _ in range(4):
        step()
        encodings.append(rec.commit(0, wait=True).result().encoding)
    extra = os_threads() - threading.active_count() - before
print(extra, threads, torch.get_num_threads(), sum(e.startswith("predictive/") for e in encodings))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc")
@pytest.mark.skipif(not intraop.openmp_backend() or torch.get_num_threads() < 2,
                    reason="torch runs no OpenMP teams here")
def test_recording_starts_no_thread_but_its_own(tmp_path: Path) -> None:
    env = dict(os.environ)  # (the tree under test on its path: tests/conftest.py)
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout.split()
    extra, threads_before, threads_after, predictive = map(int, out)
    assert predictive == 3  # the first version has no step to predict from
    assert threads_after == threads_before >= 2  # the trainer's own setting is untouched
    assert extra == 0, f"recording started {extra} threads besides its own Python threads"


def test_serial_torch_applies_to_the_calling_thread_alone() -> None:
    seen: list[int] = []

    def background() -> None:
        intraop.serial_torch()
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    t = threading.Thread(target=background)
    t.start()
    t.join()
    expected = 1 if intraop.openmp_backend() else before
    assert seen == [expected]
    assert torch.get_num_threads() == before
