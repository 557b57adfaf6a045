"""The Decode peer on Trio against real Prefill peers, a real bootstrap server and fake engines."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
from pd_helpers import poll_for, port_is_free, serve_decode, serve_prefill, wait_until

from tspd.core.commands import Bootstrapped, Failed, RemotePrefillDone, Succeeded
from tspd.core.contract import CacheContract
from tspd.core.decode import DecodeConfig
from tspd.core.interop import bootstrap_token_and_candidates
from tspd.core.prefill import PrefillConfig
from tspd.shell.agreement import ZmqAgreement
from tspd.shell.arena import HostArena, verify_room
from tspd.shell.bootstrap import open_bootstrap_server
from tspd.shell.decode import DecodePeer, DecodeSettings, open_decode_peer
from tspd.shell.ports import free_port
from tspd.shell.prefill import PrefillPeer, PrefillSettings, open_prefill_peer
from tspd.testing.fake_engine import AsyncFakeEngine, FakeFabric
from tspd.testing.layouts import PageAllocator, multi_layer_contract, simple_contract

SEED = 11
PROMPT = 10
GLOBAL_HEADS = 4


def _contract(tp: int) -> CacheContract:
    return multi_layer_contract(
        layers=2, num_pages=24, heads=GLOBAL_HEADS // tp, head_dim=4, tp_size=tp
    )


@asynccontextmanager
async def _prefill_group(
    tp: int, fabric: FakeFabric, bootstrap: str, **config: object
) -> AsyncIterator[list[PrefillPeer]]:
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(tp)]
    async with AsyncExitStack() as stack:
        peers = []
        for rank in range(tp):
            contract = _contract(tp)
            arena = stack.enter_context(HostArena.for_contract(contract))
            agreement = await stack.enter_async_context(ZmqAgreement(rank, endpoints))
            cfg = PrefillConfig(
                tp_size=tp,
                tp_rank=rank,
                contract=contract,
                arena_base=1,
                transfer_workers=2,
                **config,  # type: ignore[arg-type]
            )
            settings = PrefillSettings(bootstrap_addr=bootstrap, world_size=tp, engine_rank=rank)
            peer = await stack.enter_async_context(
                open_prefill_peer(
                    cfg,
                    AsyncFakeEngine(fabric=fabric),
                    arena,
                    settings=settings,
                    agreement=agreement if tp > 1 else None,
                )
            )
            peers.append(peer)
        yield peers


def _assert_empty(stats: dict[str, int], keys: Sequence[str]) -> None:
    for key in keys:
        assert stats[key] == 0, (key, stats)


PREFILL_KEYS = ("rooms", "tracked_requests", "unclaimed", "destinations", "metadata")
DECODE_KEYS = ("rooms", "tracked_requests", "routes", "completions", "waiting", "tracker_rooms")


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
async def test_end_to_end_over_bootstrap_with_tp(prefill_tp: int, decode_tp: int) -> None:
    fabric = FakeFabric()
    room = 424242
    async with (
        open_bootstrap_server() as server,
        _prefill_group(prefill_tp, fabric, server.address) as prefill,
        AsyncExitStack() as stack,
    ):
        decodes = []
        endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(decode_tp)]
        for rank in range(decode_tp):
            contract = _contract(decode_tp)
            arena = stack.enter_context(HostArena.for_contract(contract))
            agreement = await stack.enter_async_context(ZmqAgreement(rank, endpoints))
            cfg = DecodeConfig(decode_tp, rank, contract, 1, "", "", 1)
            decodes.append(
                await stack.enter_async_context(
                    open_decode_peer(
                        cfg,
                        AsyncFakeEngine(fabric=fabric),
                        arena,
                        agreement=agreement if decode_tp > 1 else None,
                    )
                )
            )
        outcome: dict[str, object] = {}

        async def decode_rank(peer: DecodePeer) -> None:
            outcome[f"d{peer.core.config.tp_rank}"] = await serve_decode(
                peer, "req", room, server.address, PROMPT
            )

        async def prefill_side() -> None:
            outcome["p"] = await serve_prefill(prefill, "req", room, PROMPT, seed=SEED)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(prefill_side)
            for peer in decodes:
                nursery.start_soon(decode_rank, peer)
        assert isinstance(outcome["p"], Succeeded)
        token, candidates = bootstrap_token_and_candidates(SEED, room, 2)
        for peer in decodes:
            rank = peer.core.config.tp_rank
            event, manifest = outcome[f"d{rank}"]  # type: ignore[misc]
            assert isinstance(event, RemotePrefillDone), event
            assert (event.bootstrap_token, event.spec_candidate_ids) == (token, candidates)
            mismatches = verify_room(
                peer.arena,
                peer.core.config.contract,
                manifest,
                seed=SEED,
                room=room,
                tp_size=decode_tp,
                tp_rank=rank,
            )
            assert mismatches == []
            _assert_empty(peer.statistics(), DECODE_KEYS)
        for peer in prefill:
            await wait_until(lambda peer=peer: peer.statistics()["rooms"] == 0)  # type: ignore[misc]
            _assert_empty(peer.statistics(), PREFILL_KEYS)


async def test_an_unreachable_bootstrap_server_fails_the_room_with_its_reason() -> None:
    contract = _contract(1)
    with HostArena.for_contract(contract) as arena:
        cfg = DecodeConfig(1, 0, contract, 1, "", "", 1)
        async with open_decode_peer(cfg, AsyncFakeEngine(fabric=FakeFabric()), arena) as decode:
            addr = f"127.0.0.1:{free_port()}"
            decode.register_request("x", 5, addr)
            event = await poll_for(decode, "x")
            assert isinstance(event, Failed)
            assert (
                event.reason == f"Could not fetch prefill parallel info from bootstrap_addr: {addr}"
            )
            _assert_empty(decode.statistics(), DECODE_KEYS)


async def test_an_incompatible_prefill_fails_the_room_instead_of_raising() -> None:
    fabric = FakeFabric()
    async with open_bootstrap_server() as server, _prefill_group(1, fabric, server.address):
        other = simple_contract(num_pages=8, page_bytes=256)
        with HostArena.for_contract(other) as arena:
            cfg = DecodeConfig(1, 0, other, 1, "", "", 1)
            async with open_decode_peer(cfg, AsyncFakeEngine(fabric=fabric), arena) as decode:
                decode.register_request("y", 6, server.address)
                event = await poll_for(decode, "y")
                assert isinstance(event, Failed)
                assert event.reason.startswith("Cache P/D contract mismatch: ")


async def test_heartbeat_failures_fail_the_rooms_of_a_lost_prefill() -> None:
    fabric = FakeFabric()
    contract = _contract(1)
    with HostArena.for_contract(contract) as arena:
        cfg = DecodeConfig(1, 0, contract, 1, "", "", 1, heartbeat_max_failures=2)
        settings = DecodeSettings(heartbeat_interval=0.05)
        async with open_decode_peer(
            cfg, AsyncFakeEngine(fabric=fabric), arena, settings=settings
        ) as decode:
            async with open_bootstrap_server() as server, _prefill_group(1, fabric, server.address):
                addr = server.address
                decode.register_request("z", 7, addr)
                assert isinstance(await poll_for(decode, "z"), Bootstrapped)
                tables = PageAllocator(contract).allocate(PROMPT)
                decode.send_preallocation(7, tables, prompt_len=PROMPT)
                await wait_until(lambda: decode.heartbeats >= 2)
            # The Prefill instance and its bootstrap server are gone.
            event = await poll_for(decode, "z")
            assert isinstance(event, Failed)
            assert (
                event.reason == f"Losing connection with prefill instance (bootstrap_addr: {addr})"
            )
            _assert_empty(decode.statistics(), DECODE_KEYS)


async def test_waiting_timeout_fails_a_room_whose_prefill_never_sends() -> None:
    fabric = FakeFabric()
    contract = _contract(1)
    async with open_bootstrap_server() as server, _prefill_group(1, fabric, server.address):
        with HostArena.for_contract(contract) as arena:
            cfg = DecodeConfig(1, 0, contract, 1, "", "", 1, waiting_timeout=0.3)
            async with open_decode_peer(cfg, AsyncFakeEngine(fabric=fabric), arena) as decode:
                event, _ = await serve_decode(decode, "w", 8, server.address, PROMPT)
                assert isinstance(event, Failed)
                assert event.reason.startswith("Request 8 timed out after 0.")
                assert event.reason.endswith("s in TransferPoll.WaitingForInput")
                _assert_empty(decode.statistics(), DECODE_KEYS)


async def test_leaving_the_block_closes_the_status_socket() -> None:
    contract = _contract(1)
    engine = AsyncFakeEngine(fabric=FakeFabric())
    with HostArena.for_contract(contract) as arena:
        cfg = DecodeConfig(1, 0, contract, 1, "", "", 1)
        async with open_decode_peer(cfg, engine, arena) as decode:
            port = decode.status_port
            assert engine.engine.regions() == {arena.base: arena.size}
        assert engine.engine.regions() == {}
    await wait_until(lambda: port_is_free(port), limit=5)
