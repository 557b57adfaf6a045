"""The router: admits requests and sends each to its Prefill and Decode sides.

A request waits until its Prefill DP group (``room % dp_size``, as
docs/protocol.md#proto-room-routing routes) is up, awake, with fewer than
``max_inflight`` requests, and its Decode instance (the instance's DP group
``room % dp_size`` when it has several) is up with pages for it; then
the Decode pages are reserved and both sides get the request after a small,
independent delay (either may hear of it first). A hedged request also goes to a
second Decode instance under the same room, when that one has room too.

The router counts the sides still live; when every request arrived and every
side ended (or was lost with a crashed process), it tells the cluster to drain.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from tspd.sim.workload import Request

if TYPE_CHECKING:
    from tspd.sim.cluster import Cluster
    from tspd.sim.prefill import PrefillGroup

__all__ = ["Router"]

#: How far into the queue the router looks for a request it can send.
_SCAN = 64


class Router:
    """Admission and dispatch for one run."""

    def __init__(self, cluster: Cluster, requests: list[Request]) -> None:
        self.cluster = cluster
        self.waiting: deque[Request] = deque()
        self.unsent = len(requests)
        #: Request sides (Prefill, Decode, hedged Decode) not ended yet.
        self.live_sides = 0
        for request in requests:
            cluster.queue.at(request.arrival, self.arrive, request)

    def arrive(self, request: Request) -> None:
        """A request reaches the router."""
        self.waiting.append(request)
        self.kick()

    def kick(self) -> None:
        """Send every waiting request that can go now (capacity may have freed)."""
        if not self.waiting:
            return
        kept: deque[Request] = deque()
        scanned = 0
        # Instances found full or down in this pass: later requests for them wait
        # without another look (requests keep their order per instance).
        blocked: set[object] = set()
        cluster = self.cluster
        while self.waiting and scanned < _SCAN:
            request = self.waiting.popleft()
            scanned += 1
            group = cluster.prefill_group(request)
            decode = cluster.decode_group(request.decode, request.room)
            if group in blocked or decode in blocked:
                kept.append(request)
            elif not self._send(request):
                kept.append(request)
                blocked.add(group if not self._group_open(group) else decode)
        kept.extend(self.waiting)
        self.waiting = kept
        self._maybe_drained()

    def _group_open(self, group: PrefillGroup) -> bool:
        return group.accepting and len(group.requests) < self.cluster.config.max_inflight

    def _send(self, request: Request) -> bool:
        cluster = self.cluster
        group = cluster.prefill_group(request)
        decode = cluster.decode_group(request.decode, request.room)
        if not self._group_open(group):
            return False
        if decode.reserve(request) is None:
            return False
        rng, now = cluster.workload_rng, cluster.now
        self.unsent -= 1
        self.live_sides += 2
        cluster.timeline.note(
            request.room,
            now,
            "router",
            f"{request.rid}: {request.prompt_len} tokens to {group.name} and {decode.name}",
        )
        cluster.sent_to[request.room] = [decode.name]
        cluster.queue.at(now + rng.uniform(0.0, 0.001), group.submit, request)
        cluster.queue.at(now + rng.uniform(0.0, 0.001), decode.submit, request)
        if request.hedge is not None:
            twin = replace(request, rid=f"{request.rid}h", hedge=None)
            other = cluster.decode_group(request.hedge, request.room)
            if other.reserve(twin) is not None:
                self.live_sides += 1
                cluster.sent_to[request.room].append(other.name)
                cluster.timeline.note(request.room, now, "router", f"hedged to {other.name}")
                cluster.queue.at(now + rng.uniform(0.0, 0.002), other.submit, twin)
        return True

    def side_ended(self, request: Request) -> None:
        """One side of a request ended (or was lost)."""
        self.live_sides -= 1
        self.kick()
        self._maybe_drained()

    def _maybe_drained(self) -> None:
        if self.unsent == 0 and self.live_sides == 0:
            self.cluster.drain()
