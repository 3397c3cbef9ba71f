"""The predictive codec: the log holds each optimizer step's gradients and hyperparameters,
the replayer runs the same step, and only ``actual XOR predicted`` residuals are stored.

Each test trains a small model live, records every version, then replays every version and
compares it bit for bit with what the trainer had (params and optimizer state)."""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from eventlog import RunAddress, Target, serde
from eventlog.embedded import path_from_url
from eventlog.errors import BatchedStepsMismatchError, CorruptMessageError, DigestMismatchError
from eventlog.events import OptimizerStep, TensorDelta
from eventlog.fold import deferred as deferred_module
from eventlog.fold.deferred import DeferredSteps
from eventlog.fold.engine import rebuild
from eventlog.settings import Settings, current, override
from replayer.replay import replay, state_dicts
from rewind.recorder import Recorder
from rewind.results import CommitResult

from .storage import plain_records

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adam-foreach-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True, amsgrad=True,
                                                       weight_decay=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.1),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "sgd-momentum-foreach": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, foreach=True,
                                                      weight_decay=1e-4),
    "sgd-plain": lambda p: torch.optim.SGD(p, lr=0.05),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
}


class Live:
    """A small MLP trained with ``optimizer``, recorded every ``steps_per_commit`` steps."""

    def __init__(self, address: RunAddress, make_opt: Callable[[Any], torch.optim.Optimizer],
                 chunk_bytes: int = 8192, **recorder: Any) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4))
        self.opt = make_opt(self.model.parameters())
        self.rec = Recorder(address, self.model, self.opt, rng=False, chunk_bytes=chunk_bytes, **recorder)
        self.results: list[CommitResult] = []
        self.states: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        self.step = 0

    def train(self, steps: int, *, between: Callable[[], None] | None = None) -> CommitResult:
        for _ in range(steps):
            self.model(torch.randn(16, 64)).pow(2).mean().backward()
            self.opt.step()
            self.opt.zero_grad()
            self.step += 1
        if between is not None:
            between()
        result = self.rec.commit(self.step, wait=True).result()
        self.results.append(result)
        self.states[result.version] = {
            "model": _clone(self.model.state_dict()), "optimizer": _clone(self.opt.state_dict()["state"])}
        return result

    def assert_every_version_replays_exactly(self, address: RunAddress) -> None:
        for version, want in self.states.items():
            state, report = replay(address, Target("version", version))
            got = state_dicts(state)
            assert _bits(got["model"]) == _bits(want["model"]), f"model at version {version}"
            assert _bits(got["optimizer"]["state"]) == _bits(want["optimizer"]), \
                f"optimizer at version {version}"
            assert report.skipped_duplicate == report.skipped_unsealed == 0


