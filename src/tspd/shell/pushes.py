"""Outgoing control messages: a bounded pool of PUSH sockets, one per peer endpoint.

Transport (docs/protocol.md#proto-zmq): status messages and failure notices (Prefill → Decode) and
registrations and pre-allocations (Decode → Prefill) go out on PUSH sockets
connected to ``tcp://<endpoint>:<port>``, one per endpoint. Delivery is
fire-and-forget: a PUSH to a peer that is not there yet queues, and everything
above relies on timeouts and heartbeats, not acknowledgements.

TokenSpeed keeps every such socket for the life of the process. tspd cannot:
libzmq allows 1,023 sockets a context (the next one fails with "Too many open
files"), every restarted Decode binds a new status port, so ordinary churn gets
there, and a socket to a peer that is gone reconnects forever. So
:class:`PushPool`

* keeps at most ``max_sockets`` sockets open, lingering ones included; a new
  endpoint closes the least recently used socket first;
* closes a socket unused for ``idle_ttl`` seconds;
* closes, on :meth:`PushPool.release`, the socket of a route the core no longer
  needs (a Decode session that failed or was replaced);
* reconnects with a backoff up to :data:`RECONNECT_IVL_MAX_MS` instead of every
  100 ms.

A closed route reopens on its next message. Closing keeps what was just handed
over: a released socket that sent within the last ``flush_window`` seconds
lingers (libzmq's ``ZMQ_LINGER``) for the rest of that window, so a failure
notice queued just before still reaches a connected peer; so does every such
socket when the peer stops, and the stop waits for them. Only when more than
``max_sockets`` endpoints were used within one such window does the least
recently used socket go at once (counted and logged: raise ``max_sockets``).

Code in the peer's Trio thread sends with :meth:`PushPool.send_nowait`, which
never blocks: the message is handed to libzmq at once, in call order (measured:
a hop through a sender task added ~50 µs to every status message). A message to
a peer whose queue is full — it is gone and libzmq's high-water mark is reached
— is dropped and counted rather than stalling every other peer's messages; the
room's timeouts settle it. An endpoint libzmq refuses, or any other socket
error, never escapes: the socket is closed and ``send_nowait`` returns the
reason, so the peer fails only that route's rooms. No task ever waits on these
sockets, so the one-FD-waiter rule of :mod:`tspd.shell.zmq` holds trivially.

In secure mode (``curve``, docs/security.md) every socket is a CURVE client whose
server key ``server_key(endpoint, port)`` names when the socket opens: the key the
bootstrap route gave for a Prefill rank, or the identity that registered a Decode
session. A route without a known key is refused like an unusable address: secure
mode never sends in plain.
:meth:`PushPool.run` is the owner task: it keeps the pool open, closes idle
sockets, and closes every socket when the peer stops.
"""

from __future__ import annotations

import heapq
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, final

import trio
import zmq

from tspd.log import component_logger
from tspd.shell.zmq import TrioSocket, open_socket

if TYPE_CHECKING:
    from tspd.shell.security import CurveGuard

__all__ = [
    "DEFAULT_IDLE_TTL",
    "DEFAULT_MAX_SOCKETS",
    "FLUSH_WINDOW_S",
    "RECONNECT_IVL_MAX_MS",
    "PushPool",
    "PushStats",
    "endpoint_url",
]

log = component_logger("push")

#: Sockets a pool keeps open by default. Each costs two descriptors once connected
#: (libzmq's mailbox and the TCP connection); 256 peers of one rank is a large
#: deployment, and 512 descriptors leave room under a default ``ulimit -n`` of
#: 1024 and libzmq's 1,023 sockets a context for everything else.
DEFAULT_MAX_SOCKETS: Final = 256
#: Seconds a socket may go unused before the pool closes it; its next message
#: reconnects (a millisecond on a LAN, against a minute of silence).
DEFAULT_IDLE_TTL: Final = 60.0
#: A socket closed within this many seconds of its last send lingers for the rest
#: of it: libzmq puts a message on a connected peer's wire within microseconds, and
#: 250 ms also covers a connection that is being re-established (the first retry
#: comes 100 ms after a refused connect).
FLUSH_WINDOW_S: Final = 0.25
#: libzmq's ``ZMQ_RECONNECT_IVL_MAX`` for every pool socket. libzmq retries a lost
#: or refused connection every 100 ms (``ZMQ_RECONNECT_IVL``) forever; with this the
#: interval doubles after each failed attempt up to 5 s, so a peer that is gone
#: costs one connect attempt every 5 s until the idle TTL closes its socket, and a
#: peer that comes back is reached within 5 s, well inside the rooms' timeouts
#: (bootstrap 120 s, waiting 300 s).
RECONNECT_IVL_MAX_MS: Final = 5_000

#: A send at least this long after the previous one yields the CPU (see send_nowait).
_YIELD_AFTER_S = 0.0005
#: Seconds between two warnings about busy sockets closed to make room.
_EVICT_WARN_EVERY_S: Final = 10.0
#: The clock and the yield send_nowait uses (module names, so tests can replace them).
_now = time.perf_counter
_yield_cpu = os.sched_yield


