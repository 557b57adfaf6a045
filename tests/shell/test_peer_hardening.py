"""What a peer sends cannot end a Prefill or Decode peer or grow its memory: unusable
reply endpoints, unreachable routes, thousands of Decode endpoints, oversized frames.
Everything on 127.0.0.1, bounded in count and time."""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import pytest
import trio
import zmq
from pd_helpers import ClosedPorts, DecodeStub, open_fds, poll_for, wait_until

from tspd.core import wire
from tspd.core.commands import Bootstrapped, Event, Failed, Succeeded
from tspd.core.decode import DecodeConfig
from tspd.core.kv_config import KVEventsConfig
from tspd.core.poll import TransferPoll
from tspd.core.prefill import PrefillConfig
from tspd.shell import pushes
from tspd.shell.arena import HostArena
from tspd.shell.decode import open_decode_peer
from tspd.shell.kv_publisher import open_kv_publisher
from tspd.shell.kv_subscriber import MAX_BATCH_BYTES, EventSource, open_kv_subscriber
from tspd.shell.prefill import PrefillPeer, PrefillSettings, RemoteDecodeRow, open_prefill_peer
from tspd.shell.zmq import MIN_FRAME_LIMIT, TrioSocket, open_socket
from tspd.testing.fake_engine import AsyncFakeEngine, FakeFabric
from tspd.testing.layouts import PageAllocator, simple_contract

CONTRACT = simple_contract(num_pages=16, page_bytes=64)
PROMPT = 20


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    # A context of the test's own: exhausting it cannot break other tests.
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@asynccontextmanager
async def _prefill(
    ctx: zmq.Context[zmq.Socket[bytes]],
    fabric: FakeFabric,
    *stubs: DecodeStub,
    **settings: object,
) -> AsyncIterator[PrefillPeer]:
    config = PrefillConfig(
        tp_size=1, tp_rank=0, contract=CONTRACT, arena_base=1, bootstrap_timeout=60.0
    )
    engine = AsyncFakeEngine(fabric=fabric)
    with HostArena.for_contract(CONTRACT) as arena:
        async with open_prefill_peer(
            config,
            engine,
            arena,
            settings=PrefillSettings(**settings),  # type: ignore[arg-type]
            context=ctx,
        ) as peer:
            for stub in stubs:
                stub.connect(peer.control_port)
            yield peer


def _stub(fabric: FakeFabric) -> DecodeStub:
    return DecodeStub(CONTRACT, AsyncFakeEngine(fabric=fabric))


async def _events(peer: PrefillPeer, *rids: str, limit: float = 10) -> dict[str, Event]:
    seen: dict[str, Event] = {}
    with trio.fail_after(limit):
        while not all(rid in seen for rid in rids):
            seen.update((e.rid, e) for e in await peer.poll() if e.rid in rids)
            await trio.sleep(0.002)
    return seen


async def _send(stub: DecodeStub, frames: list[bytes]) -> None:
    await stub.push.send_multipart(frames)


def _bad_preallocation(room: int, session: str) -> list[bytes]:
    """Fails the room and answers ``Failed`` on the session's route
    (docs/protocol.md#proto-preallocation-checks)."""
    return [str(room).encode(), session.encode(), b"{not a manifest"]


# --------------------------------------------------------------- reply endpoints


