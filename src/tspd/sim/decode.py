"""A simulated Decode instance: its TP ranks, its scheduler and its arenas.

Each rank is a :class:`~tspd.core.decode.DecodeCore` with a status port, a
transfer session and an arena. The instance's scheduler
(docs/protocol.md#proto-decode-poll):

* reserves the request's pages when the router admits it (the pages now belong
  to the request's room on every rank: one block table for the TP group);
* registers the request on every rank (route planning, registrations, bootstrap
  lookups answered by the simulated bootstrap servers);
* on ``Bootstrapped``, zeroes the pages on every rank and pre-allocates them;
* on ``RemotePrefillDone``, checks the first token and the cached-token count,
  decodes for a while and frees the pages; on ``Failed``, frees them at once.

Each rank also heartbeats the bootstrap addresses it uses every heartbeat
interval, and has a timer for the waiting timeout.

Write fencing (docs/protocol.md#proto-failures): when the cores say a failed
room's pages are held (``Failed.pages_held``), the scheduler keeps them until a
``PagesReleased`` event names the request (it must come within the quarantine
timeout); cores without fencing release nothing and the pages are freed at once.

The arena side: :meth:`DecodeInstance.land` applies a write's copies cell by cell
and checks *fencing*: every page it touches must still belong to the write's room
(held pages still do; freed or reused ones do not). A rank's room that turns
``Success`` has its pages checked against the Prefill's data (the ``data``
check).

A crash loses every rank's tables, the scheduler's requests and the arenas; after
the restart delay the instance comes back with new cores, new status ports and new
transfer sessions (Decode churn).

A rank crash (the ``rank-crash`` fault, :meth:`DecodeInstance.kill_rank`) kills one
rank alone: its core's tables and status port are gone, its transfer session
refuses writes (they fail fast, as to any dead session), its lookups, heartbeats
and scatters stop, and nobody is told; the other ranks run on. The scheduler's
next step that needs every rank (an iteration's agreement, a registration)
stalls (:meth:`DecodeInstance.stalled`): requests that arrive meanwhile wait, and
``Timings.agreement_timeout`` after the stall the whole instance goes down as in a
crash (:meth:`tspd.sim.cluster.Cluster.stall`).

Staged transfers (docs/wire.md#staged-transfers): an instance with a staging
region (``SimConfig.staging``) gives every rank one
(:class:`~tspd.sim.staging.DecodeStaging`) and the core its staging settings. A
pre-allocation that offers a slot *claims* it for the room; the claim ends when
the scheduler learns the room's pages are returned (``RemotePrefillDone``,
``Failed`` with its pages not held, ``PagesReleased``), which is when the core
frees its slots. A slot offered while it overlaps a live claim is a ``staging``
violation, and so is a core whose slot count differs from the claims.
:meth:`DecodeInstance.land_staged` lands a staged write's parts in the region (a
part outside a claim of its room is ``fencing``). ``ScatterStaged`` starts a
scatter that takes ``Timings.scatter_time`` or so: at its end the slot's blob is
checked as the shell checks it (:func:`tspd.sim.staging.read_checked`), its data
copied into the room's pages (each page must still be the room's: ``staging``)
and the core told with ``staged_done``; a refusal of a blob that nothing but its
own room's write touched is a ``staging`` violation. A crash during the scatter
loses it with everything else (the ``crash`` fault arms such crashes too).

An instance of several attention-DP groups (``1xTP2DP2``) is one
:class:`DecodeInstance` per group, each a TP group with its own scheduler, ranks,
sessions and pages; the router sends a room to group ``room % dp_size`` of its
instance, and a crash takes every group of the instance down at once (one engine).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tspd.core import wire
from tspd.core.commands import (
    Bootstrapped,
    Command,
    Event,
    Failed,
    FetchParallelInfo,
    FetchRankInfo,
    PagesReleased,
    RemotePrefillDone,
    ScatterStaged,
    SendFrames,
)
from tspd.core.copies import CopyPlan
from tspd.core.decode import DecodeConfig, DecodeCore
from tspd.core.machines import RoomState
from tspd.core.staging import BLOB_ENTRY_BYTES, BLOB_HEADER_BYTES
from tspd.sim import arena
from tspd.sim.agreement import iterate_group
from tspd.sim.bootstrap import BootstrapServer
from tspd.sim.invariants import Check
from tspd.sim.notes import record
from tspd.sim.staging import (
    ByteArray,
    Claim,
    DecodeStaging,
    Int64Array,
    decode_cells,
    read_checked,
)
from tspd.sim.workload import Request

if TYPE_CHECKING:
    from tspd.sim.cluster import Cluster
    from tspd.sim.prefill import PrefillRank

__all__ = ["DecodeInstance", "DecodeRank"]

_SUCCESS = RoomState.SUCCESS
_ABSENT = RoomState.ABSENT


@dataclass(frozen=True, slots=True)
class _Fetch:
    """A bootstrap lookup in flight: who asked whom for what."""

    incarnation: int
    rank: DecodeRank
    server: BootstrapServer
    #: ``(engine_rank, dp_group)``, or ``None`` for the parallel info.
    target: tuple[int, int] | None
    ok: bool
    #: The server's incarnation when the request went out.
    served_by: int


class DecodeRank:
    """One Decode rank process (one incarnation of it)."""

    __slots__ = (
        "alive",
        "arena",
        "base",
        "core",
        "geometry",
        "instance",
        "ip",
        "name",
        "port",
        "seen",
        "session",
        "staging",
        "timer_at",
        "timer_spins",
        "tp_rank",
        "trap",
    )

    def __init__(self, instance: DecodeInstance, tp_rank: int) -> None:
        cluster = instance.cluster
        config = cluster.config
        self.instance = instance
        self.tp_rank = tp_rank
        self.name = f"{instance.name}r{tp_rank}"
        self.ip = f"10.2.{instance.index}.{instance.dp * instance.tp + tp_rank + 1}"
        self.port = cluster.next_port()
        self.session = f"{self.ip}:{cluster.next_port()}"
        self.geometry = arena.geometry_for(
            instance.tp,
            tp_rank,
            config.kv_heads,
            config.head_dim,
            config.page_tokens,
            config.num_pages,
            config.layers,
        )
        contract = arena.contract_for(
            instance.tp,
            config.kv_heads,
            config.head_dim,
            config.page_tokens,
            config.num_pages,
            config.layers,
        )
        self.base = cluster.next_base() << 32
        self.arena: list[int | None] = [None] * self.geometry.cells
        timings = config.timings
        # Cores with write fencing hold a failed room's pages up to this long.
        options: dict[str, float] = (
            {"quarantine_timeout": timings.quarantine_timeout}
            if "quarantine_timeout" in DecodeConfig.__dataclass_fields__
            else {}
        )
        #: The staging region (docs/wire.md#staged-transfers), when the instance has one.
        self.staging = (
            DecodeStaging(cluster.next_base() << 32, config.staging_bytes)
            if instance.staging
            else None
        )
        if self.staging is not None:
            options |= {
                "staging_bytes": config.staging_bytes,
                "staging_base": self.staging.base,
                "staging_min_bytes": config.staging_min_bytes,
            }
        self.core = DecodeCore(
            DecodeConfig(
                tp_size=instance.tp,
                tp_rank=tp_rank,
                contract=contract,
                arena_base=self.base,
                session_id=self.session,
                endpoint=self.ip,
                port=self.port,
                waiting_timeout=timings.waiting_timeout,
                heartbeat_max_failures=timings.heartbeat_max_failures,
                **options,  # type: ignore[arg-type]
            )
        )
        self.seen: dict[int, RoomState] = {}
        self.timer_at: float | None = None
        self.timer_spins = 0
        self.alive = True
        #: Armed by ``rank-crash``: the rank dies in the middle of its next write
        #: (a Prefill rank's own, or one to a Decode rank's session).
        self.trap = False

    def on_status(self, frames: Sequence[bytes]) -> None:
        """A status message arrived."""
        room: int | None = None
        if frames and frames[0].isdigit() and len(frames[0]) < 20:
            room = int(frames[0])
            self.instance.cluster.focus = room
        self.core.receive_status(frames, self.instance.cluster.now)
        self.instance.pump(self, () if room is None else (room,))


class DecodeInstance:
    """One Decode instance (one TP group) and its scheduler; with attention DP,
    one DP group of an instance (the router sends it the rooms ``room % dp_size``
    picks, and the instance's groups crash together)."""

    def __init__(
        self, cluster: Cluster, index: int, tp: int, dp: int = 0, dp_size: int = 1
    ) -> None:
        self.cluster = cluster
        self.index = index
        self.tp = tp
        #: The attention-DP group this is of its instance (``room % dp_size``).
        self.dp = dp
        self.dp_size = dp_size
        self.name = f"d{index}" + (f".{dp}" if dp_size > 1 else "")
        #: Whether the instance's ranks have a staging region.
        self.staging = cluster.decode_staging[index]
        self.ranks: list[DecodeRank] = []
        self.alive = False
        self.incarnation = 0
        self.pool = arena.PagePool(cluster.config.num_pages, cluster.page_rng)
        #: Requests the scheduler tracks, by rid, and by room.
        self.requests: dict[str, Request] = {}
        self.by_room: dict[int, Request] = {}
        #: Reserved pages per request (rid), and their owner room index per page.
        self.pages: dict[str, list[int]] = {}
        self.owner: dict[int, int] = {}
        #: ``(tp_rank, room)`` whose data was checked when the rank's room turned
        #: Success (the request's end need not check them again).
        self.checked: set[tuple[int, int]] = set()
        #: Failed requests whose pages the cores hold (write fencing), by rid.
        self.held: dict[str, Request] = {}
        #: Room indexes some of whose writes landed here after they ended.
        self.fenced: set[int] = set()
        #: ``(page, room index)``: such a write landed in the page while that room
        #: owned it (its cells may now hold anything the late write carried, nothing
        #: included, when the source arena was emptied meanwhile).
        self.fenced_hits: set[tuple[int, int]] = set()
        self.poll_at: float | None = None
        self.crashes = 0
        #: Requests that arrived while the scheduler stalls on a dead rank.
        self.queued: list[Request] = []
        #: Ranks of this incarnation that died alone (``rank-crash``), and whether
        #: the scheduler stalls on them.
        self.dead_ranks = 0
        self.stalling = False

    @property
    def hosts(self) -> frozenset[str]:
        """The hosts of the instance's ranks."""
        return frozenset(rank.ip for rank in self.ranks)

    def key(self, request: Request) -> str:
        """The request's name on this side."""
        return f"{self.name}:{request.rid}"

    def pages_key(self, request: Request) -> str:
        """The name of the request's held pages, for their release deadline."""
        return f"{self.name}:{request.rid}:pages"

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        """Start (or restart) every rank with new ports and sessions."""
        cluster = self.cluster
        self.incarnation += 1
        self.poll_at = None
        self.dead_ranks = 0
        self.stalling = False
        self.ranks = [DecodeRank(self, r) for r in range(self.tp)]
        self.alive = True
        self.pool = arena.PagePool(cluster.config.num_pages, cluster.page_rng)
        for rank in self.ranks:
            cluster.network.listen(rank.ip, rank.port, rank.name, rank.on_status)
            cluster.sessions[rank.session] = rank
            cluster.queue.after(
                cluster.config.timings.heartbeat_interval, self._heartbeat, (self.incarnation, rank)
            )

    def crash(self) -> None:
        """The instance dies: tables, requests, pages and arenas are lost."""
        cluster = self.cluster
        now = cluster.now
        self.alive = False
        self.crashes += 1
        for rank in self.ranks:
            rank.alive = False
            cluster.network.close(rank.ip, rank.port)
            cluster.retired_sessions.append(rank.session)
            cluster.sessions.pop(rank.session, None)
        for request in self.requests.values():
            cluster.timeline.note(
                request.room, now, self.name, "request lost: the instance crashed"
            )
            cluster.checker.ended(self.key(request))
            cluster.outcomes.lost += 1
            cluster.router.side_ended(request)
        for request in self.queued:
            cluster.timeline.note(
                request.room, now, self.name, "request lost: the instance crashed"
            )
            cluster.outcomes.lost += 1
            cluster.router.side_ended(request)
        self.queued.clear()
        self.requests.clear()
        self.by_room.clear()
        self.pages.clear()
        self.owner.clear()
        self.checked.clear()
        for request in self.held.values():
            cluster.checker.ended(self.pages_key(request))
        self.held.clear()
        cluster.queue.after(cluster.config.timings.restart_delay, self._restart, self.incarnation)

    def _restart(self, incarnation: int) -> None:
        if incarnation == self.incarnation and not self.alive:
            self.start()
            self.cluster.router.kick()

    def kill_rank(self, tp_rank: int) -> None:
        """Rank ``tp_rank`` dies alone (``rank-crash``): its core's tables and its
        status port are gone, its session refuses writes, and nobody is told. The
        other ranks run on until the scheduler stalls."""
        self.cluster.rank_dies_alone(self, self.ranks[tp_rank])

    def stalled(self) -> bool:
        """Whether a scheduler step needing every rank cannot complete
        (:meth:`Cluster.stalled <tspd.sim.cluster.Cluster.stalled>`)."""
        return self.cluster.stalled(
            self,
            lambda: (
                [(self.key(r), r.room) for r in self.requests.values()]
                + [(self.pages_key(r), r.room) for r in self.held.values()]
            ),
        )

    # ------------------------------------------------------------------ driving cores

    def pump(
        self, rank: DecodeRank, rooms: Iterable[int], *, every: bool = False, wake: bool = True
    ) -> None:
        """Execute the rank's queued commands, check the rooms touched (or every
        room it holds), re-arm its timer and schedule an iteration."""
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
            if (
                seen.get(room, _ABSENT) is not state
                and observe(seen, rank.name, state, room) is _SUCCESS
            ):
                self._check_data(rank, room)
        cluster.arm_timer(rank, self.on_timer)
        if wake:
            self.wake()

    def _execute(self, rank: DecodeRank, command: Command, touched: set[int], now: float) -> None:
        cluster = self.cluster
        kind = type(command)
        if kind is SendFrames:
            assert isinstance(command, SendFrames)
            room = command.room
            host = command.endpoint.split(":", 1)[0]
            if room is not None:
                touched.add(room)
                what = "register" if command.frames[0] == b"None" else "pre-allocate"
                if what == "pre-allocate" and rank.staging is not None:
                    what += self._offered(rank, host, command)
                cluster.timeline.note(
                    room, now, rank.name, f"{what} with {command.endpoint}:{command.port}"
                )
            cluster.network.send(rank.ip, host, command.port, command.frames, room, rank.name)
        elif kind is FetchParallelInfo:
            assert isinstance(command, FetchParallelInfo)
            self._fetch(rank, command.bootstrap_addr, None)
        elif kind is FetchRankInfo:
            assert isinstance(command, FetchRankInfo)
            self._fetch(rank, command.bootstrap_addr, (command.engine_rank, command.dp_group))
        elif kind is ScatterStaged:
            assert isinstance(command, ScatterStaged)
            touched.add(command.room)
            self._scatter(rank, command)
        else:
            record(cluster, rank.name, command, touched, now)

    # ------------------------------------------------------------------ staging

    def _offered(self, rank: DecodeRank, host: str, command: SendFrames) -> str:
        """A pre-allocation from a rank with a staging region: claim the slot it
        offers (none may overlap a live claim); a note for the timeline."""
        cluster, region, room = self.cluster, rank.staging, command.room
        assert region is not None
        assert room is not None
        frames = command.frames
        stats = cluster.staging
        if len(frames) != 4:
            if not frames[2]:
                return ""  # a dummy pre-allocation
            if (host, command.port) in cluster.staging_routes:
                stats.slots_declined += 1
                return " (no staging slot)"
            stats.to_plain_prefill += 1
            return ""
        slot = wire.decode_preallocation(list(frames), staging=True).slot
        assert slot is not None
        offset, length = slot
        stats.slots_offered += 1
        if offset + length > len(region.data):
            cluster.checker.violate(
                Check.STAGING,
                rank.name,
                f"offered staging slot {offset}..{offset + length} past its "
                f"{len(region.data)}-byte region",
                room,
            )
        for other in region.overlapping(offset, length):
            cluster.checker.violate(
                Check.STAGING,
                rank.name,
                f"offered staging bytes {offset}..{offset + length} to room {room} while room "
                f"{other.room} still holds {other.offset}..{other.offset + other.length} (its "
                "pages were not returned)",
                room,
            )
        region.claims[offset] = Claim(offset, length, room, cluster.room_index[room])
        return f" (staging slot {offset}+{length})"

    def _release_slots(self, events: list[Event]) -> None:
        """The concluded events that return a room's pages return its slots: the
        core freed them in the same ``conclude``."""
        for event in events:
            if isinstance(event, (RemotePrefillDone, PagesReleased)) or (
                isinstance(event, Failed) and not event.pages_held
            ):
                for rank in self.ranks:
                    if rank.staging is not None:
                        rank.staging.release(event.room)

    def _scatter(self, rank: DecodeRank, command: ScatterStaged) -> None:
        """The core asks for a staged blob's scatter: it ends after a while."""
        cluster = self.cluster
        stats = cluster.staging
        stats.scatters += 1
        region = rank.staging
        room = command.room
        claim = region.claims.get(command.slot_offset) if region is not None else None
        if claim is None or claim.room != room or claim.length != command.slot_length:
            whose = "no room's" if claim is None else f"room {claim.room}'s"
            cluster.checker.violate(
                Check.STAGING,
                rank.name,
                f"scatters the blob of Prefill rank {command.prefill_rank} from staging slot "
                f"{command.slot_offset}+{command.slot_length}, which is {whose} slot",
                room,
            )
        timings = cluster.config.timings
        duration = timings.scatter_time * (0.5 + min(cluster.staging_rng.expovariate(1.0), 10.0))
        cluster.timeline.note(
            room,
            cluster.now,
            rank.name,
            f"scatter of a {command.staged_bytes}-byte blob from Prefill rank "
            f"{command.prefill_rank} begins",
        )
        if self.index in cluster.scatter_traps:
            cluster.scatter_traps.discard(self.index)
            cluster.queue.after(duration / 2, cluster.crash_in_scatter, (self.index, room))
        cluster.queue.after(duration, self._scattered, (self.incarnation, rank, command))

    def _scattered(self, argument: tuple[int, DecodeRank, ScatterStaged]) -> None:
        """The scatter's end: the shell's checks, the copy, ``staged_done``."""
        incarnation, rank, command = argument
        if incarnation != self.incarnation or not rank.alive:
            return
        cluster = self.cluster
        stats = cluster.staging
        region = rank.staging
        assert region is not None
        room = command.room
        claim = region.claims.get(command.slot_offset)
        if claim is None or claim.room != room:
            whose = "freed" if claim is None else f"given to room {claim.room}"
            cluster.checker.violate(
                Check.STAGING,
                rank.name,
                f"staging slot {command.slot_offset}+{command.slot_length} was {whose} before "
                f"the scatter of the blob from Prefill rank {command.prefill_rank} ended (the "
                "room's pages were returned while a Prefill rank still wrote them)",
                room,
            )
        checked = read_checked(region, command)
        error: str | None = None
        if isinstance(checked, str):
            error = checked
            stats.refused += 1
            cluster.timeline.note(room, cluster.now, rank.name, f"staged blob refused: {error}")
            if claim is not None and not claim.damaged:
                cluster.checker.violate(
                    Check.STAGING,
                    rank.name,
                    f"refused the staged blob of Prefill rank {command.prefill_rank}, though "
                    f"nothing but the room's own write reached its slot: {error}",
                    room,
                )
        else:
            self._copy_blob(rank, room, *checked)
            stats.scattered += 1
            stats.staged_rooms.add(room)
            cluster.timeline.note(room, cluster.now, rank.name, "staged blob scattered")
        cluster.focus = room
        rank.core.staged_done(room, command.prefill_rank, error, cluster.now)
        self.pump(rank, (room,))

    def _copy_blob(
        self, rank: DecodeRank, room: int, dst: Int64Array, lengths: Int64Array, blob: ByteArray
    ) -> None:
        """Copy a checked blob's data into the page model (the shell's
        ``scatter_blob``): whole cells, into pages the room still owns."""
        cluster = self.cluster
        geometry, cells = rank.geometry, rank.arena
        cell = geometry.cell_bytes
        page_of_cell, chunk_end, owner = geometry.page_of_cell, geometry.chunk_end, self.owner
        index = cluster.room_index[room]
        bad = (dst % cell != 0) | (lengths % cell != 0) | (dst + lengths > len(cells) * cell)
        if bad.any():
            i = int(bad.argmax())
            cluster.checker.violate(
                Check.DATA,
                rank.name,
                f"staged blob entry {i} ({int(dst[i])}, {int(lengths[i])}) is not whole cells "
                "of the arena",
                room,
            )
        at = BLOB_HEADER_BYTES + BLOB_ENTRY_BYTES * len(dst)
        # Every entry is whole cells, so the data decodes as cells in one go.
        data = decode_cells(blob[at : at + int(lengths.sum())], cell)
        taken = 0
        for d, m in zip(dst.tolist(), lengths.tolist(), strict=True):
            c, end = d // cell, (d + m) // cell
            first = c
            while c < end:
                page = page_of_cell[c]
                if page <= 0 or owner.get(page) != index:
                    holder = owner.get(page)
                    whose = "no room's" if holder is None else f"room#{holder}'s"
                    cluster.checker.violate(
                        Check.STAGING,
                        rank.name,
                        f"the scatter writes page {page}, which is {whose} page, not the room's "
                        "(a scatter must end before its room's pages are returned)",
                        room,
                    )
                c = chunk_end[c]
            cells[first:end] = data[taken : taken + end - first]
            taken += end - first

    def land_staged(
        self,
        target: DecodeRank,
        source: PrefillRank,
        room: int,
        parts: CopyPlan,
        count: int,
        late: bool,
        garbled: bool,
    ) -> None:
        """The first ``count`` parts of a staged write of ``room`` land in
        ``target``'s staging region (if its process still lives), read from the
        Prefill's staging region now; each part must lie in a slot the room claims
        (else ``fencing``, and the claims it touched are damaged)."""
        if not target.alive:
            return
        cluster = self.cluster
        region, origin = target.staging, source.staging
        if region is None or origin is None:
            cluster.checker.violate(
                Check.STAGING,
                source.name,
                f"a staged write from {source.name} reached {target.name}, and one of them has "
                "no staging region",
                room,
            )
            return
        index = cluster.room_index[room]
        foreign: tuple[int, int, list[Claim]] | None = None
        first: int | None = None
        srcs, dsts, lengths = parts.tolist()
        for src, dst, length in zip(srcs[:count], dsts[:count], lengths[:count], strict=True):
            s, d = src - origin.base, dst - region.base
            if not (0 <= s <= len(origin.data) - length and 0 <= d <= len(region.data) - length):
                cluster.checker.violate(
                    Check.DATA,
                    source.name,
                    f"staged part {(src, dst, length)} leaves a staging region",
                    room,
                )
            region.data[d : d + length] = origin.data[s : s + length]
            first = d if first is None else first
            claims = region.overlapping(d, length)
            if not any(c.index == index and c.covers(d, length) for c in claims):
                foreign = foreign or (d, length, claims)
            for claim in claims:
                if claim.index != index:
                    claim.damaged = True
        if garbled and first is not None:
            region.data[first] ^= 0xFF
            cluster.staging.garbled += 1
            for claim in region.overlapping(first, 1):
                claim.damaged = True
        what = "late staged write" if late else "staged write"
        cluster.timeline.note(
            room,
            cluster.now,
            target.name,
            f"{what} from {source.name} lands ({count} of {len(parts)} parts"
            + (", garbled)" if garbled else ")"),
        )
        if foreign is not None:
            d, length, claims = foreign
            whose = (
                "a free staging slot"
                if not claims
                else "the staging slot of " + ", ".join(f"room#{c.index}" for c in claims)
            )
            self.fenced.add(index)
            cluster.staging.late_blobs += 1
            cluster.checker.fencing(
                target.name,
                f"a {what} from {source.name} landed in {whose} (bytes {d}..{d + length}) after "
                "the room gave its slot up here",
                room,
            )

    def _fetch(self, rank: DecodeRank, addr: str, target: tuple[int, int] | None) -> None:
        cluster = self.cluster
        server = cluster.bootstrap_by_addr.get(addr)
        if server is None:
            raise AssertionError(f"{rank.name} asked an unknown bootstrap address {addr}")
        delay, ok = cluster.network.exchange(rank.ip, server.host, server.up)
        cluster.queue.after(
            delay,
            self._fetched,
            _Fetch(self.incarnation, rank, server, target, ok, server.incarnation),
        )

    def _fetched(self, fetch: _Fetch) -> None:
        rank, server = fetch.rank, fetch.server
        if fetch.incarnation != self.incarnation or not rank.alive:
            return
        now = self.cluster.now
        addr = server.addr
        unreachable = f"bootstrap server {addr} unreachable"
        ok = fetch.ok and server.answers(fetch.served_by)
        if fetch.target is None:
            info = server.parallel_info() if ok else unreachable
            rank.core.parallel_info(addr, info, now)
        else:
            engine_rank, dp_group = fetch.target
            answer = server.rank_info(engine_rank, dp_group) if ok else unreachable
            rank.core.rank_info(addr, dp_group, engine_rank, answer, now)
        self.pump(rank, (), every=True)

    def _heartbeat(self, argument: tuple[int, DecodeRank]) -> None:
        incarnation, rank = argument
        if incarnation != self.incarnation or not rank.alive:
            return
        cluster = self.cluster
        addrs = rank.core.bootstrap_addrs()
        interval = cluster.config.timings.heartbeat_interval
        if not addrs:
            cluster.queue.after(interval, self._heartbeat, argument)
            return
        results: list[tuple[BootstrapServer, bool, int]] = []
        longest = 0.0
        for addr in addrs:
            server = cluster.bootstrap_by_addr[addr]
            delay, ok = cluster.network.exchange(rank.ip, server.host, server.up)
            results.append((server, ok, server.incarnation))
            longest = max(longest, delay)
        cluster.queue.after(longest, self._beaten, (incarnation, rank, results))

    def _beaten(
        self, argument: tuple[int, DecodeRank, list[tuple[BootstrapServer, bool, int]]]
    ) -> None:
        incarnation, rank, results = argument
        if incarnation != self.incarnation or not rank.alive:
            return
        cluster = self.cluster
        for server, ok, served_by in results:
            rank.core.heartbeat(server.addr, ok and server.answers(served_by), cluster.now)
        self.pump(rank, (), every=True)
        cluster.queue.after(
            cluster.config.timings.heartbeat_interval, self._heartbeat, (incarnation, rank)
        )

    def on_timer(self, rank: DecodeRank) -> None:
        """The rank's deadline came (the waiting timeout)."""
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

    def reserve(self, request: Request) -> list[int] | None:
        """The router admits ``request`` here if pages are free: they are its room's
        from now on, until :meth:`submit` registers it or a crash loses them.
        ``None`` when the instance is down or full."""
        if not self.alive or len(self.pages) >= self.cluster.config.max_inflight:
            return None
        pages = self.pool.take(request.pages)
        if pages is None:
            return None
        for page in pages:
            self.owner[page] = request.index
        self.pages[request.rid] = pages
        return pages

    def wake(self, delay: float | None = None) -> None:
        """Schedule an iteration ``delay`` from now (the poll interval by default)."""
        cluster = self.cluster
        when = cluster.now + (cluster.config.timings.poll_interval if delay is None else delay)
        if self.poll_at is not None and self.poll_at <= when:
            return
        self.poll_at = when
        cluster.queue.at(when, self.iterate, self.incarnation)

    def submit(self, request: Request) -> None:
        """The router's request arrives: register it on every rank (its pages were
        reserved when the router admitted it, unless the instance died since)."""
        cluster = self.cluster
        now = cluster.now
        if not self.alive or request.rid not in self.pages:
            cluster.timeline.note(request.room, now, self.name, "request lost: the instance died")
            cluster.outcomes.lost += 1
            cluster.router.side_ended(request)
            return
        if self.stalled():
            cluster.timeline.note(request.room, now, self.name, "queued: a rank is dead")
            self.queued.append(request)
            return
        self.requests[request.rid] = request
        self.by_room[request.room] = request
        server = cluster.bootstrap[request.prefill]
        cluster.focus = request.room
        cluster.timeline.note(request.room, now, self.name, f"register {request.rid}")
        for rank in self.ranks:
            rank.core.register_request(request.rid, request.room, server.addr, now)
            self.pump(rank, (request.room,))
        cluster.checker.expect_end(self.key(request), request.room, now + cluster.decode_bound)

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
            if (
                self.requests
                or self.held
                or any(rank.core.has_in_flight() for rank in ranks if rank.alive)
            ):
                self.stalled()
            return
        events = iterate_group(
            cluster.checker, [r.name for r in ranks], [r.core for r in ranks], now
        )
        if events is None:
            return
        if self.staging:
            self._release_slots(events[0])
        rooms = [r.room for e in events[0] if (r := self.requests.get(e.rid)) is not None]
        for rank in ranks:
            self.pump(rank, rooms, wake=False)
        for index, event in enumerate(events[0]):
            if isinstance(event, PagesReleased):
                self._pages_released(event.rid)
                continue
            request = self.requests.get(event.rid)
            if request is None:
                cluster.checker.violate(
                    Check.OUTCOME, self.name, f"an event for an unknown request: {event}"
                )
                continue
            if isinstance(event, Bootstrapped):
                self._preallocate(request)
            elif isinstance(event, RemotePrefillDone):
                self._prefill_done(request, event)
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
                if getattr(event, "pages_held", False):
                    self._hold(request)
                else:
                    self._release(request.rid)
        if events[0]:
            self.wake()

    def _hold(self, request: Request) -> None:
        """The cores hold the failed request's pages: keep them until released,
        which must happen within the quarantine timeout."""
        cluster = self.cluster
        quarantine = cluster.quarantine_timeout
        self.held[request.rid] = request
        cluster.timeline.note(request.room, cluster.now, self.name, "pages held (fencing)")
        cluster.checker.expect_end(
            self.pages_key(request), request.room, cluster.now + quarantine + cluster.slack
        )
        cluster.queue.after(quarantine + 1e-6, self.iterate, self.incarnation)

    def _pages_released(self, rid: str) -> None:
        cluster = self.cluster
        request = self.held.pop(rid, None)
        if request is None:
            cluster.checker.violate(
                Check.OUTCOME, self.name, f"PagesReleased for {rid}, whose pages are not held"
            )
            return
        cluster.timeline.note(request.room, cluster.now, self.name, "pages released")
        cluster.checker.ended(self.pages_key(request))
        self._release(rid)

    def _preallocate(self, request: Request) -> None:
        cluster = self.cluster
        now = cluster.now
        pages = self.pages[request.rid]
        cluster.focus = request.room
        cluster.timeline.note(request.room, now, self.name, f"Bootstrapped; pre-allocate {pages}")
        tables = {arena.GROUP: pages}
        for rank in self.ranks:
            arena.zero(rank.arena, rank.geometry, pages)
            rank.core.send_preallocation(request.room, tables, now, prompt_len=request.prompt_len)
            self.pump(rank, (request.room,))

    def _prefill_done(self, request: Request, event: RemotePrefillDone) -> None:
        cluster = self.cluster
        for rank in self.ranks:
            if (rank.tp_rank, request.room) not in self.checked:
                self._check_data(rank, request.room)
        if event.bootstrap_token != request.token or event.cached_tokens != request.cached_tokens:
            cluster.checker.violate(
                Check.DATA,
                self.name,
                f"{request.rid} got token {event.bootstrap_token} and {event.cached_tokens} "
                f"cached tokens; the Prefill handed over {request.token} and "
                f"{request.cached_tokens}",
                request.room,
            )
        self._end(request, "RemotePrefillDone")
        cluster.queue.after(
            cluster.config.timings.decode_time, self._release_later, (self.incarnation, request.rid)
        )

    def _end(self, request: Request, outcome: str) -> None:
        cluster = self.cluster
        cluster.timeline.note(request.room, cluster.now, self.name, f"request ends: {outcome}")
        del self.requests[request.rid]
        self.by_room.pop(request.room, None)
        for rank in self.ranks:
            self.checked.discard((rank.tp_rank, request.room))
        cluster.checker.ended(self.key(request))
        cluster.router.side_ended(request)
        if outcome == "RemotePrefillDone":
            cluster.outcomes.decode_succeeded += 1
        else:
            cluster.outcomes.decode_failed += 1

    def _release_later(self, argument: tuple[int, str]) -> None:
        incarnation, rid = argument
        if incarnation == self.incarnation:
            self._release(rid)

    def _release(self, rid: str) -> None:
        pages = self.pages.pop(rid, None)
        if pages is None:
            return
        for page in pages:
            self.owner.pop(page, None)
        self.pool.give(pages)
        self.cluster.router.kick()

    # ------------------------------------------------------------------ arena

    def _check_data(self, rank: DecodeRank, room: int) -> None:
        """Rank ``rank``'s room turned Success: its pages must hold the room's data."""
        cluster = self.cluster
        request = self.by_room.get(room)
        if request is None:
            cluster.checker.violate(
                Check.DATA, rank.name, "a room this instance does not track turned Success", room
            )
            return
        self.checked.add((rank.tp_rank, room))
        pages = self.pages[request.rid]
        mismatch = arena.check(
            rank.arena, rank.geometry, cluster.codec, request.index, pages, request.prompt_len
        )
        if mismatch is None:
            return
        found = mismatch.found
        detail = (
            f"Success, but page {mismatch.page} (slot {mismatch.slot}, field {mismatch.field}) "
            f"cell {mismatch.cell} holds {cluster.codec.describe(found)} instead of "
            f"{cluster.codec.describe(mismatch.wanted)}"
        )
        others = [name for name in cluster.sent_to.get(room, ()) if name != self.name]
        if others:
            detail += f" (the room was also sent to {', '.join(others)})"
        if (mismatch.page, request.index) in self.fenced_hits or (
            found is not None and cluster.codec.room_of(found) in self.fenced
        ):
            cluster.checker.fenced_corruptions += 1
            cluster.checker.fencing(rank.name, f"{detail} (a fenced late write)", room)
            return
        cluster.checker.violate(Check.DATA, rank.name, detail, room)

    def land(
        self,
        target: DecodeRank,
        source: PrefillRank,
        room: int,
        plan: CopyPlan,
        count: int,
        late: bool,
    ) -> None:
        """The first ``count`` copies of a write of ``room`` land in ``target``'s
        arena (if its process still lives): cell for cell, each page checked for
        fencing."""
        if not target.alive:
            return
        cluster = self.cluster
        index = cluster.room_index[room]
        geometry, dst = target.geometry, target.arena
        cell = geometry.cell_bytes
        src_arena, src_base, src_cells = source.arena, source.base, source.geometry.cells
        page_of_cell, chunk_end = geometry.page_of_cell, geometry.chunk_end
        owner = self.owner
        fenced_page: int | None = None
        srcs, dsts, lengths = plan.tolist()
        for n_copy, (src, dst_addr, length) in enumerate(zip(srcs, dsts, lengths, strict=True)):
            if n_copy >= count:
                break
            s, d = src - src_base, dst_addr - target.base
            if s % cell or d % cell or length % cell:
                cluster.checker.violate(
                    Check.DATA,
                    source.name,
                    f"copy {(src, dst_addr, length)} is not cell-aligned",
                    room,
                )
            s, d, n = s // cell, d // cell, length // cell
            if not (s >= 0 and s + n <= src_cells and d >= 0 and d + n <= geometry.cells):
                cluster.checker.violate(
                    Check.DATA, source.name, f"copy {(src, dst_addr, length)} leaves an arena", room
                )
            c, end = d, d + n
            while c < end:
                page = page_of_cell[c]
                if page <= 0:
                    cluster.checker.violate(
                        Check.DATA,
                        source.name,
                        f"copy {(src, dst_addr, length)} writes outside any page of {target.name}",
                        room,
                    )
                holder = owner.get(page)
                if holder != index:
                    if fenced_page is None:
                        fenced_page = page
                    if holder is not None:
                        self.fenced_hits.add((page, holder))
                c = chunk_end[c]
            dst[d:end] = src_arena[s : s + n]
        what = "late write" if late else "write"
        cluster.timeline.note(room, cluster.now, target.name, f"{what} from {source.name} lands")
        if fenced_page is not None:
            self.fenced.add(index)
            holder = self.owner.get(fenced_page)
            whose = "a free page" if holder is None else f"a page of room#{holder}"
            cluster.checker.fencing(
                target.name,
                f"a {what} from {source.name} landed in {whose} ({fenced_page}) after the room "
                "ended here",
                room,
            )
