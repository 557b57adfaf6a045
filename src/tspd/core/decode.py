"""``DecodeCore``: one Decode rank's protocol state, sans-IO
(docs/protocol.md#proto-decode-room-table, docs/protocol.md#proto-decode-poll,
docs/protocol.md#proto-failure-prefill-death).

A Decode rank plans the route to the Prefill TP ranks of each request's bootstrap
address, registers with them, pre-allocates, counts completions and heartbeats the
Prefill bootstrap servers. The core keeps every table; the shell does the I/O.

How the shell drives it (one Trio task owns the core; nothing here is thread-safe):

* **Scheduler**, on every rank of the attention-TP group in the same order:
  :meth:`~DecodeCore.register_request` per new request; once its ``Bootstrapped``
  event came and its pages are allocated and zeroed,
  :meth:`~DecodeCore.send_preallocation`; each iteration, when
  :meth:`~DecodeCore.has_in_flight`: ``values = core.poll_values(now)``, the MIN
  all-reduce over the group, ``events = core.conclude(agreed, now)``.
* **Bootstrap client**: execute :class:`~tspd.core.commands.FetchParallelInfo` and
  :class:`~tspd.core.commands.FetchRankInfo` and answer with
  :meth:`~DecodeCore.parallel_info` / :meth:`~DecodeCore.rank_info` (pass the parsed
  info, or an error string when the fetch or the parse failed).
* **Status socket**: every message received: :meth:`~DecodeCore.receive_status`.
* **Heartbeat task**: every interval, ``GET /health`` on each of
  :meth:`~DecodeCore.bootstrap_addrs` and report :meth:`~DecodeCore.heartbeat`.
* **Timer**: sleep until :meth:`~DecodeCore.next_deadline`, then
  :meth:`~DecodeCore.handle_timeout` (the waiting timeout; the poll sees it too).
* After **every** call, execute :meth:`~DecodeCore.drain_commands` in order.

Nothing a peer sends, and no planning error, raises into the engine: the room fails
with the spec's reason (docs/protocol.md#proto-decode-room-table) instead. Only caller errors raise
(:class:`~tspd.core.errors.ProtocolError`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Self

from tspd.core import wire
from tspd.core.bootstrap import ParallelInfo, RankInfo
from tspd.core.commands import (
    DecodeCommand,
    Event,
    Failed,
    FetchParallelInfo,
    FetchRankInfo,
    LogLevel,
    PagesReleased,
    Rejected,
    RejectReason,
    RemotePrefillDone,
    ScatterStaged,
    SendFrames,
)
from tspd.core.config import (
    DEFAULT_STAGING_MIN_BYTES,
    check_rank_config,
    check_staging,
    parse_pd_env,
)
from tspd.core.contract import CacheContract, check_local_contract, parse_contract
from tspd.core.copies import Int64Array
from tspd.core.errors import ConfigError, ProtocolError, TspdError
from tspd.core.machines import (
    DECODE_ROOM_TABLE,
    PREFILL_ADDRESS_HEALTH_TABLE,
    AddressHealth,
    DecodeTrigger,
    HealthTrigger,
    RequestTrigger,
    RoomState,
)
from tspd.core.manifest import BlockManifest, build_manifest, validate_manifest
from tspd.core.planner import RoutePlanner
from tspd.core.poll import TransferPoll
from tspd.core.rank import RankCore, TrackedRequest
from tspd.core.reasons import Failure, ReasonClass
from tspd.core.rooms import RoomClocks
from tspd.core.staging import SlotPool, blob_length, room_ranges
from tspd.core.topology import ParallelTopology
from tspd.core.trace import Mark, Side, TraceConfig

__all__ = ["DEAD_ROUTE_TIMEOUTS", "DecodeConfig", "DecodeCore"]

_EARLY_COMPLETION: Final = Failure(
    ReasonClass.PROTOCOL, "Received KV completion before its transfer route was registered"
)
_UNEXPECTED_RANK: Final = Failure(
    ReasonClass.PROTOCOL, "Received KV completion from an unexpected Prefill TP rank"
)
_SET_MISMATCH: Final = Failure(
    ReasonClass.PROTOCOL, "Prefill TP completion set disagrees with the transfer route"
)
_PREFILL_FAILED: Final = Failure(
    ReasonClass.PEER_FAILED, "Failed to get kvcache from prefill instance, it might be dead"
)
#: Agreed values that announce ``Bootstrapped`` (once): any live status from
#: ``Bootstrapped`` on.
_ANNOUNCING: Final = frozenset(int(p) for p in TransferPoll if p >= TransferPoll.BOOTSTRAPPED)
#: Rooms still waiting for their KV: the waiting timeout applies to them.
_WAITING_STATES: Final = frozenset({RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING})
#: This many waiting timeouts in a row at one Prefill address, with no Success
#: between them, mean its cached route is probably dead (the Prefill restarted while
#: its bootstrap server lived on): the route is dropped and fetched again.
DEAD_ROUTE_TIMEOUTS: Final = 3
_WAITING_WARNING = (
    "Some requests timed out waiting for their KV cache: the prefill instance never "
    "reported them. Raise TOKENSPEED_DISAGGREGATION_WAITING_TIMEOUT (read by "
    "DecodeConfig.from_env) or DecodeConfig.waiting_timeout if a longer TTFT is "
    "acceptable."
)


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Everything a Decode rank's core needs, fixed at start.

    ``endpoint``/``port``: where this rank's status PULL socket listens (sent in
    registrations). ``session_id``: this rank's transfer-engine session
    (``"ip:rpc_port"``). ``arena_base``: its registered arena (Prefill writes there).
    ``contract``: this rank's own cache contract, which
    :func:`~tspd.core.contract.check_local_contract` must accept (a
    :class:`~tspd.core.errors.ContractError` otherwise).
    ``trace``: how many finished room traces are kept (:mod:`tspd.core.trace`).
    ``quarantine_timeout``: the longest a failed room's pages stay held when a
    Prefill rank that could write them never says the room ended (write fencing;
    twice Mooncake's default 30 s transfer timeout).
    ``topology``: the engine's parallel topology, when it has one; its TP size and
    rank must match, and a topology tspd cannot plan for (context parallelism) is
    refused here. ``test_failure_prob``/``test_failure_seed``: poll-time fault
    injection (:class:`~tspd.core.poll.FaultInjection`), for tests only.
    ``staging_bytes``/``staging_base``: this rank's staging region for staged
    transfers (docs/wire.md#staged-transfers; ``0`` bytes: off, the plain protocol
    only); the shell sets the base. ``staging_min_bytes``: a slot is offered only
    for a room of at least this many bytes on this rank.

    :meth:`from_env` builds one with defaults from TokenSpeed's environment
    variables (:mod:`tspd.core.config`).
    """

    tp_size: int
    tp_rank: int
    contract: CacheContract
    arena_base: int
    session_id: str
    endpoint: str
    port: int
    waiting_timeout: float = 300.0
    heartbeat_max_failures: int = 2
    quarantine_timeout: float = 60.0
    trace: TraceConfig = field(default_factory=TraceConfig)
    topology: ParallelTopology | None = None
    test_failure_prob: float = 0.0
    test_failure_seed: int | None = None
    staging_bytes: int = 0
    staging_base: int = 0
    staging_min_bytes: int = DEFAULT_STAGING_MIN_BYTES

    def __post_init__(self) -> None:
        check_rank_config(self.tp_size, self.tp_rank, self.topology, self.test_failure_prob)
        check_local_contract(self.contract)
        check_staging(self.staging_bytes, self.staging_base)
        if self.waiting_timeout <= 0:
            raise ConfigError(f"the waiting timeout must be positive, got {self.waiting_timeout}")
        if self.quarantine_timeout < 0:
            raise ConfigError(
                f"the quarantine timeout must not be negative, got {self.quarantine_timeout}"
            )
        if self.heartbeat_max_failures < 1:
            raise ConfigError(
                "TOKENSPEED_DISAGGREGATION_HEARTBEAT_MAX_FAILURE must be at least 1, got "
                f"{self.heartbeat_max_failures}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **fields: Any) -> Self:
        """A configuration whose defaults come from TokenSpeed's variables in
        ``environ`` (pass ``os.environ``); explicit ``fields`` win. Reads the
        waiting timeout, heartbeat failures and fault-injection probability.
        Raises :class:`ConfigError` naming a variable whose value is invalid."""
        env = parse_pd_env(environ, prefill=False)
        values: dict[str, Any] = {
            "waiting_timeout": float(env.waiting_timeout),
            "heartbeat_max_failures": env.heartbeat_max_failures,
            "test_failure_prob": env.test_failure_prob,
        }
        values.update(fields)
        return cls(**values)


@dataclass(slots=True, kw_only=True)
class _Receiver(TrackedRequest):
    #: The request's Prefill bootstrap address.
    addr: str
    #: This rank's pre-allocation went out: Prefill ranks may write its pages.
    preallocated: bool = False
    #: Prefill ranks that reported the room ended (Success or Failed).
    ended_by: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Held:
    """A failed room whose pages a Prefill rank may still write (write fencing)."""

    rid: str
    since: float
    #: Expected Prefill ranks that have not reported the room ended yet.
    writers: set[int]


@dataclass(frozen=True, slots=True)
class _Route:
    dp_group: int
    #: Every Prefill rank registered and pre-allocated with (targets and dummies).
    targets: tuple[int, ...]
    #: The ranks whose Success completes the room (dummies never report).
    expected: frozenset[int]


@dataclass(slots=True)
class _Completion:
    done: set[int] = field(default_factory=set)
    cached_tokens: int = 0
    bootstrap_token: int = -1
    spec_candidate_ids: tuple[int, ...] | None = None
    bootstrap_logprob: float | None = None


@dataclass(frozen=True, slots=True)
class _Slot:
    """A staging slot offered to one Prefill rank for one room, with the room's page
    bytes on this rank (what its blob may write)."""

    offset: int
    length: int
    starts: Int64Array
    ends: Int64Array


@dataclass(slots=True)
class _Address:
    """What is cached for one Prefill bootstrap address while it is healthy."""

    info: ParallelInfo
    #: The route planner, or the reason planning against this address fails.
    planner: RoutePlanner | str
    health: AddressHealth = AddressHealth.HEALTHY
    #: Heartbeat failures in a row: ``give_up`` fires when they reach the maximum.
    failures: int = 0
    #: Waiting timeouts in a row at this address, with no Success between them.
    timeouts: int = 0


class DecodeCore(RankCore[_Receiver, DecodeCommand]):
    """One Decode rank's requests, routes, registrations and completions. See the
    module docstring for when the shell calls what; :class:`~tspd.core.rank.RankCore`
    holds what it shares with the Prefill core (room table, traces, request
    tracking)."""

    _group = "Decode"

    def __init__(self, config: DecodeConfig) -> None:
        super().__init__(
            Side.DECODE,
            config.tp_rank,
            DECODE_ROOM_TABLE,
            config.trace,
            _ANNOUNCING,
            config.test_failure_prob,
            config.test_failure_seed,
        )
        self.config = config
        self._rid_of_room: dict[int, str] = {}
        self._addresses: dict[str, _Address] = {}
        #: Rooms waiting for an address's parallel info.
        self._awaiting_info: dict[str, list[int]] = {}
        self._rank_infos: dict[tuple[str, int, int], RankInfo] = {}
        #: Rooms waiting for one Prefill rank's control endpoint.
        self._awaiting_rank: dict[tuple[str, int, int], set[int]] = {}
        #: Prefill ranks this rank registered with (the "connection pool"), in the
        #: order it registered (a dict: re-registrations go out in a fixed order, so
        #: a simulated run replays alike whatever the process's hash seed).
        self._registered: dict[tuple[str, int, int], None] = {}
        #: Failed rooms whose pages may still be written, in the order they failed.
        self._held: dict[int, _Held] = {}
        #: Cached rank infos being fetched again to check they still hold.
        self._refreshing: set[tuple[str, int, int]] = set()
        #: Rooms per bootstrap address (the heartbeat's room tracker).
        self._tracker: dict[str, set[int]] = {}
        self._routes: dict[int, _Route] = {}
        self._completions: dict[int, _Completion] = {}
        #: Rooms waiting for input -> since when; ``next_deadline`` reads its
        #: earliest entry and ``handle_timeout`` drops the expired ones.
        self._waiting_since = RoomClocks()
        #: The same clocks until the poll (or the timer) has checked them once past
        #: the waiting timeout: a room is checked once, not on every iteration.
        self._waiting_unchecked = RoomClocks()
        self._waiting_warned = False
        #: The agreed "pages free" flags of the conclude in progress.
        self._free: Sequence[int] = ()
        #: Staged transfers (docs/wire.md#staged-transfers): this rank's staging
        #: region, the slots offered per room and Prefill rank, and the staged
        #: Success statuses whose blob is being scattered.
        staging = config.staging_bytes > 0 and config.staging_base > 0
        self._staging = SlotPool(config.staging_bytes) if staging else None
        self._slots: dict[int, dict[int, _Slot]] = {}
        self._scattering: dict[int, dict[int, wire.StatusMessage]] = {}
        try:
            registration = wire.encode_registration(
                wire.Registration(
                    endpoint=config.endpoint,
                    port=config.port,
                    session_id=config.session_id,
                    arena_base=config.arena_base,
                    contract=config.contract,
                    contract_bytes=config.contract.to_json(),
                    decode_tp_size=config.tp_size,
                    decode_tp_rank=config.tp_rank,
                )
            )
        except TspdError as err:
            raise ConfigError(
                f"this Decode rank cannot register with Prefill ranks: {err} (check the "
                "status endpoint, port, session id and arena base it was started with)"
            ) from err
        self._registration_frames = tuple(registration)
        self._staged_registration_frames = (
            (
                *self._registration_frames,
                wire.encode_staging_region(config.staging_base, config.staging_bytes),
            )
            if staging
            else None
        )

    def _registration_for(self, info: RankInfo) -> tuple[bytes, ...]:
        """The registration to send a Prefill rank: with this rank's staging region
        when both offer staged transfers."""
        staged = self._staged_registration_frames
        return staged if staged is not None and info.staging else self._registration_frames

    # ------------------------------------------------------------------ queries

    def has_in_flight(self) -> bool:
        """Whether any request is tracked or any failed room's pages are held (the
        scheduler polls only then)."""
        return bool(self._requests) or bool(self._held)

    def rid_of(self, room: int) -> str | None:
        """The tracked request of ``room``, if any."""
        return self._rid_of_room.get(room)

    def tracked_rooms(self) -> list[int]:
        """The rooms of tracked requests, ascending."""
        return sorted(self._rid_of_room)

    def bootstrap_addrs(self) -> list[str]:
        """The Prefill bootstrap addresses to heartbeat: those with cached parallel info."""
        return sorted(self._addresses)

    def statistics(self) -> dict[str, int]:
        """Table sizes. Every per-room table is empty once all rooms have ended;
        ``addresses``, ``rank_infos`` and ``registered_ranks`` are per Prefill peer."""
        return {
            "rooms": len(self._rooms),
            "traces": len(self._trace),
            "tracked_requests": len(self._requests),
            "routes": len(self._routes),
            "completions": len(self._completions),
            "waiting": len(self._waiting_since),
            "tracker_rooms": sum(len(rooms) for rooms in self._tracker.values()),
            "awaiting_info": sum(len(rooms) for rooms in self._awaiting_info.values()),
            "awaiting_rank": sum(len(rooms) for rooms in self._awaiting_rank.values()),
            "addresses": len(self._addresses),
            "rank_infos": len(self._rank_infos),
            "registered_ranks": len(self._registered),
            "held_rooms": len(self._held),
            "staging_slots": sum(len(slots) for slots in self._slots.values()),
            "scattering": len(self._scattering),
        }

    # ------------------------------------------------------------------ room helpers

    def _forget_request(self, receiver: _Receiver, now: float) -> None:
        room = receiver.room
        self._trace.finish(room, self._rooms.state(room), Mark.CONCLUDED, now)
        del self._requests[receiver.rid]
        self._rid_of_room.pop(room, None)
        self._rooms.forget(room)
        self._routes.pop(room, None)
        self._completions.pop(room, None)
        self._waiting_since.pop(room)
        self._waiting_unchecked.pop(room)
        if room not in self._held:
            self._free_slots(room)
        tracked = self._tracker.get(receiver.addr)
        if tracked is not None:
            tracked.discard(room)
            if not tracked and receiver.addr not in self._addresses:
                del self._tracker[receiver.addr]
        waiting = self._awaiting_info.get(receiver.addr)
        if waiting is not None and room in waiting:
            waiting.remove(room)
        for key in [k for k, rooms in self._awaiting_rank.items() if room in rooms]:
            self._awaiting_rank[key].discard(room)

    # ------------------------------------------------------------------ bootstrap

    def register_request(self, rid: str, room: int, bootstrap_addr: str, now: float) -> None:
        """Track request ``rid`` for ``room`` at Prefill ``bootstrap_addr``
        (``host:port``): the room is ``Bootstrapping``; its route is planned as soon
        as the address's parallel info is known (fetched once per address)."""
        if not 0 <= room <= wire.MAX_ROOM:
            raise ProtocolError(f"bootstrap_room {room} of request {rid} is outside [0, 2^63-1]")
        if rid in self._requests:
            raise ProtocolError(f"request {rid} is already registered (room {room})")
        if room in self._rid_of_room:
            raise ProtocolError(
                f"room {room} is already used by request {self._rid_of_room[room]} on this rank"
            )
        self._rooms.fire(room, DecodeTrigger.REGISTER)
        self._requests[rid] = _Receiver(rid, room, now, addr=bootstrap_addr)
        self._rid_of_room[room] = rid
        self._trace.mark(room, Mark.REGISTERED, now, rid=rid)
        self._tracker.setdefault(bootstrap_addr, set()).add(room)
        if bootstrap_addr in self._addresses:
            self._route(room, bootstrap_addr, now)
            return
        waiting = self._awaiting_info.setdefault(bootstrap_addr, [])
        if not waiting:
            self._commands.append(FetchParallelInfo(bootstrap_addr))
        waiting.append(room)

    def parallel_info(self, bootstrap_addr: str, info: ParallelInfo | str, now: float) -> None:
        """The answer to :class:`FetchParallelInfo`: the parsed info, or an error text.
        An error fails every room waiting for it (docs/protocol.md#proto-decode-room-table)."""
        waiting = self._awaiting_info.pop(bootstrap_addr, [])
        if isinstance(info, str):
            self._log(
                LogLevel.ERROR,
                f"fetching parallel info from Prefill bootstrap {bootstrap_addr} failed: {info}",
            )
            for room in waiting:
                self._fail(
                    room,
                    Failure(
                        ReasonClass.BOOTSTRAP,
                        f"Could not fetch prefill parallel info from bootstrap_addr: "
                        f"{bootstrap_addr}",
                    ),
                    now,
                )
            return
        self._addresses[bootstrap_addr] = _Address(info, self._planner(bootstrap_addr, info))
        self._tracker.setdefault(bootstrap_addr, set())
        for room in waiting:
            self._route(room, bootstrap_addr, now)

    def _planner(self, bootstrap_addr: str, info: ParallelInfo) -> RoutePlanner | str:
        try:
            if not info.cache_layout:
                return "Paged cache decode connected to a non-Paged cache prefill"
            if info.tp_size < 1 or info.dp_size < 1 or info.tp_size_per_dp < 1:
                return (
                    f"Prefill bootstrap {bootstrap_addr} reports an invalid topology: "
                    f"tp_size={info.tp_size}, dp_size={info.dp_size}"
                )
            return RoutePlanner(
                info.tp_size_per_dp,
                self.config.tp_size,
                parse_contract(info.cache_layout),
                self.config.contract,
            )
        except TspdError as err:
            return str(err)

    def _route(self, room: int, bootstrap_addr: str, now: float) -> None:
        if self._rooms.state(room) is not RoomState.BOOTSTRAPPING:
            return
        address = self._addresses[bootstrap_addr]
        planner = address.planner
        if isinstance(planner, str):
            self._fail(room, Failure(ReasonClass.INCOMPATIBLE, planner), now)
            return
        rank = self.config.tp_rank
        try:
            expected = planner.expected_prefill_ranks(rank)
            targets = planner.target_tp_ranks(rank)
        except TspdError as err:
            self._fail(room, Failure(ReasonClass.INCOMPATIBLE, str(err)), now)
            return
        route = _Route(room % address.info.dp_size, targets, expected)
        self._routes[room] = route
        missing = False
        for target in targets:
            key = (bootstrap_addr, route.dp_group, target)
            if key in self._rank_infos:
                continue
            missing = True
            waiting = self._awaiting_rank.setdefault(key, set())
            if not waiting:
                self._commands.append(FetchRankInfo(bootstrap_addr, target, route.dp_group))
            waiting.add(room)
        if not missing:
            self._routed(room, bootstrap_addr, now)

    def rank_info(
        self, bootstrap_addr: str, dp_group: int, engine_rank: int, info: RankInfo | str, now: float
    ) -> None:
        """The answer to :class:`FetchRankInfo`: the rank's control endpoint, or an
        error text. An error fails every room waiting for it
        (docs/protocol.md#proto-decode-room-table)."""
        key = (bootstrap_addr, dp_group, engine_rank)
        if key in self._refreshing:
            self._refreshed(key, info, now)
            return
        waiting = sorted(self._awaiting_rank.pop(key, set()))
        if isinstance(info, str):
            self._log(
                LogLevel.ERROR,
                f"fetching Prefill rank {engine_rank} (DP group {dp_group}) from bootstrap "
                f"{bootstrap_addr} failed: {info}",
            )
            for room in waiting:
                self._fail(
                    room,
                    Failure(
                        ReasonClass.BOOTSTRAP,
                        f"Could not fetch bootstrap info for engine rank: {engine_rank} and "
                        f"target_dp_group: {dp_group}",
                    ),
                    now,
                )
            return
        self._rank_infos[key] = info
        for room in waiting:
            route = self._routes.get(room)
            if route is None or self._rooms.state(room) is not RoomState.BOOTSTRAPPING:
                continue
            if all((bootstrap_addr, route.dp_group, t) in self._rank_infos for t in route.targets):
                self._routed(room, bootstrap_addr, now)

    def _refreshed(self, key: tuple[str, int, int], info: RankInfo | str, now: float) -> None:
        """A cached rank info fetched again (:meth:`heartbeat`). A Prefill rank whose
        control endpoint moved restarted: rooms that pre-allocated with the old
        process fail (it took their pre-allocations with it), and this rank registers
        with the new one before any further pre-allocation goes there."""
        self._refreshing.discard(key)
        old = self._rank_infos.get(key)
        if isinstance(info, str) or old is None:
            return  # Liveness is the heartbeat's call; keep what is cached.
        if old == info:
            return
        bootstrap_addr, dp_group, engine_rank = key
        self._rank_infos[key] = info
        failure = Failure(
            ReasonClass.PEER_DEAD,
            f"Prefill rank {engine_rank} (DP group {dp_group}) of {bootstrap_addr} restarted: "
            f"its control endpoint moved from {old.rank_ip}:{old.rank_port} to "
            f"{info.rank_ip}:{info.rank_port}",
        )
        affected = 0
        for room in sorted(self._tracker.get(bootstrap_addr, ())):
            route = self._routes.get(room)
            if (
                route is None
                or route.dp_group != dp_group
                or engine_rank not in route.targets
                or self._rooms.state(room) not in _WAITING_STATES
            ):
                continue
            affected += 1
            self._fail(room, failure, now, DecodeTrigger.PREFILL_LOST)
        self._log(
            LogLevel.WARNING, f"{failure.message}; registering again, {affected} requests failed"
        )
        self._registered[key] = None
        self._commands.append(
            SendFrames(info.rank_ip, info.rank_port, self._registration_for(info))
        )

    def _routed(self, room: int, bootstrap_addr: str, now: float) -> None:
        route = self._routes[room]
        for target in route.targets:
            key = (bootstrap_addr, route.dp_group, target)
            if key not in self._registered:
                info = self._rank_infos[key]
                self._registered[key] = None
                self._commands.append(
                    SendFrames(info.rank_ip, info.rank_port, self._registration_for(info), room)
                )
        self._rooms.fire(room, DecodeTrigger.ROUTED)
        self._trace.mark(room, Mark.BOOTSTRAPPED, now)

    # ------------------------------------------------------------------ pre-allocation

    def send_preallocation(
        self,
        room: int,
        manifest: BlockManifest | Mapping[str, Sequence[int]],
        now: float,
        *,
        prefix_len: int = 0,
        prompt_len: int | None = None,
    ) -> None:
        """Pre-allocate ``room`` with every target Prefill rank (docs/protocol.md#proto-journey
        step 5).

        ``manifest`` is the request's manifest, or its block-table row per group (then
        ``prefix_len``/``prompt_len`` give the window). It is validated against this
        rank's contract; an invalid one fails the room with the reason. Dummy ranks
        get an empty manifest. The room becomes ``WaitingForInput`` and its waiting
        timer starts. A room that already failed or ended is left alone.
        """
        state = self._rooms.state(room)
        if state in (RoomState.ABSENT, RoomState.FAILED):
            return
        if state is not RoomState.BOOTSTRAPPED:
            raise ProtocolError(
                f"room {room} is {state.value}: pre-allocate only after its Bootstrapped event"
            )
        receiver = self._requests[self._rid_of_room[room]]
        route = self._routes[room]
        try:
            if not isinstance(manifest, BlockManifest):
                if prompt_len is None:
                    raise ProtocolError("a pre-allocation from block tables needs prompt_len")
                manifest = build_manifest(self.config.contract, manifest, prefix_len, prompt_len)
            validate_manifest(manifest, self.config.contract, "destination")
            full = wire.encode_preallocation(room, self.config.session_id, manifest)
            # Dummy ranks' frames, only when the route has dummy ranks (equal TP has
            # none): the targets are the expected ranks plus the dummies.
            empty = (
                wire.encode_preallocation(room, self.config.session_id, None)
                if len(route.targets) > len(route.expected)
                else full
            )
        except ProtocolError:
            raise
        except TspdError as err:
            self._fail(
                room,
                Failure(ReasonClass.PREALLOCATION, f"invalid pre-allocation metadata: {err}"),
                now,
            )
            return
        infos = [self._rank_infos.get((receiver.addr, route.dp_group, t)) for t in route.targets]
        if any(info is None for info in infos):
            # Its route was dropped meanwhile (repeated waiting timeouts): nothing to
            # pre-allocate with; the request fails and a retry routes afresh.
            self._fail(
                room,
                Failure(
                    ReasonClass.PEER_DEAD,
                    f"the cached route to Prefill {receiver.addr} was dropped before room "
                    f"{room} pre-allocated; retry the request",
                ),
                now,
            )
            return
        for target, info in zip(route.targets, infos, strict=True):
            assert info is not None
            frames = full if target in route.expected else empty
            if frames is full and info.staging and self._staging is not None:
                slot = self._offer_slot(room, target, manifest, receiver.addr)
                if slot is not None:
                    frames = [*full, wire.encode_staging_slot(*slot)]
            self._commands.append(SendFrames(info.rank_ip, info.rank_port, tuple(frames), room))
        receiver.preallocated = True
        self._rooms.fire(room, DecodeTrigger.PREALLOCATED)
        self._waiting_since.start(room, now)
        self._waiting_unchecked.start(room, now)
        self._trace.mark(room, Mark.PREALLOCATED, now)

    # ------------------------------------------------------------------ status socket

    def receive_status(
        self, frames: Sequence[bytes], now: float, sender: str | None = None
    ) -> None:
        """Handle one status message from a Prefill rank (docs/protocol.md#proto-status,
        docs/protocol.md#proto-decode-room-table). Malformed messages are logged and
        dropped; messages for unknown rooms are ignored. ``Success`` and ``Failed``
        complete or fail the room; any other status from an expected rank is a
        monotonic update (:meth:`_progress_from`).

        ``sender``: in secure mode, the message's authenticated CURVE identity (its
        ``User-Id``, docs/security.md). A status whose sender is not the key the
        bootstrap route gave for the Prefill rank it names is rejected
        (``wrong-identity``) and touches nothing. ``None`` (plain mode) checks
        nothing."""
        try:
            message = wire.decode_status(list(frames))
        except TspdError as err:
            self._commands.append(
                Rejected(RejectReason.MALFORMED_STATUS, "unknown", str(err), level=LogLevel.WARNING)
            )
            return
        if sender is not None and not self._sent_by_rank(message, sender):
            self._commands.append(
                Rejected(
                    RejectReason.WRONG_IDENTITY,
                    sender,
                    f"rejecting a {message.status.label} status for room {message.room} that "
                    f"names Prefill rank {message.prefill_rank}: its CURVE identity {sender} "
                    "is not the key the bootstrap route gave for that rank of the room's route",
                    message.room,
                    level=LogLevel.WARNING,
                )
            )
            return
        room = message.room
        status = message.status
        if status is TransferPoll.SUCCESS and message.staged_bytes:
            self._staged_success(message, now)
            return
        if status is TransferPoll.SUCCESS or status is TransferPoll.FAILED:
            self._ended_by(room, message.prefill_rank)
        state = self._rooms.state(room)
        if state in (RoomState.ABSENT, RoomState.FAILED):
            return
        if status is TransferPoll.FAILED:
            self._fail(room, _PREFILL_FAILED, now)
        elif status is TransferPoll.SUCCESS:
            self._completed_by(room, message, now)
        else:
            self._progress_from(room, message, now)

    def _staged_success(self, message: wire.StatusMessage, now: float) -> None:
        """A ``Success`` whose bytes are a blob in this rank's staging slot
        (docs/wire.md#staged-transfers): the room completes for that Prefill rank only
        once the blob is checked and scattered (:class:`ScatterStaged`, then
        :meth:`staged_done`). Until then the rank counts as a writer of the room's
        pages, so a room that fails meanwhile keeps them held."""
        room, rank, size = message.room, message.prefill_rank, message.staged_bytes
        state = self._rooms.state(room)
        rid = self._rid_of_room.get(room)
        receiver = self._requests.get(rid) if rid is not None else None
        if receiver is not None and rank in receiver.ended_by:
            self._log(
                LogLevel.DEBUG,
                f"ignoring a repeated staged Success for room {room} from Prefill rank {rank}",
                room,
            )
            return
        if rank in self._scattering.get(room, {}):
            return
        slot = self._slots.get(room, {}).get(rank)
        if state in (RoomState.ABSENT, RoomState.FAILED):
            self._ended_by(room, rank)
            return
        if slot is None or size > slot.length:
            self._ended_by(room, rank)
            self._fail(
                room,
                Failure(
                    ReasonClass.TRANSFER,
                    f"Prefill rank {rank} reported room {room} written as a {size}-byte staged "
                    + (
                        "blob, but this Decode rank offered it no staging slot"
                        if slot is None
                        else f"blob, larger than the {slot.length}-byte slot offered"
                    ),
                ),
                now,
            )
            return
        self._scattering.setdefault(room, {})[rank] = message
        self._commands.append(
            ScatterStaged(room, rank, slot.offset, slot.length, size, slot.starts, slot.ends)
        )

    def staged_done(self, room: int, prefill_rank: int, error: str | None, now: float) -> None:
        """The answer to :class:`ScatterStaged`: the blob was scattered into the room's
        pages (``error`` ``None``), or refused with ``error`` (the room fails). Either
        way the Prefill rank no longer writes the room's pages."""
        pending = self._scattering.get(room)
        message = pending.pop(prefill_rank, None) if pending is not None else None
        if message is None:
            return
        if not pending:
            del self._scattering[room]
        self._ended_by(room, prefill_rank)
        if self._rooms.state(room) in (RoomState.ABSENT, RoomState.FAILED):
            return
        if error is not None:
            self._fail(
                room,
                Failure(
                    ReasonClass.TRANSFER,
                    f"the staged blob of room {room} from Prefill rank {prefill_rank} was "
                    f"refused: {error}",
                ),
                now,
            )
            return
        self._completed_by(room, message, now)

    def _offer_slot(
        self, room: int, target: int, manifest: BlockManifest, bootstrap_addr: str
    ) -> tuple[int, int] | None:
        """A staging slot for ``room``'s blob from Prefill rank ``target``, when the
        room is large enough and this rank's staging region has room; ``None``
        otherwise (that rank then writes in place)."""
        pool = self._staging
        assert pool is not None
        contract = self.config.contract
        slots = self._slots.get(room)
        ranges = next(iter(slots.values())) if slots else None
        if ranges is None:
            # The room's payload bytes bound its merged page ranges from above: a
            # room below the threshold is settled without building the ranges.
            if manifest.payload_bytes(contract) < self.config.staging_min_bytes:
                return None
            starts, ends = room_ranges(contract, manifest)
        else:
            starts, ends = ranges.starts, ranges.ends
        room_bytes = int((ends - starts).sum())
        if room_bytes < self.config.staging_min_bytes:
            return None
        # Table entries: one per copy of the rank's plan at most, a copy per field
        # page and row of its fragments (one row for a whole copy). A plan of more
        # copies does not fit and is written in place.
        address = self._addresses.get(bootstrap_addr)
        planner = address.planner if address is not None else None
        fragments = (
            planner.plan(self.config.tp_rank).fragments_by_prefill_rank.get(target, ())
            if isinstance(planner, RoutePlanner)
            else ()
        )
        rows = max((f.rows_per_page for f in fragments), default=1)
        entries = rows * sum(
            len(group.block_ids) * len(contract.fields_for_group(group.group_id))
            for group in manifest.groups
        )
        length = blob_length(entries, room_bytes)
        offset = pool.alloc(length)
        if offset is None:
            self._log(
                LogLevel.DEBUG,
                f"room {room} is not offered staging by Prefill rank {target}: this rank's "
                f"staging region has no {length}-byte hole now",
                room,
            )
            return None
        self._slots.setdefault(room, {})[target] = _Slot(offset, length, starts, ends)
        return offset, length

    def _free_slots(self, room: int) -> None:
        """Return the room's staging slots: no Prefill rank writes them any more."""
        slots = self._slots.pop(room, None)
        if slots is not None and self._staging is not None:
            for slot in slots.values():
                self._staging.free(slot.offset)

    def _sent_by_rank(self, message: wire.StatusMessage, sender: str) -> bool:
        """Secure mode: whether ``sender`` is the CURVE key the bootstrap route gave for
        Prefill rank ``message.prefill_rank`` of the room's route (a room no longer
        routed: of that rank at any Prefill address this rank knows)."""
        rank = message.prefill_rank
        route = self._routes.get(message.room)
        rid = self._rid_of_room.get(message.room)
        if route is not None and rid is not None:
            info = self._rank_infos.get((self._requests[rid].addr, route.dp_group, rank))
            return info is not None and info.curve_key == sender
        return any(k[2] == rank and i.curve_key == sender for k, i in self._rank_infos.items())

    def _ended_by(self, room: int, rank: int) -> None:
        """Prefill rank ``rank`` says ``room`` ended there: it writes none of the
        room's pages any more (its write fencing)."""
        rid = self._rid_of_room.get(room)
        if rid is not None:
            self._requests[rid].ended_by.add(rank)
            return
        held = self._held.get(room)
        if held is not None:
            held.writers.discard(rank)

    def _progress_from(self, room: int, message: wire.StatusMessage, now: float) -> None:
        """A status before ``Success`` (``Bootstrapping`` … ``Transferring``): the room's
        status takes ``max(current, reported)`` (docs/protocol.md#proto-decode-room-table,
        docs/protocol.md#proto-room-table), ``Failed`` staying
        sticky. Only an expected rank moves it, and never past this rank's own steps
        (route, pre-allocation): so only ``Transferring`` after the pre-allocation
        changes anything. It never completes the room; every expected rank's
        ``Success`` still does, and the waiting timeout still runs."""
        status, rank = message.status, message.prefill_rank
        route = self._routes.get(room)
        if route is None or rank not in route.expected:
            self._log(
                LogLevel.DEBUG,
                f"ignoring status {status.label} for room {room} from Prefill rank {rank}: "
                "not a rank of the room's transfer route",
                room,
            )
            return
        before = self._rooms.state(room)
        if status is not TransferPoll.TRANSFERRING:
            self._log(
                LogLevel.DEBUG,
                f"status {status.label} for room {room} from Prefill rank {rank} is not "
                f"ahead of its state {before.value}: nothing changes",
                room,
            )
            return
        after = self._rooms.fire(room, DecodeTrigger.TRANSFERRING)
        if after is RoomState.TRANSFERRING and before is not RoomState.TRANSFERRING:
            self._trace.mark(room, Mark.TRANSFER_STARTED, now)
            self._log(
                LogLevel.DEBUG,
                f"Req(room={room}) in Transferring, which is unexpected: Prefill rank {rank} "
                "reported it; the room now reports Transferring and still completes on "
                "every expected rank's Success",
                room,
            )
        elif after is before and before in (RoomState.BOOTSTRAPPING, RoomState.BOOTSTRAPPED):
            self._log(
                LogLevel.DEBUG,
                f"Prefill rank {rank} reported Transferring for room {room} before this "
                f"rank pre-allocated it (room is {before.value}): ignored",
                room,
            )

    def _completed_by(self, room: int, message: wire.StatusMessage, now: float) -> None:
        route = self._routes.get(room)
        if route is None:
            self._fail(room, _EARLY_COMPLETION, now)
            return
        rank = message.prefill_rank
        if rank not in route.expected:
            self._fail(room, _UNEXPECTED_RANK, now)
            return
        completion = self._completions.setdefault(room, _Completion())
        completion.done.add(rank)
        completion.cached_tokens = max(completion.cached_tokens, message.cached_tokens)
        if completion.bootstrap_token == -1 and message.bootstrap_token != -1:
            completion.bootstrap_token = message.bootstrap_token
        if completion.spec_candidate_ids is None and message.spec_candidate_ids:
            completion.spec_candidate_ids = message.spec_candidate_ids
        if completion.bootstrap_logprob is None:
            completion.bootstrap_logprob = message.bootstrap_logprob
        if len(completion.done) < len(route.expected):
            self._rooms.fire(room, DecodeTrigger.RANK_DONE)
        elif completion.done != route.expected:
            self._fail(room, _SET_MISMATCH, now)
        else:
            self._rooms.fire(room, DecodeTrigger.COMPLETED)
            self._trace.mark(room, Mark.COMPLETED, now)
            rid = self._rid_of_room.get(room)
            address = self._addresses.get(self._requests[rid].addr) if rid else None
            if address is not None:
                address.timeouts = 0

    # ------------------------------------------------------------------ heartbeat

    def heartbeat(self, bootstrap_addr: str, ok: bool, now: float) -> None:
        """One heartbeat outcome for ``bootstrap_addr``
        (docs/protocol.md#proto-failure-prefill-death). ``ok`` resets the
        failure count and prunes the address's room tracker; the
        ``heartbeat_max_failures``-th consecutive failure declares the address dead:
        its cached info and registrations are dropped and every tracked room not yet
        ``Success`` fails."""
        address = self._addresses.get(bootstrap_addr)
        if address is None:
            return
        if ok:
            address.failures = 0
            trigger = HealthTrigger.BEAT_OK
        else:
            address.failures += 1
            trigger = (
                HealthTrigger.GIVE_UP
                if address.failures >= self.config.heartbeat_max_failures
                else HealthTrigger.BEAT_FAILED
            )
        address.health = AddressHealth(PREFILL_ADDRESS_HEALTH_TABLE.fire(address.health, trigger))
        # The machine's state decides what the outcome does.
        if address.health is AddressHealth.HEALTHY:
            tracked = self._tracker.get(bootstrap_addr, set())
            tracked.intersection_update(r for r in list(tracked) if r in self._rid_of_room)
            self._refresh_routes(bootstrap_addr)
            self._register_again(bootstrap_addr)
        elif address.health is AddressHealth.DEAD:
            self._drop_address(bootstrap_addr, now)

    def _refresh_routes(self, bootstrap_addr: str) -> None:
        """Fetch the address's cached rank infos again, so a Prefill rank that
        restarted behind a bootstrap server that did not is noticed (the heartbeat
        only asks the server)."""
        for key in self._rank_infos:
            if key[0] == bootstrap_addr and key not in self._refreshing:
                self._refreshing.add(key)
                self._commands.append(FetchRankInfo(bootstrap_addr, key[2], key[1]))

    def _register_again(self, bootstrap_addr: str) -> None:
        """Send the (unchanged) registration to the address's Prefill ranks again: a
        rank that forgot this session (a full registration table, a restart) has it
        back within one heartbeat, and one that kept it only marks it recently used."""
        for key in self._registered:
            if key[0] == bootstrap_addr:
                info = self._rank_infos.get(key)
                if info is not None:
                    self._commands.append(
                        SendFrames(info.rank_ip, info.rank_port, self._registration_for(info))
                    )

    def _forget_routes(self, bootstrap_addr: str) -> None:
        """Drop the address's cached info, rank infos and registrations: the next
        request fetches them again and registers anew."""
        self._addresses.pop(bootstrap_addr, None)
        for key in [k for k in self._rank_infos if k[0] == bootstrap_addr]:
            del self._rank_infos[key]
            self._refreshing.discard(key)
        self._registered = {k: None for k in self._registered if k[0] != bootstrap_addr}

    def _drop_address(self, bootstrap_addr: str, now: float) -> None:
        self._forget_routes(bootstrap_addr)
        rooms = sorted(self._tracker.pop(bootstrap_addr, set()))
        failure = Failure(
            ReasonClass.PEER_DEAD,
            f"Losing connection with prefill instance (bootstrap_addr: {bootstrap_addr})",
        )
        affected = 0
        for room in rooms:
            if self._rooms.state(room) in (RoomState.SUCCESS, RoomState.ABSENT):
                continue
            affected += 1
            self._fail(room, failure, now, DecodeTrigger.PREFILL_LOST)
        self._log(LogLevel.ERROR, f"{failure.message}, affected {affected} requests")
        live = [r for r in rooms if r in self._rid_of_room]
        if live:
            # Requests still tracked keep their address entry until they end.
            self._tracker[bootstrap_addr] = set(live)

    # ------------------------------------------------------------------ scheduler

    def _check_waiting(self, receiver: _Receiver, now: float) -> bool:
        room = receiver.room
        since = self._waiting_since.get(room)
        if (
            since is None
            or receiver.concluded
            or self._rooms.state(room) not in _WAITING_STATES
            or now - since < self.config.waiting_timeout
        ):
            return False
        if not self._waiting_warned:
            self._waiting_warned = True
            self._log(LogLevel.WARNING, _WAITING_WARNING)
        # TokenSpeed's wording; a room a Prefill rank reported Transferring names that.
        status = self._rooms.state(room).poll or TransferPoll.WAITING_FOR_INPUT
        reason = f"Request {room} timed out after {now - since:.1f}s in {status.label}"
        # The request concludes Failed; the room's status is left alone until the
        # group's agreement fails it (docs/protocol.md#proto-decode-room-table).
        self._rooms.record_failure(room, Failure(ReasonClass.TIMEOUT_WAITING, reason))
        receiver.fire(RequestTrigger.WAITING_TIMEOUT)
        address = self._addresses.get(receiver.addr)
        if address is not None:
            address.timeouts += 1
            if address.timeouts >= DEAD_ROUTE_TIMEOUTS:
                self._log(
                    LogLevel.WARNING,
                    f"{address.timeouts} requests in a row timed out waiting for Prefill "
                    f"{receiver.addr}: dropping its cached route; the next request fetches "
                    "it from the bootstrap server again and registers anew",
                )
                self._forget_routes(receiver.addr)
        return True

    def _check_expired_waits(self, now: float) -> None:
        """Check, once each, the requests whose waiting clock ran out by ``now``: the
        clocks' heap says which, so an iteration with none costs one comparison."""
        for room in self._waiting_unchecked.pop_expired(now, self.config.waiting_timeout):
            rid = self._rid_of_room.get(room)
            if rid is not None:
                self._check_waiting(self._requests[rid], now)

    def poll_values(self, now: float) -> list[int]:
        """This rank's value per tracked request, in registration order, for the MIN
        all-reduce (docs/protocol.md#proto-decode-poll), followed by one flag per
        request (0: this rank's pages may still be written, should it fail) and one
        per held room (1: this rank may reuse its pages) -- the write-fencing values,
        agreed with the same MIN (docs/architecture.md#write-fencing). A request
        waiting for input past the waiting timeout concludes ``Failed`` with its
        reason."""
        self._check_expired_waits(now)
        values = self._local_values(now)
        append = values.append
        # Then, per request, whether this rank's pages may still be written if it
        # fails (0) or not (1): the MIN holds them when any rank's may be.
        for receiver in self._requests.values():
            append(0 if self._holds(receiver) else 1)
        # Then one value per held room, in the order they failed: 1 when this rank
        # may reuse its pages (the MIN releases them once every rank may).
        bound = self.config.quarantine_timeout
        scattering = self._scattering
        for room, held in self._held.items():
            # A blob being scattered into the room's pages holds them past any bound.
            append(
                1
                if room not in scattering and (not held.writers or now - held.since >= bound)
                else 0
            )
        return values

    def conclude(self, agreed: Sequence[int], now: float) -> list[Event]:
        """Apply the group's agreed values and return the scheduler's events; requests
        that ended are forgotten with their rooms."""
        receivers = list(self._requests.values())
        held = list(self._held.items())
        count = len(receivers)
        if len(agreed) != 2 * count + len(held):
            raise ProtocolError(
                f"the replica agreement returned {len(agreed)} values for "
                f"{len(receivers)} tracked requests and {len(held)} held rooms: every rank "
                "must track the same requests"
            )
        events: list[Event] = self._release(held, agreed[2 * count :], now)
        self._free = agreed[count : 2 * count]
        events += self._conclude_requests(receivers, agreed[:count], now)
        self._free = ()
        return events

    def _succeeded(self, request: _Receiver, now: float) -> Event:
        return self._prefill_done(request, now)

    def _failed(self, request: _Receiver, reason: str, index: int, now: float) -> Event:
        # Some rank of the group may still have its pages written: they stay held.
        pages_held = self._free[index] == 0
        if pages_held:
            self._hold(request, now)
        room = request.room
        return Failed(
            request.rid, reason, pages_held, room, self._event_time(room, Mark.FAILED, now)
        )

    def _hold(self, receiver: _Receiver, now: float) -> None:
        """Keep a failed room's pages held until every expected Prefill rank that got
        this rank's pre-allocation said the room ended, or the quarantine bound."""
        writers = self._writers(receiver) if receiver.preallocated else set()
        self._held.pop(receiver.room, None)
        self._held[receiver.room] = _Held(receiver.rid, now, writers)

    def _holds(self, receiver: _Receiver) -> bool:
        """Whether an expected Prefill rank may still write this rank's pages of the
        request (its pre-allocation went out and not every writer said it ended)."""
        if not receiver.preallocated:
            return False
        route = self._routes.get(receiver.room)
        return route is not None and not route.expected <= receiver.ended_by

    def _writers(self, receiver: _Receiver) -> set[int]:
        """Expected Prefill ranks of the room that have not said it ended."""
        route = self._routes.get(receiver.room)
        return set(route.expected) - receiver.ended_by if route is not None else set()

    def _release(
        self, held: list[tuple[int, _Held]], agreed: Sequence[int], now: float
    ) -> list[Event]:
        """The held rooms the group agreed to release, as :class:`PagesReleased`."""
        events: list[Event] = []
        bound = self.config.quarantine_timeout
        for (room, entry), value in zip(held, agreed, strict=True):
            if value == 1:
                del self._held[room]
                self._free_slots(room)
                timed_out = bool(entry.writers) and now - entry.since >= bound
                if timed_out:
                    self._log(
                        LogLevel.WARNING,
                        f"releasing the pages of failed room {room} after {bound:g}s without "
                        f"word from Prefill rank(s) {sorted(entry.writers)}: a late write from "
                        "them could still land (raise DecodeConfig.quarantine_timeout if "
                        "transfers can take longer)",
                        room,
                    )
                events.append(PagesReleased(entry.rid, room, timed_out))
        return events

    def _prefill_done(self, receiver: _Receiver, now: float) -> RemotePrefillDone:
        """The event of a request whose KV arrived, with what Prefill reported and when
        the completing ``Success`` arrived."""
        room = receiver.room
        completion = self._completions.get(room) or _Completion()
        return RemotePrefillDone(
            receiver.rid,
            completion.bootstrap_token,
            completion.spec_candidate_ids or (),
            completion.cached_tokens,
            completion.bootstrap_logprob,
            room,
            self._event_time(room, Mark.COMPLETED, now),
        )

    # ------------------------------------------------------------------ timers

    def next_deadline(self) -> float | None:
        """The earliest waiting-timeout expiry, or ``None``. O(1) amortised: the
        shell reads it after every call into the core."""
        since = self._waiting_since.earliest()
        return None if since is None else since + self.config.waiting_timeout

    def handle_timeout(self, now: float) -> None:
        """Conclude every request waiting for input past the waiting timeout (the poll
        does the same; whichever runs first records the reason)."""
        self._check_expired_waits(now)
        self._waiting_since.pop_expired(now, self.config.waiting_timeout)
