"""EngineRunner (blocking engines in threads, never abandoned) and step waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from tspd.core.schedule import STEP_MODULUS
from tspd.engines.base import AddressList, AsyncTransferEngine, TransferError, WriteTicket
from tspd.shell import offload
from tspd.shell.offload import EngineRunner, _pieces, wait_step
from tspd.testing.fake_engine import FakeEngine, FakeFabric


def _pair(latency: float = 0.0) -> tuple[FakeEngine, FakeEngine, np.ndarray, np.ndarray]:
    fabric = FakeFabric()
    a, b = FakeEngine(fabric=fabric, latency=latency), FakeEngine(fabric=fabric)
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    a.register_memory(int(src.ctypes.data), 256)
    b.register_memory(int(dst.ctypes.data), 256)
    return a, b, src, dst


async def test_runner_is_an_async_engine_and_copies() -> None:
    a, b, src, dst = _pair()
    runner = EngineRunner(a)
    assert isinstance(runner, AsyncTransferEngine)
    assert runner.session_id == a.session_id
    await runner.batch_write(b.session_id, [int(src.ctypes.data)], [int(dst.ctypes.data)], [256])
    assert bytes(dst) == bytes(src)
    assert runner.in_flight == 0


async def test_runner_propagates_transfer_errors() -> None:
    a, b, src, dst = _pair()
    runner = EngineRunner(a)
    a.fail_next(b.session_id)
    with pytest.raises(TransferError):
        await runner.batch_write(b.session_id, [int(src.ctypes.data)], [int(dst.ctypes.data)], [8])
    assert runner.in_flight == 0


async def test_runner_register_and_unregister_pass_through() -> None:
    fabric = FakeFabric()
    engine = FakeEngine(fabric=fabric)
    runner = EngineRunner(engine)
    arena = np.zeros(64, dtype=np.uint8)
    runner.register_memory(int(arena.ctypes.data), 64)
    assert engine.regions() == {int(arena.ctypes.data): 64}
    runner.unregister_memory(int(arena.ctypes.data))
    assert engine.regions() == {}
    runner.close()
    assert engine.closed


async def test_a_cancelled_write_still_finishes_before_returning() -> None:
    a, b, src, dst = _pair(latency=0.3)
    runner = EngineRunner(a)
    with trio.CancelScope() as scope:
        scope.deadline = trio.current_time() + 0.05
        await runner.batch_write(
            b.session_id, [int(src.ctypes.data)], [int(dst.ctypes.data)], [256]
        )
        await trio.sleep(10)  # the cancellation lands here, after the write
    assert scope.cancelled_caught
    assert bytes(dst) == bytes(src), "the write must have completed, not been abandoned"
    assert runner.in_flight == 0


class _NoMemoryEngine:
    """An engine with nothing to register or close, at ``127.0.0.1:1``."""

    session_id = "127.0.0.1:1"

    def register_memory(self, addr: int, length: int) -> None:
        pass

    def unregister_memory(self, addr: int) -> None:
        pass

    def close(self) -> None:
        pass


class _GateEngine(_NoMemoryEngine):
    """A blocking engine that records how many writes run at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.running = 0
        self.peak = 0

    def batch_write(
        self, peer_session: str, src: AddressList, dst: AddressList, lengths: AddressList
    ) -> None:
        with self._lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(0.05)
        with self._lock:
            self.running -= 1


@pytest.mark.parametrize("limit", [1, 3])
async def test_limiter_bounds_concurrent_writes(limit: int) -> None:
    engine = _GateEngine()
    runner = EngineRunner(engine, limiter=trio.CapacityLimiter(limit))
    empty: Sequence[int] = []
    async with trio.open_nursery() as nursery:
        for _ in range(6):
            nursery.start_soon(runner.batch_write, "peer:1", empty, empty, empty)
    assert engine.peak == limit


