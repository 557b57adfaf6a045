"""Layerwise streaming: the forward loop of one Prefill DP group.

With ``SimConfig.layerwise`` a Prefill group computes its prompts the way a
chunked-prefill engine does (docs/protocol.md#proto-prefill-forward), one forward
at a time on the group's "GPU":

* a request joins the ready queue on its ``Bootstrapped`` event; its prefix-cache
  hit (``cached_tokens``) is already in its pages, so its first chunk starts there;
* a forward takes up to ``prefill_chunk`` tokens from the queue in order (the head
  request may get a partial chunk; chunk ends fall anywhere in a page) and, before
  it runs, every rank arms it with the same extend rows
  (:meth:`~tspd.core.prefill.PrefillCore.arm_layerwise`, which plans each row's
  chunk and queues its :class:`~tspd.core.commands.StartTransfer`);
* the forward then runs layer by layer: on each rank, producer step ``i`` writes
  the rows' tokens of layer ``i``'s fields into the arena
  (:func:`tspd.sim.arena.fill_tokens`) and then advances that rank's step counter
  (the ranks of a group drift apart by a little jitter); the rank's transfer
  engine (:mod:`tspd.sim.transfers`) wakes the chunks waiting for that step;
* once the forward ends, each request whose prompt is complete samples its first
  token and hands it over (:meth:`~tspd.core.prefill.PrefillCore.hand_over`) after
  a small random delay, so the token arrives before or after the final chunk's
  writes end (the core reports ``Success`` when both are there).

The device counter is the simulator's own (``PrefillRank.steps``): it advances by
one per layer of every forward, whatever the core reserved, so a core whose step
reservation drifted from the device would have its writes read layers not
computed yet (a ``data`` violation) or wait for steps that never come (a
``deadline`` violation). A request that ends while one of its chunks is being
computed keeps its pages until the forward ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tspd.core.prefill import ExtendRow
from tspd.sim import arena
from tspd.sim.workload import Request

if TYPE_CHECKING:
    from tspd.sim.prefill import PrefillGroup, PrefillRank

__all__ = ["ForwardLoop"]

#: A forward's fixed cost, besides its tokens (as in ``Cluster.forward_time``).
FORWARD_BASE = 0.001
#: How far a rank's producer steps may lag the group's, as a share of one step.
STEP_JITTER = 0.25


@dataclass(frozen=True, slots=True)
class _Row:
    """One request's chunk in one forward: tokens ``[begin, end)``."""

    request: Request
    begin: int
    end: int
    pages: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Step:
    """Producer step ``index`` of forward ``forward`` on ``rank``."""

    incarnation: int
    rank: PrefillRank
    forward: int
    index: int
    rows: tuple[_Row, ...]


