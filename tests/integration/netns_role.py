"""One Prefill or Decode rank in its own process, fed rooms on stdin by a router.

Started by ``test_netns.py`` inside a host's network namespace: the test plays the
router and writes each room (a decimal number, one a line) to the Prefill and the
Decode at the same time, as a PD router sends one request to both instances. Unlike
``tspd demo prefill|decode``, which serve a fixed range as fast as they can, rooms
arrive here when the router says, so a fault can be injected while traffic flows
and a restarted Prefill only ever gets rooms sent after it came back.

    python netns_role.py prefill|decode --host IP --bootstrap IP:PORT

Timeouts come from TokenSpeed's variables (``TOKENSPEED_DISAGGREGATION_*``); the
Decode's heartbeat interval and quarantine bound from the options. The KV bytes
follow the interop pattern: the Prefill writes it, the Decode checks every byte and
the bootstrap token (docs/protocol.md#proto-interop). The Prefill hands a room's KV
over ``--forward-seconds`` after it is ``Bootstrapped``, as a prefill forward would:
rooms stay in flight long enough for a fault to catch some.

Stdout, one JSON object a line, ``t`` from ``time.monotonic()`` (the same clock in
every network namespace):

* ``{"event": "ready", ...}`` once the peer runs (Prefill: registered with the
  bootstrap server);
* ``{"event": "room", "room", "ok", "reason", "reason_class", "t", "registered"}``
  per room that ended (``registered``: when it was registered);
* ``{"event": "done", "live": [...]}`` after stdin closed and every room ended, or
  after ``--drain-limit`` seconds with the rooms still live (lost: exit status 1).

A Decode keeps a failed room's pages while a Prefill rank may still write them
(``Failed.pages_held``) until ``PagesReleased``; a room whose pages cannot be had yet
waits for them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from tspd.core.commands import Bootstrapped, Failed, PagesReleased, RemotePrefillDone, Succeeded
from tspd.core.contract import CacheContract
from tspd.core.decode import DecodeConfig
from tspd.core.errors import ConfigError, TspdError
from tspd.core.interop import bootstrap_token_and_candidates
from tspd.core.manifest import BlockManifest, build_manifest
from tspd.core.prefill import PrefillConfig
from tspd.demo.workload import Workload
from tspd.layouts import PageAllocator
from tspd.log import configure_logging
from tspd.shell.arena import HostArena, clear_room, fill_room, verify_room
from tspd.shell.decode import DecodePeer, DecodeSettings, open_decode_peer
from tspd.shell.engine_setup import open_mooncake_engine
from tspd.shell.offload import EngineRunner
from tspd.shell.prefill import PrefillPeer, PrefillSettings, RemoteDecodeRow, open_prefill_peer

#: The longest a scheduler iteration without events waits for the peer.
IDLE = 0.005


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": time.monotonic(), **fields}), flush=True)


class Router:
    """Rooms from stdin: ``take()`` returns those that arrived; ``closed`` once stdin
    ended."""

    def __init__(self) -> None:
        self.arrived: deque[int] = deque()
        self.closed = False
        self.wake = trio.Event()

    async def read(self) -> None:
        stream = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        buffer = b""
        async with stream:
            while chunk := await stream.receive_some(65536):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                self.arrived.extend(int(line) for line in lines if line.strip())
                self.wake.set()
        self.closed = True
        self.wake.set()

    def take(self) -> list[int]:
        rooms = list(self.arrived)
        self.arrived.clear()
        return rooms

    async def idle(self, peer: PrefillPeer | DecodePeer) -> None:
        """Wait for the peer's activity or a new room, at most :data:`IDLE`."""
        with trio.move_on_after(IDLE):
            async with trio.open_nursery() as nursery:

                async def either(wait: Any) -> None:
                    await wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(either, peer.wait_for_activity)
                nursery.start_soon(either, self.wake.wait)
        if self.wake.is_set():
            self.wake = trio.Event()


def _failure(peer: PrefillPeer | DecodePeer, room: int) -> str | None:
    trace = peer.trace(room)
    return None if trace is None or trace.reason_class is None else str(trace.reason_class)


@asynccontextmanager
async def _engine(host: str) -> AsyncIterator[EngineRunner]:
    """This rank's Mooncake engine for the block, set up off the Trio thread."""
    async with open_mooncake_engine(host) as mooncake:
        yield EngineRunner.from_env(mooncake, os.environ)


