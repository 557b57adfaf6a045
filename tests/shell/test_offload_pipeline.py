"""Pipelined writes: several batches in flight to a peer, within the engine's bound.

Everything runs on the in-process :class:`FakeEngine`, whose counters record how
many batches (and descriptors per peer) were in flight at once; nothing here
times anything.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
from pd_helpers import wait_until

from tspd.core.commands import DestinationWrite, StartTransfer, TransferInterval
from tspd.core.copies import CopyPlan
from tspd.engines.base import (
    AddressList,
    BatchTicket,
    PipelinedEngine,
    TransferError,
    WriteTicket,
)
from tspd.shell.offload import DEFAULT_PIPELINE_MIN_DESCRIPTORS, EngineRunner
from tspd.shell.transfers import TransferWorkers
from tspd.testing.fake_engine import FakeEngine, FakeFabric

COPY = 16  # bytes a copy
COPIES = 4096


class _Pair:
    """A runner over a fake engine, a peer, and a plan of scattered copies to it."""

    def __init__(
        self,
        *,
        copies: int = COPIES,
        in_flight: int = 1024,
        limiter: trio.CapacityLimiter | None = None,
        **runner: int,
    ) -> None:
        fabric = FakeFabric()
        self.a = FakeEngine(fabric=fabric, max_in_flight_descriptors=in_flight)
        self.b = FakeEngine(fabric=fabric)
        rng = np.random.default_rng(3)
        self.src = rng.integers(1, 256, copies * COPY, dtype=np.uint8)
        self.dst = np.zeros(copies * COPY, dtype=np.uint8)
        self.s, self.d = int(self.src.ctypes.data), int(self.dst.ctypes.data)
        self.a.register_memory(self.s, copies * COPY)
        self.b.register_memory(self.d, copies * COPY)
        self.order = rng.permutation(copies)
        self.plan = CopyPlan(
            self.s + np.arange(copies, dtype=np.int64) * COPY,
            self.d + self.order.astype(np.int64) * COPY,
            np.full(copies, COPY, dtype=np.int64),
        )
        self.runner = EngineRunner(self.a, limiter=limiter, **runner)
        self.peer = self.b.session_id

    async def reach(self) -> None:
        """One small write through the thread: the peer counts as reached."""
        await self.runner.batch_write(self.peer, [self.s], [self.d], [1])
        self.dst[:] = 0

    def landed(self, first: int, last: int) -> bool:
        """Exactly copies ``[first, last)`` of the plan are at their destinations."""
        expected = np.zeros_like(self.dst).reshape(-1, COPY)
        expected[self.order[first:last]] = self.src.reshape(-1, COPY)[first:last]
        return bytes(expected.reshape(-1)) == bytes(self.dst)


def test_the_fake_engine_is_a_pipelined_engine() -> None:
    assert isinstance(FakeEngine(fabric=FakeFabric()), PipelinedEngine)
    with pytest.raises(ValueError, match="max_in_flight_descriptors"):
        FakeEngine(fabric=FakeFabric(), max_in_flight_descriptors=0)


async def test_a_large_write_keeps_two_batches_in_flight_within_the_engine_bound() -> None:
    p = _Pair()
    await p.reach()
    calls: list[tuple[int, int]] = []
    done = await p.runner.write_plan(
        p.peer, p.plan, on_batch=lambda n, nbytes: calls.append((n, nbytes))
    )
    assert done
    assert p.landed(0, COPIES)
    # Batches of half the bound (512), two in flight: never more than the bound.
    assert p.a.stats.batch_submits == COPIES // 512
    assert p.a.stats.peak_batches_in_flight == 2
    assert p.a.stats.peak_descriptors_in_flight == 1024
    assert calls == [(512, 512 * COPY)] * (COPIES // 512)
    assert (p.runner.pipelined_writes, p.runner.thread_writes, p.runner.polled_writes) == (1, 1, 0)
    assert p.runner.peak_batches_in_flight == 2
    assert p.a.batches_in_flight == 0
    assert p.runner.in_flight == 0


@pytest.mark.parametrize(
    ("in_flight", "max_descriptors", "submits", "peak_batches", "peak_descriptors"),
    [
        pytest.param(256, 1024, 32, 2, 256, id="a-small-engine-bound"),
        pytest.param(1024, 300, 14, 3, 900, id="max-descriptors-caps-a-batch"),
        pytest.param(1024, 100, 41, 8, 800, id="at-most-eight-batches"),
    ],
)
async def test_the_engine_bound_and_max_descriptors_size_the_batches(
    in_flight: int, max_descriptors: int, submits: int, peak_batches: int, peak_descriptors: int
) -> None:
    p = _Pair(in_flight=in_flight)
    await p.reach()
    assert await p.runner.write_plan(p.peer, p.plan, max_descriptors=max_descriptors)
    assert p.landed(0, COPIES)
    assert p.a.stats.batch_submits == submits
    assert p.a.stats.peak_batches_in_flight == peak_batches
    assert p.a.stats.peak_descriptors_in_flight == peak_descriptors


async def test_the_first_write_to_a_peer_sends_one_batch_through_a_thread_then_pipelines() -> None:
    p = _Pair()
    calls: list[int] = []
    assert await p.runner.write_plan(p.peer, p.plan, on_batch=lambda n, _: calls.append(n))
    assert p.landed(0, COPIES)
    assert (p.runner.thread_writes, p.runner.pipelined_writes) == (1, 1)
    assert p.a.stats.batch_submits == COPIES // 512 - 1
    assert calls == [512] * (COPIES // 512)


async def test_small_writes_are_polled_as_before_and_pipelining_can_be_switched_off() -> None:
    p = _Pair(copies=DEFAULT_PIPELINE_MIN_DESCRIPTORS - 1)
    await p.reach()
    assert await p.runner.write_plan(p.peer, p.plan)
    assert p.landed(0, len(p.plan))
    assert (p.runner.polled_writes, p.runner.pipelined_writes, p.a.stats.batch_submits) == (1, 0, 0)

    q = _Pair(pipeline_min_descriptors=0)
    await q.reach()
    assert await q.runner.write_plan(q.peer, q.plan, max_descriptors=1024)
    assert q.landed(0, COPIES)
    assert (q.runner.polled_writes, q.runner.pipelined_writes, q.a.stats.batch_submits) == (4, 0, 0)
    with pytest.raises(ValueError, match="pipeline_min_descriptors"):
        EngineRunner(q.a, pipeline_min_descriptors=-1)
    with pytest.raises(ValueError, match="max_descriptors"):
        await q.runner.write_plan(q.peer, q.plan, max_descriptors=0)


async def test_fencing_checks_the_room_before_every_submission() -> None:
    p = _Pair()
    await p.reach()
    checks = 0

    def active() -> bool:
        nonlocal checks
        checks += 1
        return checks <= 3

    assert not await p.runner.write_plan(p.peer, p.plan, active=active)
    assert checks == 4
    assert p.a.stats.batch_submits == 3, "nothing is submitted once the room ended"
    assert p.a.batches_in_flight == 0, "what was submitted was waited for"
    assert p.landed(0, 3 * 512)
    assert p.runner.in_flight == 0


async def test_a_failed_batch_stops_submission_and_raises_once_the_rest_is_done() -> None:
    p = _Pair()
    await p.reach()
    p.a.fail_next(p.peer, code=-3)
    with pytest.raises(TransferError) as err:
        await p.runner.write_plan(p.peer, p.plan)
    assert (err.value.peer, err.value.code) == (p.peer, -3)
    # The failure shows when the first batch is collected; the second was already
    # submitted, is waited for, and lands; nothing more is submitted.
    assert p.a.stats.batch_submits == 2
    assert p.a.batches_in_flight == 0
    assert p.landed(512, 1024)
    assert p.runner.in_flight == 0
    # The peer goes back to the thread for its next write.
    await p.runner.batch_write(p.peer, [p.s], [p.d], [1])
    assert p.runner.thread_writes == 2


class _RefusingEngine:
    """A fake engine whose ``refuse_at``-th batch submission is refused."""

    blocking_setup = False

    def __init__(self, inner: FakeEngine, refuse_at: int) -> None:
        self.inner = inner
        self.session_id = inner.session_id
        self.max_in_flight_descriptors = inner.max_in_flight_descriptors
        self.refuse_at = refuse_at
        self.submits = 0

    def register_memory(self, addr: int, length: int) -> None:
        self.inner.register_memory(addr, length)

    def unregister_memory(self, addr: int) -> None:
        self.inner.unregister_memory(addr)

    def batch_write(
        self, peer_session: str, src: AddressList, dst: AddressList, lengths: AddressList
    ) -> None:
        self.inner.batch_write(peer_session, src, dst, lengths)

    def submit_write(self, peer_session: str, src: int, dst: int, length: int) -> WriteTicket:
        return self.inner.submit_write(peer_session, src, dst, length)

    def check_write(self, ticket: WriteTicket) -> bool:
        return self.inner.check_write(ticket)

    def submit_batch(
        self, peer_session: str, src: AddressList, dst: AddressList, lengths: AddressList
    ) -> BatchTicket:
        self.submits += 1
        if self.submits == self.refuse_at:
            raise TransferError(peer_session, -9, "refused at submission")
        return self.inner.submit_batch(peer_session, src, dst, lengths)

    def wait_batch(self, ticket: BatchTicket) -> None:
        self.inner.wait_batch(ticket)

    def close(self) -> None:
        self.inner.close()


async def test_a_refused_submission_waits_for_the_batches_in_flight() -> None:
    p = _Pair()
    engine = _RefusingEngine(p.a, refuse_at=4)
    runner = EngineRunner(engine)
    await runner.batch_write(p.peer, [p.s], [p.d], [1])
    p.dst[:] = 0
    with pytest.raises(TransferError) as err:
        await runner.write_plan(p.peer, p.plan)
    assert err.value.code == -9
    assert p.a.batches_in_flight == 0
    assert p.landed(0, 3 * 512), "the three batches submitted before it landed"


async def test_a_cancelled_write_submits_nothing_more_and_finishes_what_it_started() -> None:
    p = _Pair()
    await p.reach()
    with trio.CancelScope() as scope:
        # Cancelled as soon as the first batch is done, the second in flight.
        await p.runner.write_plan(p.peer, p.plan, on_batch=lambda *_: scope.cancel())
        raise AssertionError("the cancellation must land when the write returns")
    assert scope.cancelled_caught
    assert p.a.stats.batch_submits == 2
    assert p.a.batches_in_flight == 0
    assert p.landed(0, 1024), "the batch in flight was waited for, not abandoned"
    assert p.runner.in_flight == 0


async def test_a_failure_outranks_a_cancellation() -> None:
    p = _Pair()
    await p.reach()
    p.a.fail_next(p.peer, code=-5)
    checks = 0
    with trio.CancelScope() as scope:

        def active() -> bool:
            nonlocal checks
            checks += 1
            if checks == 2:
                scope.cancel()
            return True

        with pytest.raises(TransferError) as err:
            await p.runner.write_plan(p.peer, p.plan, active=active)
    assert err.value.code == -5
    assert p.a.stats.batch_submits == 2
    assert p.a.batches_in_flight == 0


async def test_a_pipelined_write_holds_the_limiter_only_to_submit() -> None:
    p = _Pair(limiter=trio.CapacityLimiter(1))
    await p.reach()
    during_checks: list[float] = []
    between: list[float] = []

    def active() -> bool:
        during_checks.append(p.runner.limiter.available_tokens)
        return True

    assert await p.runner.write_plan(
        p.peer,
        p.plan,
        active=active,
        on_batch=lambda *_: between.append(p.runner.limiter.available_tokens),
    )
    assert during_checks == [0] * (COPIES // 512), "the room is checked under the limiter"
    assert between == [1] * (COPIES // 512), "free while batches are in flight"


async def test_concurrent_writes_to_one_peer_share_its_bound() -> None:
    p = _Pair(copies=2 * COPIES)
    await p.reach()
    halves = [
        CopyPlan(p.plan.src[i::2].copy(), p.plan.dst[i::2].copy(), p.plan.length[i::2].copy())
        for i in (0, 1)
    ]
    async with trio.open_nursery() as nursery:
        for half in halves:
            nursery.start_soon(p.runner.write_plan, p.peer, half)
    assert p.landed(0, 2 * COPIES)
    # Each write keeps its own batches within what the others leave, but always
    # has one in flight: at most the bound plus one batch.
    assert p.a.stats.peak_descriptors_in_flight <= 1024 + 512
    assert p.runner.pipelined_writes == 2


async def test_start_write_leaves_a_write_that_would_be_pipelined_to_the_worker() -> None:
    p = _Pair()
    await p.reach()
    big = p.runner.start_write(p.peer, p.plan.src, p.plan.dst, p.plan.length)
    assert big is None
    small = p.runner.start_write(p.peer, p.plan.src[:8], p.plan.dst[:8], p.plan.length[:8])
    assert small is not None
    await p.runner.finish_write(small)
    assert p.landed(0, 8)


async def test_one_large_batch_write_is_pipelined_too() -> None:
    p = _Pair()
    await p.reach()
    await p.runner.batch_write(p.peer, p.plan.src, p.plan.dst, p.plan.length)
    assert p.landed(0, COPIES)
    assert p.runner.pipelined_writes == 1
    assert p.a.stats.peak_batches_in_flight == 2
    with pytest.raises(TransferError, match="differ in length"):
        await p.runner.batch_write(p.peer, p.plan.src, p.plan.dst[:-1], p.plan.length)


# -- through the transfer workers -------------------------------------------------------


class _Feedback:
    def __init__(self) -> None:
        self.ok: list[int] = []
        self.failed: list[tuple[int, str | None, str]] = []
        self.checks = 0
        self.active_checks = 10**9

    def chunk_succeeded(self, chunk: StartTransfer) -> None:
        self.ok.append(chunk.room)

    def chunk_failed(self, chunk: StartTransfer, session_id: str | None, reason: str) -> None:
        self.failed.append((chunk.room, session_id, reason))

    def wait_should_stop(self, chunk: StartTransfer) -> str | None:
        return None

    def room_active(self, chunk: StartTransfer) -> bool:
        self.checks += 1
        return self.checks <= self.active_checks


def _chunk(p: _Pair, room: int) -> StartTransfer:
    write = DestinationWrite(p.peer, "127.0.0.1", 1, p.plan)
    return StartTransfer(room, 0, (TransferInterval(None, (write,)),), True, (p.peer,))


async def _run_one(p: _Pair, feedback: _Feedback, room: int) -> TransferWorkers:
    writes: list[tuple[str, int]] = []
    workers = TransferWorkers(
        p.runner, feedback, count=1, on_write=lambda s, n, _: writes.append((s, n))
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(workers.run)
        workers.submit(_chunk(p, room))
        await wait_until(lambda: bool(feedback.ok or feedback.failed))
        nursery.cancel_scope.cancel()
    if feedback.ok:
        assert writes == [(p.peer, COPIES * COPY)], "one write reported, with every byte"
    else:
        assert writes == []
    return workers


async def test_workers_pipeline_a_large_chunk_and_report_it_once() -> None:
    p = _Pair()
    await p.reach()
    feedback = _Feedback()
    workers = await _run_one(p, feedback, 7)
    assert feedback.ok == [7]
    assert p.landed(0, COPIES)
    assert p.a.stats.peak_batches_in_flight == 2
    stats = workers.stats
    assert (stats.engine_calls, stats.descriptors, stats.bytes_written) == (
        COPIES // 512,
        COPIES,
        COPIES * COPY,
    )


async def test_workers_stop_a_large_chunk_whose_room_ended_mid_write() -> None:
    p = _Pair()
    await p.reach()
    feedback = _Feedback()
    feedback.active_checks = 2  # two submissions, then the room has ended
    await _run_one(p, feedback, 8)
    assert feedback.failed == [(8, None, "room 8 ended before its transfer finished")]
    assert p.a.stats.batch_submits == 2
    assert p.a.batches_in_flight == 0
    assert p.landed(0, 1024)


async def test_workers_fail_a_large_chunk_with_its_batch_error() -> None:
    p = _Pair()
    await p.reach()
    p.a.fail_next(p.peer, code=-4)
    feedback = _Feedback()
    workers = await _run_one(p, feedback, 9)
    [(room, session, reason)] = feedback.failed
    assert (room, session) == (9, p.peer)
    assert "code -4" in reason
    assert workers.stats.failed_chunks == 1
    assert p.a.batches_in_flight == 0
