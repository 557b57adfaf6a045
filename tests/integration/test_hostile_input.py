"""Hostile input cannot crash, bloat or flood live peers (the hardening issue's CI test).

One Prefill rank and one Decode rank (TP 1) on the real Mooncake engine and their
bootstrap server run in this process on 127.0.0.1. A seeded generator
(:class:`tspd.bench.hostile.HostileInput`, the one ``tspd bench hostile`` uses) sends
thousands of random and mutated multipart messages at the Prefill's control socket
and the Decode's status socket — random frames, truncated and extended
registrations, bad endpoints, huge, negative and non-canonical numbers, giant
candidate frames, frames over the size limit, valid registrations from ever new
sessions with reply endpoints the attacker chose — and random HTTP at the bootstrap
server, including requests that stop half-way. Then a normal batch of rooms must
all succeed with every byte verified, and the peers must be back where they were:
descriptors, tables, and a log that did not grow with the attack.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from tspd.bench.hostile import Attack, HttpAttack, Targets
from tspd.bench.victims import (
    GOOD_ROOMS,
    LogTally,
    PrefillRooms,
    RoomOutcome,
    decode_rooms,
    fds_of,
    mooncake_decode,
    mooncake_prefill,
    workload,
)
from tspd.core.bootstrap import build_route_payload
from tspd.core.prefill import FAILED_ROOM_MEMORY, REJECTED_SESSION_MEMORY
from tspd.shell.bootstrap import BootstrapClient, BootstrapServer, open_bootstrap_server
from tspd.shell.decode import DecodePeer
from tspd.shell.http import HttpLimits
from tspd.shell.prefill import PrefillPeer

pytest.importorskip("mooncake.engine")

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]

MESSAGES = 4000
HTTP_REQUESTS = 40
SLOW_CONNECTIONS = 4
PUSH_SOCKETS = 32
PREFILL_EMPTY = (
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
)
DECODE_EMPTY = ("rooms", "tracked_requests", "routes", "completions", "waiting", "tracker_rooms")


class Peers:
    """The live peers, their scheduler stand-ins and the bootstrap server."""

    def __init__(self, server: BootstrapServer, prefill: PrefillPeer, decode: DecodePeer) -> None:
        self.server = server
        self.prefill = prefill
        self.decode = decode
        self.work = workload()
        self.rooms = PrefillRooms(prefill, self.work)

    async def run_rooms(self, first: int, count: int) -> tuple[RoomOutcome, RoomOutcome]:
        """Serve ``count`` rooms on both sides at once; (Decode, Prefill) outcomes."""
        batch = list(range(first, first + count))
        outcomes: dict[str, RoomOutcome] = {}

        async def decode_side() -> None:
            outcomes["decode"] = await decode_rooms(
                self.decode, self.work, batch, self.server.address
            )

        async with trio.open_nursery() as nursery:
            self.rooms.expect(batch)
            nursery.start_soon(decode_side)
            outcomes["prefill"] = await self.rooms.collect(batch)
        return outcomes["decode"], outcomes["prefill"]


@asynccontextmanager
async def live_peers() -> AsyncIterator[Peers]:
    contract = workload().contract(1)
    limits = HttpLimits(
        request_timeout=1.0, keep_alive_timeout=2.0, read_timeout=3.0, max_connections=64
    )
    async with (
        open_bootstrap_server(limits=limits) as server,
        mooncake_prefill(
            contract,
            bootstrap=server.address,
            settings={"push_sockets": PUSH_SOCKETS, "push_idle_ttl": 1.0},
            bootstrap_timeout=2.0,
            failed_session_ttl=2.0,
        ) as prefill,
        mooncake_decode(contract) as decode,
        trio.open_nursery() as nursery,
    ):
        assert prefill.registered_with_bootstrap
        peers = Peers(server, prefill, decode)
        nursery.start_soon(peers.rooms.run)
        yield peers
        nursery.cancel_scope.cancel()


def _attack(peers: Peers) -> tuple[Attack, HttpAttack]:
    """The attacker's sockets and HTTP client (created in this thread)."""
    contract = peers.prefill.core.config.contract.to_json()
    targets = Targets(
        contract=contract,
        control_port=peers.prefill.control_port,
        status_port=peers.decode.status_port,
    )
    attack = Attack(targets, seed=20240601, sinks=4, closed=8, sockets=2)
    payload = build_route_payload(
        rank_ip="127.0.0.1",
        rank_port=peers.prefill.control_port,
        engine_rank=0,
        world_size=1,
        dp_size=1,
        cache_layout=contract,
    )
    return attack, HttpAttack(peers.server.address, attack.gen, payload)


