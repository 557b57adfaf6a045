"""The asyncio "engine" both asyncio examples run: written once against
:class:`tspd.hosts.bridge.TrioBridge`, so the same code runs over Trio guest mode
(``asyncio_guest_engine.py``) and over trio-asyncio (``trio_asyncio_engine.py``).

Everything stays on 127.0.0.1: a bootstrap server, one Prefill and one Decode rank
whose KV is copied by fake transfer engines (``tspd.testing.local_pd.LocalPD``), a
KV-event publisher and a subscriber. The engine registers a few requests on both
sides, polls, hands each prompt's KV over, sees ``RemotePrefillDone`` on Decode with
the bytes intact, publishes the prompts' prefix blocks and reads them back.
"""

from __future__ import annotations

import asyncio
import contextlib

from tspd.core.commands import Bootstrapped, Event, Failed, RemotePrefillDone, Succeeded
from tspd.core.kv_events import AllBlocksCleared, BlockStored
from tspd.core.manifest import BlockManifest
from tspd.hosts.bridge import TrioBridge
from tspd.shell.kv_subscriber import KVEventSubscriber, ReceivedBatch
from tspd.testing.local_pd import LocalPD, Prompt

PROMPT = 12
REQUESTS = ("req-1", "req-2", "req-3")


async def read_blocks(
    bridge: TrioBridge, subscriber: KVEventSubscriber, joined: asyncio.Event, count: int
) -> int:
    """The router side: count stored blocks until ``count`` arrived."""
    blocks = 0
    async for item in bridge.iterate(subscriber):
        if isinstance(item, ReceivedBatch):
            joined.set()
            blocks += sum(isinstance(e, BlockStored) for e in item.batch.events)
            if blocks >= count:
                break
    return blocks


async def engine(bridge: TrioBridge, pd: LocalPD, label: str) -> str:
    """Serve a few requests end to end through ``bridge``; return the summary line."""
    server = await bridge.enter(pd.bootstrap_server(), name="bootstrap server")
    prefill = await bridge.enter(pd.prefill_peer(server.address), name="Prefill peer")
    decode = await bridge.enter(pd.decode_peer(), name="Decode peer")
    subscriber = await bridge.enter(pd.subscriber(), name="KV subscriber")
    publisher = await bridge.enter(pd.publisher(), name="KV publisher")

    joined = asyncio.Event()
    reader = asyncio.create_task(
        read_blocks(bridge, subscriber, joined, (PROMPT // 4) * len(REQUESTS))
    )
    while not joined.is_set():  # the PUB connects asynchronously: announce until heard
        await bridge.run(publisher.apublish, [AllBlocksCleared()])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(joined.wait(), 0.05)

    rooms = {rid: 500 + i for i, rid in enumerate(REQUESTS)}
    for rid, room in rooms.items():
        await bridge.run_sync(decode.register_request, rid, room, server.address)
        await bridge.run_sync(prefill.register_request, rid, room)

    prompts: dict[str, Prompt] = {}
    manifests: dict[str, BlockManifest] = {}
    done: dict[str, Event] = {}
    sent: set[str] = set()
    async with asyncio.timeout(30):
        while len(done) < len(rooms) or len(sent) < len(rooms):
            for event in await bridge.run(decode.poll):
                if isinstance(event, Bootstrapped):
                    manifests[event.rid] = pd.preallocation(rooms[event.rid], PROMPT)
                    await bridge.run_sync(
                        decode.send_preallocation, rooms[event.rid], manifests[event.rid]
                    )
                elif isinstance(event, RemotePrefillDone | Failed):
                    done[event.rid] = event
            for event in await bridge.run(prefill.poll):
                if isinstance(event, Bootstrapped):
                    prompts[event.rid] = pd.prompt(event.rid, rooms[event.rid], PROMPT)
                    await bridge.run_sync(prefill.hand_over, [prompts[event.rid].row])
                elif isinstance(event, Succeeded):
                    sent.add(event.rid)
                    await bridge.run(publisher.apublish, pd.stored_events(prompts[event.rid]))
                elif isinstance(event, Failed):
                    raise SystemExit(f"Prefill failed {event.rid}: {event.reason}")
            await asyncio.sleep(0.002)
        blocks = await reader

    for rid, event in done.items():
        pd.check_outcome(rid, event, rooms[rid], manifests[rid])
    return (
        f"{label}: {len(done)} requests transferred, KV verified, "
        f"{blocks} KV blocks published and read back"
    )