def _clone(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    return tree


def _bits(tree: Any) -> Any:
    """A tree with every tensor as (dtype, shape, raw bytes): equal iff bit-equal."""
    if isinstance(tree, torch.Tensor):
        t = tree.detach().contiguous()
        return (str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(tree, dict):
        return {str(k): _bits(v) for k, v in tree.items()}
    return tree


def _encodings(address: RunAddress) -> Counter[str]:
    """How many shard events of each kind the log holds (TensorDelta by encoding)."""
    log = address.open_log()
    seen: Counter[str] = Counter()
    try:
        for shard in range(log.shard_count() or 0):
            for rec in log.read(shard):
                body = serde.decode(rec.value, "test").body
                seen[body.encoding if isinstance(body, TensorDelta) else type(body).__name__] += 1
    finally:
        log.close()
    return seen


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_supported_optimizers_replay_exactly_from_gradients_alone(address: RunAddress, kind: str) -> None:
    live = Live(address, OPTIMIZERS[kind])
    for _ in range(8):
        live.train(1)
    live.rec.close()
    # Version 1 writes the whole state; at version 2 the optimizer state is new (SGD's
    # momentum buffer, Adam's moments appear at the first step): XOR. From then on, predictive.
    assert "not predictive: the layout changed" in live.results[0].encoding
    predictive = [r for r in live.results if r.encoding.startswith("predictive/")]
    assert len(predictive) >= 6
    for r in predictive:
        assert r.residual_bytes == 0, "torch's own step predicts itself exactly"
        # The gradient (~0.85 of the params once compressed) against params plus moments:
        # Adam keeps two moments, momentum SGD one.
        bound = {"adam": 0.35, "sgd-plain": 1.0}.get(kind[:4] if kind.startswith("adam") else kind, 0.5)
        assert r.encoded_bytes <= bound * r.raw_bytes
    counts = _encodings(address)
    assert counts["RESIDUAL"] == 0 and counts["OptimizerStep"] >= 6 and counts["GRAD"] > 0
    live.assert_every_version_replays_exactly(address)


def test_a_wrong_prediction_still_recovers_exactly_through_residuals(address: RunAddress) -> None:
    live = Live(address, OPTIMIZERS["adam"])
    for _ in range(3):
        live.train(1)

    def lr_behind_the_optimizers_back() -> None:
        # The recorder saw lr=1e-3 at the step; pretend the step used twice that.
        live.rec._steps.steps[-1].hyperparams[0]["lr"] *= 2  # type: ignore[union-attr]

    def weights_edited_after_the_step() -> None:
        with torch.no_grad():
            live.model[0].weight[:5].mul_(0.5)

    wrong_lr = live.train(1, between=lr_behind_the_optimizers_back)
    edited = live.train(1, between=weights_edited_after_the_step)
    fine = live.train(1)
    live.rec.close()
    print(f"residual bytes: wrong lr {wrong_lr.residual_bytes}, edited weights "
          f"{edited.residual_bytes}, untouched {fine.residual_bytes}")
    raw = wrong_lr.raw_bytes
    # A wrong lr mispredicts every param (the moments are still right); an edit of five rows
    # mispredicts only the chunks that hold them.
    assert 0 < edited.residual_bytes < wrong_lr.residual_bytes < raw
    assert fine.residual_bytes == 0
    assert wrong_lr.encoding.startswith("predictive/") and edited.encoding.startswith("predictive/")
    assert _encodings(address)["RESIDUAL"] > 0
    live.assert_every_version_replays_exactly(address)


class HandRolledSGD(torch.optim.Optimizer):
    """A custom optimizer: its step is not one the replayer knows."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def test_an_unsupported_optimizer_falls_back_to_xor_deltas(address: RunAddress) -> None:
    live = Live(address, lambda p: HandRolledSGD(p, lr=1e-3))
    for _ in range(4):
        live.train(1)
    live.rec.close()
    for r in live.results[1:]:
        assert r.encoding == ("xor-delta/blosc2-zstd (not predictive: optimizer HandRolledSGD is "
                              "not replayable (supported: Adam, AdamW, SGD))")
    counts = _encodings(address)
    assert counts["GRAD"] == counts["OptimizerStep"] == counts["RESIDUAL"] == 0 and counts["XOR"] > 0
    live.assert_every_version_replays_exactly(address)


def test_two_steps_per_commit_are_predictive_and_three_fall_back(address: RunAddress) -> None:
    live = Live(address, OPTIMIZERS["adamw"])
    live.train(1)
    live.train(1)
    two = live.train(2)
    held: list[int] = []
    three = live.train(3, between=lambda: held.extend(len(s.grads) for s in live.rec._steps.steps))  # type: ignore[union-attr]
    after = live.train(1)
    live.rec.close()
    assert two.encoding == "predictive/AdamW x2 + gradients/none + residual/blosc2-zstd"
    assert two.residual_bytes == 0
    assert "not predictive: 3 optimizer steps since the last commit" in three.encoding
    assert held == [0, 0, 0], "past the limit no gradient is kept alive"
    assert after.encoding.startswith("predictive/") and after.residual_bytes == 0
    assert _encodings(address)["OptimizerStep"] >= 3
    live.assert_every_version_replays_exactly(address)


def test_a_replay_that_predicts_differently_names_version_tensor_and_torch(
    address: RunAddress, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = Live(address, OPTIMIZERS["adam"])
    for _ in range(4):
        live.train(1)
    live.rec.close()
    from eventlog import optimstep

    real = optimstep.run_step

    def another_torch(*args: Any) -> None:  # a replay whose step differs in the last bit
        real(*args)
        params = args[2]
        params[0].view(-1)[0:1].view(torch.int32).add_(1)

    monkeypatch.setattr(optimstep, "run_step", another_torch)
    # Batched steps skip each step's check: the seal catches the difference, and says how
    # to name the step...
    with address.open_log() as log, pytest.raises(BatchedStepsMismatchError) as batched:
        rebuild(log, Target("version", 4), defer_steps=True)
    assert "versions 2..4 were replayed by batched optimizer steps" in str(batched.value)
    assert "REWIND_REPLAY_DEFER_STEPS=0" in str(batched.value)
    # (this fold checked every gradient chunk: the message sends no one looking for damage)
    assert "without per-step checks" in str(batched.value) and "damaged" not in str(batched.value)
    # ...which replay() does by itself: it folds again with per-step checks.
    with pytest.raises(DigestMismatchError) as info:
        replay(address, Target("version", 4))
    msg = str(info.value)
    assert "step of version 2 predicted tensor 'model/0.weight' differently" in msg
    # Both sides' torch are named: the recording's (from the event) and this replay's.
    assert msg.count(f"torch {torch.__version__} on cpu") == 2 and "replaying under" in msg


def _trained_embedded_run(tmp_path: Any, run_id: str, versions: int) -> tuple[RunAddress, Any]:
    """An embedded run of ``versions`` Adam versions, its recorder closed; and its database."""
    db = tmp_path / "rewind.db"
    address = RunAddress(f"sqlite://{db}", f"sqlite://{db}", run_id)
    live = Live(address, OPTIMIZERS["adam"])
    for _ in range(versions):
        live.train(1)
    live.rec.close()
    return address, db


def test_batched_steps_that_diverge_alone_are_reported_as_such(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """When only the batched path computes differently, the fold with every check matches
    the seal: replay() returns that verified state, and warns that the batched steps are at
    fault (naming the tensor and how many bytes differ) instead of sending the user to
    look for damage, or failing a recovery it could complete."""
    address, _ = _trained_embedded_run(tmp_path, "diverge", 3)
    expected, _ = replay(address, Target(), settings=current().with_changes(replay_defer_steps=False))
    from eventlog.fold import deferred

    real = deferred._run_unit

    def off_by_one_bit(unit: Any, *args: Any) -> None:
        real(unit, *args)
        views = args[2]
        views.whole(unit[0].param).view(-1)[0:1].view(torch.int32).add_(1)

    monkeypatch.setattr(deferred, "_run_unit", off_by_one_bit)
    with caplog.at_level(logging.WARNING, logger="replayer.replay"):
        state, report = replay(address, Target(), settings=current().with_changes(replay_defer_steps=True))
    assert report.version == 3
    got, want = state.tensors(), expected.tensors()
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[n].bits, want[n].bits) for n in want)  # type: ignore[attr-defined]
    [record] = [r for r in caplog.records if "batched optimizer steps" in r.getMessage()]
    msg = record.getMessage()
    assert "rebuilt to version 3 has digest" in msg and "A bug: please report it" in msg
    assert ("a fold from the same start that checked every step and gradient chunk (and the "
            "snapshot's files) matched the seal") in msg
    assert re.search(r"rebuilt 'model/[^']+' \([1-4] of \d+ bytes\)", msg), msg
    assert "a second batched fold, from the snapshot read with its checksums, missed it too: the " \
           "batched optimizer steps compute differently" in msg
    assert "to name" not in msg  # no advice to look for a damaged chunk


def test_optimizer_state_lives_on_its_params_shard(address: RunAddress) -> None:
    live = Live(address, OPTIMIZERS["adam"])
    live.train(1)
    live.train(1)
    live.rec.close()
    state, _ = replay(address, Target())
    shard_of = {s.name: s.shard for s in state.layout.tensors}
    params = [n for n in shard_of if n.startswith("model/")]
    assert len({shard_of[p] for p in params}) == 2, "params still spread over both shards"
    names = list(dict(live.model.named_parameters()))
    for i, name in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert shard_of[f"optimizer/state/{i}/{key}"] == shard_of[f"model/{name}"]


def test_optimizer_step_events_are_typed_and_validated() -> None:
    from eventlog.errors import IntegrityError
    from eventlog.events import Envelope
    from eventlog.fold.apply import ShardState

    body = OptimizerStep("Adam", 0, 1, "2.4.0", "cpu", b"\x91\x81\xa2lr\xcb?P\x62M\xd2\xf1\xa9\xfc",
                         ("model/w",), (0,), ("optimizer/state/0",), (), ())
    env = Envelope("r", 5, 2, 2, 0, "w", 0, body)
    with pytest.raises(IntegrityError, match="updates 'model/w', but the shard holds no such param"):
        ShardState(0).apply(env, {2}, 10, "shard 0 offset 7")


def test_a_step_that_cannot_be_replayed_while_recording_falls_back_to_deltas(
    address: RunAddress, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eventlog import optimstep

    live = Live(address, OPTIMIZERS["adam"])
    live.train(1)
    live.train(1)
    real = optimstep.run_step

    def half_then_fail(optimizer: str, hyper: Any, params: Any, *rest: Any) -> None:
        params[0].view(-1)[:3] = 7.0  # ran part way on the previous bits, then gave up
        raise RuntimeError("torch refused the step")

    monkeypatch.setattr(optimstep, "run_step", half_then_fail)
    failed = live.train(1)
    monkeypatch.setattr(optimstep, "run_step", real)
    after = live.train(1)
    live.rec.close()
    assert failed.encoding == ("xor-delta/blosc2-zstd (not predictive: the Adam step could not be "
                               "replayed (torch refused the step))")
    # The refused step ran on copies: the version is a delta against the previous bits, which
    # replays exactly below only if the step wrote none of them.
    assert after.encoding.startswith("predictive/") and after.residual_bytes == 0
    live.assert_every_version_replays_exactly(address)


def test_gradients_without_a_version_counter_fall_back_and_never_break_the_step(address: RunAddress) -> None:
    live = Live(address, OPTIMIZERS["sgd-plain"])
    live.train(1)
    live.train(1)
    for p in live.model.parameters():  # e.g. gradients computed by hand under inference mode
        with torch.inference_mode():
            g = torch.ones_like(p)
        p.grad = g
    live.opt.step()  # the recorder's pre-hook must not raise here
    live.opt.zero_grad()
    result = live.train(0)
    live.rec.close()
    assert "not predictive: a gradient was changed in place after optimizer.step() (or keeps no version)" \
        in result.encoding
    live.assert_every_version_replays_exactly(address)


def test_a_step_that_writes_its_gradients_is_not_predicted(address: RunAddress) -> None:
    """foreach nesterov SGD adds the momentum into each gradient in place. The recorder
    sees the gradients' version counters move during the step and logs XOR deltas instead
    (so a replay never runs a step whose gradients differ from the ones logged), and every
    version replays exactly."""
    live = Live(address, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, foreach=True))
    for _ in range(4):
        live.train(1)
    live.rec.close()
    assert all("not predictive: a gradient was changed in place" in r.encoding for r in live.results[1:]), \
        [r.encoding for r in live.results]
    live.assert_every_version_replays_exactly(address)


@pytest.mark.parametrize("kind", ["adam", "adam-foreach-amsgrad", "adam-fused", "sgd-nesterov"])
def test_batched_tiled_steps_replay_the_bits_of_one_step_at_a_time(
    address: RunAddress, kind: str, monkeypatch: pytest.MonkeyPatch,
    configure: Callable[..., Settings],
) -> None:
    """Folds batch consecutive steps and run them tile by tile. Small tiles (one 8 KiB
    gradient chunk per unit, so each param's step counter is split over tiles) and a small
    gradient budget (a batch every two or three steps) must give the trainer's bits."""
    live = Live(address, OPTIMIZERS[kind])
    for _ in range(9):
        live.train(1)
    live.rec.close()
    batches: list[list[int]] = []
    real_run = DeferredSteps.run

    def counted(self: DeferredSteps, tensors: Any, unit_bytes: int) -> None:
        if self.steps:
            batches.append([s.version for s in self.steps])
        real_run(self, tensors, unit_bytes)

    monkeypatch.setattr(DeferredSteps, "run", counted)
    with address.open_log() as log:
        state = rebuild(log, Target("version", 9))
    # Version 1 holds the whole state, then every version is predictive: one batch of all
    # their steps on each shard holding params.
    predictive = tuple(r.version for r in live.results if r.encoding.startswith("predictive/"))
    assert predictive == tuple(range(2, 10))
    assert set(map(tuple, batches)) == {predictive}
    # Verified against the seal: no batched version is left unchecked.
    assert [s.deferred.unchecked for s in state.shards] == [[] for _ in state.shards]
    batches.clear()
    grad_bytes = max(r.encoded_bytes - r.residual_bytes for r in live.results[2:])
    configure(replay_tile_bytes=8192, replay_defer_bytes=grad_bytes)  # about two steps per shard
    if address.log_url.startswith("sqlite://"):
        # Gradients read as views of segment files hold no memory, so the budget does not
        # split their batch; moved into SQLite, they are read as bytes and it does.
        live.assert_every_version_replays_exactly(address)
        assert set(map(tuple, batches)) == {predictive[:i] for i in range(1, len(predictive) + 1)}, batches
        batches.clear()
        # They still keep their files mapped, and a budget of mapped bytes splits it.
        with override(replay_defer_mapped_bytes=grad_bytes):
            live.assert_every_version_replays_exactly(address)
        assert any(len(b) > 1 for b in batches) and any(b[0] > 2 for b in batches), batches
        batches.clear()
        plain_records(path_from_url(address.log_url))
    live.assert_every_version_replays_exactly(address)
    assert any(len(b) > 1 for b in batches) and any(b[0] > 2 for b in batches), batches


def _tiles_run(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every tile that batched replays run from now on, in the order they run."""
    tiles: list[Any] = []
    run_unit = deferred_module._run_unit

    def spy(unit: list[Any], *rest: Any) -> None:
        tiles.extend(unit)
        run_unit(unit, *rest)

    monkeypatch.setattr(deferred_module, "_run_unit", spy)
    return tiles


@pytest.mark.parametrize(("kind", "compression", "tile_bytes", "part"), [
    ("adam", "none", 8192, 4096),
    # 500 bytes a worker, rounded down to 448: a part of 125 floats would move elements
    # between fused Adam's vector and scalar loops, whose bits differ.
    ("adam-fused", "none", 1000, 448),
    # zstd: blosc2 4.x's lz4 at level 1 leaves an 8 KiB chunk of gradients as it is (the
    # codec then stores it raw, read in place).
    ("adam", "blosc2-zstd", 8192, None), ("sgd-nesterov", "none", 8192, None)])
def test_two_workers_cut_gradient_chunks_read_in_place_into_parts(
    address: RunAddress, kind: str, compression: str, tile_bytes: int, part: int | None,
    monkeypatch: pytest.MonkeyPatch, configure: Callable[..., Settings],
) -> None:
    """Two replay workers give each unit half the tile budget, so that both units' working
    sets stay cached. A gradient chunk read in place (uncompressed, by an optimizer that
    only reads it) is then cut into parts of whole 64-byte lines, one tile each; one
    decompressed or copied stays whole, and so does every chunk of a fold that checks each
    chunk's digest. Every version still replays bit for bit."""
    configure(grad_compression=compression)
    live = Live(address, OPTIMIZERS[kind])
    for _ in range(5):
        live.train(1)
    live.rec.close()
    configure(replay_tile_bytes=tile_bytes)  # chunks are 8 KiB
    tiles = _tiles_run(monkeypatch)
    live.assert_every_version_replays_exactly(address)  # 2 workers, chunk digests left to the seal
    chunk_tiles = [t for t in tiles if not t.whole]
    assert chunk_tiles
    if part:
        assert max(t.nbytes for t in chunk_tiles) == part and any(t.skip == part for t in chunk_tiles)
        assert all(t.skip % 64 == 0 for t in chunk_tiles)
    else:
        assert max(t.nbytes for t in chunk_tiles) == 8192 and not any(t.skip for t in chunk_tiles)
    tiles.clear()
    with address.open_log() as log:
        rebuild(log, Target(), workers=2)  # checks every gradient chunk's digest
    assert tiles and not any(t.skip for t in tiles)


def test_chunks_off_the_vector_grid_replay_as_whole_tensors(
    address: RunAddress, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log recorded with 8208-byte chunks (a multiple of 16, not of 64): a tile starting
    at such a chunk would run some of fused Adam's elements through its scalar loop, whose
    bits differ, and the batched replay would miss the seal ("a bug: please report it").
    Each such param runs as one whole-tensor tile, and every version replays bit for bit."""
    live = Live(address, OPTIMIZERS["adam-fused"], chunk_bytes=8208)
    for _ in range(4):
        live.train(1)
    live.rec.close()
    tiles = _tiles_run(monkeypatch)
    live.assert_every_version_replays_exactly(address)
    assert any(t.whole and len(t.chunks) > 1 for t in tiles)  # the 32 KiB weight, in 4 chunks


@pytest.mark.parametrize("compression", ["none", "blosc2-lz4"])
@pytest.mark.parametrize("defer", [True, False], ids=["batched", "step-by-step"])
def test_a_damaged_gradient_chunk_is_refused_naming_its_place(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, configure: Callable[..., Settings], defer: bool,
    compression: str,
) -> None:
    """Batched replays read gradients late, inside a tile: a raw one as a view of its
    message, an lz4 one decompressed. A flipped byte must still fail with the chunk's run,
    shard, offset and tensor. ``replay`` first folds without the chunk digests, leaving
    them to the seal; on the mismatch it folds again with them, and names the place."""
    import sqlite3

    configure(grad_compression=compression)
    address, db = _trained_embedded_run(tmp_path, "grads", 4)
    plain_records(db)
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT partition, offset, value FROM records "
                         "WHERE run='grads' AND partition>=0").fetchall()
        grads = [(p, o, bytes(v), body) for p, o, v in rows
                 if isinstance(body := serde.decode(bytes(v)).body, TensorDelta) and body.encoding == "GRAD"]
        # (a chunk lz4 cannot shrink is stored raw)
        assert {g[3].compression for g in grads} <= {compression, "none"}
        partition, offset, value, delta = max((g for g in grads if g[3].compression == compression),
                                              key=lambda g: len(g[3].payload))
        damaged = bytearray(value)
        damaged[value.rfind(delta.payload) + 3 * len(delta.payload) // 4] ^= 0x5A
        c.execute("UPDATE records SET value=? WHERE run='grads' AND partition=? AND offset=?",
                  (bytes(damaged), partition, offset))
    c.close()
    with address.open_log() as log, pytest.raises(CorruptMessageError) as info:
        rebuild(log, Target(), defer_steps=defer)
    msg = str(info.value)
    assert f"run 'grads' shard {partition} offset {offset}" in msg and repr(delta.name) in msg, msg
    if defer:
        with address.open_log() as log, pytest.raises(
                (BatchedStepsMismatchError, CorruptMessageError)) as unchecked:  # lz4 may refuse it
            rebuild(log, Target(), defer_steps=True, grad_digests=False)
        assert "xxh3 digest" not in str(unchecked.value)  # the digest was not what failed
        if compression == "none":
            assert isinstance(unchecked.value, BatchedStepsMismatchError), unchecked.value
            assert f"shard {partition} rebuilt to version 4" in str(unchecked.value)
            assert "the first damaged chunk" in str(unchecked.value)
        # replay() folds without the digests first, then with them, naming the place.
        import replayer.replay as replay_module

        calls: list[bool] = []

        def spy(*args: Any, **kwargs: Any) -> Any:
            calls.append(kwargs["grad_digests"])
            return rebuild(*args, **kwargs)

        monkeypatch.setattr(replay_module, "rebuild", spy)
        with pytest.raises(CorruptMessageError) as info:
            replay(address, Target(), settings=current().with_changes(replay_defer_steps=True))
        assert str(info.value) == msg
        assert calls == [False, True]
