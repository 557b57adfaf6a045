"""A Trio engine: tspd's own API, no bridge.

Run it: ``python examples/trio_engine.py``. A Trio host needs nothing from
``tspd.hosts`` but the local rig: it enters the peers and KV-event services with
``async with`` and calls them directly. Everything stays on 127.0.0.1 with fake
transfer engines (``tspd.testing.local_pd.LocalPD``). Exits 0 and prints a summary
line when every request arrived intact on Decode and the published KV blocks
were read back.
"""

from __future__ import annotations

import sys

import trio

from tspd.core.commands import Bootstrapped, Event, Failed, RemotePrefillDone, Succeeded
from tspd.core.kv_events import AllBlocksCleared, BlockStored
from tspd.core.manifest import BlockManifest
from tspd.shell.kv_subscriber import KVEventSubscriber, ReceivedBatch
from tspd.testing.local_pd import LocalPD, Prompt

PROMPT = 12
REQUESTS = ("req-1", "req-2", "req-3")


async def read_blocks(subscriber: KVEventSubscriber, joined: trio.Event, count: int) -> int:
    """The router side: count stored blocks until ``count`` arrived."""
    blocks = 0
    async for item in subscriber:
        if isinstance(item, ReceivedBatch):
            joined.set()
            blocks += sum(isinstance(e, BlockStored) for e in item.batch.events)
            if blocks >= count:
                break
    return blocks


async def engine(pd: LocalPD) -> str:
    async with (
        pd.bootstrap_server() as server,
        pd.prefill_peer(server.address) as prefill,
        pd.decode_peer() as decode,
        pd.subscriber() as subscriber,
        pd.publisher() as publisher,
        trio.open_nursery() as nursery,
    ):
        joined, read_all = trio.Event(), trio.Event()
        counted: list[int] = []

        async def reader() -> None:
            counted.append(await read_blocks(subscriber, joined, (PROMPT // 4) * len(REQUESTS)))
            read_all.set()

        nursery.start_soon(reader)
        while not joined.is_set():  # the PUB connects asynchronously
            await publisher.apublish([AllBlocksCleared()])
            with trio.move_on_after(0.05):
                await joined.wait()

        rooms = {rid: 900 + i for i, rid in enumerate(REQUESTS)}
        for rid, room in rooms.items():
            decode.register_request(rid, room, server.address)
            prefill.register_request(rid, room)

        prompts: dict[str, Prompt] = {}
        manifests: dict[str, BlockManifest] = {}
        done: dict[str, Event] = {}
        sent: set[str] = set()
        with trio.fail_after(30):
            while len(done) < len(rooms) or len(sent) < len(rooms):
                for event in await decode.poll():
                    if isinstance(event, Bootstrapped):
                        manifests[event.rid] = pd.preallocation(rooms[event.rid], PROMPT)
                        decode.send_preallocation(rooms[event.rid], manifests[event.rid])
                    elif isinstance(event, RemotePrefillDone | Failed):
                        done[event.rid] = event
                for event in await prefill.poll():
                    if isinstance(event, Bootstrapped):
                        prompts[event.rid] = pd.prompt(event.rid, rooms[event.rid], PROMPT)
                        prefill.hand_over([prompts[event.rid].row])
                    elif isinstance(event, Succeeded):
                        sent.add(event.rid)
                        await publisher.apublish(pd.stored_events(prompts[event.rid]))
                    elif isinstance(event, Failed):
                        raise SystemExit(f"Prefill failed {event.rid}: {event.reason}")
                await trio.sleep(0.002)
            await read_all.wait()

    for rid, event in done.items():
        pd.check_outcome(rid, event, rooms[rid], manifests[rid])
    return (
        f"trio engine: {len(done)} requests transferred, KV verified, "
        f"{counted[0]} KV blocks published and read back"
    )


def main() -> str:
    pd = LocalPD()
    try:
        return trio.run(engine, pd)
    finally:
        pd.close()


if __name__ == "__main__":
    print(main())
    sys.exit(0)
