"""asyncio hosts drive the PD peers and KV events through both bridges.

One small asyncio "engine", written once against :class:`TrioBridge`, runs under
Trio guest mode on asyncio's own loop and under trio-asyncio: it stands up
a bootstrap server, a Prefill and a Decode peer, a KV-event publisher and a
subscriber, registers requests, polls, hands KV over, sees every request end
``RemotePrefillDone`` on Decode with the bytes intact, and reads its own events
back. Then cancellation from the asyncio side and errors crossing the bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest
import trio

from tspd.core.commands import Bootstrapped, Event, Failed, RemotePrefillDone, Succeeded
from tspd.core.errors import ProtocolError
from tspd.core.kv_events import AllBlocksCleared, BlockStored, KVEvent
from tspd.hosts.aio import open_aio_bridge, run_aio_host
from tspd.hosts.bridge import BridgeClosed, TrioBridge
from tspd.hosts.guest import open_trio_guest
from tspd.shell.kv_subscriber import KVEventSubscriber, ReceivedBatch
from tspd.testing.local_pd import LocalPD, Prompt

T = TypeVar("T")
PROMPT = 10

Scenario = Callable[[TrioBridge], Awaitable[Any]]


def _run_asyncio(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on asyncio's own loop: once trio-asyncio is imported (the
    other bridge's tests) it replaces the default loop, which guest mode cannot
    share; a real guest-mode host never imports it (``examples/``, run as their own
    processes, check plain ``asyncio.run``)."""
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(main)


def _guest(scenario: Scenario) -> Any:
    async def main() -> Any:
        async with open_trio_guest() as guest:
            return await scenario(guest)

    return _run_asyncio(main())


def _trio_asyncio(scenario: Scenario) -> Any:
    return run_aio_host(scenario)


BRIDGES = pytest.mark.parametrize("host", [_guest, _trio_asyncio], ids=["guest", "trio_asyncio"])


async def _read_stored(
    bridge: TrioBridge, subscriber: KVEventSubscriber, joined: asyncio.Event, count: int
) -> list[KVEvent]:
    """Read batches until ``count`` BlockStored events arrived; flag the first batch."""
    stored: list[KVEvent] = []
    async for item in bridge.iterate(subscriber):
        if isinstance(item, ReceivedBatch):
            joined.set()
            stored.extend(e for e in item.batch.events if isinstance(e, BlockStored))
            if len(stored) >= count:
                return stored
    return stored


@pytest.fixture
def pd() -> Iterator[LocalPD]:
    """The one-process PD rig; its arenas are freed after the host (and with it
    every peer) has stopped."""
    rig = LocalPD()
    yield rig
    rig.close()


async def _engine(bridge: TrioBridge, pd: LocalPD, rids: list[str]) -> dict[str, Any]:
    """The asyncio engine: serve ``rids`` end to end and read the KV events back."""
    server = await bridge.enter(pd.bootstrap_server(), name="bootstrap server")
    prefill = await bridge.enter(pd.prefill_peer(server.address), name="Prefill peer")
    decode = await bridge.enter(pd.decode_peer(), name="Decode peer")
    subscriber = await bridge.enter(pd.subscriber(), name="KV subscriber")
    publisher = await bridge.enter(pd.publisher(), name="KV publisher")

    rooms = {rid: 1000 + i for i, rid in enumerate(rids)}
    blocks_per_prompt = PROMPT // 4
    joined = asyncio.Event()
    reader = asyncio.create_task(
        _read_stored(bridge, subscriber, joined, blocks_per_prompt * len(rids))
    )
    while not joined.is_set():
        await bridge.run(publisher.apublish, [AllBlocksCleared()])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(joined.wait(), 0.05)

    for rid, room in rooms.items():
        await bridge.run_sync(decode.register_request, rid, room, server.address)
        await bridge.run_sync(prefill.register_request, rid, room)
    prompts: dict[str, Prompt] = {}
    manifests = {}
    prefill_done: dict[str, Event] = {}
    decode_done: dict[str, Event] = {}
    async with asyncio.timeout(20):
        while len(prefill_done) < len(rids) or len(decode_done) < len(rids):
            for event in await bridge.run(decode.poll):
                if isinstance(event, Bootstrapped):
                    manifests[event.rid] = pd.preallocation(rooms[event.rid], PROMPT)
                    await bridge.run_sync(
                        decode.send_preallocation, rooms[event.rid], manifests[event.rid]
                    )
                elif isinstance(event, RemotePrefillDone | Failed):
                    decode_done[event.rid] = event
            for event in await bridge.run(prefill.poll):
                if isinstance(event, Bootstrapped):
                    prompt = prompts[event.rid] = pd.prompt(event.rid, rooms[event.rid], PROMPT)
                    await bridge.run_sync(prefill.hand_over, [prompt.row])
                elif isinstance(event, Succeeded):
                    prefill_done[event.rid] = event
                    await bridge.run(publisher.apublish, pd.stored_events(prompts[event.rid]))
                elif isinstance(event, Failed):
                    prefill_done[event.rid] = event
            await asyncio.sleep(0.002)
    async with asyncio.timeout(20):
        stored = await reader
    mismatches = {rid: pd.verify(rooms[rid], manifests[rid]) for rid in decode_done}
    return {
        "prefill": prefill_done,
        "decode": decode_done,
        "tokens": {rid: pd.expected_token(room) for rid, room in rooms.items()},
        "mismatches": mismatches,
        "stored": stored,
        "expected": [e for rid in rids for e in pd.stored_events(prompts[rid])],
        "decode_stats": await bridge.run_sync(decode.statistics),
    }


