"""The in-process fake engines: real copies, Mooncake-like failures, faults, counters."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from tspd.engines.base import AsyncTransferEngine, PollingEngine, TransferEngine, TransferError
from tspd.testing.fake_engine import AsyncFakeEngine, FakeEngine, FakeFabric


def _arena(size: int, fill: int = 0) -> tuple[np.ndarray, int]:
    arr = np.full(size, fill, dtype=np.uint8)
    return arr, int(arr.ctypes.data)


@pytest.fixture
def fabric() -> FakeFabric:
    return FakeFabric()


def test_fake_engines_satisfy_the_protocols(fabric: FakeFabric) -> None:
    assert isinstance(FakeEngine(fabric=fabric), TransferEngine)
    assert isinstance(AsyncFakeEngine(fabric=fabric), AsyncTransferEngine)


def test_session_ids_are_unique_host_port(fabric: FakeFabric) -> None:
    a, b = FakeEngine("127.0.0.1", fabric=fabric), FakeEngine("127.0.0.1", fabric=fabric)
    assert a.session_id != b.session_id
    host, port = a.session_id.split(":")
    assert host == "127.0.0.1"
    assert int(port) > 0
    assert fabric.sessions() == sorted([a.session_id, b.session_id])


def test_batch_write_copies_bytes_and_counts(fabric: FakeFabric) -> None:
    src_arr, src = _arena(4096)
    src_arr[:] = np.arange(4096) % 251
    dst_arr, dst = _arena(4096)
    a, b = FakeEngine(fabric=fabric), FakeEngine(fabric=fabric)
    a.register_memory(src, 4096)
    b.register_memory(dst, 4096)
    a.batch_write(b.session_id, [src, src + 100], [dst + 1000, dst], np.array([50, 10]))
    assert bytes(dst_arr[1000:1050]) == bytes(src_arr[0:50])
    assert bytes(dst_arr[0:10]) == bytes(src_arr[100:110])
    assert dst_arr[10:1000].sum() == 0
    assert a.stats.batches == 1
    assert a.stats.descriptors == 2
    assert a.stats.bytes_written == 60
    assert a.stats.writes_by_peer == {b.session_id: 1}


def test_out_of_range_destination_fails_and_writes_nothing(fabric: FakeFabric) -> None:
    _, src = _arena(64, fill=7)
    dst_arr, dst = _arena(64)
    a, b = FakeEngine(fabric=fabric), FakeEngine(fabric=fabric)
    a.register_memory(src, 64)
    b.register_memory(dst, 32)
    with pytest.raises(TransferError, match="not within any registered buffer") as info:
        a.batch_write(b.session_id, [src, src], [dst, dst + 16], [8, 32])
    assert info.value.code == -1
    assert info.value.peer == b.session_id
    assert dst_arr.sum() == 0, "a rejected batch must not copy its valid descriptors"
    assert a.stats.failures == 1


def test_unregistered_source_is_refused(fabric: FakeFabric) -> None:
    _, src = _arena(64)
    _, dst = _arena(64)
    a, b = FakeEngine(fabric=fabric), FakeEngine(fabric=fabric)
    b.register_memory(dst, 64)
    with pytest.raises(TransferError, match="source"):
        a.batch_write(b.session_id, [src], [dst], [8])


def test_dead_and_unknown_peers_fail(fabric: FakeFabric) -> None:
    _, src = _arena(64)
    _, dst = _arena(64)
    a, b = FakeEngine(fabric=fabric), FakeEngine(fabric=fabric)
    a.register_memory(src, 64)
    b.register_memory(dst, 64)
    b.close()
    b.close()  # idempotent
    with pytest.raises(TransferError, match="not reachable"):
        a.batch_write(b.session_id, [src], [dst], [8])
    with pytest.raises(TransferError, match="not reachable"):
        a.batch_write("127.0.0.1:1", [src], [dst], [8])


def test_mismatched_columns_and_bad_types_fail(fabric: FakeFabric) -> None:
    _, src = _arena(64)
    _, dst = _arena(64)
    a, b = FakeEngine(fabric=fabric), FakeEngine(fabric=fabric)
    a.register_memory(src, 64)
    b.register_memory(dst, 64)
    with pytest.raises(TransferError, match="differ in length"):
        a.batch_write(b.session_id, [src, src], [dst], [8])
    with pytest.raises(TransferError, match="integer"):
        a.batch_write(b.session_id, np.array([1.5]), [dst], [8])


def test_empty_batch_and_zero_length_succeed(fabric: FakeFabric) -> None:
    a, b = FakeEngine(fabric=fabric), FakeEngine(fabric=fabric)
    a.batch_write(b.session_id, [], [], [])
    a.batch_write(b.session_id, [0], [0], [0])
    assert a.stats.bytes_written == 0
    assert a.stats.batches == 2


def test_register_overlap_and_unknown_unregister(fabric: FakeFabric) -> None:
    _, base = _arena(128)
    a = FakeEngine(fabric=fabric)
    a.register_memory(base, 64)
    with pytest.raises(TransferError) as overlap:
        a.register_memory(base + 32, 64)
    assert overlap.value.code == -7
    a.register_memory(base + 64, 64)
    a.unregister_memory(base)
    with pytest.raises(TransferError) as unknown:
        a.unregister_memory(base)
    assert unknown.value.code == -3
    assert a.regions() == {base + 64: 64}


def test_writes_after_peer_unregisters_fail(fabric: FakeFabric) -> None:
    _, src = _arena(64)
    _, dst = _arena(64)
    a, b = FakeEngine(fabric=fabric), FakeEngine(fabric=fabric)
    a.register_memory(src, 64)
    b.register_memory(dst, 64)
    a.batch_write(b.session_id, [src], [dst], [8])
    b.unregister_memory(dst)
    with pytest.raises(TransferError):
        a.batch_write(b.session_id, [src], [dst], [8])


def test_fail_next_counts_down_per_peer(fabric: FakeFabric) -> None:
    _, src = _arena(64)
    _, dst = _arena(64)
    a, b, c = (FakeEngine(fabric=fabric) for _ in range(3))
    a.register_memory(src, 64)
    b.register_memory(dst, 32)
    c.register_memory(dst + 32, 32)
    a.fail_next(b.session_id, 2, code=-5)
    a.batch_write(c.session_id, [src], [dst + 32], [8])  # other peers are unaffected
    for _ in range(2):
        with pytest.raises(TransferError) as info:
            a.batch_write(b.session_id, [src], [dst], [8])
        assert info.value.code == -5
    a.batch_write(b.session_id, [src], [dst], [8])
    assert a.stats.failures == 2


def test_hang_next_stalls_with_the_injected_sleep_then_fails(fabric: FakeFabric) -> None:
    slept: list[float] = []
    _, src = _arena(64)
    _, dst = _arena(64)
    a = FakeEngine(fabric=fabric, sleep=slept.append)
    b = FakeEngine(fabric=fabric)
    a.register_memory(src, 64)
    b.register_memory(dst, 64)
    a.hang_next(b.session_id, 5.0)
    with pytest.raises(TransferError, match="stalling 5s"):
        a.batch_write(b.session_id, [src], [dst], [8])
    assert slept == [5.0]
    a.batch_write(b.session_id, [src], [dst], [8])
    assert slept == [5.0]
    a.clear_faults()


def test_transfer_error_pickles_with_its_fields() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(TransferError("h:1", -1, "boom")))
    assert (err.peer, err.code, err.detail) == ("h:1", -1, "boom")
    assert "h:1" in str(err)


async def test_async_fake_engine_latency_runs_in_virtual_time(
    fabric: FakeFabric, autojump_clock: trio.testing.MockClock
) -> None:
    src_arr, src = _arena(64, fill=9)
    dst_arr, dst = _arena(64)
    a = AsyncFakeEngine(fabric=fabric, latency=2.0)
    b = AsyncFakeEngine(fabric=fabric)
    a.register_memory(src, 64)
    b.register_memory(dst, 64)
    start = trio.current_time()
    await a.batch_write(b.session_id, [src], [dst], [64])
    assert trio.current_time() - start == pytest.approx(2.0)
    assert bytes(dst_arr) == bytes(src_arr)
    assert a.stats.bytes_written == 64


async def test_async_fake_engine_hang_then_failure(
    fabric: FakeFabric, autojump_clock: trio.testing.MockClock
) -> None:
    _, src = _arena(64)
    _, dst = _arena(64)
    a = AsyncFakeEngine(fabric=fabric)
    b = AsyncFakeEngine(fabric=fabric)
    a.register_memory(src, 64)
    b.register_memory(dst, 64)
    a.hang_next(b.session_id, 30.0)
    start = trio.current_time()
    with pytest.raises(TransferError):
        await a.batch_write(b.session_id, [src], [dst], [8])
    assert trio.current_time() - start == pytest.approx(30.0)
    a.fail_next(b.session_id)
    with pytest.raises(TransferError):
        await a.batch_write(b.session_id, [src], [dst], [8])
    await a.batch_write(b.session_id, [src], [dst], [8])


async def test_async_fake_engine_finishes_a_write_despite_cancel(
    fabric: FakeFabric, autojump_clock: trio.testing.MockClock
) -> None:
    src_arr, src = _arena(64, fill=3)
    dst_arr, dst = _arena(64)
    a = AsyncFakeEngine(fabric=fabric, latency=1.0)
    b = AsyncFakeEngine(fabric=fabric)
    a.register_memory(src, 64)
    b.register_memory(dst, 64)
    with trio.move_on_after(0.5):
        await a.batch_write(b.session_id, [src], [dst], [64])
    assert bytes(dst_arr) == bytes(src_arr)
    assert a.in_flight == 0
    b.close()
    a.close()


# -- the non-blocking pair (PollingEngine) ------------------------------------


class _Clock:
    """A hand-driven clock for the fake engine's non-blocking writes."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_fake_engine_is_a_polling_engine(fabric: FakeFabric) -> None:
    assert isinstance(FakeEngine(fabric=fabric), PollingEngine)


