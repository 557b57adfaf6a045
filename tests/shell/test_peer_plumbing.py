"""The peers' plumbing: deadline timer, push pool, loop portal, step waits, transfer workers."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing
import zmq
from pd_helpers import wait_until

from tspd.core.commands import DestinationWrite, StartTransfer, TransferInterval
from tspd.core.copies import CopyPlan
from tspd.shell.nursery import single_error
from tspd.shell.pushes import PushPool, endpoint_url
from tspd.shell.steps import StepCounter
from tspd.shell.threadsafe import LoopPortal, PeerClosed
from tspd.shell.timer import DeadlineTimer
from tspd.shell.transfers import TransferWorkers
from tspd.shell.zmq import bind_free_port, open_socket
from tspd.testing.fake_engine import AsyncFakeEngine, FakeEngine, FakeFabric


async def test_timer_fires_at_each_deadline_and_follows_earlier_ones(
    autojump_clock: trio.testing.MockClock,
) -> None:
    start = trio.current_time()
    fired: list[float] = []
    deadlines = [start + 5.0, start + 2.0]

    def next_deadline() -> float | None:
        return min(deadlines) if deadlines else None

    def on_timeout(now: float) -> None:
        fired.append(now - start)
        deadlines.remove(min(deadlines))

    timer = DeadlineTimer(next_deadline, on_timeout)
    async with trio.open_nursery() as nursery:
        await nursery.start(timer.run)
        await trio.sleep(3)
        deadlines.append(start + 1.0)  # already due: a poke makes the timer notice
        timer.poke()
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    assert fired == pytest.approx([2.0, 3.01, 5.0])


class _TaskSteps(trio.abc.Instrument):
    """Counts the steps one task runs."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.count = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.count += 1


async def test_timer_sleeps_through_pokes_that_leave_its_deadline_or_move_it_later() -> None:
    """A poke whose deadline is not earlier than the one the task sleeps until does
    not wake it (one room after another: each new deadline is later); one that is
    earlier does, and the task fires then."""
    start = trio.current_time()
    deadlines = [start + 100.0]
    fired: list[float] = []
    done = trio.Event()

    def next_deadline() -> float | None:
        return min(deadlines) if deadlines else None

    def on_timeout(now: float) -> None:
        fired.append(now - start)
        deadlines.remove(min(deadlines))
        done.set()

    timer = DeadlineTimer(next_deadline, on_timeout, coalesce=0.001)
    async with trio.open_nursery() as nursery:
        await nursery.start(timer.run)
        await trio.sleep(0.01)  # the task sleeps until start + 100
        (task,) = nursery.child_tasks
        steps = _TaskSteps(task)
        trio.lowlevel.add_instrument(steps)
        try:
            for i in range(50):
                deadlines.append(start + 101.0 + i)  # later: nothing to do
                timer.poke()
                await trio.lowlevel.checkpoint()
            deadlines.remove(start + 100.0)  # moved later: still nothing
            timer.poke()
            await trio.sleep(0.01)
            assert steps.count == 0
            assert timer.wakeups == 0
            deadlines.append(trio.current_time() + 0.05)  # earlier: wake and fire
            timer.poke()
            timer.poke()  # a burst wakes it once
            with trio.fail_after(5):
                await done.wait()
        finally:
            trio.lowlevel.remove_instrument(steps)
        nursery.cancel_scope.cancel()
    assert timer.wakeups == 1
    assert steps.count >= 1
    assert len(fired) == 1


async def test_timer_follows_a_deadline_that_moved_later_without_a_poke(
    autojump_clock: trio.testing.MockClock,
) -> None:
    start = trio.current_time()
    deadlines = [start + 2.0]
    fired: list[float] = []

    def on_timeout(now: float) -> None:
        fired.append(now - start)
        deadlines.remove(min(deadlines))

    timer = DeadlineTimer(lambda: min(deadlines) if deadlines else None, on_timeout)
    async with trio.open_nursery() as nursery:
        await nursery.start(timer.run)
        await trio.sleep(1)
        deadlines[0] = start + 5.0  # the task wakes at 2, re-reads, sleeps until 5
        await trio.sleep(10)
        nursery.cancel_scope.cancel()
    assert fired == pytest.approx([5.0])