class ForwardLoop:
    """The forwards of one Prefill group incarnation (layerwise mode)."""

    def __init__(self, group: PrefillGroup) -> None:
        self.group = group
        config = group.cluster.config
        self.budget = config.prefill_chunk
        self.layers = config.layers
        self.incarnation = group.incarnation
        #: Requests with tokens left to compute, in order.
        self.ready: deque[Request] = deque()
        #: The next token to compute, per rid.
        self.progress: dict[str, int] = {}
        #: Rids in the running forward, and pages to free once it ends.
        self.running: set[str] = set()
        self.deferred: list[list[int]] = []
        self.busy_until: float | None = None
        self.forwards = 0
        #: Rank steps of the running forward still to come (it ends at zero).
        self._steps_left = 0

    # ------------------------------------------------------------------ bounds

    def forward_bound(self) -> float:
        """The longest one forward can take, jitter included."""
        timings = self.group.cluster.config.timings
        return (FORWARD_BASE + self.budget * timings.forward_per_token) * (1.0 + STEP_JITTER)

    def backlog_bound(self) -> float:
        """How long until every queued request's prompt is computed, at most (each
        forward costs its base and its tokens; a request needs one forward per
        budget of its tokens, plus one for the chunk it shares)."""
        cluster = self.group.cluster
        per_token = cluster.config.timings.forward_per_token
        now = cluster.now
        total = 0.0 if self.busy_until is None else max(0.0, self.busy_until - now)
        for request in self.ready:
            left = request.prompt_len - self.progress.get(request.rid, request.cached_tokens)
            total += (-(-left // self.budget) + 1) * FORWARD_BASE + left * per_token
        return total * (1.0 + STEP_JITTER) + self.forward_bound()

    # ------------------------------------------------------------------ queue

    def bootstrapped(self, request: Request) -> float:
        """``request`` may run; returns the latest time its prompt is computed."""
        self.ready.append(request)
        self.progress.setdefault(request.rid, request.cached_tokens)
        bound = self.group.cluster.now + self.backlog_bound()
        self.kick()
        return bound

    def ended(self, rid: str, pages: list[int] | None) -> list[int] | None:
        """Request ``rid`` ended: the pages to free now (``None`` while a forward
        still computes into them; they are freed when it ends)."""
        self.progress.pop(rid, None)
        if pages is not None and rid in self.running:
            self.deferred.append(pages)
            return None
        return pages

    def kick(self) -> None:
        """Start the next forward if the GPU is idle and a request is ready."""
        group = self.group
        if self.busy_until is not None or not group.alive or not self.ready:
            return
        if group.stalled():
            return  # A forward's collectives need the dead rank.
        cluster = group.cluster
        rows: list[_Row] = []
        budget = self.budget
        ready = self.ready
        while ready and budget > 0:
            request = ready[0]
            if request.rid not in group.requests:
                ready.popleft()
                continue
            begin = self.progress[request.rid]
            end = min(request.prompt_len, begin + budget)
            pages = group.pages.get(request.rid)
            if pages is None:
                pages = group.take_pages(request)
                for rank in group.ranks:
                    # The prefix-cache hit is in the pages already, every layer.
                    arena.fill_tokens(
                        rank.arena,
                        rank.geometry,
                        cluster.codec,
                        request.index,
                        pages,
                        rank.geometry.field_ids,
                        0,
                        begin,
                    )
                    rank.core.record_usage(request.room, request.cached_tokens)
            rows.append(_Row(request, begin, end, tuple(pages)))
            budget -= end - begin
            if end < request.prompt_len:
                self.progress[request.rid] = end
                break
            ready.popleft()
            self.progress[request.rid] = end
        if not rows:
            return
        self._run(rows)

    # ------------------------------------------------------------------ one forward

    def _run(self, rows: list[_Row]) -> None:
        group = self.group
        cluster = group.cluster
        now = cluster.now
        self.forwards += 1
        forward = self.forwards
        self.running = {row.request.rid for row in rows}
        extend = [
            ExtendRow(
                row.request.rid, row.begin, row.end - row.begin, {arena.GROUP: list(row.pages)}
            )
            for row in rows
        ]
        rooms = [row.request.room for row in rows]
        for row in rows:
            cluster.timeline.note(
                row.request.room,
                now,
                group.name,
                f"forward {forward}: tokens [{row.begin}, {row.end}) of {row.request.prompt_len}",
            )
        for rank in group.ranks:
            cluster.focus = rooms[0]
            rank.core.arm_layerwise(extend, now)
            group.pump(rank, rooms, wake=False)
        tokens = sum(row.end - row.begin for row in rows)
        step = (FORWARD_BASE + tokens * cluster.config.timings.forward_per_token) / self.layers
        frozen = tuple(rows)
        rng = cluster.forward_rng
        latest = now
        for rank in group.ranks:
            lag = rng.uniform(0.0, STEP_JITTER * step)
            for index in range(self.layers):
                when = now + (index + 1) * step + lag
                cluster.queue.at(
                    when, self._step, _Step(self.incarnation, rank, forward, index, frozen)
                )
            latest = max(latest, now + self.layers * step + lag)
        self._steps_left = self.layers * len(group.ranks)
        self.busy_until = latest

    def _step(self, step: _Step) -> None:
        """Producer step ``step.index`` of a forward completes on one rank."""
        rank = step.rank
        if step.incarnation != self.group.incarnation or not rank.alive:
            return
        if self.group.stalled():
            return  # A layer's collectives need the dead rank: the forward stops.
        cluster = self.group.cluster
        geometry = rank.geometry
        fields = rank.schedule.steps[step.index]
        for row in step.rows:
            arena.fill_tokens(
                rank.arena,
                geometry,
                cluster.codec,
                row.request.index,
                row.pages,
                fields,
                row.begin,
                row.end,
            )
        rank.steps += 1
        rank.engine.step_advanced()
        self._steps_left -= 1
        if self._steps_left == 0:
            self._forward_end(step.rows)

    def _forward_end(self, rows: tuple[_Row, ...]) -> None:
        group = self.group
        cluster = group.cluster
        self.busy_until = None
        self.running = set()
        for pages in self.deferred:
            group.pool.give(pages)
        self.deferred = []
        rng = cluster.forward_rng
        latency = cluster.config.timings.write_latency
        for row in rows:
            request = row.request
            if row.end == request.prompt_len and request.rid in group.requests:
                cluster.queue.after(
                    rng.uniform(0.0, 3.0 * latency), self._hand_over, (self.incarnation, request)
                )
        if group.sleep == "closing":
            group.ask_release()
        self.kick()

    def _hand_over(self, argument: tuple[int, Request]) -> None:
        """The request's first token was sampled: every rank publishes it."""
        incarnation, request = argument
        group = self.group
        if incarnation != group.incarnation or request.rid not in group.requests:
            return
        if group.stalled():
            return
        cluster = group.cluster
        now = cluster.now
        pages = group.pages[request.rid]
        cluster.focus = request.room
        cluster.timeline.note(request.room, now, group.name, "first token: hand over")
        for rank in group.ranks:
            rank.core.hand_over(request.room, {arena.GROUP: pages}, request.token, (), now)
            group.pump(rank, (request.room,))
