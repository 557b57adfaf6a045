"""PushPool stays bounded: at most max_sockets open, idle ones closed, released routes
closed after a brief linger, stale ones backing off, refused endpoints contained."""

from __future__ import annotations

import errno
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
import trio
import zmq
from pd_helpers import ClosedPorts, open_fds, wait_until

from tspd.shell import pushes
from tspd.shell.ports import free_port
from tspd.shell.pushes import RECONNECT_IVL_MAX_MS, PushPool, endpoint_url
from tspd.shell.zmq import TrioSocket, bind_free_port, open_socket


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(pushes, "_now", lambda: now[0])
    monkeypatch.setattr(pushes, "_yield_cpu", lambda: None)
    return now


@asynccontextmanager
async def _running(pool: PushPool) -> AsyncIterator[PushPool]:
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.run)
        yield pool
        nursery.cancel_scope.cancel()


def _pulls(ctx: zmq.Context[zmq.Socket[bytes]], count: int) -> list[tuple[TrioSocket, int]]:
    out = []
    for _ in range(count):
        pull = open_socket(ctx, zmq.PULL)
        out.append((pull, bind_free_port(pull)))
    return out


async def _received(pull: TrioSocket) -> list[bytes]:
    with trio.fail_after(5):
        return [frame for message in await pull.recv_batch() for frame in message]