async def test_push_pool_sends_in_order_and_closes_its_sockets() -> None:
    ctx = zmq.Context.instance()
    pull = open_socket(ctx, zmq.PULL)
    port = bind_free_port(pull)
    pool = PushPool(ctx, name="test")
    pool.send_nowait("127.0.0.1", port, [b"too early"])
    assert pool.stats.dropped == 1
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        for i in range(50):
            pool.send_nowait("127.0.0.1:9999", port, [str(i).encode()], room=i)
        got: list[bytes] = []
        with trio.fail_after(10):
            while len(got) < 50:
                got.extend(m[0] for m in await pull.recv_batch())
        nursery.cancel_scope.cancel()
    assert got == [str(i).encode() for i in range(50)]
    assert pool.stats.sent == 50
    assert pool.stats.opened == 1  # one endpoint: "127.0.0.1:9999" is host 127.0.0.1
    assert pool.stats.sockets == 0  # all closed when the pool stopped
    pull.close()
    assert endpoint_url("10.0.0.1:1234", 5) == "tcp://10.0.0.1:5"


async def test_portal_runs_calls_from_threads_in_order_without_waiting() -> None:
    portal = LoopPortal(trio.lowlevel.current_trio_token(), name="test peer")
    seen: list[int] = []
    futures = []

    def poster() -> None:
        for i in range(20):
            futures.append(portal.post(lambda i=i: seen.append(i)))
        futures.append(portal.post(lambda: 1 // 0))

    await trio.to_thread.run_sync(poster)
    await wait_until(lambda: futures[-1].done())
    assert seen == list(range(20))
    with pytest.raises(ZeroDivisionError):
        futures[-1].result()
    portal.close()
    with pytest.raises(PeerClosed):
        portal.post(lambda: None).result()


def test_step_counter_counts_completed_steps_modulo_2_62() -> None:
    counter = StepCounter()
    assert counter.read() == 0
    assert counter.address == counter.address
    counter.advance(3)
    assert counter.read() == 3
    counter.advance(2**62 - 3)
    assert counter.read() == 0


class _Feedback:
    def __init__(self) -> None:
        self.ok: list[int] = []
        self.failed: list[tuple[int, str | None, str]] = []
        self.stop: str | None = None

    def chunk_succeeded(self, chunk: StartTransfer) -> None:
        self.ok.append(chunk.room)

    def chunk_failed(self, chunk: StartTransfer, session_id: str | None, reason: str) -> None:
        self.failed.append((chunk.room, session_id, reason))

    def wait_should_stop(self, chunk: StartTransfer) -> str | None:
        return self.stop

    def room_active(self, chunk: StartTransfer) -> bool:
        return True


class _Pair:
    """Two fake engines, a source and a destination buffer, and a helper for chunks."""

    def __init__(self) -> None:
        fabric = FakeFabric()
        self.src = np.arange(64, dtype=np.uint8)
        self.dst = np.zeros(64, dtype=np.uint8)
        self.a = AsyncFakeEngine(fabric=fabric)
        self.b = FakeEngine("127.0.0.1", fabric=fabric)
        self.a.register_memory(self.src.ctypes.data, 64)
        self.b.register_memory(self.dst.ctypes.data, 64)

    def chunk(
        self, room: int, shard: int, *, step: int | None = None, final: bool = True
    ) -> StartTransfer:
        part = room % 8
        plan = CopyPlan.from_copies(
            [(self.src.ctypes.data + 8 * part, self.dst.ctypes.data + 8 * part, 8)]
        )
        write = DestinationWrite(self.b.session_id, "127.0.0.1", 1, plan)
        return StartTransfer(
            room, shard, (TransferInterval(step, (write,)),), final, (self.b.session_id,)
        )

    def close(self) -> None:
        self.a.close()
        self.b.close()


async def test_workers_write_report_and_survive_failures() -> None:
    pair = _Pair()
    counter = StepCounter()
    feedback = _Feedback()
    workers = TransferWorkers(pair.a, feedback, count=2, read_step=counter.read)
    async with trio.open_nursery() as nursery:
        await nursery.start(workers.run)
        pair.a.fail_next(pair.b.session_id)
        workers.submit(pair.chunk(1, 0))
        await wait_until(lambda: workers.in_flight() == 0)
        workers.submit(pair.chunk(2, 0))
        workers.submit(pair.chunk(3, 1, step=0))
        await wait_until(lambda: workers.in_flight() == 1)
        counter.advance()
        await wait_until(lambda: workers.in_flight() == 0)
        nursery.cancel_scope.cancel()
    assert [f[:2] for f in feedback.failed] == [(1, pair.b.session_id)]
    assert feedback.ok == [2, 3]
    assert np.array_equal(pair.src[16:32], pair.dst[16:32])
    pair.close()


async def test_queued_full_chunks_share_engine_calls_and_report_in_order() -> None:
    pair = _Pair()
    counter = StepCounter()
    feedback = _Feedback()
    workers = TransferWorkers(pair.a, feedback, count=1, read_step=counter.read, max_descriptors=3)
    for room in range(1, 6):
        workers.submit(pair.chunk(room, 0))
    workers.submit(pair.chunk(6, 0, step=0))  # layerwise: waits, and keeps its place
    workers.submit(pair.chunk(7, 0))
    async with trio.open_nursery() as nursery:
        await nursery.start(workers.run)
        await wait_until(lambda: workers.in_flight() == 2)
        assert feedback.ok == [1, 2, 3, 4, 5]
        assert workers.stats.engine_calls == 2  # five one-copy rooms in calls of 3
        counter.advance()
        await wait_until(lambda: workers.in_flight() == 0)
        nursery.cancel_scope.cancel()
    assert feedback.ok == [1, 2, 3, 4, 5, 6, 7]
    assert np.array_equal(pair.src[8:64], pair.dst[8:64])
    pair.close()


async def test_a_failed_shared_call_fails_each_room_in_it() -> None:
    pair = _Pair()
    feedback = _Feedback()
    workers = TransferWorkers(pair.a, feedback, count=1)
    pair.a.fail_next(pair.b.session_id)
    for room in (1, 2, 3):
        workers.submit(pair.chunk(room, 0))
    async with trio.open_nursery() as nursery:
        await nursery.start(workers.run)
        await wait_until(lambda: workers.in_flight() == 0)
        workers.submit(pair.chunk(4, 0))
        await wait_until(lambda: workers.in_flight() == 0)
        nursery.cancel_scope.cancel()
    assert [(room, sid) for room, sid, _ in feedback.failed] == [
        (room, pair.b.session_id) for room in (1, 2, 3)
    ]
    assert feedback.ok == [4]
    pair.close()


async def test_single_error_unwraps_one_exception_groups() -> None:
    with pytest.raises(KeyError):
        await _nursery_raising_key()


async def _nursery_raising_key() -> None:
    with single_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_raise_key)


async def _raise_key() -> None:
    raise KeyError("x")


async def test_a_step_wait_stops_with_the_reason_the_peer_gives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fabric = FakeFabric()
    engine = AsyncFakeEngine(fabric=fabric)
    feedback = _Feedback()
    workers = TransferWorkers(engine, feedback, count=1, read_step=StepCounter().read)
    chunk = StartTransfer(9, 0, (TransferInterval(5, ()),), True, ("127.0.0.1:1",))
    async with trio.open_nursery() as nursery:
        await nursery.start(workers.run)
        workers.submit(chunk)
        await trio.sleep(3)
        assert workers.in_flight() == 1  # still waiting for step 5
        feedback.stop = "Cache-transfer layerwise peer failed for room 9"
        await trio.sleep(0.2)
        nursery.cancel_scope.cancel()
    assert feedback.failed == [(9, None, "Cache-transfer layerwise peer failed for room 9")]
    assert feedback.ok == []
