"""A simulated Prefill attention-DP group: its TP ranks and its scheduler.

Each rank is a :class:`~tspd.core.prefill.PrefillCore` on a host of its own, with
a control port, an arena (:mod:`tspd.sim.arena`) and a transfer engine
(:mod:`tspd.sim.transfers`). The group's scheduler drives every rank the way an
engine's TP group does (docs/protocol.md#proto-prefill-poll):

* a request is registered on every rank in the same order;
* an iteration polls every rank, takes the element-wise MIN of their values (the
  replica agreement, docs/protocol.md#proto-replica-agreement) and concludes on
  every rank, which must all return the same events;
* ``Bootstrapped`` starts the forward; when it ends, the request's pages are
  allocated and written on every rank and handed over (full transfer); with
  ``SimConfig.layerwise`` the request joins the group's forward loop instead
  (:mod:`tspd.sim.layerwise`), which streams it chunk by chunk, layer by layer;
* ``Succeeded``/``Failed`` end the request and free its pages;
* with the ``abort`` fault, some requests are aborted on every rank at a random
  moment.

Iterations are event-driven: one runs ``poll_interval`` after any input reached a
core, after an iteration that produced events, and at every request's bootstrap
timeout — exactly when a polling loop could see something new.

A crash takes the whole group down (a TP group dies together): the cores, their
tables, the scheduler's requests and the arenas are lost; after the restart delay
every rank comes back with a new core on a new control port and ``PUT``\\ s its
route again. Nobody else is told.

A rank crash (the ``rank-crash`` fault, :meth:`PrefillGroup.kill_rank`) kills one
rank alone: its core's tables and control port are gone, its writes in flight
stop and it sends nothing more; the other ranks run on (their workers, their
status messages, their timers). The scheduler's next step that needs every rank
(an iteration's agreement, a registration, a forward, a hand-over, an abort, a
release) stalls (:meth:`PrefillGroup.stalled`): requests that arrive meanwhile
wait in the engine's queue, and ``Timings.agreement_timeout`` after the stall the
group goes down as in a crash (:meth:`tspd.sim.cluster.Cluster.stall`).

A sleep (the ``sleep`` fault, docs/protocol.md#proto-sleep-wake) closes the group
to new requests (those already on their way wait in the engine's queue) and asks
for the release of every rank's arena registration when the sleep begins and
again each time a request ends; each rank's
:meth:`~tspd.core.prefill.PrefillCore.check_release` refuses while its core tracks
a request, and the release happens once every rank accepts. The arenas' contents
are lost (the memory is freed), and no write may read them until the wake restores
the registration: the ``released`` check fails a release accepted while the
scheduler still tracks a request, a write in flight at the release and a write
issued while released. The group wakes after ``Timings.sleep_time`` and serves
again; the cores, ports and sessions stay.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from tspd.core.bootstrap import STAGING_FIELD, build_route_payload
from tspd.core.commands import (
    Bootstrapped,
    Command,
    Failed,
    Log,
    SendFrames,
    StartTransfer,
    Succeeded,
)
from tspd.core.errors import ProtocolError
from tspd.core.machines import RoomState
from tspd.core.prefill import PrefillConfig, PrefillCore
from tspd.sim import arena
from tspd.sim.agreement import iterate_group
from tspd.sim.invariants import Check
from tspd.sim.layerwise import ForwardLoop
from tspd.sim.notes import record
from tspd.sim.staging import PrefillStaging
from tspd.sim.transfers import SimEngine
from tspd.sim.workload import Request

if TYPE_CHECKING:
    from tspd.sim.cluster import Cluster

__all__ = ["PrefillGroup", "PrefillRank"]

_ABSENT = RoomState.ABSENT


class PrefillRank:
    """One Prefill rank process (one incarnation of it)."""

    __slots__ = (
        "alive",
        "arena",
        "base",
        "core",
        "engine",
        "geometry",
        "group",
        "ip",
        "name",
        "port",
        "registered",
        "schedule",
        "seen",
        "staging",
        "steps",
        "timer_at",
        "timer_spins",
        "tp_rank",
        "trap",
    )

    def __init__(self, group: PrefillGroup, tp_rank: int, port: int) -> None:
        cluster = group.cluster
        config = cluster.config
        self.group = group
        self.tp_rank = tp_rank
        self.name = f"{group.name}r{tp_rank}"
        self.ip = f"10.1.{group.instance}.{group.dp * group.tp + tp_rank + 1}"
        self.port = port
        self.geometry = arena.geometry_for(
            group.tp,
            tp_rank,
            config.kv_heads,
            config.head_dim,
            config.page_tokens,
            config.num_pages,
            config.layers,
        )
        contract = arena.contract_for(
            group.tp,
            config.kv_heads,
            config.head_dim,
            config.page_tokens,
            config.num_pages,
            config.layers,
        )
        #: The producer schedule (one step per layer) and the device's step counter:
        #: producer steps completed so far (layerwise only).
        self.schedule = arena.schedule_for(contract, config.layers)
        self.steps = 0
        self.base = (cluster.next_base()) << 32
        self.arena: list[int | None] = [None] * self.geometry.cells
        timings = config.timings
        #: The staging region (docs/wire.md#staged-transfers), when the instance has one.
        self.staging = (
            PrefillStaging(cluster.next_base() << 32, config.staging_bytes)
            if group.staging
            else None
        )
        staging = (
            {
                "staging_bytes": config.staging_bytes,
                "staging_base": self.staging.base,
                "staging_min_copies": config.staging_min_copies,
            }
            if self.staging is not None
            else {}
        )
        self.core = PrefillCore(
            PrefillConfig(
                tp_size=group.tp,
                tp_rank=tp_rank,
                contract=contract,
                arena_base=self.base,
                session_id=f"{self.ip}:{cluster.next_port()}",
                transfer_workers=config.transfer_workers,
                bootstrap_timeout=timings.bootstrap_timeout,
                failed_session_ttl=timings.failed_session_ttl,
                layerwise=self.schedule if config.layerwise else None,
                layerwise_interval=config.layerwise_interval,
                **staging,  # type: ignore[arg-type]
            )
        )
        self.engine = SimEngine(cluster, self, config.transfer_workers)
        #: The state each room was last seen in on this rank (for ``sticky``).
        self.seen: dict[int, RoomState] = {}
        self.timer_at: float | None = None
        self.timer_spins = 0
        self.alive = True
        #: Armed by ``rank-crash``: the rank dies in the middle of its next write
        #: (a Prefill rank's own, or one to a Decode rank's session).
        self.trap = False
        #: Whether the arena is registered with the transfer engine (not asleep).
        self.registered = True

    def on_control(self, frames: Sequence[bytes]) -> None:
        """A message arrived on the control port."""
        room: int | None = None
        if frames and frames[0] != b"None" and frames[0].isdigit() and len(frames[0]) < 20:
            room = int(frames[0])
            self.group.cluster.focus = room
        self.core.receive_control(frames, self.group.cluster.now)
        self.group.pump(self, () if room is None else (room,))


class PrefillGroup:
    """One attention-DP group of one Prefill instance, and its scheduler."""

    def __init__(self, cluster: Cluster, instance: int, dp: int, dp_size: int, tp: int) -> None:
        self.cluster = cluster
        self.instance = instance
        self.dp = dp
        self.dp_size = dp_size
        self.tp = tp
        self.name = f"p{instance}" + (f".{dp}" if dp_size > 1 else "")
        #: Whether the instance's ranks have a staging region.
        self.staging = cluster.prefill_staging[instance]
        self.ranks: list[PrefillRank] = []
        self.alive = False
        self.incarnation = 0
        #: Requests the scheduler tracks, by rid; their rooms; their pages.
        self.requests: dict[str, Request] = {}
        self.by_room: dict[int, Request] = {}
        self.pages: dict[str, list[int]] = {}
        self.pool = arena.PagePool(cluster.config.num_pages, cluster.page_rng)
        self.poll_at: float | None = None
        self.crashes = 0
        #: The forward loop (layerwise mode only; a new one per incarnation).
        self.forwards: ForwardLoop | None = None
        #: ``"closing"`` while a sleep waits for the release, ``"asleep"`` once the
        #: arenas are released, ``None`` while serving.
        self.sleep: str | None = None
        self.sleeps = 0
        #: Releases a rank refused (a request was still tracked).
        self.refusals = 0
        #: Requests that arrived while the group was going to sleep or asleep, or
        #: while its scheduler stalls on a dead rank.
        self.queued: list[Request] = []
        #: Ranks of this incarnation that died alone (``rank-crash``), and whether
        #: the scheduler stalls on them.
        self.dead_ranks = 0
        self.stalling = False

    @property
    def hosts(self) -> frozenset[str]:
        """The hosts of the group's ranks."""
        return frozenset(rank.ip for rank in self.ranks)

    @property
    def accepting(self) -> bool:
        """Whether the router may send the group requests (up, not going to sleep)."""
        return self.alive and self.sleep is None

    def key(self, request: Request) -> str:
        """The request's name on this side, for deadlines and reports."""
        return f"{self.name}:{request.rid}"

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        """Start (or restart) every rank: new cores, new ports, routes ``PUT``."""
        cluster = self.cluster
        self.incarnation += 1
        self.poll_at = None
        self.sleep = None
        self.dead_ranks = 0
        self.stalling = False
        self.ranks = [PrefillRank(self, r, cluster.next_port()) for r in range(self.tp)]
        self.alive = True
        self.pool = arena.PagePool(cluster.config.num_pages, cluster.page_rng)
        self.forwards = ForwardLoop(self) if cluster.config.layerwise else None
        interval = cluster.config.timings.reregister_interval
        for rank in self.ranks:
            cluster.network.listen(rank.ip, rank.port, rank.name, rank.on_control)
            if self.staging:
                cluster.staging_routes.add((rank.ip, rank.port))
            self._register(rank)
            if interval > 0:
                cluster.queue.after(interval, self._reregister, rank)

    def _register(self, rank: PrefillRank) -> None:
        """``PUT`` the rank's route to its instance's bootstrap server; a failure is
        logged and the rank runs on, unreachable (docs/protocol.md#proto-bootstrap-clients)."""
        cluster = self.cluster
        server = cluster.bootstrap[self.instance]
        payload = build_route_payload(
            rank_ip=rank.ip,
            rank_port=rank.port,
            engine_rank=self.dp * self.tp + rank.tp_rank,
            world_size=self.tp * self.dp_size,
            dp_size=self.dp_size,
            cache_layout=rank.core.config.contract.to_json(),
        )
        if rank.staging is not None:
            payload[STAGING_FIELD] = True
        delay, ok = cluster.network.exchange(rank.ip, server.host, server.up)
        if ok:
            cluster.queue.after(delay / 2, self._put, (rank, payload, server.incarnation))
        else:
            cluster.queue.after(delay, self._unregistered, rank)

    def _reregister(self, rank: PrefillRank) -> None:
        if rank.alive:
            self._register(rank)
            self.cluster.queue.after(
                self.cluster.config.timings.reregister_interval, self._reregister, rank
            )

    def _unregistered(self, rank: PrefillRank) -> None:
        if rank.alive:
            server = self.cluster.bootstrap[self.instance]
            self.cluster.log(
                rank.name,
                f"the Prefill rank failed to register with the bootstrap server at "
                f"{server.addr}; Decode ranks cannot reach it until it registers again",
            )

    def _put(self, argument: tuple[PrefillRank, dict[str, object], int]) -> None:
        rank, payload, served_by = argument
        if not rank.alive:
            return
        server = self.cluster.bootstrap[self.instance]
        if not server.answers(served_by):
            self._unregistered(rank)
            return
        reply = server.put_route(payload)
        if reply.status != 200:
            self.cluster.checker.violate(
                Check.RAISED, rank.name, f"the bootstrap server refused its route: {reply.body}"
            )

    def crash(self) -> None:
        """The group dies: every rank, its tables, its requests and pages."""
        cluster = self.cluster
        now = cluster.now
        self.alive = False
        self.crashes += 1
        for rank in self.ranks:
            rank.alive = False
            rank.engine.alive = False
            cluster.network.close(rank.ip, rank.port)
        for request in self.requests.values():
            cluster.timeline.note(request.room, now, self.name, "request lost: the group crashed")
            cluster.checker.ended(self.key(request))
            cluster.outcomes.lost += 1
            cluster.router.side_ended(request)
        for request in self.queued:
            cluster.timeline.note(request.room, now, self.name, "request lost: the group crashed")
            cluster.outcomes.lost += 1
            cluster.router.side_ended(request)
        self.requests.clear()
        self.by_room.clear()
        self.pages.clear()
        self.queued.clear()
        cluster.queue.after(cluster.config.timings.restart_delay, self._restart, self.incarnation)

    def _restart(self, incarnation: int) -> None:
        if incarnation == self.incarnation and not self.alive:
            self.start()
            self.cluster.router.kick()

    def kill_rank(self, tp_rank: int) -> None:
        """Rank ``tp_rank`` dies alone (``rank-crash``): its core's tables, its
        control port and its writes in flight are gone, it sends nothing more, and
        nobody is told. The other ranks run on until the scheduler stalls."""
        rank = self.ranks[tp_rank]
        rank.alive = False
        rank.engine.kill()
        self.cluster.rank_dies_alone(self, rank)

    def stalled(self) -> bool:
        """Whether a scheduler step needing every rank cannot complete
        (:meth:`Cluster.stalled <tspd.sim.cluster.Cluster.stalled>`)."""
        return self.cluster.stalled(
            self, lambda: [(self.key(r), r.room) for r in self.requests.values()]
        )

    # ------------------------------------------------------------------ driving cores

    def pump(
        self, rank: PrefillRank, rooms: Iterable[int], *, every: bool = False, wake: bool = True
    ) -> None:
        """Execute the rank's queued commands, check the rooms the call touched (or
        ``every`` room the rank holds), re-arm its timer, and schedule an
        iteration."""
        cluster = self.cluster
        if not rank.alive:
            return
        touched = set(rooms)
        now = cluster.now
        for command in rank.core.drain_commands():
            self._execute(rank, command, touched, now)
        if every:
            touched.update(rank.seen)
        observe, state_of, seen = cluster.checker.observe, rank.core.room_state, rank.seen
        for room in touched:
            state = state_of(room)
            if seen.get(room, _ABSENT) is not state:
                observe(seen, rank.name, state, room)
        cluster.arm_timer(rank, self.on_timer)
        if wake:
            self.wake()

    def _execute(self, rank: PrefillRank, command: Command, touched: set[int], now: float) -> None:
        cluster = self.cluster
        kind = type(command)
        if kind is SendFrames:
            assert isinstance(command, SendFrames)
            host = command.endpoint.split(":", 1)[0]
            if command.room is not None:
                touched.add(command.room)
                cluster.timeline.note(
                    command.room,
                    now,
                    rank.name,
                    f"status {command.frames[1].decode()} to {host}:{command.port}",
                )
            cluster.network.send(
                rank.ip, host, command.port, command.frames, command.room, rank.name
            )
        elif kind is StartTransfer:
            assert isinstance(command, StartTransfer)
            room = command.room
            touched.add(room)
            bound = rank.engine.enqueue(command)
            request = self.by_room.get(room)
            if request is not None:
                cluster.checker.expect_end(
                    self.key(request), room, bound + cluster.slack + cluster.poll_slack
                )
            cluster.timeline.note(
                room, now, rank.name, f"transfer queued on worker {command.shard}"
            )
        else:
            if kind is Log and rank.staging is not None:
                assert isinstance(command, Log)
                if " unstaged: " in command.message:
                    cluster.staging.unstaged += 1
            record(cluster, rank.name, command, touched, now)

    def on_timer(self, rank: PrefillRank) -> None:
        """The rank's deadline came (unclaimed rooms, failed sessions)."""
        if not rank.alive:
            return
        rank.timer_at = None
        deadline = rank.core.next_deadline()
        if deadline is not None and deadline <= self.cluster.now:
            rank.core.handle_timeout(self.cluster.now)
            self.pump(rank, (), every=True)
        else:
            self.cluster.arm_timer(rank, self.on_timer)

    # ------------------------------------------------------------------ scheduler

    def wake(self, delay: float | None = None) -> None:
        """Schedule an iteration ``delay`` from now (the poll interval by default)."""
        when = self.cluster.now + (
            self.cluster.config.timings.poll_interval if delay is None else delay
        )
        if self.poll_at is not None and self.poll_at <= when:
            return
        self.poll_at = when
        self.cluster.queue.at(when, self.iterate, self.incarnation)

    def submit(self, request: Request) -> None:
        """The router's request arrives: register it on every rank."""
        cluster = self.cluster
        now = cluster.now
        if not self.alive:
            cluster.timeline.note(request.room, now, self.name, "request lost: the group is down")
            cluster.outcomes.lost += 1
            cluster.router.side_ended(request)
            return
        if self.sleep is not None:
            # Sent before the group closed: it waits in the engine's queue and is
            # scheduled (registered with the cores) once the group is awake.
            cluster.timeline.note(request.room, now, self.name, "queued until the group wakes")
            self.queued.append(request)
            return
        if self.stalled():
            cluster.timeline.note(request.room, now, self.name, "queued: a rank is dead")
            self.queued.append(request)
            return
        timings = cluster.config.timings
        self.requests[request.rid] = request
        self.by_room[request.room] = request
        cluster.focus = request.room
        cluster.timeline.note(request.room, now, self.name, f"register {request.rid}")
        for rank in self.ranks:
            rank.core.register_request(request.rid, request.room, now)
            self.pump(rank, (request.room,))
        cluster.checker.expect_end(
            self.key(request),
            request.room,
            now + timings.bootstrap_timeout + cluster.forward_time(request) + cluster.slack,
        )
        cluster.queue.after(timings.bootstrap_timeout + 1e-6, self.iterate, self.incarnation)
        if request.abort_after is not None:
            cluster.queue.after(request.abort_after, self._abort, (self.incarnation, request))

    def iterate(self, incarnation: int) -> None:
        """One scheduler iteration on every rank: poll, MIN, conclude."""
        if incarnation != self.incarnation or not self.alive:
            return
        cluster = self.cluster
        if self.poll_at is not None and self.poll_at <= cluster.now:
            self.poll_at = None
        now = cluster.now
        ranks = self.ranks
        if self.dead_ranks:
            # The agreement needs the dead rank: it cannot complete.
            if self.requests or any(rank.core.has_in_flight() for rank in ranks if rank.alive):
                self.stalled()
            return
        events = iterate_group(
            cluster.checker, [r.name for r in ranks], [r.core for r in ranks], now
        )
        if events is None:
            return
        rooms = [r.room for e in events[0] if (r := self.requests.get(e.rid)) is not None]
        for rank in ranks:
            self.pump(rank, rooms, wake=False)
        for index, event in enumerate(events[0]):
            request = self.requests.get(event.rid)
            if request is None:
                cluster.checker.violate(
                    Check.OUTCOME, self.name, f"an event for an unknown request: {event}"
                )
                continue
            if isinstance(event, Bootstrapped):
                cluster.timeline.note(request.room, now, self.name, "Bootstrapped event")
                if self.forwards is not None:
                    bound = self.forwards.bootstrapped(request)
                    cluster.checker.expect_end(
                        self.key(request), request.room, bound + cluster.slack
                    )
                else:
                    cluster.queue.after(
                        cluster.forward_time(request),
                        self._forward_done,
                        (self.incarnation, request),
                    )
            elif isinstance(event, Succeeded):
                self._end(request, "Succeeded")
            else:
                assert isinstance(event, Failed)
                for rank, theirs in zip(self.ranks, events, strict=True):
                    other = theirs[index]
                    if not isinstance(other, Failed) or not other.reason:
                        cluster.checker.violate(
                            Check.OUTCOME,
                            rank.name,
                            f"Failed without a reason: {other}",
                            request.room,
                        )
                self._end(request, f"Failed: {event.reason}")
        if events[0]:
            self.wake()

    def _end(self, request: Request, outcome: str) -> None:
        cluster = self.cluster
        cluster.timeline.note(request.room, cluster.now, self.name, f"request ends: {outcome}")
        del self.requests[request.rid]
        self.by_room.pop(request.room, None)
        pages = self.pages.pop(request.rid, None)
        if self.forwards is not None:
            pages = self.forwards.ended(request.rid, pages)
        if pages is not None:
            self.pool.give(pages)
        cluster.checker.ended(self.key(request))
        cluster.router.side_ended(request)
        if outcome == "Succeeded":
            cluster.outcomes.prefill_succeeded += 1
        else:
            cluster.outcomes.prefill_failed += 1
        if self.sleep == "closing":
            self.ask_release()

    # ------------------------------------------------------------------ sleep / wake

    def go_to_sleep(self) -> bool:
        """The engine is asked to sleep: stop taking requests and ask for the
        release. ``False`` when the group is down or already sleeping."""
        if not self.alive or self.sleep is not None:
            return False
        cluster = self.cluster
        self.sleep = "closing"
        self.sleeps += 1
        cluster.log(self.name, f"going to sleep ({len(self.requests)} requests tracked)")
        self.ask_release()
        return True

    def ask_release(self) -> None:
        """Ask for the release once the current event is done (the group is going to
        sleep; a request ended, or a forward)."""
        self.cluster.queue.after(0.0, self._release, self.incarnation)

    def _release(self, incarnation: int) -> None:
        """Ask every rank to release its arena's registration; go to sleep once all
        accept (a refusal waits for the next request's end, or chunk's end)."""
        if incarnation != self.incarnation or self.sleep != "closing":
            return
        if self.forwards is not None and self.forwards.busy_until is not None:
            return  # The engine releases between forwards; the forward's end asks again.
        if self.stalled():
            return
        cluster = self.cluster
        for rank in self.ranks:
            try:
                rank.core.check_release()
            except ProtocolError:
                self.refusals += 1
                return
        if self.requests:
            request = next(iter(self.requests.values()))
            cluster.checker.violate(
                Check.RELEASED,
                self.name,
                f"check_release() accepted while the scheduler tracks {len(self.requests)} "
                f"requests ({', '.join(sorted(self.requests)[:4])})",
                request.room,
            )
        for rank in self.ranks:
            writes = rank.engine.writes_in_flight()
            if writes:
                room = writes[0]
                cluster.checker.violate(
                    Check.RELEASED,
                    rank.name,
                    f"check_release() let the arena's registration go while {len(writes)} "
                    f"write(s) from it were in flight (rooms {sorted(set(writes))}): they read "
                    "released memory",
                    room,
                )
            rank.registered = False
            arena.clear(rank.arena)
        self.sleep = "asleep"
        cluster.log(self.name, "asleep: the arenas' registrations are released")
        cluster.queue.after(cluster.config.timings.sleep_time, self._wake, incarnation)

    def _wake(self, incarnation: int) -> None:
        if incarnation != self.incarnation or self.sleep != "asleep":
            return
        for rank in self.ranks:
            rank.registered = True
        self.sleep = None
        self.cluster.log(self.name, "awake: the arenas are registered again")
        queued, self.queued = self.queued, []
        for request in queued:
            self.submit(request)
        self.cluster.router.kick()

    def _forward_done(self, argument: tuple[int, Request]) -> None:
        """The request's forward ran: its KV is in its pages; hand it over."""
        incarnation, request = argument
        if incarnation != self.incarnation or request.rid not in self.requests:
            return
        if self.stalled():
            return  # The forward's collectives need the dead rank.
        cluster = self.cluster
        now = cluster.now
        pages = self.take_pages(request)
        cluster.focus = request.room
        tables = {arena.GROUP: pages}
        cluster.timeline.note(request.room, now, self.name, f"hand over pages {pages}")
        for rank in self.ranks:
            arena.fill(rank.arena, rank.geometry, cluster.codec, request.index, pages)
            rank.core.record_usage(request.room, request.cached_tokens)
            rank.core.hand_over(request.room, tables, request.token, (), now)
            self.pump(rank, (request.room,))

    def take_pages(self, request: Request) -> list[int]:
        """Allocate the request's pages on every rank (one block table)."""
        pages = self.pool.take(request.pages)
        if pages is None:
            raise AssertionError(f"{self.name} has no pages for {request.rid}: size the run")
        self.pages[request.rid] = pages
        return pages

    def _abort(self, argument: tuple[int, Request]) -> None:
        incarnation, request = argument
        if incarnation != self.incarnation or request.rid not in self.requests:
            return
        if self.stalled():
            return
        cluster = self.cluster
        cluster.focus = request.room
        cluster.timeline.note(request.room, cluster.now, self.name, "scheduler aborts the request")
        for rank in self.ranks:
            rank.core.abort(request.room, f"sim: the scheduler aborted {request.rid}", cluster.now)
            self.pump(rank, (request.room,))