def _flood(attack: Attack, http: HttpAttack) -> int:
    """The attack, in a worker thread: ZMQ messages interleaved with HTTP requests and
    a few half-sent requests held open; returns how many half-sent requests the server
    closed."""
    with http.slow(SLOW_CONNECTIONS) as held:
        for target in ("control", "status"):
            attack.send_oversized(target)  # each on a connection libzmq then drops
        per_round = MESSAGES // HTTP_REQUESTS
        for _ in range(HTTP_REQUESTS):
            attack.run(per_round, mix={"control": 50, "status": 50})
            http.one(timeout=2.0)
        attack.run(MESSAGES - per_round * HTTP_REQUESTS, mix={"control": 50, "status": 50})
        return http.closed_by_server(held, within=5.0)


async def _eventually(check: Any, what: Any, limit: float = 10.0) -> None:
    with trio.move_on_after(limit):
        for _ in iter(int, 1):
            if check():
                break
            await trio.sleep(0.05)
    assert check(), what() if callable(what) else what


def _zmq_sockets() -> Counter[str]:
    """Open sockets of the process-wide ZMQ context, by type and endpoint."""
    import zmq

    out: Counter[str] = Counter()
    for sock in list(zmq.Context.instance()._sockets):
        if not sock.closed:
            endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
            out[f"{zmq.SocketType(sock.type).name} {endpoint!r}"] += 1
    return out


def _fd_kinds() -> Counter[str]:
    """This process's descriptors by kind (``socket``, ``anon_inode:[eventfd]``...)."""
    kinds: Counter[str] = Counter()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            kinds[re.sub(r"\[\d+\]", "", os.readlink(f"/proc/self/fd/{name}"))] += 1
    return kinds


async def test_hostile_input_leaves_the_peers_serving_and_bounded() -> None:
    tally = LogTally()
    with tally.attached(logging.INFO):
        async with live_peers() as peers:
            decoded, served = await peers.run_rooms(GOOD_ROOMS, 5)
            assert (decoded.ok, served.ok) == (5, 5), (decoded, served)
            await trio.sleep(0.2)
            fds_before, kinds_before = fds_of(), _fd_kinds()
            zmq_before = _zmq_sockets()
            prefill_before = peers.prefill.statistics()
            lines_before = tally.warning_lines

            attack, http = _attack(peers)
            try:
                slow_closed = await trio.to_thread.run_sync(_flood, attack, http)
                await trio.sleep(0.5)
                attack.settle(0.2)
            finally:
                attack.close()
            figures = attack.figures
            sent = figures.messages
            assert sent >= MESSAGES
            assert not figures.send_timeouts, figures.send_timeouts  # both peers kept reading
            valid_registrations = attack.gen.kinds["control:registration_valid"]

            # A normal batch of rooms: every one succeeds, every byte verified.
            decoded, served = await peers.run_rooms(GOOD_ROOMS + 5, 20)
            assert decoded.ok == 20, decoded
            assert served.ok == 20, served
            assert decoded.bytes_verified > 0

            # The bootstrap server answered the junk, closed the half-sent requests
            # and still routes Decode ranks to the Prefill's control socket.
            assert slow_closed == SLOW_CONNECTIONS
            assert sum(http.answers.values()) == HTTP_REQUESTS
            assert not {a for a in http.answers if a.startswith("5") and a != "503"}, http.answers
            async with BootstrapClient() as client:
                info = await client.get_rank_info(peers.server.address, 0, 0)
            assert info.rank_port == peers.prefill.control_port

            # Tables back to where they were: rooms the attacker pre-allocated are
            # dropped after the bootstrap timeout (1.5 s here).
            def prefill_settled() -> bool:
                stats = peers.prefill.statistics()
                return all(stats[k] == prefill_before[k] for k in PREFILL_EMPTY)

            def decode_settled() -> bool:
                stats = peers.decode.statistics()
                return all(stats[k] == 0 for k in DECODE_EMPTY)

            await _eventually(prefill_settled, f"Prefill tables {peers.prefill.statistics()}")
            await _eventually(decode_settled, f"Decode tables {peers.decode.statistics()}")
            stats = peers.prefill.statistics()
            assert stats["registrations"] <= prefill_before["registrations"] + valid_registrations
            assert stats["rejected"] <= REJECTED_SESSION_MEMORY
            assert stats["failed_room_memory"] <= FAILED_ROOM_MEMORY
            assert peers.prefill._pushes.stats.sockets <= PUSH_SOCKETS

            # Descriptors: the push pool closes idle sockets after 1 s here.
            await _eventually(
                lambda: fds_of() <= fds_before + 2,
                lambda: (
                    f"descriptors {fds_of()} vs {fds_before} before the attack: "
                    f"{_fd_kinds() - kinds_before} more, push pools "
                    f"{peers.prefill._pushes.stats} / {peers.decode._pushes.stats}; ZMQ "
                    f"sockets {_zmq_sockets() - zmq_before} more"
                ),
            )
            lines = tally.warning_lines - lines_before
            top = tally.by_template.most_common(4)

    # At most one log line per 20 hostile messages (rate-limited per reason).
    bound = max(200, sent // 20)
    assert lines <= bound, f"{lines} log lines for {sent} hostile messages: {top}"