def test_submitted_write_completes_at_the_first_check(fabric: FakeFabric) -> None:
    a, b = FakeEngine(fabric=fabric), FakeEngine(fabric=fabric)
    src_arr, src = _arena(64, fill=7)
    dst_arr, dst = _arena(64)
    a.register_memory(src, 64)
    b.register_memory(dst, 64)
    ticket = a.submit_write(b.session_id, src, dst, 64)
    assert ticket.peer_session == b.session_id
    assert ticket.length == 64
    assert a.pending_writes == 1
    assert not dst_arr.any(), "nothing is copied before the write is checked"
    assert a.check_write(ticket) is True
    assert bytes(dst_arr) == bytes(src_arr)
    assert a.pending_writes == 0
    assert a.stats.descriptors == 1
    with pytest.raises(TransferError, match="no write in flight"):
        a.check_write(ticket)  # a ticket is spent once done


def test_submitted_write_with_latency_is_pending_until_it_passed(fabric: FakeFabric) -> None:
    clock = _Clock()
    a = FakeEngine(fabric=fabric, latency=0.5, clock=clock)
    b = FakeEngine(fabric=fabric)
    src_arr, src = _arena(16, fill=3)
    dst_arr, dst = _arena(16)
    a.register_memory(src, 16)
    b.register_memory(dst, 16)
    ticket = a.submit_write(b.session_id, src, dst, 16)
    assert a.check_write(ticket) is False
    clock.now += 0.49
    assert a.check_write(ticket) is False
    assert not dst_arr.any()
    clock.now += 0.02
    assert a.check_write(ticket) is True
    assert bytes(dst_arr) == bytes(src_arr)