async def test_wait_step_returns_when_counter_passes_target(
    autojump_clock: trio.testing.MockClock,
) -> None:
    counter = [0]

    async def producer() -> None:
        for _ in range(5):
            await trio.sleep(1.0)
            counter[0] += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(producer)
        start = trio.current_time()
        value = await wait_step(lambda: counter[0], 2)
        # Step 2 is done once the counter reads 3 (strictly past it).
        assert value == 3
        assert trio.current_time() - start == pytest.approx(3.0, abs=0.01)


async def test_wait_step_is_wrap_safe(autojump_clock: trio.testing.MockClock) -> None:
    top = STEP_MODULUS - 1
    counter = [top - 1]

    async def producer() -> None:
        while True:
            await trio.sleep(0.5)
            counter[0] = (counter[0] + 1) % STEP_MODULUS

    async with trio.open_nursery() as nursery:
        nursery.start_soon(producer)
        assert await wait_step(lambda: counter[0], top) == 0
        nursery.cancel_scope.cancel()


async def test_wait_step_is_cancellable(autojump_clock: trio.testing.MockClock) -> None:
    with trio.move_on_after(5) as scope:
        await wait_step(lambda: 0, 10)
    assert scope.cancelled_caught


async def test_wait_step_in_thread() -> None:
    counter = [0]

    async def producer() -> None:
        for _ in range(3):
            await trio.sleep(0.01)
            counter[0] += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(producer)
        value = await wait_step(lambda: counter[0], 1, in_thread=True, poll=0.001)
    assert value >= 2


async def test_wait_step_in_thread_cancel_stops_the_thread() -> None:
    reads = [0]

    def read() -> int:
        reads[0] += 1
        return 0

    with trio.move_on_after(0.05):
        await wait_step(read, 10, in_thread=True, poll=0.001)
    await trio.sleep(0.05)
    settled = reads[0]
    await trio.sleep(0.05)
    assert reads[0] == settled, "the abandoned polling thread must stop"


async def test_wait_step_rejects_a_bad_poll() -> None:
    with pytest.raises(ValueError, match="poll"):
        await wait_step(lambda: 5, 1, poll=0)


async def test_a_write_cancelled_while_waiting_for_the_limiter_never_starts() -> None:
    a, b, src, dst = _pair(latency=0.2)
    runner = EngineRunner(a, limiter=trio.CapacityLimiter(1))
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(runner.batch_write, b.session_id, [s], [d], [8])
        await trio.sleep(0.05)  # the first write holds the only token
        with trio.move_on_after(0.01) as scope:
            await runner.batch_write(b.session_id, [s + 8], [d + 8], [8])
        assert scope.cancelled_caught
    assert a.stats.batches == 1, "the queued write must not have run"
    assert dst[8:16].sum() == 0


# -- polled writes (engines with the non-blocking pair) -------------------------


async def _warm(runner: EngineRunner, peer: str, src: int, dst: int) -> None:
    """One write through the thread, after which ``peer`` counts as reached."""
    await runner.batch_write(peer, [src], [dst], [1])


async def test_small_writes_to_a_reached_peer_are_polled_not_threaded() -> None:
    a, b, src, dst = _pair()
    runner = EngineRunner(a, poll_max_descriptors=4)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    await _warm(runner, b.session_id, s, d)
    assert (runner.thread_writes, runner.polled_writes) == (1, 0)
    # Four copies (the limit given), as arrays like a CopyPlan's columns.
    offsets = np.arange(4, dtype=np.int64) * 64
    await runner.batch_write(b.session_id, s + offsets, d + offsets[::-1], np.full(4, 64))
    assert (runner.thread_writes, runner.polled_writes) == (1, 1)
    for i in range(4):
        assert bytes(dst[(3 - i) * 64 : (4 - i) * 64]) == bytes(src[i * 64 : (i + 1) * 64])
    assert a.pending_writes == 0
    assert runner.in_flight == 0
    # Five copies go through the thread again.
    await runner.batch_write(b.session_id, [s] * 5, [d] * 5, [1] * 5)
    assert (runner.thread_writes, runner.polled_writes) == (2, 1)