@pytest.mark.parametrize("endpoint", [b"*", b"foo bar", b"::1"])
async def test_a_registration_with_an_unusable_endpoint_is_dropped_and_the_peer_serves_on(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    fabric = FakeFabric()
    stub = _stub(fabric)
    try:
        async with _prefill(ctx, fabric, stub) as peer:
            sid = stub.engine.session_id
            bad = stub.registration_frames()
            bad[1] = endpoint
            await _send(stub, bad)
            await _send(stub, _bad_preallocation(3, sid))
            await _send(stub, stub.registration_frames())
            await wait_until(lambda: peer.core.is_registered(sid), limit=5)
            assert peer.statistics()["registrations"] == 1
            assert peer._pushes.stats.failed == 0
            assert (
                "Rejecting malformed CachePD Decode registration: CachePD registration "
                "endpoint is invalid: " in caplog.text
            )
            # And the peer still answers by the good route.
            await _send(stub, _bad_preallocation(4, sid))
            notice = await stub.next_status()
            assert (notice.room, notice.status) == (4, TransferPoll.FAILED)
    finally:
        stub.close()


async def test_a_route_that_cannot_be_sent_to_fails_only_its_sessions_rooms(
    ctx: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    fabric = FakeFabric()
    lost, kept = _stub(fabric), _stub(fabric)
    try:
        async with _prefill(ctx, fabric, lost, kept) as peer:
            for stub in (lost, kept):
                await stub.register()
                await wait_until(lambda s=stub: peer.core.is_registered(s.engine.session_id))  # type: ignore[misc]
            for rid, room, stub in (("a", 1, lost), ("b", 2, lost), ("c", 3, kept)):
                peer.register_request(rid, room)
                await stub.preallocate(room, PROMPT)
                assert isinstance(await poll_for(peer, rid), Bootstrapped)

            def exhausted(*args: object, **kwargs: object) -> TrioSocket:
                raise zmq.ZMQError(24)  # EMFILE: "Too many open files"

            monkeypatch.setattr(pushes, "open_socket", exhausted)
            peer.abort(1, "operator abort")  # its notice cannot be sent
            monkeypatch.undo()
            reason = f"Decode unreachable: cannot send to tcp://127.0.0.1:{lost.port}: "
            assert await _events(peer, "a", "b") == {
                "a": Failed("a", "operator abort"),
                "b": Failed("b", reason + "Too many open files"),
            }
            assert not peer.core.is_registered(lost.engine.session_id)
            # The other session's room goes on as if nothing happened.
            tables = PageAllocator(CONTRACT).allocate(PROMPT)
            peer.hand_over([RemoteDecodeRow("c", tables, 9)])
            assert await poll_for(peer, "c") == Succeeded("c")
            assert (await kept.next_status()).status is TransferPoll.SUCCESS
    finally:
        lost.close()
        kept.close()


# ------------------------------------------------------------------- socket churn


async def test_3000_decode_endpoints_keep_the_prefills_sockets_and_fds_bounded(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    bound = 32
    fabric = FakeFabric()
    stub = _stub(fabric)
    closed = ClosedPorts()
    held: deque[list[int]] = deque()
    try:
        async with _prefill(ctx, fabric, stub, push_sockets=bound) as peer:
            await _send(stub, stub.registration_frames())
            await wait_until(lambda: peer.core.is_registered(stub.engine.session_id))
            baseline = open_fds()
            pool = peer._pushes
            done = 0
            for batch in range(30):
                ports = closed.take(100)
                held.append(ports)
                for i, port in enumerate(ports):
                    session = f"127.0.0.1:{batch * 100 + i}"
                    await _send(stub, stub.registration_frames(port=port, session_id=session))
                    await _send(stub, _bad_preallocation(batch * 100 + i + 10, session))
                done += len(ports)
                await wait_until(
                    lambda done=done: pool.stats.sent + pool.stats.dropped == done  # type: ignore[misc]
                )
                assert pool.stats.sockets <= bound
                if len(held) > 2:
                    closed.release(held.popleft())  # their sockets are long closed
                await wait_until(
                    lambda: open_fds() - len(closed) <= baseline + 2 * bound + 4, limit=5
                )
            assert peer.statistics()["registrations"] == 3001
            # Still serving: the first Decode's route works.
            await _send(stub, _bad_preallocation(5, stub.engine.session_id))
            notice = await stub.next_status()
            assert (notice.room, notice.status) == (5, TransferPoll.FAILED)
    finally:
        closed.close()
        stub.close()


async def test_a_replaced_registration_closes_its_old_socket_after_the_notice(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    fabric = FakeFabric()
    stub = _stub(fabric)
    try:
        async with _prefill(ctx, fabric, stub) as peer:
            sid = stub.engine.session_id
            await stub.register()
            await wait_until(lambda: peer.core.is_registered(sid))
            peer.register_request("r", 9)
            await stub.preallocate(9, PROMPT)
            assert isinstance(await poll_for(peer, "r"), Bootstrapped)
            await _send(stub, _bad_preallocation(8, sid))  # opens the socket to the stub
            assert (await stub.next_status()).room == 8
            assert peer._pushes.holds("127.0.0.1", stub.port)
            # Same session, another status port: conflicting, so rejected
            # (docs/protocol.md#proto-registration-handling).
            await stub.register(port=stub.port + 1 if stub.port < 65535 else stub.port - 1)
            notice = await stub.next_status()  # room 9's notice still arrives
            assert (notice.room, notice.status) == (9, TransferPoll.FAILED)
            assert not peer._pushes.holds("127.0.0.1", stub.port)
    finally:
        stub.close()


# ------------------------------------------------------------------ message sizes


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


_SENDER = """
import sys, zmq
ctx = zmq.Context()
push = ctx.socket(zmq.PUSH)
push.setsockopt(zmq.LINGER, 20_000)
push.connect(f"tcp://127.0.0.1:{sys.argv[1]}")
frame = bytes(100 * 1024 * 1024)
for room in range(10):
    push.send_multipart([b"%d" % room, b"127.0.0.1:1", frame], copy=False)
push.close()
ctx.term()
"""


async def test_oversized_frames_to_the_control_socket_are_refused_unread(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    fabric = FakeFabric()
    stub = _stub(fabric)
    try:
        async with _prefill(ctx, fabric, stub) as peer:
            baseline = _rss()
            peak = [baseline]
            stop = threading.Event()

            def sample() -> None:
                while not stop.wait(0.002):
                    peak[0] = max(peak[0], _rss())

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                with trio.fail_after(60):
                    await trio.run_process([sys.executable, "-c", _SENDER, str(peer.control_port)])
            finally:
                stop.set()
                sampler.join()
            # Ten 100 MB frames went to a live socket: none was stored or copied.
            assert peak[0] - baseline < 48 * 1024 * 1024, (baseline, peak)
            await wait_until(lambda: _rss() - baseline < 16 * 1024 * 1024, limit=5)
            # The control socket still serves.
            await _send(stub, stub.registration_frames())
            await wait_until(lambda: peer.core.is_registered(stub.engine.session_id))
    finally:
        stub.close()


async def test_an_oversized_status_never_reaches_the_decode_core(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    engine = AsyncFakeEngine(fabric=FakeFabric())
    received: list[list[bytes]] = []
    with HostArena.for_contract(CONTRACT) as arena:
        config = DecodeConfig(1, 0, CONTRACT, 1, "", "", 1)
        async with open_decode_peer(config, engine, arena, context=ctx) as decode:
            real = decode.core.receive_status

            def spy(frames: list[bytes], now: float) -> None:
                received.append(list(frames))
                real(frames, now)

            decode.core.receive_status = spy  # type: ignore[method-assign]
            push = open_socket(ctx, zmq.PUSH)
            push.sock.connect(f"tcp://127.0.0.1:{decode.status_port}")
            async with push:
                # One 64 MiB candidate frame, for a room nobody knows (the finding).
                await push.send_multipart([b"1", b"5", b"0", b"-1", bytes(64 << 20), b"0", b""])
                marker = wire.failure_notice(77, 0)
                with trio.fail_after(10):
                    while marker not in received:
                        push.send_multipart_nowait(marker)
                        await trio.sleep(0.1)
    assert max(len(f) for m in received for f in m) <= wire.MAX_STATUS_FRAME_BYTES


async def test_the_kv_event_sockets_bound_their_frames(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint="tcp://*:0",
        replay_endpoint="tcp://127.0.0.1:0",
    )
    async with open_kv_publisher(config, ctx=ctx) as pub:
        assert pub._router is not None
        assert pub._router.sock.getsockopt(zmq.MAXMSGSIZE) == MIN_FRAME_LIMIT
        assert pub.replay_endpoint is not None
        source = EventSource(pub.endpoint.replace("0.0.0.0", "127.0.0.1"), pub.replay_endpoint)
        async with open_kv_subscriber([source], ctx=ctx) as sub:
            feed = sub._feeds[source.label]
            assert feed.sub.sock.getsockopt(zmq.MAXMSGSIZE) == MAX_BATCH_BYTES
            assert feed.dealer is not None
            assert feed.dealer.sock.getsockopt(zmq.MAXMSGSIZE) == MAX_BATCH_BYTES