async def prefill(args: argparse.Namespace, workload: Workload, contract: CacheContract) -> int:
    config = PrefillConfig.from_env(
        os.environ, tp_size=1, tp_rank=0, contract=contract, arena_base=1, transfer_workers=2
    )
    settings = PrefillSettings(host=args.host, bootstrap_addr=args.bootstrap)
    pages = PageAllocator(contract)
    router = Router()
    live: dict[str, tuple[int, float]] = {}
    tables: dict[str, dict[str, list[int]]] = {}
    # Bootstrapped rooms in order, each with when its "forward" is done.
    forwards: deque[tuple[float, str]] = deque()
    with HostArena.for_contract(contract) as arena:
        async with (
            _engine(args.host) as engine,
            open_prefill_peer(config, engine, arena, settings=settings) as peer,
            trio.open_nursery() as nursery,
        ):
            emit(
                "ready",
                control=f"tcp://{args.host}:{peer.control_port}",
                session=engine.session_id,
                registered=peer.registered_with_bootstrap,
            )
            nursery.start_soon(router.read)
            drain_until: float | None = None
            while not (router.closed and not live and not router.arrived):
                if router.closed and drain_until is None:
                    drain_until = time.monotonic() + args.drain_limit
                if drain_until is not None and time.monotonic() > drain_until:
                    break
                for room in router.take():
                    rid = workload.rid(room)
                    live[rid] = (room, time.monotonic())
                    peer.register_request(rid, room)
                events = await peer.poll()
                for event in events:
                    if isinstance(event, Bootstrapped):
                        forwards.append((time.monotonic() + args.forward_seconds, event.rid))
                    elif isinstance(event, Succeeded | Failed):
                        room, registered = live.pop(event.rid)
                        if event.rid in tables:
                            pages.release(tables.pop(event.rid))
                        ok = isinstance(event, Succeeded)
                        emit(
                            "room",
                            room=room,
                            ok=ok,
                            reason=None if ok else event.reason,  # type: ignore[union-attr]
                            reason_class=None if ok else _failure(peer, room),
                            registered=registered,
                        )
                rows = []
                while forwards and forwards[0][0] <= time.monotonic():
                    rid = forwards[0][1]
                    if rid not in live:
                        forwards.popleft()
                        continue
                    room = live[rid][0]
                    prompt = workload.prompt_len(room, contract)
                    try:
                        tables[rid] = pages.allocate(prompt)
                    except ConfigError:
                        break  # out of pages: this room waits for others to end
                    forwards.popleft()
                    manifest = build_manifest(contract, tables[rid], 0, prompt)
                    fill_room(peer.arena, contract, manifest, seed=workload.seed, room=room)
                    token, candidates = bootstrap_token_and_candidates(
                        workload.seed, room, workload.candidates
                    )
                    rows.append(RemoteDecodeRow(rid, tables[rid], token, candidates))
                if rows:
                    try:
                        peer.hand_over(rows)
                    except TspdError as err:  # a room that failed meanwhile
                        logging.getLogger("netns_role").warning("hand-over: %s", err)
                if not events:
                    await router.idle(peer)
            emit("done", live=sorted(room for room, _ in live.values()))
            nursery.cancel_scope.cancel()
    return 1 if live else 0


