"""Write fencing on the Prefill side: no engine call starts for a room that ended
(checked before every call, not only the first), and a room's Failed notice waits
until none of its writes is in flight."""

from __future__ import annotations

import numpy as np
import trio
from pd_helpers import wait_until

from tspd.core.commands import DestinationWrite, StartTransfer, TransferInterval
from tspd.core.copies import CopyPlan
from tspd.core.machines import RoomState
from tspd.core.poll import TransferPoll
from tspd.shell.offload import EngineRunner
from tspd.shell.transfers import TransferWorkers
from tspd.testing.core_pair import CorePair
from tspd.testing.fake_engine import FakeEngine, FakeFabric
from tspd.testing.layouts import simple_contract


class _Feedback:
    """The room ends after ``end_after`` checks (one before each engine call)."""

    def __init__(self, end_after: int) -> None:
        self.checks = 0
        self.end_after = end_after
        self.ok: list[int] = []
        self.failed: list[tuple[int, str | None, str]] = []

    def chunk_succeeded(self, chunk: StartTransfer) -> None:
        self.ok.append(chunk.room)

    def chunk_failed(self, chunk: StartTransfer, session_id: str | None, reason: str) -> None:
        self.failed.append((chunk.room, session_id, reason))

    def wait_should_stop(self, chunk: StartTransfer) -> str | None:
        return None

    def room_active(self, chunk: StartTransfer) -> bool:
        self.checks += 1
        return self.checks <= self.end_after


async def test_no_engine_call_starts_after_the_room_ended() -> None:
    fabric = FakeFabric()
    src = np.arange(1, 65, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    a, b = FakeEngine(fabric=fabric), FakeEngine(fabric=fabric)
    a.register_memory(int(src.ctypes.data), 64)
    b.register_memory(int(dst.ctypes.data), 64)
    feedback = _Feedback(end_after=2)
    # 8 scattered copies in calls of at most 2 descriptors: 4 engine calls.
    plan = CopyPlan.from_copies(
        [(int(src.ctypes.data) + 8 * i, int(dst.ctypes.data) + 8 * i, 4) for i in range(8)]
    )
    write = DestinationWrite(b.session_id, "127.0.0.1", 1, plan)
    chunk = StartTransfer(7, 0, (TransferInterval(None, (write,)),), True, (b.session_id,))
    workers = TransferWorkers(EngineRunner(a), feedback, count=1, max_descriptors=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(workers.run)
        workers.submit(chunk)
        await wait_until(lambda: bool(feedback.failed or feedback.ok))
        nursery.cancel_scope.cancel()
    assert feedback.ok == []
    assert feedback.failed[0][0] == 7
    assert "ended before its transfer finished" in feedback.failed[0][2]
    assert feedback.checks == 3
    # The first two calls (copies 0-3) landed, the rest never started.
    assert all(dst[8 * i] != 0 for i in range(4))
    assert all(dst[8 * i] == 0 for i in range(4, 8))


def test_failed_notice_waits_for_the_rooms_writes() -> None:
    contract = simple_contract(num_pages=16, page_bytes=64)
    pair = CorePair([contract], [contract])
    try:
        pair.auto_transfer = False
        pair.register_decode("a", 1)
        pair.register_prefill("a", 1)
        pair.poll_decode()
        pair.preallocate(1, 40)
        pair.poll_prefill()
        pair.hand_over(1, 40)
        core = pair.prefill[0]
        assert core.statistics()["writing_rooms"] == 1
        core.abort(1, "engine gave up", pair.now)
        pair.pump()
        # The write is still queued (in flight as far as the core knows): the
        # Decode has not heard Failed yet, so it keeps the pages.
        assert pair.decode[0].room_state(1) is not RoomState.FAILED
        assert core.statistics()["deferred_notices"] == 1
        pair.run_transfers()
        pair.pump()
        assert pair.decode[0].room_state(1) is RoomState.FAILED
        assert core.statistics()["writing_rooms"] == 0
        assert core.statistics()["deferred_notices"] == 0
        assert pair.status(1)[1][0] is TransferPoll.FAILED
    finally:
        pair.close()