def test_submitted_write_faults_and_bad_addresses_fail_at_the_check(fabric: FakeFabric) -> None:
    clock = _Clock()
    a, b = FakeEngine(fabric=fabric, clock=clock), FakeEngine(fabric=fabric)
    _, src = _arena(16)
    _, dst = _arena(16)
    a.register_memory(src, 16)
    b.register_memory(dst, 16)
    a.fail_next(b.session_id, code=-5)
    failing = a.submit_write(b.session_id, src, dst, 16)
    with pytest.raises(TransferError) as err:
        a.check_write(failing)
    assert (err.value.peer, err.value.code) == (b.session_id, -5)
    a.hang_next(b.session_id, 2.0)
    hung = a.submit_write(b.session_id, src, dst, 16)
    clock.now += 1.9
    assert a.check_write(hung) is False
    clock.now += 0.2
    with pytest.raises(TransferError, match="stalling 2s"):
        a.check_write(hung)
    outside = a.submit_write(b.session_id, src, dst + 8, 16)
    with pytest.raises(TransferError, match="not within any registered buffer"):
        a.check_write(outside)
    assert a.stats.failures == 3
    assert a.pending_writes == 0


def test_a_closed_fake_engine_refuses_to_submit(fabric: FakeFabric) -> None:
    a, b = FakeEngine(fabric=fabric), FakeEngine(fabric=fabric)
    a.close()
    with pytest.raises(TransferError, match="closed"):
        a.submit_write(b.session_id, 1, 1, 1)
    assert a.pending_writes == 0