async def test_polling_can_be_switched_off() -> None:
    a, b, src, dst = _pair()
    runner = EngineRunner(a, poll_max_descriptors=0)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    for _ in range(3):
        await runner.batch_write(b.session_id, [s], [d], [8])
    assert (runner.thread_writes, runner.polled_writes) == (3, 0)
    with pytest.raises(ValueError, match="poll_max_descriptors"):
        EngineRunner(a, poll_max_descriptors=-1)


async def test_a_failed_polled_write_raises_and_sends_the_peer_back_to_the_thread() -> None:
    a, b, src, dst = _pair()
    runner = EngineRunner(a)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    await _warm(runner, b.session_id, s, d)
    a.fail_next(b.session_id, code=-3)
    with pytest.raises(TransferError) as err:
        await runner.batch_write(b.session_id, [s, s + 8], [d, d + 8], [8, 8])
    assert (err.value.peer, err.value.code) == (b.session_id, -3)
    assert runner.polled_writes == 1
    assert a.pending_writes == 0, "the other copy was still waited for"
    assert runner.in_flight == 0
    # After a failure the next write to that peer reaches it through the thread.
    await runner.batch_write(b.session_id, [s], [d], [8])
    assert (runner.thread_writes, runner.polled_writes) == (2, 1)


async def test_polled_write_columns_are_validated() -> None:
    a, b, src, dst = _pair()
    runner = EngineRunner(a)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    await _warm(runner, b.session_id, s, d)
    with pytest.raises(TransferError, match="differ in length"):
        await runner.batch_write(b.session_id, [s, s], [d], [1, 1])
    with pytest.raises(TransferError, match="integers"):
        await runner.batch_write(b.session_id, [s], [d], [1.5])  # type: ignore[list-item]
    await runner.batch_write(b.session_id, [s], [d], [0])  # zero bytes: nothing to do
    assert a.pending_writes == 0


async def test_a_cancelled_polled_write_finishes_before_the_cancel_lands() -> None:
    a, b, src, dst = _pair()
    runner = EngineRunner(a)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    await _warm(runner, b.session_id, s, d)
    dst[:] = 0
    a.latency = 0.2
    with trio.CancelScope() as scope:
        scope.deadline = trio.current_time() + 0.02
        await runner.batch_write(b.session_id, [s], [d], [256])
        await trio.sleep(10)  # the cancellation lands here, after the write
    assert scope.cancelled_caught
    assert runner.polled_writes == 1
    assert bytes(dst) == bytes(src), "the write must have completed, not been abandoned"
    assert a.pending_writes == 0


async def test_a_cancelled_failing_polled_write_reports_its_error() -> None:
    a, b, src, dst = _pair()
    runner = EngineRunner(a)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    await _warm(runner, b.session_id, s, d)
    a.hang_next(b.session_id, 0.1)
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await runner.batch_write(b.session_id, [s], [d], [8])
    assert a.pending_writes == 0, "cancelled before it started: nothing submitted"
    with trio.move_on_after(0.01) as scope, pytest.raises(TransferError, match="stalling"):
        await runner.batch_write(b.session_id, [s], [d], [8])
    assert not scope.cancelled_caught
    assert a.pending_writes == 0


class _SubmitRefusingEngine:
    """Wraps a FakeEngine; refuses the ``refuse_at``-th submission of each batch."""

    def __init__(self, inner: FakeEngine, refuse_at: int) -> None:
        self.inner = inner
        self.session_id = inner.session_id
        self.refuse_at = refuse_at
        self.submitted = 0
        self.peak_pending = 0

    def register_memory(self, addr: int, length: int) -> None:
        self.inner.register_memory(addr, length)

    def unregister_memory(self, addr: int) -> None:
        self.inner.unregister_memory(addr)

    def batch_write(
        self, peer_session: str, src: AddressList, dst: AddressList, lengths: AddressList
    ) -> None:
        self.inner.batch_write(peer_session, src, dst, lengths)

    def submit_write(self, peer_session: str, src: int, dst: int, length: int) -> WriteTicket:
        self.submitted += 1
        if self.submitted == self.refuse_at:
            raise TransferError(peer_session, -9, "refused at submission")
        ticket = self.inner.submit_write(peer_session, src, dst, length)
        self.peak_pending = max(self.peak_pending, self.inner.pending_writes)
        return ticket

    def check_write(self, ticket: WriteTicket) -> bool:
        return self.inner.check_write(ticket)

    def close(self) -> None:
        self.inner.close()


