"""A plain-thread engine: a scheduler loop in an ordinary thread, tspd in a Trio thread.

Run it: ``python examples/thread_engine.py``. The scheduler thread never awaits
anything: ``open_trio_thread`` runs the peers and KV-event services in a
background Trio thread, and the facades' entry points (register, hand over,
pre-allocate) return a future at once; ``poll()`` waits only for its poll round,
never for a transfer. Everything stays on 127.0.0.1 with fake transfer engines
(``tspd.testing.local_pd.LocalPD``). Exits 0 and prints a summary line when every
request arrived intact on Decode and the published KV blocks were read back.
"""

from __future__ import annotations

import sys
import threading
import time

from tspd.core.commands import Bootstrapped, Event, Failed, RemotePrefillDone, Succeeded
from tspd.core.kv_events import AllBlocksCleared, BlockStored
from tspd.core.manifest import BlockManifest
from tspd.hosts.threads import (
    ThreadedDecode,
    ThreadedPrefill,
    ThreadedSubscriber,
    TrioThread,
    open_trio_thread,
)
from tspd.shell.kv_subscriber import ReceivedBatch
from tspd.testing.local_pd import LocalPD, Prompt

PROMPT = 12
REQUESTS = ("req-1", "req-2", "req-3")


def read_blocks(subscriber: ThreadedSubscriber, count: int, result: list[int]) -> None:
    """The router side, in a thread of its own: count stored blocks."""
    blocks = 0
    deadline = time.monotonic() + 30
    while blocks < count and time.monotonic() < deadline:
        item = subscriber.get(timeout=0.1)
        if isinstance(item, ReceivedBatch):
            blocks += sum(isinstance(e, BlockStored) for e in item.batch.events)
    result.append(blocks)


def scheduler(host: TrioThread, pd: LocalPD) -> str:
    server = host.enter(pd.bootstrap_server(), name="bootstrap server")
    prefill = ThreadedPrefill(host, host.enter(pd.prefill_peer(server.address)))
    decode = ThreadedDecode(host, host.enter(pd.decode_peer()))
    subscriber = ThreadedSubscriber(host, host.enter(pd.subscriber()))
    publisher = host.enter(pd.publisher(), name="KV publisher")

    # The PUB connects asynchronously: announce an empty cache until it is heard.
    heard = False
    while not heard:
        publisher.publish([AllBlocksCleared()])
        heard = isinstance(subscriber.get(timeout=0.05), ReceivedBatch)
    counted: list[int] = []
    reader = threading.Thread(
        target=read_blocks, args=(subscriber, (PROMPT // 4) * len(REQUESTS), counted)
    )
    reader.start()

    rooms = {rid: 700 + i for i, rid in enumerate(REQUESTS)}
    for rid, room in rooms.items():
        decode.register_request(rid, room, server.address)
        prefill.register_request(rid, room)

    prompts: dict[str, Prompt] = {}
    manifests: dict[str, BlockManifest] = {}
    done: dict[str, Event] = {}
    sent: set[str] = set()
    deadline = time.monotonic() + 30
    while len(done) < len(rooms) or len(sent) < len(rooms):
        if time.monotonic() > deadline:
            raise SystemExit(f"requests did not finish: done={done} sent={sent}")
        # An idle round waits (at most 1 ms each) for the peer's activity in the same
        # crossing that brings its events: no sleep-polling.
        for event in decode.poll(wait=0.001):
            if isinstance(event, Bootstrapped):
                manifests[event.rid] = pd.preallocation(rooms[event.rid], PROMPT)
                decode.send_preallocation(rooms[event.rid], manifests[event.rid])
            elif isinstance(event, RemotePrefillDone | Failed):
                done[event.rid] = event
        for event in prefill.poll(wait=0.001):
            if isinstance(event, Bootstrapped):
                prompts[event.rid] = pd.prompt(event.rid, rooms[event.rid], PROMPT)
                prefill.hand_over([prompts[event.rid].row])  # returns at once
            elif isinstance(event, Succeeded):
                sent.add(event.rid)
                publisher.publish(pd.stored_events(prompts[event.rid]))
            elif isinstance(event, Failed):
                raise SystemExit(f"Prefill failed {event.rid}: {event.reason}")
    reader.join()

    for rid, event in done.items():
        pd.check_outcome(rid, event, rooms[rid], manifests[rid])
    return (
        f"thread engine: {len(done)} requests transferred, KV verified, "
        f"{counted[0]} KV blocks published and read back"
    )


def main() -> str:
    pd = LocalPD()
    try:
        with open_trio_thread(name="example-trio") as host:
            return scheduler(host, pd)
    finally:
        pd.close()


if __name__ == "__main__":
    print(main())
    sys.exit(0)
