"""A whole simulated cluster, run for one seed.

:class:`Cluster` builds every process of a :class:`~tspd.sim.config.SimConfig` —
a bootstrap server and its attention-DP groups per Prefill instance
(:mod:`tspd.sim.prefill`), the Decode instances (:mod:`tspd.sim.decode`), the
router (:mod:`tspd.sim.router`) — on one virtual clock (:mod:`tspd.sim.clock`),
schedules the run's partitions and crashes, and runs events until the cluster has
drained: every request arrived and ended on both sides, and then long enough for
every table's timers (unclaimed rooms, failed sessions, late writes) to run out.

After every event the invariants of :mod:`tspd.sim.invariants` are checked on
what the event touched, and the deadlines of live requests are checked against
the virtual time; every ``audit_interval`` every core's table sizes are checked
against their bounds; at the end, every per-room table must be empty.

Deadlines, per side, from the moment a side registered the request (``slack``
covers network delays and scheduler iterations):

* Decode: two bootstrap lookups (``http_timeout`` each), then the waiting timeout;
* Prefill: the bootstrap timeout and the forward; once a transfer is queued, the
  time its worker can take, every engine call bounded by the transfer timeout.

Everything random comes from generators seeded from the seed, one per concern
(workload, faults, network, engines, pages, staging), so the workload of a seed
does not change when faults are switched on or off, and a run without staging
draws nothing for it.

With ``SimConfig.staging`` the run draws which instances have a staging region
(:mod:`tspd.sim.staging`); the audits then also require every Decode core's slot
count to equal the slots the simulator saw it offer and not yet take back, and
every Prefill core's staged rooms to be rooms its workers hold; after the drain
both are zero, with the simulator's claims and holdings.
"""

from __future__ import annotations

import math
import random
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Final, TypeVar

from tspd.core.decode import DecodeConfig
from tspd.core.prefill import FAILED_ROOM_MEMORY, REJECTED_SESSION_MEMORY
from tspd.sim.arena import TagCodec
from tspd.sim.bootstrap import BootstrapServer
from tspd.sim.clock import EventQueue
from tspd.sim.config import SimConfig
from tspd.sim.decode import DecodeInstance, DecodeRank
from tspd.sim.invariants import Check, Checker, StopRun, Violation
from tspd.sim.network import Network, Partition
from tspd.sim.prefill import PrefillGroup, PrefillRank
from tspd.sim.result import Outcomes, SimResult
from tspd.sim.router import Router
from tspd.sim.staging import StagingStats
from tspd.sim.timeline import Timeline
from tspd.sim.transfers import TransferStats
from tspd.sim.workload import Request, draw_requests

__all__ = ["Cluster", "run"]

#: Core table sizes that must be zero once every room ended.
PREFILL_PER_ROOM: Final = (
    "rooms",
    "traces",
    "tracked_requests",
    "tracked_rooms",
    "unclaimed",
    "destinations",
    "usage",
    "layerwise_rooms",
    "metadata",
    "awaiting_token",
    "transfers_in_flight",
    "failed_sessions",
    "writing_rooms",
    "deferred_notices",
    "staged_rooms",
)
DECODE_PER_ROOM: Final = (
    "rooms",
    "traces",
    "tracked_requests",
    "routes",
    "completions",
    "waiting",
    "tracker_rooms",
    "awaiting_info",
    "awaiting_rank",
    "held_rooms",
    "staging_slots",
    "scattering",
)
#: Timelines kept in a result for fenced rooms (the first few).
FENCED_TIMELINES: Final = 3
#: Cluster events kept for a report (the most recent).
EVENTS_KEPT: Final = 40
#: Timer wake-ups in a row that find a core's deadline still due and nothing done.
MAX_TIMER_SPINS: Final = 64
#: Events a run may take per request (and a floor): beyond, it does not drain.
STEPS_PER_ROOM: Final = 20_000

