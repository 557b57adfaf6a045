"""One Prefill rank and one Decode rank on loopback: the tutorial of ``docs/tutorial.md``.

Everything runs in one Trio program on 127.0.0.1: a bootstrap server, a Prefill
peer and a Decode peer, both moving bytes through the in-process fake transfer
engine (swap in :class:`tspd.engines.mooncake.MooncakeEngine` for real transfers).
The Decode rank asks for one request's KV cache, the Prefill rank writes it and
reports success, and the script checks that every byte arrived. The test suite
runs this file (``tests/test_docs.py``), so the tutorial cannot rot.

Run it with ``python examples/tutorial_loopback.py``.
"""

from __future__ import annotations

import trio

from tspd.core.commands import Bootstrapped, Event, RemotePrefillDone, Succeeded
from tspd.core.decode import DecodeConfig
from tspd.core.manifest import build_manifest
from tspd.core.prefill import PrefillConfig
from tspd.layouts import PageAllocator, mha_contract
from tspd.shell.arena import HostArena, fill_room, verify_room
from tspd.shell.bootstrap import open_bootstrap_server
from tspd.shell.decode import DecodePeer, open_decode_peer
from tspd.shell.prefill import PrefillPeer, PrefillSettings, RemoteDecodeRow, open_prefill_peer
from tspd.testing.fake_engine import AsyncFakeEngine, FakeFabric

ROOM = 7  # the request's bootstrap room, shared by both sides
PROMPT = 40  # prompt tokens: 3 pages of 16 tokens
SEED = 1  # seeds the bytes Prefill writes and Decode checks


async def next_event(peer: PrefillPeer | DecodePeer, rid: str) -> Event:
    """Poll ``peer`` until it reports an event for request ``rid``."""
    with trio.fail_after(10):
        while True:
            for event in await peer.poll():
                if event.rid == rid:
                    return event
            with trio.move_on_after(0.05):  # polls also see time passing
                await peer.wait_for_activity()


async def main() -> None:
    # Both sides' cache layout: a small GQA model (2 layers, 8 KV heads of 128, bf16)
    # with 8 pages of 16 tokens each; tspd.layouts also builds MLA, sliding-window,
    # state and tensor-parallel layouts.
    contract = mha_contract(
        num_layers=2, num_kv_heads=8, head_dim=128, page_tokens=16, num_pages=8, dtype="bf16"
    )
    fabric = FakeFabric()  # the in-process "network" the fake engines share
    with HostArena.for_contract(contract) as p_mem, HostArena.for_contract(contract) as d_mem:
        async with (
            open_bootstrap_server("127.0.0.1") as server,
            open_prefill_peer(
                PrefillConfig(tp_size=1, tp_rank=0, contract=contract, arena_base=0),
                AsyncFakeEngine(fabric=fabric),
                p_mem,
                settings=PrefillSettings(bootstrap_addr=server.address),
            ) as prefill,
            open_decode_peer(
                DecodeConfig(1, 0, contract, arena_base=0, session_id="", endpoint="", port=0),
                AsyncFakeEngine(fabric=fabric),
                d_mem,
            ) as decode,
        ):
            # 1. Both schedulers learn about the request.
            prefill.register_request("req-1", ROOM)
            decode.register_request("req-1", ROOM, server.address)

            # 2. Decode finds Prefill through the bootstrap server and registers;
            #    then it pre-allocates pages for the prompt.
            assert isinstance(await next_event(decode, "req-1"), Bootstrapped)
            d_pages = PageAllocator(contract).allocate(PROMPT)
            d_manifest = build_manifest(contract, d_pages, 0, PROMPT)
            decode.send_preallocation(ROOM, d_manifest)

            # 3. Prefill sees its destination, computes the KV (here: fills its pages
            #    with known bytes) and hands the request over for transfer.
            assert isinstance(await next_event(prefill, "req-1"), Bootstrapped)
            p_pages = PageAllocator(contract).allocate(PROMPT)
            fill_room(
                p_mem, contract, build_manifest(contract, p_pages, 0, PROMPT), seed=SEED, room=ROOM
            )
            prefill.hand_over([RemoteDecodeRow("req-1", p_pages, bootstrap_token=42)])

            # 4. Both sides report the outcome; Decode's pages now hold Prefill's bytes.
            assert isinstance(await next_event(prefill, "req-1"), Succeeded)
            done = await next_event(decode, "req-1")
            assert isinstance(done, RemotePrefillDone)
            assert done.bootstrap_token == 42
            assert verify_room(d_mem, contract, d_manifest, seed=SEED, room=ROOM) == []
            print(f"room {ROOM}: {PROMPT} tokens of KV moved from Prefill to Decode")


if __name__ == "__main__":
    trio.run(main)
