"""Staged transfers between tspd peers (docs/wire.md#staged-transfers), on Trio with a
real bootstrap server, real ZMQ sockets and the in-process engine: scattered rooms go
as one blob per destination and arrive byte for byte; a peer that does not offer
staging gets the plain protocol; a hostile blob fails only its room."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio
from pd_helpers import serve_decode, serve_prefill, wait_until

from tspd.core.commands import RemotePrefillDone, Succeeded
from tspd.core.contract import CacheContract
from tspd.core.decode import DecodeConfig
from tspd.core.prefill import PrefillConfig
from tspd.shell import transfers
from tspd.shell.agreement import ZmqAgreement
from tspd.shell.arena import HostArena, verify_room
from tspd.shell.bootstrap import open_bootstrap_server
from tspd.shell.decode import DecodePeer, open_decode_peer
from tspd.shell.ports import free_port
from tspd.shell.prefill import PrefillPeer, PrefillSettings, open_prefill_peer
from tspd.testing.fake_engine import AsyncFakeEngine, FakeFabric
from tspd.testing.layouts import multi_layer_contract

SEED = 5
PROMPT = 40  # pages of 1 token: scattered, 2 layers x k/v fields each
HEADS = 4
STAGING = 4 << 20


def _contract(tp: int) -> CacheContract:
    return multi_layer_contract(layers=2, num_pages=96, heads=HEADS // tp, head_dim=4, tp_size=tp)


@asynccontextmanager
async def _group(
    side: str, tp: int, fabric: FakeFabric, bootstrap: str, staging: int, **extra: Any
) -> AsyncIterator[list[Any]]:
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(tp)]
    async with AsyncExitStack() as stack:
        peers: list[Any] = []
        for rank in range(tp):
            contract = _contract(tp)
            arena = stack.enter_context(HostArena.for_contract(contract))
            agreement = await stack.enter_async_context(ZmqAgreement(rank, endpoints))
            engine = AsyncFakeEngine(fabric=fabric)
            if side == "prefill":
                cfg: Any = PrefillConfig(
                    tp_size=tp,
                    tp_rank=rank,
                    contract=contract,
                    arena_base=1,
                    transfer_workers=2,
                    staging_bytes=staging,
                    staging_min_copies=2,
                    **extra,
                )
                settings = PrefillSettings(
                    bootstrap_addr=bootstrap, world_size=tp, engine_rank=rank
                )
                peer: Any = open_prefill_peer(
                    cfg, engine, arena, settings=settings, agreement=agreement if tp > 1 else None
                )
            else:
                cfg = DecodeConfig(
                    tp, rank, contract, 1, "", "", 1, staging_bytes=staging, staging_min_bytes=1
                )
                peer = open_decode_peer(cfg, engine, arena, agreement=agreement if tp > 1 else None)
            peers.append(await stack.enter_async_context(peer))
        yield peers


async def _run(
    prefill_tp: int,
    decode_tp: int,
    *,
    prefill_staging: int = STAGING,
    decode_staging: int = STAGING,
    rooms: Sequence[int] = (7, 8, 9),
) -> tuple[list[PrefillPeer], list[DecodePeer], dict[str, Any]]:
    fabric = FakeFabric()
    out: dict[str, Any] = {}
    async with (
        open_bootstrap_server() as server,
        _group("prefill", prefill_tp, fabric, server.address, prefill_staging) as prefill,
        _group("decode", decode_tp, fabric, server.address, decode_staging) as decodes,
    ):
        for room in rooms:
            rid = f"req-{room}"

            async def decode_rank(peer: DecodePeer, rid: str = rid, room: int = room) -> None:
                out[f"{room}/d{peer.core.config.tp_rank}"] = await serve_decode(
                    peer, rid, room, server.address, PROMPT, contiguous=False
                )

            async def prefill_side(rid: str = rid, room: int = room) -> None:
                out[f"{room}/p"] = await serve_prefill(
                    prefill, rid, room, PROMPT, seed=SEED, contiguous=False
                )

            async with trio.open_nursery() as nursery:
                nursery.start_soon(prefill_side)
                for peer in decodes:
                    nursery.start_soon(decode_rank, peer)
            assert isinstance(out[f"{room}/p"], Succeeded), out
            for peer in decodes:
                rank = peer.core.config.tp_rank
                event, manifest = out[f"{room}/d{rank}"]
                assert isinstance(event, RemotePrefillDone), event
                assert (
                    verify_room(
                        peer.arena,
                        peer.core.config.contract,
                        manifest,
                        seed=SEED,
                        room=room,
                        tp_size=decode_tp,
                        tp_rank=rank,
                    )
                    == []
                )
        for peer in prefill:
            await wait_until(lambda peer=peer: peer.statistics()["rooms"] == 0)  # type: ignore[misc]
            assert peer.statistics()["staged_rooms"] == 0
        for peer in decodes:
            stats = peer.statistics()
            assert stats["staging_slots"] == stats["scattering"] == 0, stats
        out["staged_writes"] = sum(p._workers.stats.staged_writes for p in prefill)
        out["writes"] = sum(p._workers.stats.chunks for p in prefill)
    return prefill, decodes, out


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
async def test_scattered_rooms_go_staged_and_arrive_byte_for_byte(
    prefill_tp: int, decode_tp: int
) -> None:
    _, _, out = await _run(prefill_tp, decode_tp)
    # Every destination write of every room went as one blob.
    assert out["staged_writes"] == 3 * max(prefill_tp, decode_tp)


@pytest.mark.parametrize(("prefill_staging", "decode_staging"), [(0, STAGING), (STAGING, 0)])
async def test_one_side_without_staging_gets_the_plain_protocol(
    prefill_staging: int, decode_staging: int
) -> None:
    _, _, out = await _run(1, 1, prefill_staging=prefill_staging, decode_staging=decode_staging)
    assert out["staged_writes"] == 0
    assert out["writes"] == 3


async def test_a_blob_gathered_in_many_parts_arrives_byte_for_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Parts of 512 bytes: each room's blob goes as many writes, each in flight while
    # the next part is gathered.
    monkeypatch.setattr(transfers, "STAGED_PART_BYTES", 512)
    prefill, _, out = await _run(2, 1)
    assert out["staged_writes"] == 6
    calls = sum(p._workers.stats.engine_calls for p in prefill)
    assert calls > 6 * 3, calls


async def test_the_next_part_of_a_blob_is_queued_while_the_one_before_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The first part's write holds until a second write of the blob is handed over
    # (at most 0.5 s): the next part's write is queued while the one before is in
    # flight, so it starts the moment the runner allows, never more than
    # STAGED_PARTS_IN_FLIGHT of them at once.
    monkeypatch.setattr(transfers, "STAGED_PART_BYTES", 512)
    write = transfers.TransferWorkers._write
    seen = {"active": 0, "peak": 0, "held": False}
    overlap = trio.Event()

    async def counted(self: Any, session: str, plan: Any, active: Any) -> bool:
        seen["active"] += 1
        seen["peak"] = max(seen["peak"], seen["active"])
        if seen["active"] > 1:
            overlap.set()
        try:
            if not seen["held"]:
                seen["held"] = True
                with trio.move_on_after(0.5):
                    await overlap.wait()
            return await write(self, session, plan, active)
        finally:
            seen["active"] -= 1

    monkeypatch.setattr(transfers.TransferWorkers, "_write", counted)
    _, _, out = await _run(1, 1, rooms=(7,))
    assert out["staged_writes"] == 1
    assert overlap.is_set()
    assert seen["peak"] == transfers.STAGED_PARTS_IN_FLIGHT == 2


async def test_both_staging_regions_are_backed_before_they_are_registered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A region first touched by a transfer pays a page fault a page: both peers back
    # theirs when they open, before registering it with the engine.
    backed: list[int] = []
    prefault = HostArena.prefault

    def recorded(self: HostArena) -> None:
        backed.append(self.size)
        prefault(self)

    monkeypatch.setattr(HostArena, "prefault", recorded)
    _, _, out = await _run(1, 1, rooms=(7,))
    assert out["staged_writes"] == 1
    assert backed == [STAGING, STAGING]
