"""Outgoing control messages: one PUSH socket per peer endpoint, one owner task.

Spec §3: status messages and failure notices (Prefill → Decode) and
registrations and pre-allocations (Decode → Prefill) go out on PUSH sockets
connected to ``tcp://<endpoint>:<port>`` and cached per endpoint for the life of
the peer. Delivery is fire-and-forget: a PUSH to a peer that is not there queues,
and everything above relies on timeouts and heartbeats, not acknowledgements.

:class:`PushPool` owns every such socket. Any code in the peer's Trio thread
hands it a message with :meth:`PushPool.send_nowait` (never blocks); the pool's
task (:meth:`PushPool.run`) sends them in order. A message to a peer whose queue
is full (the peer is gone and libzmq's high-water mark is reached) is dropped and
counted rather than stalling every other peer's messages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import trio
import zmq

from tspd.log import component_logger
from tspd.shell.zmq import TrioSocket, open_socket

__all__ = ["PushPool", "PushStats", "endpoint_url"]

log = component_logger("push")


def endpoint_url(endpoint: str, port: int) -> str:
    """``tcp://host:port`` for a peer's advertised endpoint.

    Spec §3: if ``endpoint`` contains ``:`` only the part before the first ``:``
    is the host (IPv6 literals are not supported by TokenSpeed either).
    """
    host = endpoint.split(":", 1)[0]
    return f"tcp://{host}:{port}"


@dataclass(slots=True)
class PushStats:
    """Counters of a :class:`PushPool`."""

    sent: int = 0
    dropped: int = 0
    sockets: int = 0


@final
class PushPool:
    """Cached PUSH sockets, one per destination endpoint, driven by one task."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], *, name: str) -> None:
        self._context = context
        self._name = name
        self._sockets: dict[str, TrioSocket] = {}
        self._send, self._receive = trio.open_memory_channel[
            tuple[str, Sequence[bytes], int | None]
        ](math.inf)
        self.stats = PushStats()

    def send_nowait(
        self, endpoint: str, port: int, frames: Sequence[bytes], room: int | None = None
    ) -> None:
        """Queue ``frames`` for ``endpoint:port`` (never blocks; order is kept)."""
        try:
            self._send.send_nowait((endpoint_url(endpoint, port), frames, room))
        except trio.ClosedResourceError:
            log.warning(
                "%s: dropping a message to %s:%s for room %s: the peer is shutting down",
                self._name,
                endpoint,
                port,
                room,
            )

    def _socket(self, url: str) -> TrioSocket:
        sock = self._sockets.get(url)
        if sock is None:
            sock = open_socket(self._context, zmq.PUSH)
            sock.sock.connect(url)
            self._sockets[url] = sock
            self.stats.sockets = len(self._sockets)
        return sock

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Send queued messages until cancelled; closes every socket on the way out."""
        task_status.started()
        try:
            async for url, frames, room in self._receive:
                if self._socket(url).send_multipart_nowait(frames):
                    self.stats.sent += 1
                    continue
                self.stats.dropped += 1
                log.warning(
                    "%s: dropped a message for room %s to %s: its queue is full "
                    "(the peer is probably gone); the room's timeouts will settle it",
                    self._name,
                    room,
                    url,
                )
        finally:
            self._send.close()
            for sock in self._sockets.values():
                sock.close()
            self._sockets.clear()
