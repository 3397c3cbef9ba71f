"""The backend contract, written once and run against every backend (embedded, kafka+redis)."""

from __future__ import annotations

import pytest
import torch

from eventlog import FencedError, RunAddress, StaleVersionError
from eventlog.ports import CONTROL, MessageStream
from rewind.recorder import Recorder


def _values(records: list) -> list[bytes]:  # type: ignore[type-arg]
    return [r.value for r in records]


def test_transaction_is_visible_only_after_commit(address: RunAddress) -> None:
    with address.open_log() as log:
        log.create(2)
        assert log.shard_count() == 2
        writer = log.writer("w")
        with writer.transaction() as txn:
            txn.append(CONTROL, b"c0")
            txn.append(0, b"s0")
            txn.append(1, b"s1")
            assert log.read(CONTROL) == [] and log.read(0) == []
        assert _values(log.read(CONTROL)) == [b"c0"]
        assert _values(log.read(0)) == [b"s0"] and _values(log.read(1)) == [b"s1"]
        writer.close()


def test_aborted_transaction_leaves_nothing(address: RunAddress) -> None:
    with address.open_log() as log:
        log.create(1)
        writer = log.writer("w")
        with pytest.raises(RuntimeError, match="boom"), writer.transaction() as txn:
            txn.append(0, b"lost")
            raise RuntimeError("boom")
        with writer.transaction() as txn:
            txn.append(0, b"kept")
        assert _values(log.read(0)) == [b"kept"]
        writer.close()


def test_read_ranges_and_offsets(address: RunAddress) -> None:
    with address.open_log() as log:
        log.create(1)
        writer = log.writer("w")
        for i in range(10):
            with writer.transaction() as txn:
                txn.append(0, f"m{i}".encode())
        records = log.read(0)
        assert _values(records) == [f"m{i}".encode() for i in range(10)]
        offsets = [r.offset for r in records]
        assert offsets == sorted(offsets) and log.end_offset(0) > offsets[-1]
        assert _values(log.read(0, gt=offsets[2], lte=offsets[5])) == [b"m3", b"m4", b"m5"]
        assert _values(log.read(0, gt=offsets[2], limit=2)) == [b"m3", b"m4"]
        assert _values(list(log.scan(0, gt=offsets[7]))) == [b"m8", b"m9"]
        log.truncate_before(0, offsets[4])
        assert log.start_offset(0) == offsets[4]
        assert _values(log.read(0)) == [f"m{i}".encode() for i in range(4, 10)]
        writer.close()


def test_decoded_reads_hand_each_record_to_its_decoder_as_a_stream(address: RunAddress) -> None:
    """``read_decoded``/``scan_decoded`` see the bytes ``read`` sees, whatever pieces the
    decoder asks for: a few header bytes, then one large read of the rest (as fastavro reads
    a tensor chunk's payload), then nothing left. A decoder's error leaves the log readable."""
    sizes = [3, 4096, 4097, (1 << 20) + 7]
    values = [bytes((i * 31 + j) % 251 for j in range(n)) for i, n in enumerate(sizes)]
    with address.open_log() as log:
        log.create(1)
        writer = log.writer("w")
        for v in values:
            with writer.transaction() as txn:
                txn.append(0, v)
        offsets = [r.offset for r in log.read(0)]

        def pieces(stream: MessageStream, size: int, offset: int) -> tuple[int, bytes]:
            head = stream.read(5)
            rest = stream.read(size - len(head))
            assert stream.read(1) == b"" and stream.tell() == size
            return offset, head + rest

        got = log.read_decoded(0, pieces)
        assert [(d.offset, d.size) for d in got] == list(zip(offsets, sizes, strict=True))
        assert [d.value for d in got] == list(zip(offsets, values, strict=True))
        assert [d.value[1] for d in log.read_decoded(0, pieces, gt=offsets[0], lte=offsets[2])] == values[1:3]
        assert [d.value[1] for d in log.scan_decoded(0, pieces, gt=offsets[1], batch=1)] == values[2:]

        def first_only(stream: MessageStream, size: int, offset: int) -> int:
            if offset != offsets[0]:
                raise ValueError(f"offset {offset} was decoded before the caller reached it")
            return offset

        for batch in (1, 16):  # a fold that stops at its target decodes nothing after it
            assert next(log.scan_decoded(0, first_only, batch=batch)).value == offsets[0]

        def refuse(stream: MessageStream, size: int, offset: int) -> None:
            raise ValueError(f"cannot decode offset {offset}")

        with pytest.raises(ValueError, match=f"offset {offsets[0]}"):
            log.read_decoded(0, refuse)
        with writer.transaction() as txn:  # no read snapshot was left open: a new record shows
            txn.append(0, b"after")
        assert _values(log.read(0)) == [*values, b"after"]
        assert [d.value[1] for d in log.scan_decoded(0, pieces, gt=offsets[-1], batch=1)] == [b"after"]
        writer.close()


