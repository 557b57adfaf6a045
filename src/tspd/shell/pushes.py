"""Outgoing control messages: one PUSH socket per peer endpoint, owned by the peer.

Spec §3: status messages and failure notices (Prefill → Decode) and
registrations and pre-allocations (Decode → Prefill) go out on PUSH sockets
connected to ``tcp://<endpoint>:<port>`` and cached per endpoint for the life of
the peer. Delivery is fire-and-forget: a PUSH to a peer that is not there yet
queues, and everything above relies on timeouts and heartbeats, not
acknowledgements.

:class:`PushPool` holds every such socket. Code in the peer's Trio thread sends
with :meth:`PushPool.send_nowait`, which never blocks: the message is handed to
libzmq at once, in call order (measured: a hop through a sender task added
~50 µs to every status message). A message to a peer whose queue is full — it
is gone and libzmq's high-water mark is reached — is dropped and counted rather
than stalling every other peer's messages; the room's timeouts settle it. No
task ever waits on these sockets, so the one-FD-waiter rule of
:mod:`tspd.shell.zmq` holds trivially. :meth:`PushPool.run` is the owner task:
it keeps the pool open and closes every socket when the peer stops.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import final

import trio
import zmq

from tspd.log import component_logger
from tspd.shell.zmq import TrioSocket, open_socket

__all__ = ["PushPool", "PushStats", "endpoint_url"]

log = component_logger("push")

#: A send at least this long after the previous one yields the CPU (see send_nowait).
_YIELD_AFTER_S = 0.0005
#: The clock and the yield send_nowait uses (module names, so tests can replace them).
_now = time.perf_counter
_yield_cpu = os.sched_yield


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
    """Cached PUSH sockets, one per destination endpoint."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], *, name: str) -> None:
        self._context = context
        self._name = name
        self._sockets: dict[str, TrioSocket] = {}
        self._open = False
        self._last_send = -math.inf
        self.stats = PushStats()

    def send_nowait(
        self, endpoint: str, port: int, frames: Sequence[bytes], room: int | None = None
    ) -> None:
        """Send ``frames`` to ``endpoint:port`` now, without blocking (see the module
        doc for what happens when the peer's queue is full)."""
        if not self._open:
            log.warning(
                "%s: dropping a message to %s:%s for room %s: the peer is not running",
                self._name,
                endpoint,
                port,
                room,
            )
            self.stats.dropped += 1
            return
        url = endpoint_url(endpoint, port)
        if self._socket(url).send_multipart_nowait(frames):
            self.stats.sent += 1
            now = _now()
            if now - self._last_send >= _YIELD_AFTER_S:
                # A lone message: libzmq's I/O thread puts it on the wire, so let it
                # have the CPU now rather than after whatever this thread does next
                # (2-core host, one room in flight: ~40 µs off a status message's
                # delivery, p50). Not within bursts, where yielding per message
                # cost ~10 % of rooms/s at 256 in flight.
                _yield_cpu()
            self._last_send = now
            return
        self.stats.dropped += 1
        log.warning(
            "%s: dropped a message for room %s to %s: its queue is full "
            "(the peer is probably gone); the room's timeouts will settle it",
            self._name,
            room,
            url,
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
        """Keep the pool open until cancelled, then close every socket."""
        self._open = True
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            self._open = False
            for sock in self._sockets.values():
                sock.close()
            self._sockets.clear()