R = TypeVar("R", PrefillRank, DecodeRank)


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw (Knuth's method; ``mean`` is small)."""
    limit, count, product = math.exp(-mean), 0, rng.random()
    while product > limit:
        count += 1
        product *= rng.random()
    return count


class Cluster:
    """Every process of one run, and the run itself (:meth:`run`)."""

    def __init__(self, config: SimConfig, seed: int) -> None:
        self.config = config
        self.seed = seed
        timings = config.timings
        self.queue = EventQueue()
        self.workload_rng = random.Random(f"{seed}:workload")
        self.fault_rng = random.Random(f"{seed}:faults")
        self.engine_rng = random.Random(f"{seed}:engines")
        self.page_rng = random.Random(f"{seed}:pages")
        self.forward_rng = random.Random(f"{seed}:forwards")
        self.staging_rng = random.Random(f"{seed}:staging")
        self.timeline = Timeline()
        self.checker = Checker(self.queue, self.timeline, config.fencing == "strict")
        self.network = Network(
            self.queue, random.Random(f"{seed}:network"), config.faults, timings, self.timeline
        )
        self.stats = TransferStats()
        self.staging = StagingStats()
        self.outcomes = Outcomes()
        self.codec = TagCodec(
            fields=2 * config.layers,
            slots=-(-config.max_prompt // config.page_tokens),
            page_tokens=config.page_tokens,
            kv_heads=config.kv_heads,
        )
        #: Allowance for network delays and scheduler iterations in deadlines.
        self.slack = 1.0 + 20 * timings.poll_interval
        self.poll_slack = 3 * timings.poll_interval
        self.decode_bound = 2 * timings.http_timeout + timings.waiting_timeout + self.slack
        #: How long Decode cores hold a failed room's pages at most (0: cores
        #: without write fencing, which hold nothing).
        self.quarantine_timeout = (
            timings.quarantine_timeout
            if "quarantine_timeout" in DecodeConfig.__dataclass_fields__
            else 0.0
        )
        self._port = 20000
        self._base = 0
        #: Live Decode transfer sessions, and those whose process died.
        self.sessions: dict[str, DecodeRank] = {}
        self.retired_sessions: list[str] = []
        #: Cluster-wide happenings (partitions, crashes, warnings naming no room),
        #: the most recent ones, for reports.
        self.events: deque[str] = deque(maxlen=EVENTS_KEPT)
        self.bootstrap = [
            BootstrapServer(i, f"10.3.{i}.1")
            for i in range(sum(shape.count for shape in config.prefill))
        ]
        self.bootstrap_by_addr = {server.addr: server for server in self.bootstrap}
        # Which instances have a staging region (docs/wire.md#staged-transfers).
        share = config.staging
        draw = self.staging_rng.random
        self.prefill_staging = [
            bool(share) and draw() < share for shape in config.prefill for _ in range(shape.count)
        ]
        self.decode_staging = [
            bool(share) and draw() < share for shape in config.decode for _ in range(shape.count)
        ]
        self.staging.prefill_instances = sum(self.prefill_staging)
        self.staging.decode_instances = sum(self.decode_staging)
        #: Prefill control routes ``(ip, port)`` that offer staging.
        self.staging_routes: set[tuple[str, int]] = set()
        #: Decode instances whose next scatter crashes them halfway (the crash fault).
        self.scatter_traps: set[int] = set()
        self.prefill: list[list[PrefillGroup]] = []
        for shape in config.prefill:
            for _ in range(shape.count):
                instance = len(self.prefill)
                self.prefill.append(
                    [PrefillGroup(self, instance, dp, shape.dp, shape.tp) for dp in range(shape.dp)]
                )
        #: Per Decode instance, its attention-DP groups; and every group, flat.
        self.decode_instances: list[list[DecodeInstance]] = []
        for shape in config.decode:
            for _ in range(shape.count):
                index = len(self.decode_instances)
                self.decode_instances.append(
                    [DecodeInstance(self, index, shape.tp, dp, shape.dp) for dp in range(shape.dp)]
                )
        self.decode: list[DecodeInstance] = [d for ds in self.decode_instances for d in ds]
        requests = draw_requests(config, self.workload_rng)
        self.requests = requests
        self.room_index = {request.room: request.index for request in requests}
        #: The Decode instances each room was sent to (two for a hedged request).
        self.sent_to: dict[int, list[str]] = {}
        self.window = requests[-1].arrival if requests else 0.0
        self.router = Router(self, requests)
        self.draining_until: float | None = None
        self.audit_interval = 0.25
        self.partitions = 0
        self.crashes = 0
        self.bootstrap_crashes = 0
        self.sleeps = 0
        self.rank_crashes = 0
        #: The room the current event is about, when one is: a core that raises
        #: is reported with that room's timeline.
        self.focus: int | None = None

    # ------------------------------------------------------------------ helpers

    @property
    def now(self) -> float:
        """The virtual time."""
        return self.queue.now

    def next_port(self) -> int:
        """A port no process of the run has used (restarts get new ones)."""
        self._port += 1
        return self._port

    def next_base(self) -> int:
        """A fresh arena number (arena bases are ``number << 32``)."""
        self._base += 1
        return self._base

    def prefill_group(self, request: Request) -> PrefillGroup:
        """The Prefill DP group that serves ``request`` (``room % dp_size``)."""
        groups = self.prefill[request.prefill]
        return groups[request.room % len(groups)]

    def decode_group(self, instance: int, room: int) -> DecodeInstance:
        """The DP group of Decode instance ``instance`` that serves ``room``
        (``room % dp_size``)."""
        groups = self.decode_instances[instance]
        return groups[room % len(groups)]

    def forward_time(self, request: Request) -> float:
        """How long the Prefill forward of ``request`` takes."""
        return 0.001 + request.prompt_len * self.config.timings.forward_per_token

    def arm_timer(self, rank: R, fire: Callable[[R], None]) -> None:
        """Make sure ``fire(rank)`` runs at the rank's core's next deadline."""
        deadline = rank.core.next_deadline()
        if deadline is None:
            return
        if rank.timer_at is not None and rank.timer_at <= max(deadline, self.now + 1e-6):
            return
        if deadline <= self.now:
            # A deadline that is due but expired nothing (floating point at the
            # boundary): look again a hair later; a core whose deadline never
            # clears would spin here, which is a bug of its own.
            rank.timer_spins += 1
            if rank.timer_spins > MAX_TIMER_SPINS:
                self.checker.violate(
                    Check.DEADLINE,
                    rank.name,
                    f"next_deadline() stays at {deadline} after handle_timeout at {self.now}",
                )
            deadline = self.now + 1e-9 * max(1.0, self.now)
        else:
            rank.timer_spins = 0
        rank.timer_at = deadline
        self.queue.at(deadline, fire, rank)

    def drain(self) -> None:
        """Every request ended: run on until every table's timers ran out."""
        if self.draining_until is not None:
            return
        t = self.config.timings
        self.draining_until = self.now + (
            t.bootstrap_timeout
            + t.failed_session_ttl
            + 2 * t.transfer_timeout
            + 2 * t.heartbeat_interval
            + self.quarantine_timeout
            + 1.0
        )

    def _note(self, text: str) -> None:
        self.events.append(f"t={self.now:.3f} {text}")

    def log(self, where: str, message: str) -> None:
        """A core's warning that names no room, kept among the cluster events."""
        self._note(f"{where}: {message}")

    # ------------------------------------------------------------------ faults

    def _schedule_faults(self) -> None:
        faults, rng, timings = self.config.faults, self.fault_rng, self.config.timings
        span = self.window + 2.0
        groups = [g for groups in self.prefill for g in groups]
        if faults.partition:
            for _ in range(_poisson(rng, faults.partition)):
                start = rng.uniform(0.0, span)
                end = start + timings.partition_time * rng.uniform(0.25, 1.5)
                kind = rng.randrange(4)
                if kind == 0:
                    target = rng.choice(groups)
                    hosts, what = target.hosts, target.name
                elif kind == 1:
                    target_d = rng.choice(self.decode)
                    hosts, what = target_d.hosts, target_d.name
                elif kind == 2:
                    server = rng.choice(self.bootstrap)
                    hosts, what = frozenset({server.host}), server.name
                else:
                    rank = rng.choice(
                        [r for g in groups for r in g.ranks]
                        + [r for d in self.decode for r in d.ranks]
                    )
                    hosts, what = frozenset({rank.ip}), rank.name
                self.network.partitions.append(Partition(start, end, hosts))
                self.partitions += 1
                self.queue.at(start, self._partition_note, f"{what} cut off until {end:.3f}")
        if faults.crash:
            # A Decode instance crashes with all its DP groups (one engine).
            targets: list[list[PrefillGroup] | list[DecodeInstance]] = [
                *([g] for g in groups),
                *self.decode_instances,
            ]
            for _ in range(_poisson(rng, faults.crash)):
                self.queue.at(rng.uniform(0.0, span), self._crash, rng.choice(targets))
        # Faults added later draw after the earlier ones, so switching them on
        # leaves the earlier faults of a seed where they were.
        if faults.bootstrap_crash:
            for _ in range(_poisson(rng, faults.bootstrap_crash)):
                # While requests arrive: an outage matters to lookups only then.
                when = rng.uniform(0.0, self.window)
                server = rng.choice(self.bootstrap)
                outage = timings.bootstrap_outage * rng.uniform(0.1, 2.0)
                self.queue.at(when, self._bootstrap_crash, (server, outage))
        if faults.sleep:
            for _ in range(_poisson(rng, faults.sleep)):
                when = rng.uniform(0.0, self.window)
                self.queue.at(when, self._sleep, rng.choice(groups))
        staged = [i for i, on in enumerate(self.decode_staging) if on]
        if faults.crash and staged:
            # Crashes in the middle of a scatter: armed at a random moment, sprung by
            # the instance's next scatter.
            for _ in range(_poisson(rng, faults.crash)):
                when = rng.uniform(0.0, span)
                self.queue.at(when, self._arm_scatter_trap, rng.choice(staged))
        if faults.rank_crash:
            # One rank of a TP group of two or more dies alone; none: nothing happens.
            candidates: list[PrefillGroup | DecodeInstance] = [
                *(g for g in groups if g.tp >= 2),
                *(d for d in self.decode if d.tp >= 2),
            ]
            for _ in range(_poisson(rng, faults.rank_crash)):
                when = rng.uniform(0.0, span)
                if candidates:
                    hit = rng.choice(candidates)
                    tp_rank = rng.randrange(hit.tp)
                    if rng.random() < 0.5:
                        self.queue.at(when, self._rank_crash, (hit, None, tp_rank))
                    else:
                        # Armed now, sprung in the middle of the rank's next write.
                        self.queue.at(when, self._arm_rank_trap, (hit, tp_rank))

    def _arm_scatter_trap(self, instance: int) -> None:
        if self.draining_until is None:
            self.scatter_traps.add(instance)

    def crash_in_scatter(self, argument: tuple[int, int]) -> None:
        """A Decode instance crashes halfway through a scatter of ``room``."""
        instance, room = argument
        before = self.crashes
        self.timeline.note(room, self.now, f"d{instance}", "crash in the middle of a scatter")
        self._crash(self.decode_instances[instance])
        if self.crashes > before:
            self.staging.scatter_crashes += 1

    def _bootstrap_crash(self, argument: tuple[BootstrapServer, float]) -> None:
        server, outage = argument
        if not server.up or self.draining_until is not None:
            return
        self.bootstrap_crashes += 1
        self._note(f"crash: {server.name}, the bootstrap server (restarts in {outage:.3f}s)")
        server.crash()
        self.queue.after(outage, self._bootstrap_restart, (server, server.incarnation))

    def _bootstrap_restart(self, argument: tuple[BootstrapServer, int]) -> None:
        server, incarnation = argument
        if server.incarnation == incarnation and not server.up:
            server.restart()
            self._note(f"restart: {server.name}, with an empty table")

    def _sleep(self, group: PrefillGroup) -> None:
        if self.draining_until is None and group.go_to_sleep():
            self.sleeps += 1

    def _partition_note(self, text: str) -> None:
        self._note(f"partition: {text}")

    def _crash(self, target: list[PrefillGroup] | list[DecodeInstance]) -> None:
        if not all(t.alive for t in target) or self.draining_until is not None:
            return
        self.crashes += 1
        self._take_down(target, f"restarts in {self.config.timings.restart_delay}s")

    def _take_down(self, target: list[PrefillGroup] | list[DecodeInstance], why: str) -> None:
        """Every group of ``target`` dies and restarts later (the crash path)."""
        names = ", ".join(t.name for t in target)
        self._note(f"crash: {names} ({why})")
        for t in target:
            t.crash()

    def _arm_rank_trap(self, argument: tuple[PrefillGroup | DecodeInstance, int]) -> None:
        group, tp_rank = argument
        if group.alive and self.draining_until is None:
            group.ranks[tp_rank].trap = True

    def spring_rank_trap(self, rank: PrefillRank | DecodeRank) -> None:
        """A write from (or to) a trapped rank was issued: the rank dies while the
        write is in flight."""
        rank.trap = False
        group = rank.group if isinstance(rank, PrefillRank) else rank.instance
        self.queue.after(
            self.config.timings.write_latency / 4,
            self._rank_crash,
            (group, group.incarnation, rank.tp_rank),
        )

    def _rank_crash(self, argument: tuple[PrefillGroup | DecodeInstance, int | None, int]) -> None:
        """One rank of ``group`` dies alone; its siblings run on (``rank-crash``);
        ``None`` or the group's incarnation."""
        group, incarnation, tp_rank = argument
        if incarnation not in (None, group.incarnation):
            return
        if not group.alive or self.draining_until is not None:
            return
        rank = group.ranks[tp_rank]
        if not rank.alive:
            return
        self.rank_crashes += 1
        self._note(f"rank crash: {rank.name} dies alone; the other ranks of {group.name} run on")
        group.kill_rank(tp_rank)

    def rank_dies_alone(
        self, group: PrefillGroup | DecodeInstance, rank: PrefillRank | DecodeRank
    ) -> None:
        """What a group does when its rank ``rank`` dies alone (``rank-crash``): the
        rank's port closes, every request of the group notes it, and the group's
        loop runs on (its next iteration finds the rank missing)."""
        rank.alive = False
        self.network.close(rank.ip, rank.port)
        group.dead_ranks += 1
        for request in group.requests.values():
            self.timeline.note(request.room, self.now, rank.name, "the rank dies alone")
        group.wake()

    def stalled(
        self, group: PrefillGroup | DecodeInstance, keys: Callable[[], list[tuple[str, int]]]
    ) -> bool:
        """Whether ``group`` lost a rank, so that a scheduler step needing every rank
        cannot complete; the first such step starts the agreement timeout for the
        request sides ``keys()`` names."""
        if not group.dead_ranks:
            return False
        if not group.stalling:
            group.stalling = True
            self.stall(group, keys())
        return True

    def stall(self, group: PrefillGroup | DecodeInstance, keys: list[tuple[str, int]]) -> None:
        """``group``'s scheduler began a step that needs a dead rank: it waits for
        the agreement timeout, then the engine takes the group down (a Decode
        group: its whole instance) as a crash does. ``keys`` are the request sides
        the group holds, ``(key, room)``: their deadlines move by the timeout."""
        timeout = self.config.timings.agreement_timeout
        now = self.now
        self._note(f"agreement stalls: {group.name} waits for a dead rank ({timeout}s)")
        for key, room in keys:
            self.timeline.note(room, now, group.name, "the agreement stalls on a dead rank")
            self.checker.extend(key, timeout)
        target: list[PrefillGroup] | list[DecodeInstance] = (
            self.decode_instances[group.index] if isinstance(group, DecodeInstance) else [group]
        )
        self.queue.after(timeout, self._agreement_timeout, (group.incarnation, target))

    def _agreement_timeout(
        self, argument: tuple[int, list[PrefillGroup] | list[DecodeInstance]]
    ) -> None:
        incarnation, target = argument
        if target[0].incarnation != incarnation or not all(t.alive for t in target):
            return
        # Even while draining: the group's tables must go with it.
        delay = self.config.timings.restart_delay
        self._take_down(target, f"the agreement timed out on a dead rank; restarts in {delay}s")

    # ------------------------------------------------------------------ audits

    def _audit(self, _: object) -> None:
        """Check every core's tables against their bounds; repeat while running."""
        for groups in self.prefill:
            for group in groups:
                if group.alive:
                    for prank in group.ranks:
                        if prank.alive:
                            self._audit_prefill(group, prank, draining=False)
        for instance in self.decode:
            if instance.alive:
                for drank in instance.ranks:
                    if drank.alive:
                        self._audit_decode(instance, drank, draining=False)
        if self.draining_until is None:
            # Often while requests arrive, then once a second while timeouts run.
            busy = self.now <= self.window + 1.0
            self.queue.after(self.audit_interval if busy else 1.0, self._audit)

    def _bound(self, where: str, name: str, value: int, bound: int) -> None:
        if value > bound:
            self.checker.violate(Check.BOUNDS, where, f"{name} is {value}, above its bound {bound}")

    def _audit_prefill(self, group: PrefillGroup, rank: PrefillRank, *, draining: bool) -> None:
        core, where, engine = rank.core, rank.name, rank.engine
        stats = core.statistics()
        if draining:
            left = {k: stats[k] for k in PREFILL_PER_ROOM if stats.get(k)}
            if left:
                self.checker.violate(Check.DRAINED, where, f"tables not empty after drain: {left}")
        tracked = stats["tracked_requests"]
        if tracked != len(group.requests):
            self.checker.violate(
                Check.BOUNDS,
                where,
                f"the core tracks {tracked} requests, the scheduler {len(group.requests)}",
            )
        # A room is claimed by a request or on its unclaimed clock; an unclaimed room
        # may hold destinations with no status yet (docs/protocol.md#proto-prefill-room-table).
        known = stats["tracked_rooms"] + stats["unclaimed"]
        bound = self._bound
        bound(where, "tracked_rooms", stats["tracked_rooms"], tracked)
        bound(where, "rooms", stats["rooms"], known)
        for name in ("traces", "destinations", "usage", "metadata", "awaiting_token"):
            bound(where, name, stats[name], known)
        bound(where, "layerwise_rooms", stats.get("layerwise_rooms", 0), known)
        bound(where, "transfers_in_flight", stats["transfers_in_flight"], known)
        bound(where, "writing_rooms", stats.get("writing_rooms", 0), engine.pending)
        bound(where, "deferred_notices", stats.get("deferred_notices", 0), engine.pending)
        region = rank.staging
        if region is not None:
            held = {room for _, _, room, _ in region.held}
            bound(where, "staged_rooms", stats.get("staged_rooms", 0), len(held))
            if draining and region.held:
                self.checker.violate(
                    Check.STAGING,
                    where,
                    f"staged blobs still held after drain: rooms {sorted(held)}",
                    next(iter(held)),
                )
        sessions = len(self.sessions) + len(self.retired_sessions)
        bound(where, "registrations", stats["registrations"], sessions)
        bound(where, "failed_sessions", stats["failed_sessions"], sessions)
        bound(where, "rejected", stats["rejected"], REJECTED_SESSION_MEMORY)
        bound(where, "failed_room_memory", stats["failed_room_memory"], FAILED_ROOM_MEMORY)

    def _audit_decode(self, instance: DecodeInstance, rank: DecodeRank, *, draining: bool) -> None:
        core, where = rank.core, rank.name
        stats = core.statistics()
        if draining:
            left = {k: stats[k] for k in DECODE_PER_ROOM if stats.get(k)}
            if left:
                self.checker.violate(Check.DRAINED, where, f"tables not empty after drain: {left}")
        tracked = stats["tracked_requests"]
        if tracked != len(instance.requests):
            self.checker.violate(
                Check.BOUNDS,
                where,
                f"the core tracks {tracked} requests, the scheduler {len(instance.requests)}",
            )
        bound = self._bound
        for name in ("rooms", "routes", "completions", "waiting", "tracker_rooms", "awaiting_info"):
            bound(where, name, stats[name], tracked)
        bound(where, "traces", stats["traces"], stats["rooms"])
        bound(where, "held_rooms", stats.get("held_rooms", 0), len(instance.held))
        bound(where, "scattering", stats.get("scattering", 0), tracked + len(instance.held))
        region = rank.staging
        if region is not None and stats.get("staging_slots", 0) != len(region.claims):
            claims = sorted((c.room, c.offset) for c in region.claims.values())
            self.checker.violate(
                Check.STAGING,
                where,
                f"the core holds {stats.get('staging_slots', 0)} staging slots, where the slots "
                f"it offered and has not taken back are {len(claims)}: {claims[:4]}",
                claims[0][0] if claims else None,
            )
        prefill_ranks = sum(len(g.ranks) for groups in self.prefill for g in groups)
        bound(where, "awaiting_rank", stats["awaiting_rank"], tracked * prefill_ranks)
        bound(where, "addresses", stats["addresses"], len(self.bootstrap))
        bound(where, "rank_infos", stats["rank_infos"], prefill_ranks)
        bound(where, "registered_ranks", stats["registered_ranks"], prefill_ranks)

    def _final_checks(self) -> None:
        outstanding = self.checker.outstanding()
        if outstanding or self.router.unsent:
            key, room = outstanding[0] if outstanding else ("router", None)
            self.checker.violate(
                Check.OUTCOME,
                key,
                f"the run ended with {len(outstanding)} request sides live and "
                f"{self.router.unsent} requests never sent",
                room,
            )
        for groups in self.prefill:
            for group in groups:
                if group.alive:
                    for prank in group.ranks:
                        if prank.alive:
                            self._audit_prefill(group, prank, draining=True)
        for instance in self.decode:
            if instance.alive:
                for drank in instance.ranks:
                    if drank.alive:
                        self._audit_decode(instance, drank, draining=True)

    def stale_registrations(self) -> int:
        """Registrations, over every live Prefill rank, of sessions that died."""
        retired = self.retired_sessions
        return sum(
            1
            for groups in self.prefill
            for group in groups
            if group.alive
            for rank in group.ranks
            if rank.alive
            for session in retired
            if rank.core.is_registered(session)
        )

    # ------------------------------------------------------------------ the run

    def run(self) -> SimResult:
        """Run to the end (or to the first strict violation)."""
        started = time.perf_counter()
        queue, checker = self.queue, self.checker
        for groups in self.prefill:
            for group in groups:
                group.start()
        for instance in self.decode:
            instance.start()
        self._schedule_faults()
        self.queue.after(self.audit_interval, self._audit)
        t = self.config.timings
        horizon = self.window + 50 * (t.bootstrap_timeout + t.waiting_timeout + t.transfer_timeout)
        max_steps = STEPS_PER_ROOM * (len(self.requests) + 50)
        if not self.requests:
            self.drain()
        try:
            while True:
                when = queue.next_time()
                if when is None:
                    break
                if self.draining_until is not None and when > self.draining_until:
                    queue.now = self.draining_until
                    break
                if when > horizon or queue.steps > max_steps:
                    checker.violate(
                        Check.OUTCOME,
                        "cluster",
                        f"the run did not drain ({queue.steps} events, t={when:.3f})",
                    )
                self.focus = None
                queue.step()
                checker.check_deadlines()
            self._final_checks()
        except StopRun:
            pass
        except Exception as exc:
            frames = traceback.format_exception(exc)
            checker.violations.append(
                Violation(
                    Check.RAISED,
                    self.now,
                    "cluster",
                    f"{type(exc).__name__}: {exc}\n{''.join(frames[-6:])}",
                    self.focus,
                )
            )
        return self._result(time.perf_counter() - started)

    def _result(self, wall: float) -> SimResult:
        checker = self.checker
        rooms = [v.room for v in checker.violations if v.room is not None]
        rooms += [v.room for v in checker.fenced[:FENCED_TIMELINES] if v.room is not None]
        timelines = {room: self.timeline.format(room) for room in rooms}
        return SimResult(
            seed=self.seed,
            config=self.config,
            outcomes=self.outcomes,
            sim_seconds=self.now,
            wall_seconds=wall,
            steps=self.queue.steps,
            rooms=len(self.requests),
            network=self.network.stats,
            transfers=self.stats,
            crashes=self.crashes,
            partitions=self.partitions,
            bootstrap_crashes=self.bootstrap_crashes,
            sleeps=self.sleeps,
            rank_crashes=self.rank_crashes,
            violations=tuple(checker.violations),
            fenced=tuple(checker.fenced),
            fenced_corruptions=checker.fenced_corruptions,
            stale_registrations=self.stale_registrations(),
            staging=self._staging_figures(),
            timelines=timelines,
            events=tuple(self.events),
        )

    def _staging_figures(self) -> StagingStats:
        stats = self.staging
        stats.rooms = len(stats.staged_rooms)
        stats.staged_rooms = set()
        return stats


def run(config: SimConfig, seed: int) -> SimResult:
    """Run ``config`` with ``seed``; the result says what broke, if anything."""
    return Cluster(config, seed).run()