def endpoint_url(endpoint: str, port: int) -> str:
    """``tcp://host:port`` for a peer's advertised endpoint.

    Transport (docs/protocol.md#proto-zmq): if ``endpoint`` contains ``:`` only the part before the
    first ``:``
    is the host (IPv6 literals are not supported by TokenSpeed either).
    """
    host = endpoint.split(":", 1)[0]
    return f"tcp://{host}:{port}"


class _NoServerKey(Exception):
    """Secure mode: the route has no known CURVE server key."""


@dataclass(slots=True)
class PushStats:
    """Counters of a :class:`PushPool`. ``sockets``: open now, lingering ones
    included; ``failed``: messages refused outright (an address libzmq rejects, a
    socket error); ``evicted_busy``: sockets closed to make room within
    ``flush_window`` of their last send."""

    sent: int = 0
    dropped: int = 0
    sockets: int = 0
    opened: int = 0
    closed: int = 0
    failed: int = 0
    evicted_busy: int = 0


@final
class _Entry:
    __slots__ = ("last", "sock")

    def __init__(self, sock: TrioSocket, last: float) -> None:
        self.sock = sock
        self.last = last


@final
class PushPool:
    """PUSH sockets, one per destination endpoint, at most ``max_sockets`` open.

    ``idle_ttl``: seconds unused before a socket is closed (``math.inf``: never).
    ``flush_window``: how long after its last send a released socket lingers.
    ``curve``/``server_key``: secure mode (see the module doc).
    """

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        *,
        name: str,
        max_sockets: int = DEFAULT_MAX_SOCKETS,
        idle_ttl: float = DEFAULT_IDLE_TTL,
        flush_window: float = FLUSH_WINDOW_S,
        curve: CurveGuard | None = None,
        server_key: Callable[[str, int], str | None] | None = None,
    ) -> None:
        if curve is not None and server_key is None:
            raise ValueError("a secure push pool needs the server_key of each route")
        self._curve = curve
        self._server_key = server_key
        if max_sockets < 1:
            raise ValueError(f"a push pool needs room for at least 1 socket, got {max_sockets}")
        if not idle_ttl > 0:
            raise ValueError(f"the push pool's idle TTL must be positive, got {idle_ttl}")
        if flush_window < 0:
            raise ValueError(f"the push pool's flush window must be >= 0, got {flush_window}")
        self._context = context
        self._name = name
        self._max = max_sockets
        self._ttl = idle_ttl
        self._window = flush_window
        # Open sockets by URL; each entry knows when it last sent (least recently
        # used: the smallest, found by a scan when a new endpoint needs room).
        self._sockets: dict[str, _Entry] = {}
        # When each lingering socket is gone at the latest (a heap of _now() times).
        self._lingering: list[float] = []
        self._open = False
        self._last_send = -math.inf
        self._warned_at = -math.inf
        self.stats = PushStats()

    def send_nowait(
        self, endpoint: str, port: int, frames: Sequence[bytes], room: int | None = None
    ) -> str | None:
        """Send ``frames`` to ``endpoint:port`` now, without blocking (see the module
        doc for what happens when the peer's queue is full).

        Returns ``None`` when the message was handed to libzmq or dropped at a full
        queue, and the reason when the endpoint cannot be used at all (libzmq
        refused the address or a socket call failed): the pool closed that socket,
        nothing was sent, and the caller decides what fails.
        """
        if not self._open:
            log.warning(
                "%s: dropping a message to %s:%s for room %s: the peer is not running",
                self._name,
                endpoint,
                port,
                room,
            )
            self.stats.dropped += 1
            return None
        url = endpoint_url(endpoint, port)
        now = _now()
        try:
            entry = self._sockets.get(url)
            if entry is None:
                entry = self._connect(url, now, endpoint, port)
            entry.last = now
            sent = entry.sock.send_multipart_nowait(frames)
        except (zmq.ZMQError, _NoServerKey) as err:
            return self._failed(url, room, err)
        if sent:
            self.stats.sent += 1
            if now - self._last_send >= _YIELD_AFTER_S:
                # A lone message: libzmq's I/O thread puts it on the wire, so let it
                # have the CPU now rather than after whatever this thread does next
                # (2-core host, one room in flight: ~40 µs off a status message's
                # delivery, p50). Not within bursts, where yielding per message
                # cost ~10 % of rooms/s at 256 in flight.
                _yield_cpu()
            self._last_send = now
            return None
        self.stats.dropped += 1
        log.warning(
            "%s: dropped a message for room %s to %s: its queue is full "
            "(the peer is probably gone); the room's timeouts will settle it",
            self._name,
            room,
            url,
        )
        return None

    def release(self, endpoint: str, port: int) -> None:
        """Close the socket to ``endpoint:port`` (the core no longer needs the route);
        one that sent within ``flush_window`` lingers for the rest of it, while
        lingering sockets take at most half the pool. No-op when none is open."""
        entry = self._sockets.pop(endpoint_url(endpoint, port), None)
        if entry is None:
            return
        now = _now()
        self._prune_lingering(now)
        gone = self._close(entry, now, may_linger=len(self._lingering) < self._max // 2)
        if gone > now:
            heapq.heappush(self._lingering, gone)
        self.stats.closed += 1
        self._count()

    def _close(self, entry: _Entry, now: float, *, may_linger: bool = True) -> float:
        """Close ``entry``'s socket; one that sent within ``flush_window`` lingers for
        the rest of it (when ``may_linger``). Returns when it is gone at the latest
        (``now``: at once)."""
        left = self._window - (now - entry.last)
        if left > 0 and may_linger:
            entry.sock.close(linger=math.ceil(left * 1000))
            return now + left
        entry.sock.close()
        return now

    def holds(self, endpoint: str, port: int) -> bool:
        """Whether a socket to ``endpoint:port`` is open (not lingering)."""
        return endpoint_url(endpoint, port) in self._sockets

    def sweep(self) -> None:
        """Close every socket unused for ``idle_ttl`` seconds (:meth:`run` calls this
        periodically)."""
        now = _now()
        sockets = self._sockets
        for url in [url for url, entry in sockets.items() if now - entry.last >= self._ttl]:
            sockets.pop(url).sock.close()
            self.stats.closed += 1
        self._prune_lingering(now)
        self._count()

    def _connect(self, url: str, now: float, endpoint: str, port: int) -> _Entry:
        key: str | None = None
        if self._curve is not None:
            assert self._server_key is not None
            key = self._server_key(endpoint, port)
            if key is None:
                raise _NoServerKey(
                    "secure mode: no CURVE server key is known for this route (no "
                    "authenticated peer replies there); refusing to send in plain"
                )
        self._make_room(now)
        sock = open_socket(self._context, zmq.PUSH)
        try:
            sock.sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            if self._curve is not None and key is not None:
                self._curve.client(sock, key)
            sock.sock.connect(url)
        except BaseException:
            sock.close()
            raise
        entry = _Entry(sock, now)
        self._sockets[url] = entry
        self.stats.opened += 1
        self._count()
        return entry

    def _make_room(self, now: float) -> None:
        """Close least recently used sockets until one more fits the bound."""
        self._prune_lingering(now)
        sockets = self._sockets
        busy = 0
        while sockets and len(sockets) + len(self._lingering) >= self._max:
            url = min(sockets, key=lambda u: sockets[u].last)
            entry = sockets.pop(url)
            entry.sock.close()
            self.stats.closed += 1
            if now - entry.last < self._window:
                busy += 1
        if busy:
            self.stats.evicted_busy += busy
            if now - self._warned_at >= _EVICT_WARN_EVERY_S:
                self._warned_at = now
                log.warning(
                    "%s: more than %d peer endpoints in use within %.2fs; closed a socket "
                    "that had just sent to make room (%d so far), its message may be lost. "
                    "Raise the push pool's max_sockets",
                    self._name,
                    self._max,
                    self._window,
                    self.stats.evicted_busy,
                )

    def _prune_lingering(self, now: float) -> None:
        lingering = self._lingering
        while lingering and lingering[0] <= now:
            heapq.heappop(lingering)

    def _count(self) -> None:
        self.stats.sockets = len(self._sockets) + len(self._lingering)

    def _failed(self, url: str, room: int | None, err: Exception) -> str:
        entry = self._sockets.pop(url, None)
        if entry is not None:
            entry.sock.close()
            self.stats.closed += 1
            self._count()
        self.stats.failed += 1
        reason = f"cannot send to {url}: {err}"
        log.warning("%s: %s (room %s)", self._name, reason, room)
        return reason

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the pool open until cancelled, closing idle sockets every quarter of
        the TTL (at most every 15 s); then close every socket (:meth:`_close_all`)."""
        self._open = True
        task_status.started()
        try:
            every = min(max(self._ttl / 4, 0.01), 15.0)
            while True:
                await trio.sleep(every)
                self.sweep()
        finally:
            await self._close_all()

    async def _close_all(self) -> None:
        """Close every socket as the peer stops, keeping what was just handed over: a
        socket that sent within ``flush_window`` lingers for the rest of it, as a
        released one does, and the pool waits until every lingering socket's window
        has passed (at most ``flush_window``, shielded from the stop's cancel).
        libzmq sends a lingering socket's messages from its I/O thread, which ends
        with the process: without the wait, a peer that stops right after its last
        message -- a Prefill whose last room just succeeded, on a socket still
        connecting -- loses it, and the Decode waits out its waiting timeout for a
        room whose bytes arrived."""
        self._open = False
        now = _now()
        until = max(self._lingering, default=now)
        for entry in self._sockets.values():
            until = max(until, self._close(entry, now))
        self._sockets.clear()
        self._lingering.clear()
        self._count()
        if until > now:
            with trio.CancelScope(shield=True):
                await trio.sleep(until - now)