async def test_a_refused_submission_waits_for_the_copies_already_in_flight() -> None:
    a, b, src, dst = _pair(latency=0.05)
    engine = _SubmitRefusingEngine(a, refuse_at=2)
    runner = EngineRunner(engine)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    await _warm(runner, b.session_id, s, d)
    dst[:] = 0
    with pytest.raises(TransferError) as err:
        await runner.batch_write(b.session_id, [s, s + 8, s + 16], [d, d + 8, d + 16], [8] * 3)
    assert err.value.code == -9
    assert bytes(dst[:8]) == bytes(src[:8]), "the first copy was in flight and completed"
    assert not dst[8:].any(), "nothing after the refused copy was submitted"
    assert a.pending_writes == 0


async def test_the_limiter_bounds_polled_writes_too() -> None:
    a, b, src, dst = _pair(latency=0.02)
    engine = _SubmitRefusingEngine(a, refuse_at=-1)
    runner = EngineRunner(engine, limiter=trio.CapacityLimiter(1))
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    await _warm(runner, b.session_id, s, d)
    async with trio.open_nursery() as nursery:
        for i in range(4):
            nursery.start_soon(runner.batch_write, b.session_id, [s + i], [d + i], [1])
    assert runner.polled_writes == 4
    assert engine.peak_pending == 1
    assert bytes(dst[:4]) == bytes(src[:4])


class _CountedChecksEngine(_NoMemoryEngine):
    """A polling engine whose writes are done on the ``done_at``-th check; records
    the Trio time of every check."""

    def __init__(self, done_at: int) -> None:
        self.done_at = done_at
        self.checks: list[float] = []

    def batch_write(
        self, peer_session: str, src: AddressList, dst: AddressList, lengths: AddressList
    ) -> None:
        pass

    def submit_write(self, peer_session: str, src: int, dst: int, length: int) -> WriteTicket:
        return WriteTicket(peer_session, 1, length, time.monotonic())

    def check_write(self, ticket: WriteTicket) -> bool:
        self.checks.append(trio.current_time())
        return len(self.checks) >= self.done_at


