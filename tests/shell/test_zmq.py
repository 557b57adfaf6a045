"""The Trio ZMQ adapter on real sockets over tcp://127.0.0.1."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import trio
import zmq

from tspd.shell.zmq import MIN_FRAME_LIMIT, TrioSocket, bind_free_port, open_socket


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.term()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _pair(
    ctx: zmq.Context[zmq.Socket[bytes]], server_type: int, client_type: int
) -> tuple[TrioSocket, TrioSocket]:
    server = open_socket(ctx, server_type)
    port = bind_free_port(server)
    client = open_socket(ctx, client_type)
    client.sock.connect(f"tcp://127.0.0.1:{port}")
    return server, client


def _sync_echo(router: zmq.Socket[bytes], n: int) -> None:
    """A plain (threaded, blocking) ROUTER echo, like a peer in another process."""
    try:
        for _ in range(n):
            if not router.poll(10_000):
                return
            router.send_multipart(router.recv_multipart())
    finally:
        router.close(linger=0)


@pytest.mark.parametrize("batched", [False, True])
async def test_dealer_concurrent_send_and_recv_tasks_do_not_hang(
    ctx: zmq.Context[zmq.Socket[bytes]], batched: bool
) -> None:
    """The known hang: one sender task and one receiver task on the same DEALER.

    Without the kick, the sender's send consumes the FD edge of a reply that has
    already arrived, and the receiver sleeps forever.
    """
    n = 20_000
    received: list[int] = []
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = bind_free_port(router)
    async with trio.open_nursery() as nursery:
        # The router is handed over: only the echo thread touches it from now on.
        nursery.start_soon(trio.to_thread.run_sync, _sync_echo, router, n)
        dealer = open_socket(ctx, zmq.DEALER)
        dealer.sock.connect(f"tcp://127.0.0.1:{port}")

        async def sender() -> None:
            for i in range(n):
                await dealer.send_multipart([i.to_bytes(4, "big")])

        async def receiver() -> None:
            while len(received) < n:
                if batched:
                    msgs = await dealer.recv_batch(64)
                else:
                    msgs = [await dealer.recv_multipart()]
                received.extend(int.from_bytes(m[0], "big") for m in msgs)

        async with dealer:
            with trio.move_on_after(20):
                async with trio.open_nursery() as inner:
                    inner.start_soon(receiver)
                    inner.start_soon(sender)
        assert dealer.closed
    assert len(received) == n
    assert received == list(range(n))


async def test_send_that_consumes_the_read_edge_wakes_the_waiting_receiver(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Deterministic form of the hang: a reply arrives while one task waits on the FD,
    and another task's send consumes the edge before the scheduler polls it."""
    raw_router = ctx.socket(zmq.ROUTER)
    raw_router.setsockopt(zmq.LINGER, 0)
    port = bind_free_port(raw_router)
    dealer = open_socket(ctx, zmq.DEALER)
    dealer.sock.connect(f"tcp://127.0.0.1:{port}")
    got: list[list[bytes]] = []
    done = trio.Event()
    try:
        async with dealer:
            await dealer.send_multipart([b"hello"])
            assert raw_router.poll(5000)
            ident, hello = raw_router.recv_multipart()
            assert hello == b"hello"

            async def receiver() -> None:
                got.append(await dealer.recv_multipart())
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                await trio.sleep(0.05)  # the receiver now owns the FD wait
                raw_router.send_multipart([ident, b"reply"])
                # Deliberately blocking (no checkpoint): the reply lands, the FD edge fires.
                time.sleep(0.1)  # noqa: ASYNC251
                await dealer.send_multipart([b"second"])  # processes commands: eats the edge
                with trio.move_on_after(3):
                    await done.wait()
                nursery.cancel_scope.cancel()
    finally:
        raw_router.close(linger=0)
    assert got == [[b"reply"]]


