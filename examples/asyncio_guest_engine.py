"""An asyncio engine that keeps ``asyncio.run()`` and runs tspd as a Trio guest.

Run it: ``python examples/asyncio_guest_engine.py``. Everything stays on
127.0.0.1: a bootstrap server, one Prefill and one Decode rank whose KV is copied
by fake transfer engines (``tspd.testing.local_pd.LocalPD``), a KV-event publisher and
a subscriber. The engine registers a few requests on both sides, polls, hands
each prompt's KV over, sees ``RemotePrefillDone`` on Decode with the bytes
intact, publishes the prompts' prefix blocks and reads them back. Exits 0 and
prints a summary line when every check held.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

from tspd.core.commands import Bootstrapped, Event, Failed, RemotePrefillDone, Succeeded
from tspd.core.kv_events import AllBlocksCleared, BlockStored
from tspd.core.manifest import BlockManifest
from tspd.hosts.guest import TrioGuest, open_trio_guest
from tspd.shell.kv_subscriber import KVEventSubscriber, ReceivedBatch
from tspd.testing.local_pd import LocalPD, Prompt

PROMPT = 12
REQUESTS = ("req-1", "req-2", "req-3")


async def read_blocks(
    guest: TrioGuest, subscriber: KVEventSubscriber, joined: asyncio.Event, count: int
) -> int:
    """The router side: count stored blocks until ``count`` arrived."""
    blocks = 0
    async for item in guest.iterate(subscriber):
        if isinstance(item, ReceivedBatch):
            joined.set()
            blocks += sum(isinstance(e, BlockStored) for e in item.batch.events)
            if blocks >= count:
                break
    return blocks


async def engine(guest: TrioGuest, pd: LocalPD) -> str:
    server = await guest.enter(pd.bootstrap_server(), name="bootstrap server")
    prefill = await guest.enter(pd.prefill_peer(server.address), name="Prefill peer")
    decode = await guest.enter(pd.decode_peer(), name="Decode peer")
    subscriber = await guest.enter(pd.subscriber(), name="KV subscriber")
    publisher = await guest.enter(pd.publisher(), name="KV publisher")

    joined = asyncio.Event()
    reader = asyncio.create_task(
        read_blocks(guest, subscriber, joined, (PROMPT // 4) * len(REQUESTS))
    )
    while not joined.is_set():  # the PUB connects asynchronously: announce until heard
        await guest.run(publisher.apublish, [AllBlocksCleared()])
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(joined.wait(), 0.05)

    rooms = {rid: 500 + i for i, rid in enumerate(REQUESTS)}
    for rid, room in rooms.items():
        await guest.run_sync(decode.register_request, rid, room, server.address)
        await guest.run_sync(prefill.register_request, rid, room)

    prompts: dict[str, Prompt] = {}
    manifests: dict[str, BlockManifest] = {}
    done: dict[str, Event] = {}
    sent: set[str] = set()
    async with asyncio.timeout(30):
        while len(done) < len(rooms) or len(sent) < len(rooms):
            for event in await guest.run(decode.poll):
                if isinstance(event, Bootstrapped):
                    manifests[event.rid] = pd.preallocation(rooms[event.rid], PROMPT)
                    await guest.run_sync(
                        decode.send_preallocation, rooms[event.rid], manifests[event.rid]
                    )
                elif isinstance(event, RemotePrefillDone | Failed):
                    done[event.rid] = event
            for event in await guest.run(prefill.poll):
                if isinstance(event, Bootstrapped):
                    prompts[event.rid] = pd.prompt(event.rid, rooms[event.rid], PROMPT)
                    await guest.run_sync(prefill.hand_over, [prompts[event.rid].row])
                elif isinstance(event, Succeeded):
                    sent.add(event.rid)
                    await guest.run(publisher.apublish, pd.stored_events(prompts[event.rid]))
                elif isinstance(event, Failed):
                    raise SystemExit(f"Prefill failed {event.rid}: {event.reason}")
            await asyncio.sleep(0.002)
        blocks = await reader

    for rid, event in done.items():
        if not isinstance(event, RemotePrefillDone):
            raise SystemExit(f"Decode failed {rid}: {event}")
        if event.bootstrap_token != pd.expected_token(rooms[rid]):
            raise SystemExit(f"{rid}: wrong bootstrap token {event.bootstrap_token}")
        if pd.verify(rooms[rid], manifests[rid]):
            raise SystemExit(f"{rid}: the KV that arrived differs from what was sent")
    return (
        f"asyncio guest engine: {len(done)} requests transferred, KV verified, "
        f"{blocks} KV blocks published and read back"
    )


async def main() -> str:
    pd = LocalPD()
    try:
        async with open_trio_guest(name="the example's Trio guest") as guest:
            return await engine(guest, pd)
    finally:
        pd.close()


if __name__ == "__main__":
    print(asyncio.run(main()))
    sys.exit(0)
