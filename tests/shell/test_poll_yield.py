"""A group of one's poll: events come back without yielding to other tasks; a poll
with nothing yields; a cancelled poll takes nothing (docs/architecture.md#tasks)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trio

from tspd.core.commands import Failed
from tspd.testing.local_pd import LocalPD


@pytest.fixture
def pd() -> Iterator[LocalPD]:
    rig = LocalPD()
    yield rig
    rig.close()


class _Steps(trio.abc.Instrument):
    """Counts the steps the task that made it runs: a yield ends a step."""

    def __init__(self) -> None:
        self.task = trio.lowlevel.current_task()
        self.count = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.count += 1


async def test_a_poll_with_events_returns_them_without_yielding(pd: LocalPD) -> None:
    async with pd.bootstrap_server() as server, pd.prefill_peer(server.address) as peer:
        peer.register_request("r1", 11)
        peer.abort(11, "the test ends the request")
        steps = _Steps()
        trio.lowlevel.add_instrument(steps)
        try:
            events = await peer.poll()
            assert [(type(e), e.room) for e in events] == [(Failed, 11)]
            assert steps.count == 0  # the same step: no other task ran meanwhile
            assert await peer.poll() == []
            assert steps.count == 1  # a poll that found nothing yielded
        finally:
            trio.lowlevel.remove_instrument(steps)


async def test_a_cancelled_poll_takes_nothing(pd: LocalPD) -> None:
    async with pd.bootstrap_server() as server, pd.prefill_peer(server.address) as peer:
        peer.register_request("r1", 12)
        peer.abort(12, "the test ends the request")
        with trio.CancelScope() as scope:
            scope.cancel()
            await peer.poll()
        assert scope.cancelled_caught
        events = await peer.poll()
        assert [(type(e), e.room) for e in events] == [(Failed, 12)]


async def test_a_loop_that_polls_without_waiting_lets_the_peer_run(pd: LocalPD) -> None:
    """A scheduler that polls in a tight loop still lets the peer's tasks work: its
    request times out and the loop sees the Failed event."""
    async with (
        pd.bootstrap_server() as server,
        pd.prefill_peer(server.address, bootstrap_timeout=0.05) as peer,
    ):
        peer.register_request("r1", 13)
        with trio.fail_after(10):
            while not (events := await peer.poll()):
                pass
        assert [(type(e), e.room) for e in events] == [(Failed, 13)]