async def test_a_long_polled_write_is_checked_once_a_millisecond_after_its_first_sleep(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # 16 MiB: expected ~6.7 ms, so the write first sleeps ~4.7 ms; then it is not
    # spun on (zero-length checks all at one Trio time) but checked a millisecond
    # apart, leaving the CPU to the engine's own threads.
    engine = _CountedChecksEngine(done_at=4)
    runner = EngineRunner(engine)
    await _warm(runner, "127.0.0.1:2", 1, 1)
    started = trio.current_time()
    await runner.batch_write("127.0.0.1:2", [1], [1], [16 << 20])
    assert runner.polled_writes == 1
    assert len(engine.checks) == 4
    assert engine.checks[0] - started >= 0.004
    gaps = [b - a for a, b in zip(engine.checks, engine.checks[1:], strict=False)]
    assert all(gap >= 0.001 for gap in gaps), gaps


class _RecordingEngine(_SubmitRefusingEngine):
    """A FakeEngine that records every submission as ``(src, dst, length)``."""

    def __init__(self, inner: FakeEngine, refuse_at: int = 0) -> None:
        super().__init__(inner, refuse_at)
        self.submissions: list[tuple[int, int, int]] = []

    def submit_write(self, peer_session: str, src: int, dst: int, length: int) -> WriteTicket:
        self.submissions.append((src, dst, length))
        return super().submit_write(peer_session, src, dst, length)


async def test_a_copy_longer_than_split_bytes_is_submitted_in_equal_pieces() -> None:
    # Mooncake's TCP transport carries each submitted copy over its own connection:
    # a long copy goes as several pieces at once (DEFAULT_SPLIT_BYTES).
    a, b, src, dst = _pair()
    engine = _RecordingEngine(a)
    runner = EngineRunner(engine, split_bytes=64)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    await _warm(runner, b.session_id, s, d)
    dst[:] = 0
    await runner.batch_write(b.session_id, [s + 6], [d + 50], [200])
    assert runner.polled_writes == 1
    assert engine.submissions == [
        (s + 6 + offset, d + 50 + offset, 50) for offset in (0, 50, 100, 150)
    ]
    assert bytes(dst[50:250]) == bytes(src[6:206])
    assert not dst[:50].any()
    assert not dst[250:].any()
    assert a.pending_writes == 0
    assert runner.in_flight == 0


async def test_a_copy_of_at_most_split_bytes_goes_whole_and_zero_never_splits() -> None:
    a, b, src, dst = _pair()
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    for split, length, expected in ((64, 64, 1), (64, 65, 2), (0, 256, 1)):
        engine = _RecordingEngine(a)
        runner = EngineRunner(engine, split_bytes=split)
        await _warm(runner, b.session_id, s, d)
        await runner.batch_write(b.session_id, [s], [d], [length])
        assert len(engine.submissions) == expected, (split, length, engine.submissions)
        assert sum(n for _, _, n in engine.submissions) == length
    with pytest.raises(ValueError, match="split_bytes"):
        EngineRunner(a, split_bytes=-1)


async def test_a_write_splits_its_long_copies_only_up_to_a_bound_of_submissions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two 100-byte copies of four pieces each (three more submissions each), with
    # room for five submissions in all: the first goes in pieces, the second whole.
    monkeypatch.setattr(offload, "_SPLIT_SUBMISSIONS", 5)
    a, b, src, dst = _pair()
    engine = _RecordingEngine(a)
    runner = EngineRunner(engine, split_bytes=25)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    await _warm(runner, b.session_id, s, d)
    await runner.batch_write(b.session_id, [s, s + 100], [d + 100, d], [100, 100])
    assert [n for _, _, n in engine.submissions] == [25, 25, 25, 25, 100]
    assert bytes(dst[100:200]) == bytes(src[:100])
    assert bytes(dst[:100]) == bytes(src[100:200])


async def test_a_refused_piece_waits_for_the_pieces_already_in_flight() -> None:
    a, b, src, dst = _pair(latency=0.05)
    engine = _RecordingEngine(a, refuse_at=3)
    runner = EngineRunner(engine, split_bytes=64)
    s, d = int(src.ctypes.data), int(dst.ctypes.data)
    await _warm(runner, b.session_id, s, d)
    dst[:] = 0
    with pytest.raises(TransferError) as err:
        await runner.batch_write(b.session_id, [s], [d], [256])
    assert err.value.code == -9
    assert bytes(dst[:128]) == bytes(src[:128]), "the two pieces before were written"
    assert not dst[128:].any(), "nothing after the refused piece was submitted"
    assert a.pending_writes == 0
    assert runner.in_flight == 0


@given(
    st.integers(min_value=1, max_value=1 << 36),
    st.integers(min_value=2, max_value=4096),
    st.integers(min_value=0, max_value=1 << 36),
)
def test_pieces_cover_the_copy_in_equal_parts_of_at_most_split_bytes(
    split: int, count: int, extra: int
) -> None:
    # A copy longer than ``split``: ``count`` pieces of it.
    length = split * (count - 1) + 1 + extra % split
    pieces = _pieces(length, -(-length // split))
    assert len(pieces) == count == -(-length // split)
    end = 0
    for offset, size in pieces:  # back to back from 0 to the copy's end
        assert offset == end
        end += size
    assert end == length
    sizes = {size for _, size in pieces[:-1]}
    assert len(sizes) <= 1
    assert all(0 < size <= split for size in sizes)
    assert 0 < pieces[-1][1] <= pieces[0][1]
