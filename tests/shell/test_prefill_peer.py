"""The Prefill peer on Trio: real ZMQ on 127.0.0.1, fake engines, a hand-driven Decode."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing
from pd_helpers import DecodeStub, port_is_free, wait_until

from tspd.core.commands import Bootstrapped, Event, Failed, Succeeded
from tspd.core.contract import CacheContract
from tspd.core.interop import bootstrap_token_and_candidates
from tspd.core.manifest import build_manifest
from tspd.core.poll import TransferPoll
from tspd.core.prefill import ExtendRow, PrefillConfig
from tspd.core.schedule import ProducerSchedule
from tspd.shell.arena import HostArena, fill_room, verify_room
from tspd.shell.bootstrap import BootstrapClient, open_bootstrap_server
from tspd.shell.prefill import (
    PrefillPeer,
    PrefillSettings,
    ReleaseRefused,
    RemoteDecodeRow,
    open_prefill_peer,
)
from tspd.shell.steps import StepCounter
from tspd.testing.fake_engine import AsyncFakeEngine, FakeFabric
from tspd.testing.layouts import PageAllocator, multi_layer_contract

SEED = 3
PROMPT = 12


def _contract() -> CacheContract:
    return multi_layer_contract(layers=2, num_pages=32, heads=2, head_dim=8)


def _config(contract: CacheContract, **changes: object) -> PrefillConfig:
    values: dict[str, object] = {
        "tp_size": 1,
        "tp_rank": 0,
        "contract": contract,
        "arena_base": 1,
        "transfer_workers": 2,
        "bootstrap_timeout": 30.0,
        "failed_session_ttl": 5.0,
    }
    values.update(changes)
    return PrefillConfig(**values)  # type: ignore[arg-type]


async def _poll_until(peer: PrefillPeer, want: type[Event], rid: str, limit: float = 10) -> Event:
    with trio.fail_after(limit):
        while True:
            for event in await peer.poll():
                if event.rid == rid:
                    if not isinstance(event, want):
                        raise AssertionError(f"{rid}: expected {want.__name__}, got {event!r}")
                    return event
            await trio.sleep(0.002)


class Rig:
    def __init__(self, peer: PrefillPeer, decode: DecodeStub, pages: PageAllocator) -> None:
        self.peer = peer
        self.decode = decode
        self.pages = pages

    async def bootstrap(self, rid: str, room: int, prompt: int = PROMPT):  # type: ignore[no-untyped-def]
        self.peer.register_request(rid, room)
        manifest = await self.decode.preallocate(room, prompt)
        await _poll_until(self.peer, Bootstrapped, rid)
        return manifest

    def fill(self, room: int, prompt: int = PROMPT) -> dict[str, list[int]]:
        contract = self.peer.core.config.contract
        tables = self.pages.allocate(prompt)
        fill_room(
            self.peer.arena,
            contract,
            build_manifest(contract, tables, 0, prompt),
            seed=SEED,
            room=room,
        )
        return tables


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    contract = _contract()
    fabric = FakeFabric()
    decode = DecodeStub(contract, AsyncFakeEngine(fabric=fabric))
    engine = AsyncFakeEngine(fabric=fabric)
    with HostArena.for_contract(contract) as arena:
        async with open_prefill_peer(_config(contract), engine, arena) as peer:
            decode.connect(peer.control_port)
            await decode.register()
            await wait_until(lambda: peer.core.is_registered(decode.engine.session_id))
            yield Rig(peer, decode, PageAllocator(contract))
    decode.close()


def _empty(peer: PrefillPeer) -> None:
    stats = peer.statistics()
    for key in (
        "rooms",
        "tracked_requests",
        "tracked_rooms",
        "unclaimed",
        "destinations",
        "usage",
        "metadata",
        "awaiting_token",
        "transfers_in_flight",
        "chunks_in_flight",
    ):
        assert stats[key] == 0, (key, stats)


async def test_full_transfer_moves_verified_bytes_and_reports_success(rig: Rig) -> None:
    room = 1000000
    manifest = await rig.bootstrap("r1", room)
    tables = rig.fill(room)
    token, candidates = bootstrap_token_and_candidates(SEED, room, 3)
    rig.peer.record_usage(room, 4, -0.25)
    rig.peer.hand_over([RemoteDecodeRow("r1", tables, token, candidates)])
    await _poll_until(rig.peer, Succeeded, "r1")
    status = await rig.decode.next_status()
    assert status.status is TransferPoll.SUCCESS
    assert (status.room, status.bootstrap_token, status.spec_candidate_ids) == (
        room,
        token,
        candidates,
    )
    assert (status.cached_tokens, status.bootstrap_logprob) == (4, -0.25)
    assert verify_room(rig.decode.arena, rig.decode.contract, manifest, seed=SEED, room=room) == []
    assert rig.peer.statistics()["bytes_written"] > 0
    _empty(rig.peer)


async def test_a_failed_write_fails_the_room_on_both_sides_and_the_peer_keeps_serving(
    rig: Rig,
) -> None:
    await rig.bootstrap("bad", 7)
    rig.peer.engine.fail_next(rig.decode.engine.session_id)  # type: ignore[attr-defined]
    rig.peer.hand_over([RemoteDecodeRow("bad", rig.fill(7), 11)])
    event = await _poll_until(rig.peer, Failed, "bad")
    assert isinstance(event, Failed)
    assert event.reason.startswith(
        "CachePD transfer failed: Mooncake transfer failed for 127.0.0.1:"
    )
    notice = await rig.decode.next_status()
    assert (notice.room, notice.status) == (7, TransferPoll.FAILED)
    assert [f.room for f in rig.peer.failures] == [7]
    # Within the TTL the session fails fast; a fresh registration clears the mark.
    await rig.decode.register()
    await wait_until(
        lambda: rig.peer.core.session_alive(rig.decode.engine.session_id, trio.current_time())
    )
    manifest = await rig.bootstrap("good", 8)
    rig.peer.hand_over([RemoteDecodeRow("good", rig.fill(8), 12)])
    await _poll_until(rig.peer, Succeeded, "good")
    assert (await rig.decode.next_status()).status is TransferPoll.SUCCESS
    assert verify_room(rig.decode.arena, rig.decode.contract, manifest, seed=SEED, room=8) == []
    _empty(rig.peer)


async def test_abort_notifies_the_destination(rig: Rig) -> None:
    await rig.bootstrap("a", 21)
    rig.peer.abort(21, "EPD: prefill aborted request a (embedding receive timed out)")
    event = await _poll_until(rig.peer, Failed, "a")
    assert isinstance(event, Failed)
    assert "EPD: prefill aborted request a" in event.reason
    notice = await rig.decode.next_status()
    assert (notice.room, notice.status) == (21, TransferPoll.FAILED)
    _empty(rig.peer)


async def test_conflicting_registration_is_rejected_and_answered_by_route(rig: Rig) -> None:
    sid = rig.decode.engine.session_id
    await rig.decode.register(decode_tp_size=2, decode_tp_rank=1)
    await wait_until(lambda: not rig.peer.core.is_registered(sid))
    await rig.decode.preallocate(31, PROMPT)
    notice = await rig.decode.next_status()
    assert (notice.room, notice.status) == (31, TransferPoll.FAILED)
    # A garbage message on the control socket changes nothing and kills nothing.
    await rig.decode.push.send_multipart([b"\xff\xfe"])
    await rig.decode.register()
    await wait_until(lambda: rig.peer.core.is_registered(sid))
    assert rig.peer.statistics()["registrations"] == 1


async def test_release_is_refused_while_a_request_is_tracked(rig: Rig) -> None:
    rig.peer.register_request("s", 41)
    with pytest.raises(ReleaseRefused, match=r"rooms \[41\]"):
        await rig.peer.release_registration()
    rig.peer.abort(41, "test")
    await _poll_until(rig.peer, Failed, "s")
    await rig.peer.release_registration()
    assert rig.peer.arena.base not in rig.peer.engine.engine.regions()  # type: ignore[attr-defined]
    await rig.peer.restore_registration()
    assert rig.peer.arena.base in rig.peer.engine.engine.regions()  # type: ignore[attr-defined]


async def test_outbox_hands_over_from_another_thread(rig: Rig) -> None:
    room = 51
    manifest = await rig.bootstrap("t", room)
    tables = rig.fill(room)
    outbox = rig.peer.outbox
    futures = []

    def forward_thread() -> None:
        outbox.stage_remote_decode([RemoteDecodeRow("t", tables, 5, (1, 2))])
        assert outbox.remote_decode_pending()
        futures.append(outbox.hand_over_remote_decode())
        futures.append(outbox.hand_over([RemoteDecodeRow("t", tables, -1)]))

    thread = threading.Thread(target=forward_thread)
    thread.start()
    await trio.to_thread.run_sync(thread.join)
    await _poll_until(rig.peer, Succeeded, "t")
    await wait_until(lambda: all(f.done() for f in futures))
    assert futures[0].result() is None
    status = await rig.decode.next_status()
    assert status.spec_candidate_ids == (1, 2)
    assert verify_room(rig.decode.arena, rig.decode.contract, manifest, seed=SEED, room=room) == []


async def test_bootstrap_timeout_fails_the_request_in_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    contract = _contract()
    with HostArena.for_contract(contract) as arena:
        config = _config(contract, bootstrap_timeout=2.0)
        async with open_prefill_peer(config, AsyncFakeEngine(fabric=FakeFabric()), arena) as peer:
            peer.register_request("late", 61)
            assert (await peer.poll()) == []
            await trio.sleep(2.5)
            events = await peer.poll()
            assert len(events) == 1
            assert isinstance(events[0], Failed)
            assert "timed out after 2.5s in TransferPoll.Bootstrapping" in events[0].reason
            _empty(peer)


async def test_layerwise_chunks_wait_for_producer_steps() -> None:
    contract = _contract()
    fabric = FakeFabric()
    decode = DecodeStub(contract, AsyncFakeEngine(fabric=fabric))
    schedule = ProducerSchedule.from_contract(contract, 2)
    counter = StepCounter()
    config = _config(contract, layerwise=schedule, layerwise_interval=1)
    with HostArena.for_contract(contract) as arena:
        async with open_prefill_peer(
            config, AsyncFakeEngine(fabric=fabric), arena, step_counter=counter
        ) as peer:
            decode.connect(peer.control_port)
            await decode.register()
            await wait_until(lambda: peer.core.is_registered(decode.engine.session_id))
            room = 71
            peer.register_request("lw", room)
            manifest = await decode.preallocate(room, PROMPT)
            await _poll_until(peer, Bootstrapped, "lw")
            tables = PageAllocator(contract).allocate(PROMPT)
            source = build_manifest(contract, tables, 0, PROMPT)
            begin = peer.arm_layerwise([ExtendRow("lw", 0, PROMPT, tables)])
            assert begin == 0
            for step in schedule.steps:
                fill_room(arena, contract, source, seed=SEED, room=room, fields=frozenset(step))
                counter.advance()
            peer.hand_over([RemoteDecodeRow("lw", tables, 9)])
            await _poll_until(peer, Succeeded, "lw")
            status = await decode.next_status()
            assert (status.status, status.bootstrap_token) == (TransferPoll.SUCCESS, 9)
            assert verify_room(decode.arena, contract, manifest, seed=SEED, room=room) == []
            _empty(peer)
    decode.close()


async def test_registers_with_the_bootstrap_server_and_closes_everything() -> None:
    contract = _contract()
    threads = threading.active_count()
    async with open_bootstrap_server() as server, BootstrapClient() as client:
        with HostArena.for_contract(contract) as arena:
            settings = PrefillSettings(bootstrap_addr=server.address)
            engine = AsyncFakeEngine(fabric=FakeFabric())
            async with open_prefill_peer(
                _config(contract), engine, arena, settings=settings
            ) as peer:
                assert peer.registered_with_bootstrap
                info = await client.get_rank_info(server.address, 0, 0)
                assert (info.rank_ip, info.rank_port) == ("127.0.0.1", peer.control_port)
                port = peer.control_port
            assert engine.engine.regions() == {}
    # The control port is free again: nothing kept the socket open.
    await wait_until(lambda: port_is_free(port), limit=5)
    assert threading.active_count() <= threads + 1


async def test_unclaimed_preallocation_is_dropped_after_the_ttl_and_its_decode_told() -> None:
    contract = _contract()
    fabric = FakeFabric()
    decode = DecodeStub(contract, AsyncFakeEngine(fabric=fabric))
    with HostArena.for_contract(contract) as arena:
        config = _config(contract, bootstrap_timeout=0.3)
        async with open_prefill_peer(config, AsyncFakeEngine(fabric=fabric), arena) as peer:
            decode.connect(peer.control_port)
            await decode.register()
            await decode.preallocate(81, PROMPT)
            await wait_until(lambda: peer.statistics()["unclaimed"] == 1)
            notice = await decode.next_status()  # sent by the timer task after the TTL
            assert (notice.room, notice.status) == (81, TransferPoll.FAILED)
            assert peer.statistics()["unclaimed"] == 0
            assert peer.statistics()["rooms"] == 0
    decode.close()


async def test_wait_for_activity_wakes_on_peer_input(rig: Rig) -> None:
    rig.peer.register_request("act", 91)
    with trio.move_on_after(0.05) as idle:
        await rig.peer.wait_for_activity()
        await rig.peer.wait_for_activity()  # nothing new arrived since the first
    assert idle.cancelled_caught
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rig.decode.preallocate, 91, PROMPT)
        with trio.fail_after(5):
            await rig.peer.wait_for_activity()
    assert isinstance(await _poll_until(rig.peer, Bootstrapped, "act"), Bootstrapped)
    rig.peer.abort(91, "test over")
    await _poll_until(rig.peer, Failed, "act")


class _Boom(Exception):
    pass


async def test_an_error_in_the_block_reaches_the_caller_unwrapped() -> None:
    contract = _contract()
    with HostArena.for_contract(contract) as arena, pytest.raises(_Boom):
        async with open_prefill_peer(
            _config(contract), AsyncFakeEngine(fabric=FakeFabric()), arena
        ):
            raise _Boom