@BRIDGES
def test_an_asyncio_engine_serves_requests_end_to_end(
    host: Callable[[Scenario], Any], pd: LocalPD
) -> None:
    rids = ["a", "b", "c"]
    report = host(lambda bridge: _engine(bridge, pd, rids))
    assert set(report["prefill"]) == set(rids)
    assert all(isinstance(e, Succeeded) for e in report["prefill"].values()), report["prefill"]
    for rid in rids:
        event = report["decode"][rid]
        assert isinstance(event, RemotePrefillDone), event
        assert event.bootstrap_token == report["tokens"][rid]
        assert report["mismatches"][rid] == []
    assert report["stored"] == report["expected"]
    assert report["decode_stats"]["rooms"] == 0


async def _forever(flag: list[str]) -> None:
    try:
        await trio.sleep_forever()
    finally:
        flag.append("unwound")


@BRIDGES
def test_cancelling_the_asyncio_side_cancels_the_trio_task(
    host: Callable[[Scenario], Any], pd: LocalPD
) -> None:
    async def scenario(bridge: TrioBridge) -> tuple[list[str], list[str], bool]:
        flag: list[str] = []
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(bridge.run(_forever, flag), 0.05)
        # A peer's own wait, cancelled from asyncio, leaves the peer serving.
        server = await bridge.enter(pd.bootstrap_server())
        prefill = await bridge.enter(pd.prefill_peer(server.address))
        task = asyncio.create_task(bridge.run(prefill.wait_for_activity))
        await asyncio.sleep(0.02)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        after = list(flag)
        await bridge.run_sync(prefill.register_request, "r", 5)
        events = await bridge.run(prefill.poll)
        still = await bridge.run_sync(prefill.has_in_flight)
        return after, [type(e).__name__ for e in events], still and task.cancelled()

    flag, _, alive = host(scenario)
    assert flag == ["unwound"]
    assert alive


@BRIDGES
def test_errors_cross_the_bridge(host: Callable[[Scenario], Any], pd: LocalPD) -> None:
    async def scenario(bridge: TrioBridge) -> str:
        server = await bridge.enter(pd.bootstrap_server())
        prefill = await bridge.enter(pd.prefill_peer(server.address))
        with pytest.raises(ProtocolError, match="bootstrap_room -1 of request bad") as info:
            await bridge.run_sync(prefill.register_request, "bad", -1)

        async def fails() -> None:
            await trio.lowlevel.checkpoint()
            raise KeyError("from trio")

        with pytest.raises(KeyError, match="from trio"):
            await bridge.run(fails)
        return str(info.value)

    assert "outside" in host(scenario)


async def _crashing_service(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    task_status.started("up")
    await trio.sleep(0.05)
    raise RuntimeError("service crashed")


def test_a_crash_in_the_guest_never_hangs_the_asyncio_side() -> None:
    seen: list[BaseException] = []

    async def main() -> None:
        async with open_trio_guest() as guest:
            assert await guest.start(_crashing_service) == "up"
            try:
                await guest.run(trio.sleep_forever)
            except BridgeClosed as err:
                seen.append(err)
            await asyncio.sleep(0.05)
            with pytest.raises(BridgeClosed, match="crashed: RuntimeError"):
                await guest.run(trio.sleep, 0)

    with pytest.raises(RuntimeError, match="service crashed"):
        _run_asyncio(asyncio.wait_for(main(), 10))
    assert len(seen) == 1
    assert isinstance(seen[0], BridgeClosed)


def test_a_crash_under_trio_asyncio_ends_the_host_with_the_error() -> None:
    async def main(bridge: TrioBridge) -> None:
        await bridge.start(_crashing_service)
        await asyncio.sleep(10)

    with pytest.raises(RuntimeError, match="service crashed"):
        run_aio_host(main)


def test_the_host_error_wins_over_the_guest_shutdown() -> None:
    async def main() -> None:
        async with open_trio_guest() as guest:
            await guest.start(_crashing_service)
            raise ValueError("host failed")

    with pytest.raises(ValueError, match="host failed"):
        _run_asyncio(main())


def test_services_close_newest_first() -> None:
    order: list[str] = []

    @contextlib.asynccontextmanager
    async def service(name: str) -> Any:
        await trio.lowlevel.checkpoint()
        try:
            yield name
        finally:
            order.append(name)

    async def main() -> list[str]:
        async with open_trio_guest() as guest:
            return [await guest.enter(service(n)) for n in ("bootstrap", "prefill", "decode")]

    assert _run_asyncio(main()) == ["bootstrap", "prefill", "decode"]
    assert order == ["decode", "prefill", "bootstrap"]


def test_the_trio_asyncio_bridge_refuses_a_plain_asyncio_loop() -> None:
    async def main() -> None:
        async with open_aio_bridge():
            pass

    with pytest.raises(BridgeClosed, match="open_trio_guest"):
        _run_asyncio(main())


def test_the_guest_refuses_calls_after_it_closed() -> None:
    async def main() -> tuple[bool, bool]:
        async with open_trio_guest() as guest:
            inside = guest.running
        with pytest.raises(BridgeClosed, match="closed"):
            await guest.run(trio.sleep, 0)
        return inside, guest.running

    assert _run_asyncio(main()) == (True, False)


@pytest.mark.parametrize("ticks", [0, 1, 5])
def test_cancelling_the_host_while_the_guest_starts_stops_it(ticks: int) -> None:
    async def host() -> None:
        async with open_trio_guest():
            await asyncio.sleep(10)

    async def main() -> bool:
        task = asyncio.create_task(host())
        for _ in range(ticks):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=5)
        return task in done and task.cancelled()

    assert _run_asyncio(main())
