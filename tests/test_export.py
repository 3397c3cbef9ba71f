"""``rewind export`` writes a model whose weights are tied (an LM head that is its
embedding, as GPT-2's): once, with the other name listed as its alias; ``rewind recover``'s
checkpoint reads back with ``rewind.read_checkpoint`` into every recorded object."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import safetensors
import safetensors.torch
import torch
from torch import nn

from eventlog import RunAddress
from eventlog.capture import GlobalRng
from rewind import Recorder, read_checkpoint


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied, as transformers' tie_word_embeddings does


def _recorded(tmp_path: Path) -> tuple[TiedLM, torch.optim.Optimizer]:
    """Three versions of a tied model and its Adam state (and the global RNGs) in
    ``tmp_path``; the objects as they are at the last."""
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    with Recorder(RunAddress(url, url, "lm"), model=model, optimizer=opt) as rec:
        for step in range(1, 4):
            opt.zero_grad()
            model.head(model.mix(model.embed(torch.randint(16, (16,))))).square().mean().backward()
            opt.step()
            rec.commit(step=step, wait=True)
    return model, opt


def test_tied_weights_are_exported_once_with_their_alias(tmp_path: Path) -> None:
    model, _ = _recorded(tmp_path)
    want = model.state_dict()
    for fmt in ("safetensors", "hf"):
        out = tmp_path / fmt
        done = subprocess.run(["rewind", "export", "--run-dir", str(tmp_path), "--format", fmt,
                               "--out", str(out)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        # A plain torch model has no HF config to record: an hf export says it wrote none.
        assert ("no config.json: the run recorded no model config" in done.stdout) == (fmt == "hf")
        got = safetensors.torch.load_file(out / "model.safetensors")
        assert sorted(got) == ["embed.weight", "mix.bias", "mix.weight"]
        assert all(torch.equal(got[k].view(torch.int32), want[k].view(torch.int32)) for k in got)
        with safetensors.safe_open(out / "model.safetensors", "pt") as f:
            meta = f.metadata()
        assert json.loads(meta["aliases"]) == {"head.weight": "embed.weight"} and meta["step"] == "3"


def test_a_recovered_checkpoint_reads_back_into_every_object(tmp_path: Path) -> None:
    model, opt = _recorded(tmp_path)
    rng = torch.get_rng_state()
    out = tmp_path / "checkpoint"
    done = subprocess.run(["rewind", "recover", "--run-dir", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    states = read_checkpoint(out)
    assert sorted(states) == ["model", "optimizer", "rng"]
    fresh = TiedLM()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    fresh.load_state_dict(states["model"])
    fresh_opt.load_state_dict(states["optimizer"])
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k].view(torch.int32), v.view(torch.int32)), k
    assert fresh_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"] == 3
    torch.manual_seed(123)
    GlobalRng().load_state_dict(states["rng"])
    assert torch.equal(torch.get_rng_state(), rng)