async def decode(args: argparse.Namespace, workload: Workload, contract: CacheContract) -> int:
    config = DecodeConfig.from_env(
        os.environ,
        tp_size=1,
        tp_rank=0,
        contract=contract,
        arena_base=1,
        session_id="",
        endpoint=args.host,
        port=1,
        quarantine_timeout=args.quarantine,
    )
    settings = DecodeSettings(host=args.host, heartbeat_interval=args.heartbeat_interval)
    pages = PageAllocator(contract)
    router = Router()
    live: dict[str, tuple[int, float]] = {}
    held: dict[str, tuple[dict[str, list[int]], BlockManifest]] = {}
    fenced: dict[str, dict[str, list[int]]] = {}  # failed rooms' pages Prefill may write
    waiting_pages: deque[str] = deque()
    with HostArena.for_contract(contract) as arena:
        async with (
            _engine(args.host) as engine,
            open_decode_peer(config, engine, arena, settings=settings) as peer,
            trio.open_nursery() as nursery,
        ):
            emit("ready", status=f"tcp://{args.host}:{peer.status_port}", session=engine.session_id)
            nursery.start_soon(router.read)
            drain_until: float | None = None
            while not (router.closed and not live and not router.arrived):
                if router.closed and drain_until is None:
                    drain_until = time.monotonic() + args.drain_limit
                if drain_until is not None and time.monotonic() > drain_until:
                    break
                for room in router.take():
                    rid = workload.rid(room)
                    live[rid] = (room, time.monotonic())
                    peer.register_request(rid, room, args.bootstrap)
                events = await peer.poll()
                for event in events:
                    if isinstance(event, Bootstrapped):
                        waiting_pages.append(event.rid)
                    elif isinstance(event, PagesReleased):
                        pages.release(fenced.pop(event.rid))
                    elif isinstance(event, RemotePrefillDone | Failed):
                        room, registered = live.pop(event.rid)
                        row = held.pop(event.rid, None)
                        ok, reason = _check(event, room, row, arena, contract, workload)
                        if row is not None:
                            if isinstance(event, Failed) and event.pages_held:
                                fenced[event.rid] = row[0]
                            else:
                                pages.release(row[0])
                        emit(
                            "room",
                            room=room,
                            ok=ok,
                            reason=reason,
                            reason_class=_failure(peer, room)
                            if isinstance(event, Failed)
                            else None,
                            registered=registered,
                        )
                while waiting_pages and waiting_pages[0] in live:
                    rid = waiting_pages[0]
                    room = live[rid][0]
                    prompt = workload.prompt_len(room, contract)
                    try:
                        table = pages.allocate(prompt)
                    except ConfigError:
                        break  # out of pages: this room waits for others to end
                    waiting_pages.popleft()
                    manifest = build_manifest(contract, table, 0, prompt)
                    clear_room(arena, contract, manifest)
                    held[rid] = (table, manifest)
                    peer.send_preallocation(room, manifest)
                while waiting_pages and waiting_pages[0] not in live:
                    waiting_pages.popleft()
                if not events:
                    await router.idle(peer)
            emit("done", live=sorted(room for room, _ in live.values()), fenced=len(fenced))
            nursery.cancel_scope.cancel()
    return 1 if live else 0


def _check(
    event: RemotePrefillDone | Failed,
    room: int,
    row: tuple[dict[str, list[int]], BlockManifest] | None,
    arena: HostArena,
    contract: CacheContract,
    workload: Workload,
) -> tuple[bool, str | None]:
    """A finished room: (ok, reason); the token and every byte are checked."""
    if isinstance(event, Failed):
        return False, event.reason
    if row is None:
        return False, "RemotePrefillDone for a room this rank never pre-allocated"
    token, candidates = bootstrap_token_and_candidates(workload.seed, room, workload.candidates)
    if (event.bootstrap_token, event.spec_candidate_ids) != (token, candidates):
        return False, f"bootstrap token {event.bootstrap_token} differs from the pattern's {token}"
    mismatches = verify_room(arena, contract, row[1], seed=workload.seed, room=room)
    if mismatches:
        return False, f"byte mismatch: {mismatches[0]} ({len(mismatches)} in all)"
    return True, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--bootstrap", required=True, help="host:port of the bootstrap server")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="Decode, seconds")
    parser.add_argument("--quarantine", type=float, default=10.0, help="Decode, seconds")
    parser.add_argument(
        "--forward-seconds",
        type=float,
        default=0.5,
        help="Prefill: how long each room's forward takes before its KV is handed over",
    )
    parser.add_argument("--drain-limit", type=float, default=30.0)
    parser.add_argument("--pages", type=int, default=2048)
    parser.add_argument("--max-prompt-pages", type=int, default=4)
    args = parser.parse_args()
    configure_logging(logging.WARNING, stream=sys.stderr)
    workload = Workload(
        rooms=range(1), num_pages=args.pages, max_prompt_pages=args.max_prompt_pages
    )
    contract = workload.contract(1)
    runner = prefill if args.role == "prefill" else decode
    sys.exit(trio.run(runner, args, workload, contract))


if __name__ == "__main__":
    main()
