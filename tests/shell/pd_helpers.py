"""Helpers shared by the PD peer tests."""

from __future__ import annotations

from collections.abc import Callable

import trio


async def wait_until(
    condition: Callable[[], bool], limit: float = 10.0, step: float = 0.001
) -> None:
    """Poll ``condition`` until it holds; fail the test after ``limit`` seconds."""
    with trio.fail_after(limit):
        for _ in iter(int, 1):
            if condition():
                return
            await trio.sleep(step)


class DecodeStub:
    """A hand-driven Decode rank for Prefill peer tests: a registered arena on a fake
    engine, a status PULL socket, and a PUSH to the Prefill control socket."""

    def __init__(self, contract, engine, *, tp_size: int = 1, tp_rank: int = 0) -> None:  # type: ignore[no-untyped-def]
        import zmq

        from tspd.shell.arena import HostArena
        from tspd.shell.zmq import bind_free_port, open_socket
        from tspd.testing.layouts import PageAllocator

        self.contract = contract
        self.engine = engine
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.arena = HostArena.for_contract(contract)
        engine.register_memory(self.arena.base, self.arena.size)
        ctx = zmq.Context.instance()
        self.status = open_socket(ctx, zmq.PULL)
        self.port = bind_free_port(self.status)
        self.push = open_socket(ctx, zmq.PUSH)
        self.pages = PageAllocator(contract)
        self.received: list[object] = []

    def connect(self, control_port: int) -> None:
        self.push.sock.connect(f"tcp://127.0.0.1:{control_port}")

    def registration_frames(self, **changes: object) -> list[bytes]:
        import dataclasses

        from tspd.core import wire

        reg = wire.Registration(
            endpoint="127.0.0.1",
            port=self.port,
            session_id=self.engine.session_id,
            arena_base=self.arena.base,
            contract=self.contract,
            contract_bytes=self.contract.to_json(),
            decode_tp_size=self.tp_size,
            decode_tp_rank=self.tp_rank,
        )
        return wire.encode_registration(dataclasses.replace(reg, **changes))

    async def register(self, **changes: object) -> None:
        await self.push.send_multipart(self.registration_frames(**changes))

    async def preallocate(self, room: int, prompt_len: int, *, dummy: bool = False):  # type: ignore[no-untyped-def]
        from tspd.core import wire
        from tspd.core.manifest import build_manifest

        if dummy:
            await self.push.send_multipart(
                wire.encode_preallocation(room, self.engine.session_id, None)
            )
            return None
        tables = self.pages.allocate(prompt_len)
        manifest = build_manifest(self.contract, tables, 0, prompt_len)
        await self.push.send_multipart(
            wire.encode_preallocation(room, self.engine.session_id, manifest)
        )
        return manifest

    async def next_status(self, limit: float = 10.0):  # type: ignore[no-untyped-def]
        from tspd.core import wire

        with trio.fail_after(limit):
            return wire.decode_status(await self.status.recv_multipart())

    def close(self) -> None:
        self.status.close()
        self.push.close()
        self.engine.unregister_memory(self.arena.base)
        self.arena.close()


def port_is_free(port: int) -> bool:
    """Whether ``127.0.0.1:port`` can be bound (ZMQ releases a closed socket's port
    from its I/O thread, a moment after ``close``)."""
    import socket

    with socket.socket() as probe:
        # SO_REUSEADDR: connections the closed socket had accepted may linger in
        # TIME_WAIT; only a socket still listening makes the bind fail.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class ClosedPorts:
    """Ports on 127.0.0.1 that refuse connections and that no one else can bind
    while held: each is a TCP socket bound without listening. For tests that need
    many distinct, harmless destinations; release a port only once nothing of the
    test connects to it any more."""

    def __init__(self) -> None:
        import socket

        self._socket = socket
        self._held: dict[int, object] = {}

    def take(self, count: int) -> list[int]:
        ports = []
        for _ in range(count):
            sock = self._socket.socket()
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            self._held[port] = sock
            ports.append(port)
        return ports

    def release(self, ports: list[int]) -> None:
        for port in ports:
            self._held.pop(port).close()  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self._held)

    def close(self) -> None:
        self.release(list(self._held))


def open_fds() -> int:
    """How many file descriptors this process has open."""
    import os

    return len(os.listdir("/proc/self/fd"))


async def poll_for(peer, rid: str, limit: float = 10):  # type: ignore[no-untyped-def]
    """Poll a Prefill or Decode peer until it concludes an event for ``rid``."""
    with trio.fail_after(limit):
        while True:
            for event in await peer.poll():
                if event.rid == rid:
                    return event
            await trio.sleep(0.002)


async def serve_prefill(
    peers, rid: str, room: int, prompt: int, *, seed: int, contiguous: bool = True
):  # type: ignore[no-untyped-def]
    """Every rank of a Prefill group registers the request, waits for Bootstrapped,
    fills its pages with the interop pattern and hands them over; the group's one
    outcome (every rank must agree)."""
    from tspd.core.commands import Bootstrapped
    from tspd.core.interop import bootstrap_token_and_candidates
    from tspd.core.manifest import build_manifest
    from tspd.shell.arena import fill_room
    from tspd.shell.prefill import RemoteDecodeRow
    from tspd.testing.layouts import PageAllocator

    results = {}

    async def rank(peer) -> None:  # type: ignore[no-untyped-def]
        peer.register_request(rid, room)
        event = await poll_for(peer, rid)
        if not isinstance(event, Bootstrapped):
            results[peer.core.config.tp_rank] = event
            return
        contract = peer.core.config.contract
        tables = PageAllocator(contract, contiguous=contiguous).allocate(prompt)
        fill_room(
            peer.arena,
            contract,
            build_manifest(contract, tables, 0, prompt),
            seed=seed,
            room=room,
            tp_size=peer.core.config.tp_size,
            tp_rank=peer.core.config.tp_rank,
        )
        token, candidates = bootstrap_token_and_candidates(seed, room, 2)
        peer.hand_over([RemoteDecodeRow(rid, tables, token, candidates)])
        results[peer.core.config.tp_rank] = await poll_for(peer, rid)

    async with trio.open_nursery() as nursery:
        for peer in peers:
            nursery.start_soon(rank, peer)
    assert len({type(e) for e in results.values()}) == 1, results
    return results[0]


async def serve_decode(
    decode, rid: str, room: int, addr: str, prompt: int, *, contiguous: bool = True
):  # type: ignore[no-untyped-def]
    """A Decode rank registers the request, pre-allocates on Bootstrapped and waits
    for the outcome: ``(event, manifest)`` (``manifest`` ``None`` when it never
    pre-allocated)."""
    from tspd.core.commands import Bootstrapped
    from tspd.core.manifest import build_manifest
    from tspd.testing.layouts import PageAllocator

    decode.register_request(rid, room, addr)
    event = await poll_for(decode, rid)
    if not isinstance(event, Bootstrapped):
        return event, None
    contract = decode.core.config.contract
    tables = PageAllocator(contract, contiguous=contiguous).allocate(prompt)
    manifest = build_manifest(contract, tables, 0, prompt)
    decode.send_preallocation(room, manifest)
    return await poll_for(decode, rid), manifest
