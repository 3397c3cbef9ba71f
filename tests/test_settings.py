"""The settings object: read from the environment once, checked, overridden only in a block;
and a library replay leaves torch's process-wide thread count alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eventlog import RunAddress, Target
from eventlog.errors import ConfigError
from eventlog.fold.engine import rebuild
from eventlog.settings import Settings, current, override
from rewind.recorder import Recorder

ROOT = Path(__file__).resolve().parents[1]


def test_the_environment_sets_each_field_by_its_name() -> None:
    got = Settings.from_env({"REWIND_SHARDS": "5", "REWIND_SETTLE_S": "2.5", "REWIND_SNAPSHOT_MAP": "0",
                             "REWIND_GRAD_COMPRESSION": "blosc2-lz4", "REWIND_CHUNK_BYTES": ""})
    assert (got.shards, got.settle_s, got.snapshot_map, got.grad_compression) == (5, 2.5, False, "blosc2-lz4")
    assert got.chunk_bytes == Settings().chunk_bytes  # an empty variable is unset


@pytest.mark.parametrize(("name", "raw", "says"), [
    ("REWIND_SHARDS", "two", "REWIND_SHARDS='two' is not a valid int"),
    ("REWIND_SHARDS", "0", "REWIND_SHARDS) must be >= 1, got 0"),
    ("REWIND_REPLAY_DEFER_STEPS", "maybe", "REWIND_REPLAY_DEFER_STEPS='maybe' is not a valid bool"),
    ("REWIND_CHUNK_BYTES", "1000", "REWIND_CHUNK_BYTES) must be a positive multiple of 16, got 1000"),
    ("REWIND_GRAD_COMPRESSION", "gzip", "REWIND_GRAD_COMPRESSION) must be none, blosc2-lz4 or blosc2-zstd"),
])
def test_a_bad_variable_is_refused_naming_it(name: str, raw: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_env({name: raw})
    assert says in str(info.value)


def test_changes_in_code_are_checked_like_the_environment() -> None:
    with pytest.raises(ConfigError) as info:
        Settings().with_changes(snapshot_map=0)
    assert str(info.value) == "setting snapshot_map (REWIND_SNAPSHOT_MAP) must be true or false, got 0"
    with pytest.raises(ConfigError, match="no setting named shard_count"):
        Settings().with_changes(shard_count=3)
    assert Settings(settle_s=3).settle_s == 3.0 and isinstance(Settings(settle_s=3).settle_s, float)


def test_override_holds_for_its_block_only_and_nests() -> None:
    before = current()
    with override(shards=7) as outer:
        assert current() is outer and outer.shards == 7
        with override(read_batch=3):
            assert (current().shards, current().read_batch) == (7, 3)
        assert current() is outer
    assert current() is before
    with pytest.raises(ConfigError), override(shards=-1):
        pass
    assert current() is before


def test_the_environment_is_read_when_first_asked_not_at_import() -> None:
    """No module of the product reads its settings while it is imported."""
    probe = ("import os, rewind, rewind.cli, eventlog.settings as s; os.environ['REWIND_SHARDS'] = '9'; "
             "print(s.current().shards)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "9"


def _two_versions(tmp_path: Path) -> RunAddress:
    url = f"sqlite://{tmp_path / 'rewind.db'}"
    address = RunAddress(url, url, "threads")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Recorder(address, model, opt, rng=False, shards=2) as rec:
        for step in range(2):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            rec.commit(step, wait=True)
    return address


def test_a_library_rebuild_leaves_torch_threads_alone_unless_asked(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a process that owns torch (the CLI) divides its threads among replay workers."""
    address = _two_versions(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    calls: list[int] = []
    real = torch.set_num_threads

    def spy(n: int) -> None:
        calls.append(n)
        real(n)

    monkeypatch.setattr(torch, "set_num_threads", spy)
    try:
        with address.open_log() as log:
            plain = rebuild(log, Target(), workers=2)
            assert calls == [] and torch.get_num_threads() == 2
            shared = rebuild(log, Target(), workers=2, share_torch_threads=True)
        assert calls == [1, 2] and torch.get_num_threads() == 2  # divided, then given back
    finally:
        real(threads)
    assert plain.seal.seal.state_digest == shared.seal.seal.state_digest