async def test_router_echo_in_trio_with_concurrent_tasks(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Both ends on Trio: a ROUTER echo task and a DEALER with sender and receiver tasks."""
    n = 5000
    router, dealer = _pair(ctx, zmq.ROUTER, zmq.DEALER)
    received: list[int] = []

    async def echo() -> None:
        for _ in range(n):
            ident, body = await router.recv_multipart()
            await router.send_multipart([ident, body])

    async def sender() -> None:
        for i in range(n):
            await dealer.send_multipart([i.to_bytes(4, "big")])

    async def receiver() -> None:
        while len(received) < n:
            for msg in await dealer.recv_batch(64):
                received.append(int.from_bytes(msg[0], "big"))

    async with router, dealer:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(echo)
                nursery.start_soon(receiver)
                nursery.start_soon(sender)
    assert received == list(range(n))
    assert router.closed


async def test_push_pull_batch_drain_keeps_order_and_respects_max(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pull, push = _pair(ctx, zmq.PULL, zmq.PUSH)
    n = 2000
    async with pull, push:
        for i in range(n):
            await push.send_multipart([b"t", i.to_bytes(8, "big")])
        got: list[int] = []
        sizes: list[int] = []
        with trio.fail_after(10):
            while len(got) < n:
                batch = await pull.recv_batch(100)
                sizes.append(len(batch))
                got.extend(int.from_bytes(m[1], "big") for m in batch)
    assert got == list(range(n))
    assert max(sizes) <= 100
    # Queued messages come out in batches, not one per wakeup.
    assert max(sizes) > 1


async def test_recv_waits_for_a_message_sent_later(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pull, push = _pair(ctx, zmq.PULL, zmq.PUSH)
    async with pull, push:

        async def later() -> None:
            await trio.sleep(0.05)
            await push.send_multipart([b"hello", b"world"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(later)
            with trio.fail_after(5):
                msg = await pull.recv_multipart()
    assert msg == [b"hello", b"world"]


async def test_several_waiting_receivers_share_one_fd_waiter(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Three tasks block on one PULL socket: no BusyResourceError, every message once."""
    pull, push = _pair(ctx, zmq.PULL, zmq.PUSH)
    got: list[bytes] = []
    async with pull, push:

        async def take(count: int) -> None:
            for _ in range(count):
                got.append((await pull.recv_multipart())[0])

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(take, 10)
                await trio.sleep(0.02)
                for i in range(30):
                    await push.send_multipart([str(i).encode()])
    assert sorted(got, key=int) == [str(i).encode() for i in range(30)]


async def test_cancelled_recv_loses_no_message(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pull, push = _pair(ctx, zmq.PULL, zmq.PUSH)
    async with pull, push:
        with trio.move_on_after(0.05) as scope:
            await pull.recv_multipart()
        assert scope.cancelled_caught
        await push.send_multipart([b"after-cancel"])
        with trio.fail_after(5):
            assert await pull.recv_multipart() == [b"after-cancel"]


async def test_cancellation_closes_cleanly_and_leaks_no_fds(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    # Warm the context's I/O thread so its own descriptors are already counted.
    warm = open_socket(ctx, zmq.PULL)
    bind_free_port(warm)
    warm.close()
    await trio.sleep(0.05)
    before = _open_fds()
    for _ in range(20):
        pull, push = _pair(ctx, zmq.PULL, zmq.DEALER)
        with trio.move_on_after(0.01):
            async with pull, push, trio.open_nursery() as nursery:
                nursery.start_soon(pull.recv_multipart)
                nursery.start_soon(pull.recv_batch, 8)
                await trio.sleep_forever()
        assert pull.closed
        assert push.closed
    await trio.sleep(0.1)
    assert _open_fds() <= before + 2


async def test_blocked_task_wakes_with_closed_resource_error_on_close(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pull = open_socket(ctx, zmq.PULL)
    bind_free_port(pull)
    errors: list[BaseException] = []

    async def blocked() -> None:
        try:
            await pull.recv_multipart()
        except trio.ClosedResourceError as exc:
            errors.append(exc)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(blocked)
            nursery.start_soon(blocked)
            await trio.sleep(0.02)
            await pull.aclose()
    assert len(errors) == 2
    with pytest.raises(trio.ClosedResourceError):
        await pull.send_multipart([b"x"])
    pull.close()  # idempotent


async def test_send_waits_at_high_water_mark_then_completes(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """A DEALER with no peer blocks on send; once a peer connects, the send completes."""
    dealer = open_socket(ctx, zmq.DEALER)
    dealer.sock.setsockopt(zmq.SNDHWM, 1)
    port = bind_free_port(dealer)
    async with dealer:
        assert dealer.send_multipart_nowait([b"x"]) is False
        router = open_socket(ctx, zmq.ROUTER)
        async with router:

            async def connect_later() -> None:
                await trio.sleep(0.05)
                router.sock.connect(f"tcp://127.0.0.1:{port}")

            with trio.fail_after(5):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(connect_later)
                    await dealer.send_multipart([b"payload"])
                    _ident, body = await router.recv_multipart()
    assert body == b"payload"


async def test_nowait_helpers(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    pull, push = _pair(ctx, zmq.PULL, zmq.PUSH)
    async with pull, push:
        assert pull.recv_multipart_nowait() is None
        assert push.send_multipart_nowait([b"a"]) is True
        with trio.fail_after(5):
            assert await pull.recv_batch(4) == [[b"a"]]
    with pytest.raises(ValueError, match="max_msgs"):
        await pull.recv_batch(0)


def test_bind_free_port_returns_the_bound_port(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    raw = ctx.socket(zmq.PULL)
    try:
        port = bind_free_port(raw)
        assert 0 < port < 65536
        assert raw.getsockopt(zmq.LAST_ENDPOINT) == f"tcp://127.0.0.1:{port}".encode()
    finally:
        raw.close(linger=0)


async def test_frames_of_every_buffer_kind_arrive_whole(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pull, push = _pair(ctx, zmq.PULL, zmq.PUSH)
    async with pull, push:
        await push.send_multipart([b"plain", b"", b"x" * 70_000])
        await push.send_multipart([bytearray(b"ba"), memoryview(b"mv"), zmq.Frame(b"fr")])
        assert push.send_multipart_nowait([b"one"]) is True
        with trio.fail_after(5):
            received: list[list[bytes]] = []
            while len(received) < 3:
                received += await pull.recv_batch(8)
    assert received == [[b"plain", b"", b"x" * 70_000], [b"ba", b"mv", b"fr"], [b"one"]]


async def test_a_bad_frame_queues_nothing_of_its_message(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pull, push = _pair(ctx, zmq.PULL, zmq.PUSH)
    async with pull, push:
        with pytest.raises(TypeError):
            await push.send_multipart([b"head", "not bytes"])  # type: ignore[list-item]
        with pytest.raises(TypeError):
            push.send_multipart_nowait([b"head", 7])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="at least one frame"):
            push.send_multipart_nowait([])
        await push.send_multipart([b"next", b"message"])
        with trio.fail_after(5):
            assert await pull.recv_multipart() == [b"next", b"message"]
        assert pull.recv_multipart_nowait() is None


async def test_router_mandatory_refuses_an_unknown_peer_on_the_first_frame(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    router, dealer = _pair(ctx, zmq.ROUTER, zmq.DEALER)
    router.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    async with router, dealer:
        with pytest.raises(zmq.ZMQError) as refused:
            router.send_multipart_nowait([b"nobody", b"", b"payload"])
        assert refused.value.errno == zmq.EHOSTUNREACH
        await dealer.send_multipart([b"hello"])
        with trio.fail_after(5):
            client, body = await router.recv_multipart()
        assert body == b"hello"
        assert router.send_multipart_nowait([client, b"reply"]) is True
        with trio.fail_after(5):
            assert await dealer.recv_multipart() == [b"reply"]


async def test_batch_drain_stops_at_the_byte_budget(ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
    # inproc: a sent message is in the receiver's queue as soon as send returns.
    pull = open_socket(ctx, zmq.PULL)
    pull.sock.bind("inproc://byte-budget")
    push = open_socket(ctx, zmq.PUSH)
    push.sock.connect("inproc://byte-budget")
    async with pull, push:
        for i in range(10):
            await push.send_multipart([bytes([i]), b"x" * 99])  # 100 bytes a message
        with trio.fail_after(5):
            first = await pull.recv_batch(8, max_bytes=250)
            second = await pull.recv_batch(8, max_bytes=100)
            rest = await pull.recv_batch(8)
    assert [m[0] for m in first] == [b"\x00", b"\x01", b"\x02"]  # the crossing one is kept
    assert [m[0] for m in second] == [b"\x03"]
    assert [m[0] for m in rest] == [bytes([i]) for i in range(4, 10)]


# ---------------------------------------------------------------- bounded input


def _bounded_pull(
    ctx: zmq.Context[zmq.Socket[bytes]], **limits: int
) -> tuple[TrioSocket, TrioSocket]:
    pull = open_socket(ctx, zmq.PULL, name="test PULL", **limits)
    port = bind_free_port(pull)
    push = open_socket(ctx, zmq.PUSH)
    push.sock.connect(f"tcp://127.0.0.1:{port}")
    return pull, push


async def _receive_marker(pull: TrioSocket, push: TrioSocket, seen: list[list[bytes]]) -> None:
    """Send a marker until it arrives: libzmq drops the connection of a peer that
    announced an oversized frame (and what that connection had buffered); the PUSH
    reconnects."""
    with trio.fail_after(10):
        while not any(m == [b"marker"] for m in seen):
            push.send_multipart_nowait([b"marker"])
            with trio.move_on_after(0.2):
                seen.extend(await pull.recv_batch(64))


async def test_max_frame_bytes_bounds_each_frame_and_the_socket_keeps_serving(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    pull, push = _bounded_pull(ctx, max_frame_bytes=4096)
    assert pull.sock.getsockopt(zmq.MAXMSGSIZE) == 4096
    async with pull, push:
        # The bound is per frame: three frames at the bound make a legal message.
        await push.send_multipart([b"a" * 4096, b"b" * 4096, b"c" * 4096])
        with trio.fail_after(5):
            assert [len(f) for f in await pull.recv_multipart()] == [4096] * 3
        await push.send_multipart([b"ok", b"x" * 4097])
        seen: list[list[bytes]] = []
        await _receive_marker(pull, push, seen)
    assert all(max(map(len, m)) <= 4096 for m in seen)


async def test_max_frame_bytes_never_goes_below_the_handshake_floor(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    router = open_socket(ctx, zmq.ROUTER, max_frame_bytes=16)
    assert router.sock.getsockopt(zmq.MAXMSGSIZE) == MIN_FRAME_LIMIT
    port = bind_free_port(router)
    dealer = open_socket(ctx, zmq.DEALER)
    dealer.sock.setsockopt(zmq.ROUTING_ID, b"i" * 255)  # the longest routing id
    dealer.sock.connect(f"tcp://127.0.0.1:{port}")
    async with router, dealer:
        await dealer.send_multipart([b"", b"12345678"])
        with trio.fail_after(5):
            assert await router.recv_multipart() == [b"i" * 255, b"", b"12345678"]


async def test_a_message_of_too_many_frames_is_dropped_unread(
    ctx: zmq.Context[zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    pull, push = _bounded_pull(ctx, max_frames=4)
    async with pull, push:
        await push.send_multipart([b"x"] * 5)
        await push.send_multipart([b""] * 20_000)
        await push.send_multipart([b"a", b"b", b"c", b"d"])
        await push.send_multipart([b"y"] * 5)
        await push.send_multipart([b"last"])
        received: list[list[bytes]] = []
        with trio.fail_after(5):
            while [b"last"] not in received:
                received += await pull.recv_batch(8)
        assert received == [[b"a", b"b", b"c", b"d"], [b"last"]]
        assert pull.dropped_messages == 3
        # One warning per interval, not one per message.
        warnings = [r for r in caplog.records if "dropped a message of" in r.message]
        assert len(warnings) == 1
        assert (
            "test PULL: dropped a message of 5 frames (at most 4 expected)" in warnings[0].message
        )
        await push.send_multipart([b"z"] * 6)
        await push.send_multipart([b"after"])
        with trio.fail_after(5):
            assert await pull.recv_multipart() == [b"after"]
        assert pull.dropped_messages == 4
        assert pull.recv_multipart_nowait() is None