async def test_3000_endpoints_keep_the_pool_within_its_bound_and_fds_flat(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    bound = 64
    closed = ClosedPorts()
    warm = open_socket(ctx, zmq.PUSH)  # start the context's I/O threads
    warm.close()
    await trio.sleep(0.05)
    baseline = open_fds()
    pool = PushPool(ctx, name="test", max_sockets=bound)
    held: deque[list[int]] = deque()
    try:
        async with _running(pool):
            for _ in range(30):
                ports = closed.take(100)
                held.append(ports)
                for port in ports:
                    assert pool.send_nowait("127.0.0.1", port, [b"x"]) is None
                    assert pool.stats.sockets <= bound
                if len(held) > 2:
                    # 200 newer endpoints since: these ports' sockets are long closed.
                    closed.release(held.popleft())
                # Each open socket has its mailbox and at most one TCP descriptor.
                await wait_until(
                    lambda: open_fds() - len(closed) <= baseline + 2 * bound + 4, limit=5
                )
            stale = pool._sockets[endpoint_url("127.0.0.1", held[-1][-1])].sock.sock
            assert stale.getsockopt(zmq.RECONNECT_IVL_MAX) == RECONNECT_IVL_MAX_MS
            assert pool.stats.opened == 3000
            assert pool.stats.closed == 3000 - bound
            assert pool.stats.sent + pool.stats.dropped == 3000
    finally:
        closed.close()
    assert pool.stats.sockets == 0
    await wait_until(lambda: open_fds() <= baseline + 4, limit=5)


async def test_idle_sockets_are_closed_after_the_ttl_and_reopen_on_demand(
    ctx: zmq.Context[zmq.Socket[bytes]], clock: list[float]
) -> None:
    (a, port_a), (b, port_b) = _pulls(ctx, 2)
    pool = PushPool(ctx, name="test", idle_ttl=10.0)
    async with _running(pool), a, b:
        pool.send_nowait("127.0.0.1", port_a, [b"a1"])
        pool.send_nowait("127.0.0.1", port_b, [b"b1"])
        clock[0] += 6
        pool.send_nowait("127.0.0.1", port_b, [b"b2"])
        # Delivered long before a real TTL could pass (the clock here is fake).
        assert await _received(a) == [b"a1"]
        got_b = await _received(b)
        while len(got_b) < 2:
            got_b += await _received(b)
        clock[0] += 5
        pool.sweep()
        assert not pool.holds("127.0.0.1", port_a)
        assert pool.holds("127.0.0.1", port_b)
        assert (pool.stats.sockets, pool.stats.closed) == (1, 1)
        pool.send_nowait("127.0.0.1", port_a, [b"a2"])
        assert pool.stats.opened == 3
        assert await _received(a) == [b"a2"]


async def test_a_released_route_lingers_briefly_so_its_last_message_still_arrives(
    ctx: zmq.Context[zmq.Socket[bytes]], clock: list[float]
) -> None:
    ((pull, port),) = _pulls(ctx, 1)
    pool = PushPool(ctx, name="test", max_sockets=4)
    async with _running(pool), pull:
        pool.release("127.0.0.1", port)  # nothing open: no-op
        # Sent and released at once, before the connection even exists.
        pool.send_nowait("127.0.0.1", port, [b"failure notice"])
        pool.release("127.0.0.1", port)
        assert not pool.holds("127.0.0.1", port)
        assert pool.stats.sockets == 1  # lingering: still counted against the bound
        assert await _received(pull) == [b"failure notice"]
        clock[0] += pushes.FLUSH_WINDOW_S
        pool.sweep()
        assert pool.stats.sockets == 0
        # Released long after its last send: closed at once, then reopened.
        pool.send_nowait("127.0.0.1", port, [b"again"])
        assert await _received(pull) == [b"again"]
        clock[0] += 1.0
        pool.release("127.0.0.1", port)
        assert (pool.stats.sockets, pool.stats.opened, pool.stats.closed) == (0, 2, 2)


async def test_a_message_sent_just_before_the_pool_stops_still_arrives(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A peer that stops right after its last message -- a Prefill whose last room
    just succeeded -- still delivers it. Here the receiver binds only 50 ms into
    the stop, so libzmq connects on its 100 ms retry, well after the close: the
    socket lingers for the rest of the flush window and the stop waits for it."""
    port = free_port("127.0.0.1")
    pool = PushPool(ctx, name="test", max_sockets=4)
    pull = open_socket(ctx, zmq.PULL)

    async def bind_later() -> None:
        await trio.sleep(0.05)
        pull.sock.bind(endpoint_url("127.0.0.1", port))

    async with pull:
        async with trio.open_nursery() as nursery, _running(pool):
            pool.send_nowait("127.0.0.1", port, [b"room 1: success"])
            nursery.start_soon(bind_later)
        assert await _received(pull) == [b"room 1: success"]
    assert pool.stats.sockets == 0


async def test_a_pool_whose_last_send_is_old_stops_without_waiting(
    ctx: zmq.Context[zmq.Socket[bytes]], clock: list[float], autojump_clock: trio.abc.Clock
) -> None:
    (pull, port), (other, other_port) = _pulls(ctx, 2)
    pool = PushPool(ctx, name="test", max_sockets=4)
    async with pull, other:
        async with _running(pool):
            pool.send_nowait("127.0.0.1", port, [b"old"])
            clock[0] += 1.0
            started = trio.current_time()
        assert trio.current_time() == started, "nothing sent within the window: no wait"
        async with _running(pool):
            pool.send_nowait("127.0.0.1", port, [b"old"])
            clock[0] += 0.1
            pool.send_nowait("127.0.0.1", other_port, [b"recent"])
            clock[0] += pushes.FLUSH_WINDOW_S - 0.05
            started = trio.current_time()
        # Only the second socket's window was left: 50 ms of it.
        assert trio.current_time() - started == pytest.approx(0.05)


async def test_more_endpoints_than_the_bound_within_the_flush_window_are_counted_and_logged(
    ctx: zmq.Context[zmq.Socket[bytes]], clock: list[float], caplog: pytest.LogCaptureFixture
) -> None:
    pulls = _pulls(ctx, 3)
    pool = PushPool(ctx, name="test", max_sockets=2)
    async with _running(pool):
        for _, port in pulls:
            pool.send_nowait("127.0.0.1", port, [b"x"])
        assert pool.stats.evicted_busy == 1
        clock[0] += 1.0
        pool.send_nowait("127.0.0.1", pulls[0][1], [b"y"])  # evicts an idle one: fine
        assert pool.stats.evicted_busy == 1
        assert pool.stats.sockets == 2
    for pull, _ in pulls:
        pull.close()
    assert len([r for r in caplog.records if "Raise the push pool's max_sockets" in r.message]) == 1


@pytest.mark.parametrize("endpoint", ["*", "foo bar", "-a"])
async def test_an_endpoint_libzmq_refuses_is_contained(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str
) -> None:
    ((pull, port),) = _pulls(ctx, 1)
    pool = PushPool(ctx, name="test")
    async with _running(pool), pull:
        error = pool.send_nowait(endpoint, 5555, [b"x"], room=7)
        assert error is not None
        assert error.startswith(f"cannot send to tcp://{endpoint}:5555: ")
        assert (pool.stats.failed, pool.stats.sockets, pool.stats.opened) == (1, 0, 0)
        assert pool.send_nowait("127.0.0.1", port, [b"fine"]) is None
        assert await _received(pull) == [b"fine"]


async def test_a_socket_that_cannot_be_opened_is_contained(
    ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def exhausted(*args: object, **kwargs: object) -> TrioSocket:
        raise zmq.ZMQError(errno.EMFILE)

    pool = PushPool(ctx, name="test")
    async with _running(pool):
        monkeypatch.setattr(pushes, "open_socket", exhausted)
        error = pool.send_nowait("127.0.0.1", 5555, [b"x"])
        assert error == "cannot send to tcp://127.0.0.1:5555: Too many open files"
        assert pool.stats.failed == 1


def test_pool_settings_are_checked(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    with pytest.raises(ValueError, match="at least 1 socket"):
        PushPool(ctx, name="test", max_sockets=0)
    with pytest.raises(ValueError, match="idle TTL must be positive"):
        PushPool(ctx, name="test", idle_ttl=0)
