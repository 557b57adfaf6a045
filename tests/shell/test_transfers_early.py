"""Transfer workers start a small full transfer at submission when the engine polls."""

from __future__ import annotations

import numpy as np
import trio
from pd_helpers import wait_until

from tspd.core.commands import DestinationWrite, StartTransfer, TransferInterval
from tspd.core.copies import CopyPlan
from tspd.shell.offload import EngineRunner
from tspd.shell.transfers import TransferWorkers
from tspd.testing.fake_engine import FakeEngine, FakeFabric


class _Feedback:
    def __init__(self) -> None:
        self.ok: list[int] = []
        self.failed: list[tuple[int, str | None, str]] = []
        self.active = True

    def chunk_succeeded(self, chunk: StartTransfer) -> None:
        self.ok.append(chunk.room)

    def chunk_failed(self, chunk: StartTransfer, session_id: str | None, reason: str) -> None:
        self.failed.append((chunk.room, session_id, reason))

    def wait_should_stop(self, chunk: StartTransfer) -> str | None:
        return None

    def room_active(self, chunk: StartTransfer) -> bool:
        return self.active


class _Setup:
    """A runner over a fake engine, a reached peer, and chunks of one 8-byte copy."""

    def __init__(self, latency: float = 0.0) -> None:
        fabric = FakeFabric()
        self.src = np.arange(64, dtype=np.uint8)
        self.dst = np.zeros(64, dtype=np.uint8)
        self.a = FakeEngine(fabric=fabric)
        self.b = FakeEngine(fabric=fabric)
        self.a.register_memory(int(self.src.ctypes.data), 64)
        self.b.register_memory(int(self.dst.ctypes.data), 64)
        self.runner = EngineRunner(self.a)
        self.feedback = _Feedback()
        self.writes: list[tuple[str, int]] = []
        self.workers = TransferWorkers(
            self.runner,
            self.feedback,
            count=1,
            on_write=lambda session, nbytes, _: self.writes.append((session, nbytes)),
        )
        self.latency = latency

    async def reach(self) -> None:
        await self.runner.batch_write(
            self.b.session_id, [int(self.src.ctypes.data)], [int(self.dst.ctypes.data)], [1]
        )
        self.dst[:] = 0
        self.a.latency = self.latency

    def chunk(self, room: int) -> StartTransfer:
        part = room % 8
        plan = CopyPlan.from_copies(
            [(int(self.src.ctypes.data) + 8 * part, int(self.dst.ctypes.data) + 8 * part, 8)]
        )
        write = DestinationWrite(self.b.session_id, "127.0.0.1", 1, plan)
        return StartTransfer(
            room, 0, (TransferInterval(None, (write,)),), True, (write.session_id,)
        )

    def copied(self, room: int) -> bool:
        part = room % 8
        return bytes(self.dst[8 * part : 8 * part + 8]) == bytes(self.src[8 * part : 8 * part + 8])


async def test_a_full_transfer_to_a_reached_peer_starts_at_submission() -> None:
    setup = _Setup()
    await setup.reach()
    async with trio.open_nursery() as nursery:
        await nursery.start(setup.workers.run)
        setup.workers.submit(setup.chunk(1))
        # Started synchronously, before this task yielded to the worker.
        assert setup.a.pending_writes == 1
        assert setup.runner.in_flight == 1
        await wait_until(lambda: bool(setup.feedback.ok))
        nursery.cancel_scope.cancel()
    assert setup.feedback.ok == [1]
    assert setup.copied(1)
    assert setup.writes == [(setup.b.session_id, 8)]
    assert setup.workers.stats.engine_calls == 1
    assert setup.workers.in_flight() == 0
    assert setup.runner.in_flight == 0


async def test_nothing_starts_early_for_an_unreached_peer_or_an_ended_room() -> None:
    setup = _Setup()
    async with trio.open_nursery() as nursery:
        await nursery.start(setup.workers.run)
        setup.workers.submit(setup.chunk(1))  # peer not reached yet: the worker writes
        assert setup.a.pending_writes == 0
        await wait_until(lambda: setup.feedback.ok == [1])
        setup.feedback.active = False
        setup.workers.submit(setup.chunk(2))  # the room ended: not started
        assert setup.a.pending_writes == 0
        await wait_until(lambda: bool(setup.feedback.failed))
        nursery.cancel_scope.cancel()
    assert setup.feedback.failed[0][0] == 2
    assert not setup.copied(2)


async def test_chunks_queued_behind_a_started_one_keep_their_order() -> None:
    setup = _Setup(latency=0.01)
    await setup.reach()
    async with trio.open_nursery() as nursery:
        await nursery.start(setup.workers.run)
        for room in (1, 2, 3):
            setup.workers.submit(setup.chunk(room))
        assert setup.a.pending_writes == 1, "only the first chunk starts at submission"
        await wait_until(lambda: len(setup.feedback.ok) >= 3)
        nursery.cancel_scope.cancel()
    assert setup.feedback.ok == [1, 2, 3]
    assert all(setup.copied(room) for room in (1, 2, 3))


async def test_a_started_write_that_fails_fails_its_chunk() -> None:
    setup = _Setup()
    await setup.reach()
    setup.a.fail_next(setup.b.session_id, code=-4)
    async with trio.open_nursery() as nursery:
        await nursery.start(setup.workers.run)
        setup.workers.submit(setup.chunk(5))
        await wait_until(lambda: bool(setup.feedback.failed))
        nursery.cancel_scope.cancel()
    room, session, reason = setup.feedback.failed[0]
    assert (room, session) == (5, setup.b.session_id)
    assert "code -4" in reason
    assert setup.feedback.ok == []
    assert setup.workers.stats.failed_chunks == 1


async def test_stopping_the_workers_waits_for_a_write_started_at_submission() -> None:
    setup = _Setup(latency=0.05)
    await setup.reach()
    async with trio.open_nursery() as nursery:
        await nursery.start(setup.workers.run)
        setup.workers.submit(setup.chunk(3))
        assert setup.a.pending_writes == 1
        nursery.cancel_scope.cancel()  # before the worker took the chunk
    assert setup.a.pending_writes == 0, "the started write was not abandoned"
    assert setup.copied(3)
    assert setup.runner.in_flight == 0