def test_second_writer_with_same_id_fences_the_first(address: RunAddress) -> None:
    with address.open_log() as log:
        log.create(1)
        first = log.writer("trainer")
        with first.transaction() as txn:
            txn.append(0, b"before")
        second = log.writer("trainer")
        with pytest.raises(FencedError, match="fenced"), first.transaction() as txn:
            txn.append(0, b"zombie")
        with second.transaction() as txn:
            txn.append(0, b"after")
        assert _values(log.read(0)) == [b"before", b"after"]
        first.close()
        second.close()


def test_coordinator_version_cas_gsns_leases_catalog(address: RunAddress) -> None:
    run = address.run_id
    with address.open_coordinator() as coord:
        assert coord.current_version(run) == 0
        coord.compare_and_set_version(run, 0, 1)
        with pytest.raises(StaleVersionError, match="based on version 0.*at version 1"):
            coord.compare_and_set_version(run, 0, 1)
        a = coord.allocate_gsns(run, 5)
        b = coord.allocate_gsns(run, 3)
        assert b == a + 5
        coord.raise_gsn_floor(run, b + 100)
        assert coord.allocate_gsns(run, 1) == b + 101
        lease = f"{run}.snapshotter"
        t1 = coord.acquire_lease(lease, "s1", ttl_s=30)
        assert t1 is not None and coord.acquire_lease(lease, "s2", ttl_s=30) is None
        assert coord.acquire_lease(lease, "s1", ttl_s=30) == t1  # renewal keeps the token
        held = coord.lease_holder(lease)
        assert held is not None and held[0] == "s1" and 25 < held[1] <= 30
        coord.release_lease(lease, "s1")
        assert coord.lease_holder(lease) is None
        t2 = coord.acquire_lease(lease, "s2", ttl_s=30)
        assert t2 is not None and t2 > t1 and coord.lease_token(lease) == t2
        coord.catalog_put(run, "snap-1", {"version": 3})
        assert coord.catalog(run) == {"snap-1": {"version": 3}}
        coord.catalog_delete(run, "snap-1")
        assert coord.catalog(run) == {}
        coord.report_follower(run, "actor-0", 7)
        assert coord.followers(run)["actor-0"]["version"] == 7


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(8, 16)).pow(2).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_recorder_round_trip_is_bit_exact(address: RunAddress) -> None:
    model, opt = _model()
    with Recorder(address, model, opt, chunk_bytes=256) as rec:
        assert rec.restore().fresh
        for step in range(6):
            _train(model, opt)
            rec.commit(step, {"loss": float(step)})
        rec.flush()
        live = {k: v.clone() for k, v in model.state_dict().items()}
        live_opt = opt.state_dict()
        live_rng = torch.get_rng_state()
    model2, opt2 = _model()
    torch.manual_seed(99)
    with Recorder(address, model2, opt2) as rec2:
        result = rec2.restore()
        assert (result.step, result.version) == (5, 6)
        for k, v in live.items():
            assert torch.equal(v.view(torch.uint8), model2.state_dict()[k].view(torch.uint8)), k
        for pid, st in live_opt["state"].items():
            for key, t in st.items():
                assert torch.equal(t, opt2.state_dict()["state"][pid][key]), (pid, key)
        assert torch.equal(live_rng, torch.get_rng_state())
        _train(model2, opt2)
        assert rec2.commit(6, wait=True).result().version == 7


def test_stale_base_version_is_refused(address: RunAddress) -> None:
    model, opt = _model()
    with Recorder(address, model, opt) as rec:
        _train(model, opt)
        rec.commit(0, wait=True)
        with pytest.raises(StaleVersionError, match="based on version 0"):
            rec.commit(1, base_version=0, wait=True)


def test_tensor_larger_than_a_message_round_trips(address: RunAddress) -> None:
    big = torch.nn.Linear(2048, 2560)  # 21 MB of fp32 weights: above the broker's 16 MiB limit
    with torch.no_grad():
        big.weight.copy_(torch.randn_like(big.weight))
    with Recorder(address, big, rng=False) as rec:
        rec.commit(0, wait=True)
    other = torch.nn.Linear(2048, 2560)
    with Recorder(address, other, rng=False) as rec:
        rec.restore()
    assert torch.equal(big.weight.view(torch.uint8), other.weight.view(torch.uint8))
