"""The simulated network: control messages, bootstrap HTTP and reachability.

Hosts are IPv4 strings, one per simulated rank or bootstrap server. A control
message (a :class:`~tspd.core.commands.SendFrames`) travels over the directed link
between two hosts:

* its delay is the link's base delay (drawn once per link) plus an exponential
  jitter; without ``reorder`` a link delivers in order, as ZeroMQ over TCP does,
  so a message never arrives before one sent earlier on the same link;
* ``loss`` drops it, ``dup`` delivers it a second time, ``reorder`` adds a random
  extra delay and lifts the in-order rule for it;
* a partition in force when it is sent drops it;
* on arrival it goes to whatever listens on ``(host, port)`` *then*; a process
  that restarted listens on a new port, so messages to the old one are lost, as a
  PUSH to a dead peer queues forever (docs/protocol.md#proto-zmq).

Bootstrap HTTP requests are exchanges (:meth:`Network.exchange`): a reachable,
running server answers after a round trip; a server cut off by a partition costs
the connect timeout and fails; a server that is down fails after a round trip.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tspd.sim.clock import EventQueue
from tspd.sim.config import Faults, Timings
from tspd.sim.timeline import Timeline

__all__ = ["Listener", "Network", "NetworkStats", "Partition"]

Listener = Callable[[Sequence[bytes]], None]


@dataclass(frozen=True, slots=True)
class Partition:
    """``hosts`` cannot reach any other host, nor be reached, in ``[start, end)``."""

    start: float
    end: float
    hosts: frozenset[str]


@dataclass(slots=True)
class NetworkStats:
    """What happened to the control messages of a run."""

    sent: int = 0
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0
    reordered: int = 0
    cut: int = 0
    unheard: int = 0
    http: int = 0
    http_failed: int = 0


@dataclass(slots=True)
class _Link:
    base: float
    last: float = 0.0


@dataclass(slots=True)
class _Message:
    host: str
    port: int
    frames: tuple[bytes, ...]
    room: int | None
    #: The sending process, for timelines.
    sender: str


@dataclass(slots=True)
class Network:
    """Links, partitions and listeners of one run."""

    queue: EventQueue
    rng: random.Random
    faults: Faults
    timings: Timings
    timeline: Timeline
    partitions: list[Partition] = field(default_factory=list)
    stats: NetworkStats = field(default_factory=NetworkStats)
    _links: dict[tuple[str, str], _Link] = field(default_factory=dict)
    _listeners: dict[tuple[str, int], tuple[str, Listener]] = field(default_factory=dict)

    # ------------------------------------------------------------------ listeners

    def listen(self, host: str, port: int, name: str, listener: Listener) -> None:
        """``listener(frames)`` gets what arrives at ``(host, port)`` from now on;
        ``name`` is the process, for timelines."""
        self._listeners[(host, port)] = (name, listener)

    def close(self, host: str, port: int) -> None:
        """Nothing listens at ``(host, port)`` any more (its process died)."""
        self._listeners.pop((host, port), None)

    # ------------------------------------------------------------------ reachability

    def cut(self, a: str, b: str) -> bool:
        """Whether a partition separates hosts ``a`` and ``b`` now."""
        if not self.partitions:
            return False
        now = self.queue.now
        for p in self.partitions:
            if p.start <= now < p.end and ((a in p.hosts) != (b in p.hosts)):
                return True
        return False

    def _link(self, a: str, b: str) -> _Link:
        link = self._links.get((a, b))
        if link is None:
            link = self._links[(a, b)] = _Link(self.timings.link_delay * self.rng.uniform(0.2, 1.0))
        return link

    def delay(self, a: str, b: str) -> float:
        """One message's delay from ``a`` to ``b`` (base plus jitter)."""
        link = self._link(a, b)
        return link.base + self.rng.expovariate(2.0 / self.timings.link_delay)

    # ------------------------------------------------------------------ messages

    def send(
        self,
        source: str,
        host: str,
        port: int,
        frames: tuple[bytes, ...],
        room: int | None,
        sender: str,
    ) -> None:
        """Send one control message from host ``source`` (process ``sender``) to
        ``(host, port)``, with the run's message faults."""
        stats, faults, rng, now = self.stats, self.faults, self.rng, self.queue.now
        stats.sent += 1
        if self.cut(source, host):
            stats.cut += 1
            if room is not None:
                self.timeline.note(room, now, sender, f"message to {host}:{port} cut by partition")
            return
        if faults.loss and rng.random() < faults.loss:
            stats.lost += 1
            if room is not None:
                self.timeline.note(room, now, sender, f"message to {host}:{port} lost")
            return
        copies = 2 if faults.dup and rng.random() < faults.dup else 1
        if copies == 2:
            stats.duplicated += 1
            if room is not None:
                self.timeline.note(room, now, sender, f"message to {host}:{port} duplicated")
        link = self._link(source, host)
        message = _Message(host, port, frames, room, sender)
        for _ in range(copies):
            when = now + link.base + rng.expovariate(2.0 / self.timings.link_delay)
            if faults.reorder and rng.random() < faults.reorder:
                stats.reordered += 1
                when += rng.uniform(0.0, 20.0 * self.timings.link_delay)
            elif when <= link.last:
                when = link.last + 1e-9
            link.last = max(link.last, when)
            self.queue.at(when, self._arrive, message)

    def _arrive(self, message: _Message) -> None:
        target = self._listeners.get((message.host, message.port))
        if target is None:
            self.stats.unheard += 1
            if message.room is not None:
                self.timeline.note(
                    message.room,
                    self.queue.now,
                    message.sender,
                    f"message to {message.host}:{message.port} found no listener",
                )
            return
        self.stats.delivered += 1
        target[1](message.frames)

    # ------------------------------------------------------------------ HTTP

    def exchange(self, source: str, server: str, server_up: bool) -> tuple[float, bool]:
        """An HTTP request from ``source`` to a server on ``server``: how long it
        takes and whether an answer came (``server_up``: the server runs)."""
        self.stats.http += 1
        if self.cut(source, server):
            self.stats.http_failed += 1
            return self.timings.connect_timeout, False
        rtt = self.delay(source, server) + self.delay(server, source)
        if not server_up:
            self.stats.http_failed += 1
        return rtt, server_up
