"""``PrefillCore``: one Prefill rank's protocol state, sans-IO
(docs/protocol.md#proto-prefill-room-table, docs/protocol.md#proto-prefill-poll,
docs/protocol.md#proto-failures, docs/protocol.md#proto-sleep-wake).

Decode ranks register with this rank and pre-allocate each request's pages; when the
prompt's KV is written, the shell's transfer workers push it to every destination
and the core reports success. The core keeps every table; the shell moves bytes.

How the shell drives it (one Trio task owns the core; nothing here is thread-safe):

* **Control socket** — every message received on the PULL socket:
  :meth:`PrefillCore.receive_control`. Malformed input never raises; it is logged,
  rejected or answered as the spec says.
* **Scheduler**, once per iteration on every rank of the attention-TP group, in the
  same order: :meth:`~PrefillCore.register_request` for new requests; then, when
  :meth:`~PrefillCore.has_in_flight`, ``values = core.poll_values(now)``, the MIN
  all-reduce of ``values`` over the group (skipped for a group of one), and
  ``events = core.conclude(agreed, now)``. Also :meth:`~PrefillCore.abort` (EPD
  give-up), :meth:`~PrefillCore.record_usage` and
  :meth:`~PrefillCore.check_release` before a sleep.
* **Forward thread** (entered into the loop, never waiting for a transfer):
  :meth:`~PrefillCore.arm_layerwise` before an extend forward (layerwise on),
  :meth:`~PrefillCore.hand_over` after the prompt's last chunk (remote decode).
* **Transfer workers** execute :class:`~tspd.core.commands.StartTransfer` and report
  :meth:`~PrefillCore.transfer_succeeded` (final chunk only) or
  :meth:`~PrefillCore.transfer_failed`; before each write they check
  :meth:`~PrefillCore.room_active`, and a layerwise step wait re-checks
  :meth:`~PrefillCore.session_alive` every ~100 ms.
* **Timer** — sleep until :meth:`~PrefillCore.next_deadline` (``None``: nothing
  scheduled; re-read it after every call into the core), then
  :meth:`~PrefillCore.handle_timeout`.
* After **every** call, execute :meth:`~PrefillCore.drain_commands` in order.

Behaviour kept from R-pd (docs/protocol.md#proto-compat-rust): unclaimed-room TTL, first failure
wins, notify
then mark ``Success``, every copy planned before the first write, absent rooms poll
as ``Failed``, pre-allocation check order 1, 3, 5, 2, 4, 6, 7, 8. One addition: when
the agreed value fails a request whose room this rank has not failed itself (a peer
rank failed it, or the bootstrap timeout fired), the room is aborted before it is
forgotten, so the destinations that pre-allocated hear ``Failed`` at once instead of
waiting for their own timeout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Self

from tspd.core import wire
from tspd.core.commands import (
    CloseRoute,
    DestinationWrite,
    Event,
    Failed,
    Log,
    LogLevel,
    PrefillCommand,
    Rejected,
    RejectReason,
    SendFrames,
    StagedWrite,
    StartTransfer,
    Succeeded,
    TransferInterval,
)
from tspd.core.config import (
    DEFAULT_STAGING_MIN_COPIES,
    check_rank_config,
    check_staging,
    parse_pd_env,
)
from tspd.core.contract import CacheContract, check_local_contract
from tspd.core.copies import plan_steps
from tspd.core.errors import ConfigError, PlanError, ProtocolError, TspdError
from tspd.core.machines import (
    PREFILL_ROOM_TABLE,
    PREFILL_TRANSFER_TABLE,
    PrefillTrigger,
    RequestTrigger,
    RoomState,
    TransferState,
    TransferTrigger,
    fire_transfer,
)
from tspd.core.manifest import (
    BlockManifest,
    Selection,
    build_manifest,
    require_same_prompt_window,
    select_chunk,
    validate_manifest,
)
from tspd.core.planner import PlannedRegistration, plan_registration, validate_fanout
from tspd.core.poll import TransferPoll
from tspd.core.rank import RankCore, TrackedRequest
from tspd.core.reasons import Failure, ReasonClass
from tspd.core.rooms import RoomClocks
from tspd.core.schedule import ProducerSchedule, StepReservation, interval_targets
from tspd.core.staging import SlotPool, blob_data_pad, blob_length
from tspd.core.topology import ParallelTopology
from tspd.core.trace import Mark, Side, TraceConfig

__all__ = [
    "BOOTSTRAP_STALL_S",
    "FAILED_ROOM_MEMORY",
    "MAX_FAILED_SESSIONS",
    "MAX_REGISTRATIONS",
    "MAX_UNCLAIMED_ROOMS",
    "REJECTED_SESSION_MEMORY",
    "ExtendRow",
    "PrefillConfig",
    "PrefillCore",
    "epd_abort_reason",
]

#: A request still bootstrapping this long after registration is listed in the
#: periodic stall warning, which repeats at most this often.
BOOTSTRAP_STALL_S = 10.0
#: At most this many requests are listed in one stall warning.
_STALL_LISTED = 8
#: Rooms that ended ``Failed`` are remembered this many at most (each for the
#: bootstrap timeout), so a Decode that pre-allocates one after it was forgotten
#: hears ``Failed`` at once instead of waiting for its own timeout. ~100 bytes each.
FAILED_ROOM_MEMORY: Final = 65_536
#: Rooms no local request claims (pre-allocated by Decode, or failed by a message)
#: are held this many at most, each for the bootstrap timeout; past it the oldest
#: is dropped as at its TTL, so a flood of pre-allocations for made-up rooms cannot
#: grow the tables without bound.
MAX_UNCLAIMED_ROOMS: Final = 65_536
#: Decode sessions registered at most at once (~4 KiB each). Past it the least
#: recently used session with no room in flight is forgotten (its next
#: pre-allocation would be refused as unregistered), so Decode restarts and
#: made-up sessions cannot grow the table without bound.
MAX_REGISTRATIONS: Final = 4096
#: Sessions whose registration was rejected are remembered this many at most (their
#: reply route, to answer their pre-allocations ``Failed``), oldest dropped first.
REJECTED_SESSION_MEMORY: Final = 1024
#: Sessions marked failed (failed-session fast-fail) at most at once, oldest mark
#: dropped first: the table is otherwise bounded only by how many sessions a
#: failed-session TTL's worth of Decode churn brings. A dropped session's new
#: transfers go to the engine again and fail there, as after its TTL.
MAX_FAILED_SESSIONS: Final = MAX_REGISTRATIONS

_CONFLICT = "conflicting registration for an active CachePD session"
#: The peer of a message that names no session (PULL sockets do not say who sent).
_UNKNOWN_PEER: Final = "unknown"
_UNREGISTERED = "CachePD request references an unregistered Decode session"
_KIND = "CachePD request kind disagrees with its registration"
_DUPLICATE = "duplicate CachePD pre-allocation for Decode session"
_FANOUT = "pre-allocation exceeds destination fanout"
_TOKEN_UNAVAILABLE = "Cache-transfer bootstrap token is unavailable"
_MAX_TOKEN = 2**63 - 1
_MIN_INT32, _MAX_INT32 = -(2**31), 2**31 - 1
#: TransferPoll values as plain ints, for the per-request poll and conclude.
_BOOTSTRAPPING: Final = int(TransferPoll.BOOTSTRAPPING)
#: Agreed values that announce ``Bootstrapped`` (once) or, later, succeed.
_ANNOUNCING: Final = frozenset({int(TransferPoll.BOOTSTRAPPED), int(TransferPoll.SUCCESS)})
#: Transfer states of a room that streams layerwise.
_LAYERWISE: Final = frozenset(
    {
        TransferState.STREAMING,
        TransferState.FINAL_IN_FLIGHT,
        TransferState.AWAITING_TOKEN,
        TransferState.STREAMED,
    }
)
_AWAITING_TOKEN: Final = frozenset({TransferState.AWAITING_TOKEN})
#: Transfer states with a final chunk handed to the workers and not yet reported.
_WITH_WORKERS: Final = frozenset({TransferState.FINAL_IN_FLIGHT, TransferState.SENDING})
_TIMEOUT_WARNING = (
    "Some requests timed out when bootstrapping: the decode instance never sent their "
    "cache manifest. Raise TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT (read by "
    "PrefillConfig.from_env) or PrefillConfig.bootstrap_timeout if a longer TTFT is "
    "acceptable."
)


def epd_abort_reason(rid: str) -> str:
    """The reason an EPD Prefill gives when it drops a request whose embeddings never
    arrived (docs/protocol.md#proto-failure-epd-abort); pass it to :meth:`PrefillCore.abort`."""
    return f"EPD: prefill aborted request {rid} (embedding receive timed out)"


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Everything a Prefill rank's core needs, fixed at start.

    ``tp_size``/``tp_rank``: this rank's attention-TP size (per DP group) and rank.
    ``status_rank``: this rank in Decode's completion-tracking rank space
    (docs/protocol.md#proto-status;
    ``tp_rank`` without pipeline parallelism). ``contract``: this rank's own cache
    contract, which :func:`~tspd.core.contract.check_local_contract` must accept
    (a :class:`~tspd.core.errors.ContractError` otherwise).
    ``arena_base``/``arena_len``: this rank's registered cache arena (``arena_len``
    defaults to the contract's arena size). ``session_id``: this rank's own
    transfer-engine session, for logs.
    ``failed_session_ttl <= 0`` disables failed-session fast-fail.
    ``layerwise``/``layerwise_interval``: the producer schedule and the producer
    steps per transfer interval when KV streams layerwise, else ``None``;
    ``layerwise_debug`` logs every armed chunk's intervals.
    ``trace``: how many finished room traces are kept (:mod:`tspd.core.trace`).
    ``topology``: the engine's parallel topology, when it has one; its TP size and
    rank must match, and a topology tspd cannot plan for (context parallelism) is
    refused here. ``test_failure_prob``/``test_failure_seed``: poll-time fault
    injection (:class:`~tspd.core.poll.FaultInjection`), for tests only.
    ``staging_bytes``/``staging_base``: this rank's staging region for staged
    transfers (docs/wire.md#staged-transfers; ``0`` bytes: off, the plain protocol
    only); the shell sets the base. ``staging_min_copies``: a destination's write is
    staged only when its coalesced plan has at least this many copies (fewer,
    larger copies go faster as they are).

    :meth:`from_env` builds one with defaults from TokenSpeed's environment
    variables (:mod:`tspd.core.config`).
    """

    tp_size: int
    tp_rank: int
    contract: CacheContract
    arena_base: int
    status_rank: int | None = None
    arena_len: int | None = None
    session_id: str = ""
    transfer_workers: int = 4
    bootstrap_timeout: float = 120.0
    failed_session_ttl: float = 30.0
    layerwise: ProducerSchedule | None = None
    layerwise_interval: int = 1
    layerwise_debug: bool = False
    trace: TraceConfig = field(default_factory=TraceConfig)
    topology: ParallelTopology | None = None
    test_failure_prob: float = 0.0
    test_failure_seed: int | None = None
    staging_bytes: int = 0
    staging_base: int = 0
    staging_min_copies: int = DEFAULT_STAGING_MIN_COPIES

    def __post_init__(self) -> None:
        check_rank_config(self.tp_size, self.tp_rank, self.topology, self.test_failure_prob)
        check_local_contract(self.contract)
        check_staging(self.staging_bytes, self.staging_base)
        if self.staging_min_copies < 1:
            raise ConfigError(
                f"staging_min_copies must be at least 1, got {self.staging_min_copies}"
            )
        if self.transfer_workers < 1:
            raise ConfigError(
                f"a Prefill rank needs at least one transfer worker, got {self.transfer_workers}"
            )
        if self.bootstrap_timeout <= 0:
            raise ConfigError(
                f"the bootstrap timeout must be positive, got {self.bootstrap_timeout}"
            )
        if self.arena_len is not None and self.arena_len < self.contract.arena_bytes:
            raise ConfigError(
                f"the registered arena ({self.arena_len} bytes) is smaller than the cache "
                f"contract's arena ({self.contract.arena_bytes} bytes)"
            )
        if self.layerwise is not None and self.layerwise_interval < 1:
            raise ConfigError(
                f"layerwise transfer interval must be at least 1 producer step, got "
                f"{self.layerwise_interval}"
            )

    @property
    def reported_rank(self) -> int:
        """The rank written into status messages."""
        return self.tp_rank if self.status_rank is None else self.status_rank

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **fields: Any) -> Self:
        """A configuration whose defaults come from TokenSpeed's variables in
        ``environ`` (pass ``os.environ``); explicit ``fields`` win. Reads the
        bootstrap timeout, failed-session TTL, queue size (transfer workers),
        thread-pool check, layerwise debug and fault-injection probability.
        Raises :class:`ConfigError` naming a variable whose value is invalid."""
        env = parse_pd_env(environ, prefill=True)
        values: dict[str, Any] = {
            "bootstrap_timeout": float(env.bootstrap_timeout),
            "failed_session_ttl": float(env.failed_session_ttl),
            "transfer_workers": env.queue_size,
            "layerwise_debug": env.layerwise_debug,
            "test_failure_prob": env.test_failure_prob,
        }
        values.update(fields)
        return cls(**values)


@dataclass(frozen=True, slots=True)
class ExtendRow:
    """One extend row of a forward, for layerwise arming: the request, the tokens this
    chunk computes (``[extend_prefix_len, extend_prefix_len + input_length)``) and the
    request's block-table row per group."""

    rid: str
    extend_prefix_len: int
    input_length: int
    tables: Mapping[str, Sequence[int]]


@dataclass(frozen=True, slots=True)
class _Registered:
    registration: wire.Registration
    planned: PlannedRegistration

    @property
    def route(self) -> tuple[str, int]:
        return self.registration.endpoint, self.registration.port


@dataclass(frozen=True, slots=True)
class _Destination:
    session_id: str
    #: ``None`` for a dummy pre-allocation (this rank only joins the agreement).
    manifest: BlockManifest | None
    #: The staging slot ``(offset, length)`` the Decode offered for the room.
    slot: tuple[int, int] | None = None


@dataclass(slots=True)
class _Metadata:
    bootstrap_token: int
    spec_candidate_ids: tuple[int, ...]


@dataclass(slots=True)
class _Usage:
    cached_tokens: int = 0
    bootstrap_logprob: float | None = None


@dataclass(slots=True)
class _PerRoom:
    """Everything kept for rooms besides their status, one dict per concern so each
    can be asserted empty."""

    destinations: dict[int, list[_Destination]] = field(default_factory=dict)
    #: Rooms no tracked request claims -> since when (their TTL clock).
    unclaimed: RoomClocks = field(default_factory=RoomClocks)
    usage: dict[int, _Usage] = field(default_factory=dict)
    metadata: dict[int, _Metadata] = field(default_factory=dict)
    #: Rooms whose outgoing transfer started -> its state
    #: (:data:`~tspd.core.machines.PREFILL_TRANSFER`); absent: nothing went out yet.
    transfers: dict[int, TransferState] = field(default_factory=dict)
    #: Staged rooms -> destination session -> blob bytes (for their Success status).
    staged: dict[int, dict[str, int]] = field(default_factory=dict)

    def transfer(self, room: int) -> TransferState:
        """The room's outgoing transfer state."""
        return self.transfers.get(room, TransferState.ABSENT)

    def fire(self, room: int, trigger: TransferTrigger) -> TransferState:
        """Move the room's transfer through its machine."""
        new = fire_transfer(self.transfers.get(room, TransferState.ABSENT), trigger)
        if new is TransferState.ABSENT:
            self.transfers.pop(room, None)
        else:
            self.transfers[room] = new
        return new

    def count(self, states: frozenset[TransferState]) -> int:
        """How many rooms' transfers are in ``states``."""
        return sum(1 for state in self.transfers.values() if state in states)

    def clear(self, room: int) -> None:
        self.destinations.pop(room, None)
        self.unclaimed.pop(room)
        self.usage.pop(room, None)
        self.metadata.pop(room, None)
        self.transfers.pop(room, None)
        self.staged.pop(room, None)


def _check_slot(slot: tuple[int, int], region: tuple[int, int] | None, dummy: bool) -> None:
    """A pre-allocation's staging slot must lie inside the staging region its session
    registered (docs/wire.md#staged-transfers)."""
    offset, length = slot
    if region is None:
        raise PlanError(
            f"it offers a staging slot (offset {offset}, {length} bytes), but its Decode "
            "session registered no staging region"
        )
    if dummy:
        raise PlanError("it offers a staging slot for a rendezvous-only pre-allocation")
    if offset + length > region[1]:
        raise PlanError(
            f"its staging slot (offset {offset}, {length} bytes) ends past the session's "
            f"{region[1]}-byte staging region"
        )


class PrefillCore(RankCore[TrackedRequest, PrefillCommand]):
    """One Prefill rank's registrations, rooms, requests and timers. See the module
    docstring for when the shell calls what; :class:`~tspd.core.rank.RankCore` holds
    what it shares with the Decode core (room table, traces, request tracking)."""

    def __init__(self, config: PrefillConfig) -> None:
        super().__init__(
            Side.PREFILL,
            config.tp_rank,
            PREFILL_ROOM_TABLE,
            config.trace,
            _ANNOUNCING,
            config.test_failure_prob,
            config.test_failure_seed,
        )
        self.config = config
        self._per_room = _PerRoom()
        #: Rooms of tracked requests -> how many tracked requests name them.
        self._tracked: dict[int, int] = {}
        self._registrations: dict[str, _Registered] = {}
        #: Sessions whose registration was rejected: their reply route.
        self._rejected: dict[str, tuple[str, int]] = {}
        #: Secure mode: the CURVE identity each registered or rejected session came
        #: from (docs/security.md); empty in plain mode.
        self._identities: dict[str, str] = {}
        self._failed_sessions: dict[str, float] = {}
        #: Failed rooms already forgotten -> when they were (oldest first).
        self._failed_rooms: dict[int, float] = {}
        #: Registered sessions that had a pre-allocation accepted (evicted last).
        self._proven: set[str] = set()
        #: Rooms -> chunks handed to transfer workers and not yet reported back.
        self._writing: dict[int, int] = {}
        #: Rooms -> routes whose Failed notice waits for the room's writes to end.
        self._deferred_notices: dict[int, list[tuple[str, int]]] = {}
        #: This rank's staging region, when staged transfers are on
        #: (docs/wire.md#staged-transfers), and the blobs each room holds in it.
        self._staging = (
            SlotPool(config.staging_bytes)
            if config.staging_bytes > 0 and config.staging_base > 0
            else None
        )
        self._staging_held: dict[int, list[int]] = {}
        self._steps = StepReservation()
        self._stall_logged_at: float | None = None
        #: Requests still bootstrapping past the stall age, seen by this conclude.
        self._stalled: list[TrackedRequest] = []
        self._stall_due = False
        self._timeout_warned = False
        self._interval_fields: tuple[frozenset[str] | None, ...] = (None,)
        if config.layerwise is not None:
            self._interval_fields = tuple(
                fields
                for _, fields in interval_targets(0, config.layerwise, config.layerwise_interval)
            )

    # ------------------------------------------------------------------ outputs

    def _reject(
        self, reason: RejectReason, peer: str, message: str, room: int | None = None
    ) -> None:
        self._commands.append(Rejected(reason, peer, message, room))

    def _send(self, route: tuple[str, int], frames: Sequence[bytes], room: int) -> None:
        self._commands.append(SendFrames(route[0], route[1], tuple(frames), room))

    def _notify_failed(self, route: tuple[str, int], room: int) -> None:
        usage = self._per_room.usage.get(room)
        cached = usage.cached_tokens if usage else 0
        self._send(route, wire.failure_notice(room, self.config.reported_rank, cached), room)

    def _route_of(self, session_id: str) -> tuple[str, int] | None:
        registered = self._registrations.get(session_id)
        if registered is not None:
            return registered.route
        return self._rejected.get(session_id)

    # ------------------------------------------------------------------ queries

    def room_active(self, room: int) -> bool:
        """Whether writes for the room may still go out (it is neither absent nor
        ``Failed``). Workers check it before each write: no page is written after
        its room ended."""
        return not self._rooms.ended(room)

    def has_in_flight(self) -> bool:
        """Whether any request is tracked (the scheduler polls only then)."""
        return bool(self._requests)

    def tracked_rooms(self) -> list[int]:
        """The rooms of tracked requests, ascending."""
        return sorted(self._tracked)

    def check_release(self) -> None:
        """Refuse a sleep's release of the registered cache while a tracked request's
        KV may still go out, or a chunk of any room is still with the transfer workers
        (a room that failed and was forgotten while its write hung still reads the
        arena until ``transfer_done``; docs/protocol.md#proto-sleep-wake). Unclaimed
        rooms send nothing and do not block it. Raises :class:`ProtocolError` listing
        the rooms."""
        rooms = sorted(set(self._tracked) | set(self._writing))
        if rooms:
            raise ProtocolError(
                f"cannot release the cache while KV sends are in flight: rooms {rooms}"
            )

    def is_registered(self, session_id: str) -> bool:
        """Whether ``session_id`` has an accepted registration."""
        return session_id in self._registrations

    def statistics(self) -> dict[str, int]:
        """Table sizes. Every per-room table is empty once all rooms have ended;
        ``registrations``, ``rejected`` and ``failed_sessions`` are per Decode session."""
        per_room = self._per_room
        return {
            "rooms": len(self._rooms),
            "traces": len(self._trace),
            "tracked_requests": len(self._requests),
            "tracked_rooms": len(self._tracked),
            "unclaimed": len(per_room.unclaimed),
            "destinations": len(per_room.destinations),
            "usage": len(per_room.usage),
            "layerwise_rooms": per_room.count(_LAYERWISE),
            "metadata": len(per_room.metadata),
            "awaiting_token": per_room.count(_AWAITING_TOKEN),
            "transfers_in_flight": per_room.count(_WITH_WORKERS),
            "registrations": len(self._registrations),
            "rejected": len(self._rejected),
            "failed_sessions": len(self._failed_sessions),
            "failed_room_memory": len(self._failed_rooms),
            "writing_rooms": len(self._writing),
            "deferred_notices": len(self._deferred_notices),
            "staged_rooms": len(self._staging_held),
        }

    # ------------------------------------------------------------------ room helpers

    def _touch(self, room: int, now: float) -> None:
        """The room gained state: start its unclaimed clock unless a request tracks it."""
        if room not in self._tracked:
            unclaimed = self._per_room.unclaimed
            unclaimed.setdefault(room, now)
            if len(unclaimed) > MAX_UNCLAIMED_ROOMS:
                oldest = unclaimed.pop_earliest()
                if oldest is not None:
                    self._reject(
                        RejectReason.TABLE_FULL,
                        _UNKNOWN_PEER,
                        f"{MAX_UNCLAIMED_ROOMS} rooms are waiting for a request on this "
                        f"rank: dropping the oldest, room {oldest} (a flood of pre-allocations "
                        "for rooms no request claims?)",
                        oldest,
                    )
                    self._drop_unclaimed(oldest, now)

    def _forget_room(
        self, room: int, mark: Mark, now: float, trigger: PrefillTrigger = PrefillTrigger.FORGET
    ) -> None:
        state = self._rooms.state(room)
        if state is RoomState.FAILED:
            self._remember_failed(room, now)
        self._trace.finish(room, state, mark, now)
        self._rooms.forget(room, trigger)
        self._per_room.clear(room)

    def _remember_failed(self, room: int, now: float) -> None:
        memory = self._failed_rooms
        memory.pop(room, None)
        memory[room] = now
        self._expire_failed_rooms(now)

    def _expire_failed_rooms(self, now: float) -> None:
        memory = self._failed_rooms
        horizon = now - self.config.bootstrap_timeout
        while memory:
            oldest, at = next(iter(memory.items()))
            if at > horizon and len(memory) <= FAILED_ROOM_MEMORY:
                break
            del memory[oldest]

    def _recently_failed(self, room: int, now: float) -> bool:
        at = self._failed_rooms.get(room)
        return at is not None and now - at < self.config.bootstrap_timeout

    def _fail(
        self,
        room: int,
        failure: Failure,
        now: float,
        trigger: str = PrefillTrigger.FAIL,
    ) -> None:
        """Fail the room (the first failure wins) and tell every non-dummy destination
        that pre-allocated for it; its destinations are dropped."""
        self._fail_room(room, failure, now, trigger)
        self._touch(room, now)
        if room in self._per_room.transfers:
            self._per_room.fire(room, TransferTrigger.STOPPED)
        for destination in self._per_room.destinations.pop(room, ()):
            if destination.manifest is None:
                continue
            route = self._route_of(destination.session_id)
            if route is None:
                self._log(
                    LogLevel.ERROR,
                    f"cannot notify Decode of failed room {room}: session "
                    f"{destination.session_id} is not registered",
                    room,
                )
            else:
                self._tell_failed(route, room)

    def _tell_failed(self, route: tuple[str, int], room: int) -> None:
        """Send ``Failed`` for ``room`` to ``route`` -- or, while a write of the room
        is in flight, once the last one ended (:meth:`transfer_done`): write fencing,
        a Decode that hears ``Failed`` may reuse the room's pages at once."""
        if room in self._writing:
            deferred = self._deferred_notices.setdefault(room, [])
            if route not in deferred:
                deferred.append(route)
        else:
            self._notify_failed(route, room)

    def _mark_session_failed(self, session_id: str, now: float) -> None:
        if self.config.failed_session_ttl <= 0:
            return
        # Re-inserted, so the table stays in the order the sessions failed: its first
        # entry is the next to expire (next_deadline reads it, O(1)).
        self._failed_sessions.pop(session_id, None)
        self._failed_sessions[session_id] = now
        if len(self._failed_sessions) > MAX_FAILED_SESSIONS:
            oldest = next(iter(self._failed_sessions))
            del self._failed_sessions[oldest]
            self._log(
                LogLevel.WARNING,
                f"{MAX_FAILED_SESSIONS} Decode sessions are marked failed: forgetting the "
                f"oldest mark, {oldest}; transfers to it are tried again (and fail at the "
                "engine if it is still down)",
            )
        self._log(
            LogLevel.WARNING,
            f"Decode session {session_id} marked failed for "
            f"{self.config.failed_session_ttl:g}s: new transfers to it fail fast",
        )

    def session_alive(self, session_id: str, now: float) -> bool:
        """Whether transfers to ``session_id`` may go ahead: ``False`` within the
        failed-session TTL after a write to it failed
        (docs/protocol.md#proto-failure-decode-death)."""
        ttl = self.config.failed_session_ttl
        failed_at = self._failed_sessions.get(session_id)
        if ttl <= 0 or failed_at is None:
            return True
        if now - failed_at < ttl:
            return False
        del self._failed_sessions[session_id]
        return True

    # ------------------------------------------------------------------ control socket

    def receive_control(
        self, frames: Sequence[bytes], now: float, sender: str | None = None
    ) -> None:
        """Handle one message from the control socket: a registration or a
        pre-allocation (docs/protocol.md#proto-control-dispatch,
        docs/protocol.md#proto-registration-handling,
        docs/protocol.md#proto-preallocation-checks). Never raises for peer input.

        ``sender``: in secure mode, the message's authenticated CURVE identity (its
        ``User-Id``, docs/security.md). A session belongs to the identity that first
        registered it, and a Decode status endpoint to the identity of the sessions
        registered on it: a registration or pre-allocation from another identity is
        rejected (``wrong-identity``) and touches nothing. ``None`` (plain mode)
        checks nothing."""
        frames = list(frames)
        try:
            registration = wire.is_registration(frames)
        except TspdError as err:
            self._reject(RejectReason.MALFORMED_HEADER, _UNKNOWN_PEER, str(err))
            return
        if registration:
            if sender is None or self._may_register(frames, sender):
                self._handle_registration(frames, now)
        else:
            self._handle_preallocation(frames, now, sender)

    def route_identity(self, endpoint: str, port: int) -> str | None:
        """Secure mode: the CURVE identity of the sessions that reply on
        ``endpoint:port`` — a Decode status socket, whose CURVE server key it is —
        or ``None`` (plain mode, or no session there)."""
        route = (endpoint, port)
        for session_id, registered in self._registrations.items():
            if registered.route == route and session_id in self._identities:
                return self._identities[session_id]
        for session_id, rejected in self._rejected.items():
            if rejected == route and session_id in self._identities:
                return self._identities[session_id]
        return None

    def _may_register(self, frames: list[bytes], sender: str) -> bool:
        """Secure mode: whether ``sender`` may register the session the registration
        names (see :meth:`receive_control`); if so, the session is bound to it."""
        try:
            route = wire.decode_registration_route(frames, staging=self._staging is not None)
        except TspdError:
            return True  # refused as malformed by the handler, binding nothing
        session_id = route.session_id
        bound = self._identities.get(session_id)
        holder = self.route_identity(route.endpoint, route.port)
        if bound not in (None, sender) or holder not in (None, sender):
            why = (
                f"the session was registered by {bound}"
                if bound not in (None, sender)
                else f"its status endpoint belongs to sessions of {holder}"
            )
            self._reject(
                RejectReason.WRONG_IDENTITY,
                session_id,
                f"rejecting CachePD Decode registration of session {session_id} "
                f"({route.endpoint}:{route.port}) from CURVE identity {sender}: {why}",
            )
            return False
        identities = self._identities
        identities[session_id] = sender
        if len(identities) > len(self._registrations) + len(self._rejected) + 64:
            self._identities = {
                sid: key
                for sid, key in identities.items()
                if sid == session_id or sid in self._registrations or sid in self._rejected
            }
        return True

    def _handle_registration(self, frames: list[bytes], now: float) -> None:
        try:
            registration = wire.decode_registration(frames, staging=self._staging is not None)
            planned = plan_registration(
                prefill_tp=self.config.tp_size,
                prefill_rank=self.config.tp_rank,
                prefill_contract=self.config.contract,
                decode_tp=registration.decode_tp_size,
                decode_rank=registration.decode_tp_rank,
                decode_contract=registration.contract,
            )
        except TspdError as err:
            self._reject_registration(frames, str(err), now)
            return
        session_id = registration.session_id
        new = _Registered(registration, planned)
        previous = self._registrations.get(session_id)
        if previous is not None and previous != new:
            self._reject_registration(frames, _CONFLICT, now)
            return
        if (
            previous is None
            and len(self._registrations) >= MAX_REGISTRATIONS
            and not self._forget_idle_session()
        ):
            self._reject_registration(
                frames,
                f"this Prefill rank already holds {MAX_REGISTRATIONS} Decode sessions, "
                "every one with a room in flight",
                now,
            )
            return
        self._rejected.pop(session_id, None)
        self._failed_sessions.pop(session_id, None)
        self._registrations.pop(session_id, None)
        self._registrations[session_id] = new  # most recently used last
        if previous is None:
            self._log(
                LogLevel.INFO,
                f"Decode session {session_id} (TP rank {registration.decode_tp_rank}/"
                f"{registration.decode_tp_size}) registered"
                + (" as a rendezvous-only destination" if planned.is_dummy else ""),
                limit_key="registered",
            )

    def _reject_registration(self, frames: list[bytes], reason: str, now: float) -> None:
        try:
            route = wire.decode_registration_route(frames, staging=self._staging is not None)
        except TspdError as err:
            self._reject(
                RejectReason.MALFORMED_REGISTRATION,
                _UNKNOWN_PEER,
                f"Rejecting malformed CachePD Decode registration: {err}",
            )
            return
        session_id = route.session_id
        self._reject(
            RejectReason.REGISTRATION_REFUSED,
            session_id,
            f"rejecting CachePD Decode registration of session {session_id} "
            f"({route.endpoint}:{route.port}): {reason}",
        )
        affected = [
            room
            for room, destinations in self._per_room.destinations.items()
            if any(d.session_id == session_id for d in destinations)
        ]
        for room in affected:
            self._fail(
                room,
                Failure(
                    ReasonClass.REGISTRATION,
                    f"Decode session {session_id} registration rejected: {reason}",
                ),
                now,
            )
        replaced = self._registrations.pop(session_id, None)
        self._proven.discard(session_id)
        rejected = self._rejected
        rejected.pop(session_id, None)
        rejected[session_id] = (route.endpoint, route.port)
        while len(rejected) > REJECTED_SESSION_MEMORY:
            del rejected[next(iter(rejected))]
        if replaced is not None and not self._route_in_use(replaced.route):
            # The stored registration's route is no session's any more.
            self._commands.append(CloseRoute(*replaced.route))

    def _forget_idle_session(self) -> bool:
        """Make room in a full registration table: forget the least recently used
        session that no room's destinations name; ``False`` if every one is busy."""
        busy = {d.session_id for group in self._per_room.destinations.values() for d in group}
        # Sessions that never had a pre-allocation accepted go first (a flood of
        # made-up registrations must not push out the Decodes doing real work),
        # then the least recently used of the others.
        proven = self._proven
        victim = next(
            (s for s in self._registrations if s not in busy and s not in proven), None
        ) or next((s for s in self._registrations if s not in busy), None)
        if victim is not None:
            session_id = victim
            registered = self._registrations.pop(session_id)
            self._proven.discard(session_id)
            self._failed_sessions.pop(session_id, None)
            self._reject(
                RejectReason.TABLE_FULL,
                _UNKNOWN_PEER,
                f"{MAX_REGISTRATIONS} Decode sessions are registered: forgetting the least "
                f"recently used, {session_id}, which must register again before its next "
                "pre-allocation (many Decode restarts, or a flood of made-up sessions?)",
            )
            if not self._route_in_use(registered.route):
                self._commands.append(CloseRoute(*registered.route))
            return True
        return False

    def _route_in_use(self, route: tuple[str, int]) -> bool:
        """Whether a registered or rejected session still replies on ``route`` (a
        scan: only a registration's rejection or a send failure asks)."""
        return route in self._rejected.values() or any(
            r.route == route for r in self._registrations.values()
        )

    def _handle_preallocation(
        self, frames: list[bytes], now: float, sender: str | None = None
    ) -> None:
        try:
            preallocation = wire.decode_preallocation(frames, staging=self._staging is not None)
        except TspdError as err:
            self._reject(
                RejectReason.MALFORMED_PREALLOCATION,
                _UNKNOWN_PEER,
                f"rejecting a malformed CachePD pre-allocation: {err}",
            )
            return
        room, session_id = preallocation.room, preallocation.session_id
        if sender is not None and self._identities.get(session_id) != sender:
            self._reject(
                RejectReason.WRONG_IDENTITY,
                session_id,
                f"rejecting CachePD pre-allocation of room {room} for session {session_id} "
                f"from CURVE identity {sender}: that identity did not register the session",
                room,
            )
            return
        try:
            self._accept_preallocation(preallocation, now)
        except TspdError as err:
            self._reject(
                RejectReason.PREALLOCATION_REFUSED,
                session_id,
                f"rejecting CachePD pre-allocation of room {room} from session {session_id}: {err}",
                room,
            )
            self._fail(
                room,
                Failure(ReasonClass.PREALLOCATION, f"invalid pre-allocation metadata: {err}"),
                now,
            )
            route = self._route_of(session_id)
            if route is None:
                self._reject(
                    RejectReason.PREALLOCATION_REFUSED,
                    session_id,
                    f"cannot notify a malformed Decode peer: session {session_id} has no "
                    f"known route (room {room})",
                    room,
                )
            else:
                self._tell_failed(route, room)

    def _accept_preallocation(self, preallocation: wire.Preallocation, now: float) -> None:
        room, session_id = preallocation.room, preallocation.session_id
        registered = self._registrations.pop(session_id, None)
        if registered is None:
            raise PlanError(_UNREGISTERED)
        self._registrations[session_id] = registered  # most recently used last
        state = self._rooms.state(room)
        if state is RoomState.FAILED or (
            state is RoomState.ABSENT and self._recently_failed(room, now)
        ):
            # Not an error: the room failed earlier (and may have been forgotten
            # since); this destination hears it now, or once the room's writes ended.
            self._tell_failed(registered.route, room)
            return
        manifest = preallocation.manifest()
        if (manifest is None) != registered.planned.is_dummy:
            raise PlanError(_KIND)
        if manifest is not None:
            validate_manifest(manifest, registered.registration.contract, "destination")
        slot = preallocation.slot
        if slot is not None:
            _check_slot(slot, registered.registration.staging, manifest is None)
        destinations = list(self._per_room.destinations.get(room, ()))
        if any(d.session_id == session_id for d in destinations):
            raise PlanError(_DUPLICATE)
        destinations.append(_Destination(session_id, manifest, slot))
        expected = len(registered.planned.expected_decode_ranks)
        if len(destinations) > expected:
            raise PlanError(_FANOUT)
        complete = len(destinations) == expected
        if complete or state is RoomState.BOOTSTRAPPED:
            # A set that was complete is checked again with the newcomer (a retried
            # request from a Decode of another TP size expects more destinations):
            # it fails, so nobody hears Success for pages no write was planned for.
            validate_fanout([self._fanout_member(d.session_id) for d in destinations])
        self._per_room.destinations[room] = destinations
        self._proven.add(session_id)
        self._touch(room, now)
        self._rooms.fire(
            room, PrefillTrigger.FANOUT_COMPLETE if complete else PrefillTrigger.PREALLOCATE
        )
        self._trace.mark(room, Mark.PREALLOCATED, now)
        if complete:
            self._trace.mark(room, Mark.BOOTSTRAPPED, now)

    def _fanout_member(self, session_id: str) -> tuple[int, int, frozenset[int]] | None:
        registered = self._registrations.get(session_id)
        if registered is None:
            return None
        reg = registered.registration
        return reg.decode_tp_size, reg.decode_tp_rank, registered.planned.expected_decode_ranks

    # ------------------------------------------------------------------ scheduler

    def register_request(self, rid: str, room: int, now: float) -> None:
        """Track request ``rid`` for ``room`` on this rank
        (docs/protocol.md#proto-prefill-room-table row 1): the room
        becomes ``Bootstrapping`` (or keeps later progress) and leaves the unclaimed
        set. Every rank of the TP group registers the same requests in the same order.
        """
        if not 0 <= room <= wire.MAX_ROOM:
            raise ProtocolError(f"bootstrap_room {room} of request {rid} is outside [0, 2^63-1]")
        if rid in self._requests:
            raise ProtocolError(f"request {rid} is already registered (room {room})")
        self._per_room.usage.pop(room, None)
        self._failed_rooms.pop(room, None)
        self._rooms.fire(room, PrefillTrigger.REGISTER)
        self._per_room.unclaimed.pop(room)
        self._tracked[room] = self._tracked.get(room, 0) + 1
        self._requests[rid] = TrackedRequest(rid, room, now)
        self._trace.mark(room, Mark.REGISTERED, now, rid=rid)

    def poll_values(self, now: float) -> list[int]:
        """This rank's value per tracked request, in registration order, for the MIN
        all-reduce (docs/protocol.md#proto-prefill-poll step 1). A request bootstrapping past the
        bootstrap
        timeout concludes ``Failed`` here, with its reason."""
        return self._local_values(now)

    def _timed_out(self, request: TrackedRequest, value: int, now: float) -> bool:
        if value != _BOOTSTRAPPING or now - request.started < self.config.bootstrap_timeout:
            return False
        self._bootstrap_timed_out(request, now)
        return True

    def _bootstrap_timed_out(self, sender: TrackedRequest, now: float) -> None:
        """The request concludes ``Failed``; the room's status is left alone until
        the group's agreement fails it (docs/protocol.md#proto-prefill-room-table)."""
        elapsed = now - sender.started
        reason = (
            f"Request {sender.room} timed out after {elapsed:.1f}s in "
            f"{TransferPoll.BOOTSTRAPPING.label}"
        )
        if not self._timeout_warned:
            self._timeout_warned = True
            self._log(LogLevel.WARNING, _TIMEOUT_WARNING)
        self._rooms.record_failure(sender.room, Failure(ReasonClass.TIMEOUT_BOOTSTRAPPING, reason))
        sender.fire(RequestTrigger.BOOTSTRAP_TIMEOUT)

    def conclude(self, agreed: Sequence[int], now: float) -> list[Event]:
        """Apply the group's agreed values (docs/protocol.md#proto-prefill-poll steps 3-4) and
        return the
        scheduler's events; requests that ended are forgotten with their rooms."""
        requests = list(self._requests.values())
        if len(agreed) != len(requests):
            raise ProtocolError(
                f"the replica agreement returned {len(agreed)} values for "
                f"{len(requests)} tracked requests: every rank must track the same requests"
            )
        # The stall warning goes before anything this call queues; its candidates
        # are collected in the same pass as the events (:meth:`_still_open`).
        self._stall_due = (
            self._stall_logged_at is None or now - self._stall_logged_at >= BOOTSTRAP_STALL_S
        )
        stall_at = len(self._commands)
        events = self._conclude_requests(requests, agreed, now)
        if self._stalled:
            self._log_stalls(self._stalled, stall_at, now)
            self._stalled = []
        return events

    def _still_open(self, request: TrackedRequest, value: int, now: float) -> None:
        if (
            value == _BOOTSTRAPPING
            and self._stall_due
            and now - request.started >= BOOTSTRAP_STALL_S
        ):
            self._stalled.append(request)

    def _succeeded(self, request: TrackedRequest, now: float) -> Event:
        room = request.room
        return Succeeded(request.rid, room, self._event_time(room, Mark.NOTIFIED, now))

    def _failed(self, request: TrackedRequest, reason: str, index: int, now: float) -> Event:
        room = request.room
        return Failed(request.rid, reason, room=room, at=self._event_time(room, Mark.FAILED, now))

    def _forget_request(self, sender: TrackedRequest, now: float) -> None:
        del self._requests[sender.rid]
        room = sender.room
        left = self._tracked.get(room, 0) - 1
        if left > 0:
            self._tracked[room] = left
            return
        self._tracked.pop(room, None)
        self._forget_room(room, Mark.CONCLUDED, now)

    def _log_stalls(self, stalled: list[TrackedRequest], at: int, now: float) -> None:
        """Queue the stall warning at command position ``at`` (before the events'
        commands of the same conclude), listing the first few stalled requests."""
        self._stall_logged_at = now
        listed = ", ".join(
            f"{s.rid}(room={s.room}, age={now - s.started:.0f}s)" for s in stalled[:_STALL_LISTED]
        )
        self._commands.insert(
            at,
            Log(
                LogLevel.WARNING,
                f"requests still bootstrapping (their Decode ranks have not all pre-allocated): "
                f"{listed}",
            ),
        )

    def abort(self, room: int, reason: str, now: float) -> None:
        """Fail ``room`` with ``reason`` and notify its destinations
        (docs/protocol.md#proto-failure-epd-abort;
        ``epd_abort_reason(rid)`` for an EPD give-up). A later pre-allocation is
        answered ``Failed``; an untracked room is dropped after the unclaimed TTL."""
        self._fail(room, Failure(ReasonClass.ABORTED, reason), now, PrefillTrigger.ABORT)

    def record_usage(
        self, room: int, cached_tokens: int, bootstrap_logprob: float | None = None
    ) -> None:
        """Record the room's prefix-cache hit and bootstrap logprob for its status
        messages; ignored once the room ended."""
        if self._rooms.ended(room):
            return
        usage = self._per_room.usage.setdefault(room, _Usage())
        usage.cached_tokens = min(max(0, cached_tokens), wire.MAX_ROOM)
        if bootstrap_logprob is not None:
            usage.bootstrap_logprob = bootstrap_logprob

    # ------------------------------------------------------------------ forward

    def hand_over(
        self,
        room: int,
        source_tables: Mapping[str, Sequence[int]],
        bootstrap_token: int,
        spec_candidate_ids: Sequence[int],
        now: float,
    ) -> None:
        """The prompt's KV is written: send it (docs/protocol.md#proto-prefill-poll "remote decode
        hand-over").

        ``source_tables`` is the request's block-table row per group on this rank.
        Full mode: builds the source manifest over Decode's prompt window, plans
        every destination's complete, coalesced and bounds-checked copy list and
        queues one :class:`StartTransfer`. A dummy-only room succeeds at once. A
        layerwise room only gets its bootstrap token (its chunks already stream).
        Planning errors fail the room with a reason; a room that already ended is
        ignored. Raises only for caller errors: a negative token, or a room still
        waiting for pre-allocations.
        """
        if not 0 <= bootstrap_token <= _MAX_TOKEN:
            raise PlanError(_TOKEN_UNAVAILABLE)
        candidates = tuple(spec_candidate_ids)
        if len(candidates) > wire.MAX_SPEC_CANDIDATES:
            raise PlanError(
                f"room {room} has {len(candidates)} speculative candidate ids, more than "
                f"the {wire.MAX_SPEC_CANDIDATES} a status message carries"
            )
        if any(not _MIN_INT32 <= c <= _MAX_INT32 for c in candidates):
            raise PlanError(
                f"speculative candidate ids of room {room} must be int32 token ids, "
                f"got {list(candidates)}"
            )
        metadata = _Metadata(bootstrap_token, candidates)
        if self._rooms.ended(room):
            # Layerwise: the token is published to the room (docs/protocol.md#proto-late-metadata);
            # a full
            # transfer of a room that already failed or ended simply has no work.
            level = LogLevel.WARNING if self.config.layerwise is not None else LogLevel.DEBUG
            self._log(
                level, f"Dropping late prefill metadata for expired bootstrap_room={room}", room
            )
            return
        state = self._rooms.state(room)
        transfer = self._per_room.transfer(room)
        if transfer in _LAYERWISE:
            self._per_room.metadata[room] = metadata
            if transfer is TransferState.AWAITING_TOKEN:
                self._report_success(room, now)
            return
        destinations = self._per_room.destinations.get(room)
        if state is not RoomState.BOOTSTRAPPED or not destinations:
            raise ProtocolError(
                f"Cache-transfer destination metadata is unavailable for room {room} "
                f"(room is {state.value}): hand over only after the Bootstrapped event"
            )
        if transfer is not TransferState.ABSENT:
            raise ProtocolError(f"room {room} was already handed over")
        windows = [d.manifest for d in destinations if d.manifest is not None]
        if not windows:
            # Rendezvous only: this rank joins the status agreement and sends nothing.
            self._rooms.fire(room, PrefillTrigger.TRANSFER_SUCCEEDED)
            self._per_room.destinations.pop(room, None)
            self._trace.mark(room, Mark.NOTIFIED, now)
            return
        try:
            require_same_prompt_window(windows)
            window = windows[0]
            source = build_manifest(
                self.config.contract,
                source_tables,
                window.prefix_len,
                window.prompt_len,
                state_prefix_cached=window.state_prefix_cached,
            )
            writes = self._plan_writes(room, destinations, source, (None,), now)
        except TspdError as err:
            self._fail(room, Failure(ReasonClass.TRANSFER, f"CachePD transfer failed: {err}"), now)
            return
        if writes is None:
            return
        self._per_room.metadata[room] = metadata
        self._per_room.fire(room, TransferTrigger.HAND_OVER)
        staged = self._stage(room, destinations, writes[0]) if self._staging else writes[0]
        self._start(room, destinations, ((None, staged),), final=True, now=now)

    def _stage(
        self,
        room: int,
        destinations: Sequence[_Destination],
        writes: tuple[DestinationWrite, ...],
    ) -> tuple[DestinationWrite, ...]:
        """The writes of a full transfer, each sent staged where the destination
        offered a slot, the plan has at least ``staging_min_copies`` copies, its blob
        fits the slot and this rank's staging region has room for it
        (docs/wire.md#staged-transfers); the others as they are."""
        pool = self._staging
        slots = {d.session_id: d.slot for d in destinations if d.slot is not None}
        if pool is None or not slots:
            return writes
        out: list[DestinationWrite] = []
        sizes: dict[str, int] = {}
        held: list[int] = []
        for write in writes:
            slot = slots.get(write.session_id)
            registered = self._registrations.get(write.session_id)
            region = registered.registration.staging if registered is not None else None
            copies = len(write.plan)
            if (
                slot is None
                or registered is None
                or region is None
                or copies < self.config.staging_min_copies
            ):
                out.append(write)
                continue
            length = blob_length(copies, write.plan.total_bytes)
            # The blob's data starts on a page of this rank's region (blob_data_pad).
            pad = blob_data_pad(copies, pool.align)
            offset = pool.alloc(pad + length) if length <= slot[1] else None
            if offset is None:
                self._log(
                    LogLevel.DEBUG,
                    f"room {room} goes to Decode session {write.session_id} unstaged: its "
                    f"{length}-byte blob "
                    + (
                        f"exceeds the {slot[1]}-byte slot offered"
                        if length > slot[1]
                        else "does not fit this rank's staging region now"
                    ),
                    room,
                )
                out.append(write)
                continue
            held.append(offset)
            sizes[write.session_id] = length
            staged = StagedWrite(
                source_offset=offset + pad,
                source_addr=self.config.staging_base + offset + pad,
                dest_addr=region[0] + slot[0],
                length=length,
                src_base=self.config.arena_base,
                dst_base=registered.registration.arena_base,
            )
            out.append(dataclasses.replace(write, staged=staged))
        if held:
            self._staging_held[room] = held
            self._per_room.staged[room] = sizes
        return tuple(out)

    def _plan_writes(
        self,
        room: int,
        destinations: Sequence[_Destination],
        source: BlockManifest | Selection,
        steps: Sequence[frozenset[str] | None],
        now: float,
    ) -> list[tuple[DestinationWrite, ...]] | None:
        """Every non-dummy destination's copies for every step, planned in full before
        any write; ``None`` (room aborted) when a destination's session failed."""
        per_destination: list[list[DestinationWrite]] = []
        for destination in destinations:
            if destination.manifest is None:
                continue
            session_id = destination.session_id
            if not self.session_alive(session_id, now):
                self._fail(
                    room,
                    Failure(
                        ReasonClass.PEER_DEAD,
                        f"CachePD transfer failed: Decode session {session_id} is not alive",
                    ),
                    now,
                )
                return None
            registered = self._registrations.get(session_id)
            if registered is None:
                raise PlanError(_UNREGISTERED)
            reg = registered.registration
            plans = plan_steps(
                src_contract=self.config.contract,
                src_base=self.config.arena_base,
                dst_contract=reg.contract,
                dst_base=reg.arena_base,
                dst_manifest=destination.manifest,
                source=source,
                registration=registered.planned,
                steps=steps,
                coalesced=True,
            )
            per_destination.append(
                [DestinationWrite(session_id, reg.endpoint, reg.port, plan) for plan in plans]
            )
        return [tuple(writes[step] for writes in per_destination) for step in range(len(steps))]

    def _start(
        self,
        room: int,
        destinations: Sequence[_Destination],
        intervals: Sequence[tuple[int | None, tuple[DestinationWrite, ...]]],
        *,
        final: bool,
        now: float,
    ) -> None:
        ports = 0
        sessions = []
        for d in destinations:
            ports += wire.session_port(d.session_id) or 0
            if d.manifest is not None:
                sessions.append(d.session_id)
        chunk = StartTransfer(
            room=room,
            shard=ports % self.config.transfer_workers,
            intervals=tuple([TransferInterval(step, writes) for step, writes in intervals]),
            final=final,
            sessions=tuple(sessions),
        )
        self._trace.transfer(room, chunk.total_bytes, chunk.descriptors, now)
        self._writing[room] = self._writing.get(room, 0) + 1
        self._commands.append(chunk)

    def arm_layerwise(self, rows: Sequence[ExtendRow], now: float) -> int | None:
        """Layerwise: arm one chunk per extend row of the coming forward whose request
        has non-dummy destinations (docs/protocol.md#proto-prefill-poll "arm layerwise",
        docs/protocol.md#proto-prefill-forward).

        Every row's selection is built first; any error refuses the whole forward
        (raised, nothing armed, no step reserved). Then the forward's producer steps
        are reserved once and each chunk's copies, for every interval and every
        destination, are planned before its :class:`StartTransfer` is queued.
        Returns the forward's first producer step, or ``None`` when layerwise is off
        or there is no row.
        """
        schedule = self.config.layerwise
        if schedule is None or not rows:
            return None
        chunks: list[tuple[int, Selection]] = []
        for row in rows:
            sender = self._requests.get(row.rid)
            if sender is None:
                continue
            room = sender.room
            windows = [
                d.manifest
                for d in self._per_room.destinations.get(room, ())
                if d.manifest is not None
            ]
            if not windows:
                continue
            require_same_prompt_window(windows)
            selection = select_chunk(
                self.config.contract,
                row.tables,
                windows[0],
                row.extend_prefix_len,
                row.extend_prefix_len + row.input_length,
                first=self._per_room.transfer(room) is TransferState.ABSENT,
            )
            if selection is not None:
                chunks.append((room, selection))
        begin = self._steps.take(len(schedule))
        targets = interval_targets(begin, schedule, self.config.layerwise_interval)
        for room, selection in chunks:
            self._arm_chunk(room, selection, [step for step, _ in targets], now)
        return begin

    def _arm_chunk(self, room: int, selection: Selection, targets: list[int], now: float) -> None:
        if self._rooms.ended(room):
            return
        trigger = (
            TransferTrigger.ARM_FINAL_CHUNK if selection.is_final else TransferTrigger.ARM_CHUNK
        )
        if not PREFILL_TRANSFER_TABLE.allowed(self._per_room.transfer(room), trigger):
            # Past its final chunk (a room that already streamed): nothing more goes out.
            self._log(
                LogLevel.DEBUG,
                f"room {room} already streamed its final chunk: a later chunk is not sent",
                room,
            )
            return
        destinations = self._per_room.destinations.get(room, [])
        try:
            writes = self._plan_writes(room, destinations, selection, self._interval_fields, now)
        except TspdError as err:
            self._fail(room, Failure(ReasonClass.TRANSFER, f"CachePD transfer failed: {err}"), now)
            return
        if writes is None:
            return
        self._per_room.fire(room, trigger)
        if self.config.layerwise_debug:
            self._log(
                LogLevel.INFO,
                f"[cache_layerwise_transfer] room={room} wait_cache_steps={targets} "
                f"peers={len(writes[0]) if writes else 0} final={selection.is_final}",
                room,
            )
        self._start(
            room,
            destinations,
            list(zip(targets, writes, strict=True)),
            final=selection.is_final,
            now=now,
        )

    # ------------------------------------------------------------------ workers

    def transfer_succeeded(self, room: int, now: float) -> None:
        """A final chunk's writes all succeeded. Sends ``Success`` to every non-dummy
        destination first, then marks the room ``Success`` and drops its destinations
        (docs/protocol.md#proto-prefill-room-table). A layerwise room whose token has not arrived
        yet reports
        when :meth:`hand_over` brings it. Ignored for a room that already ended."""
        if self._rooms.ended(room):
            self._log(LogLevel.DEBUG, f"room {room} ended before its transfer finished", room)
            return
        if self._per_room.transfer(room) not in _WITH_WORKERS:
            self._log(
                LogLevel.DEBUG,
                f"ignoring a written final chunk of room {room}: none is with the workers",
                room,
            )
            return
        self._trace.mark(room, Mark.WRITTEN, now)
        if room not in self._per_room.metadata:
            self._per_room.fire(room, TransferTrigger.WRITTEN)
            return
        self._report_success(room, now)

    def _report_success(self, room: int, now: float) -> None:
        metadata = self._per_room.metadata.pop(room)
        usage = self._per_room.usage.get(room) or _Usage()
        message = wire.StatusMessage(
            room=room,
            status=TransferPoll.SUCCESS,
            prefill_rank=self.config.reported_rank,
            bootstrap_token=metadata.bootstrap_token,
            spec_candidate_ids=metadata.spec_candidate_ids,
            cached_tokens=usage.cached_tokens,
            bootstrap_logprob=usage.bootstrap_logprob,
        )
        frames = wire.encode_status(message)
        staged = self._per_room.staged.pop(room, {})
        for destination in self._per_room.destinations.get(room, ()):
            if destination.manifest is None:
                continue
            route = self._route_of(destination.session_id)
            if route is None:
                continue
            blob = staged.get(destination.session_id, 0)
            if blob:  # a staged destination's Success carries the blob's length
                self._send(
                    route, wire.encode_status(dataclasses.replace(message, staged_bytes=blob)), room
                )
            else:
                self._send(route, frames, room)
        self._rooms.fire(room, PrefillTrigger.TRANSFER_SUCCEEDED)
        self._per_room.fire(room, TransferTrigger.REPORTED)
        self._per_room.destinations.pop(room, None)
        self._trace.mark(room, Mark.NOTIFIED, now)

    def transfer_done(self, room: int, now: float) -> None:
        """A worker is done with one of the room's chunks -- written, failed or
        stopped -- and has no write of it in flight. Call it after
        :meth:`transfer_succeeded` / :meth:`transfer_failed` for every
        :class:`StartTransfer` (non-final chunks too). When the room's last chunk is
        done, the ``Failed`` notices held back for it go out (write fencing: a
        Decode that hears ``Failed`` from this rank may reuse the room's pages)."""
        left = self._writing.get(room, 0) - 1
        if left > 0:
            self._writing[room] = left
            return
        self._writing.pop(room, None)
        if self._staging is not None:
            for offset in self._staging_held.pop(room, ()):
                self._staging.free(offset)
        for route in self._deferred_notices.pop(room, ()):
            self._notify_failed(route, room)

    def transfer_failed(self, room: int, session_id: str | None, error: str, now: float) -> None:
        """A chunk failed. ``session_id`` set: a write to that session failed (it is
        marked failed for the TTL and the reason names its route); ``None``: any
        other worker error (``error`` is then the whole detail). The room is aborted
        with ``"CachePD transfer failed: …"`` unless it already ended, in which case
        the first failure's reason stands (docs/protocol.md#proto-failure-worker).
        The failure's class is ``transfer``, or ``peer-dead`` when no session is named
        and one of the room's destinations is a failed session (a layerwise wait
        that saw its peer fail)."""
        close: tuple[str, int] | None = None
        cls = ReasonClass.TRANSFER
        if session_id is None and any(
            not self.session_alive(d.session_id, now)
            for d in self._per_room.destinations.get(room, ())
            if d.manifest is not None
        ):
            cls = ReasonClass.PEER_DEAD
        if session_id is not None:
            newly_failed = self.session_alive(session_id, now)
            self._mark_session_failed(session_id, now)
            route = self._route_of(session_id)
            where = f"{route[0]}:{route[1]}" if route else session_id
            error = f"Mooncake transfer failed for {where}: {error}"
            if newly_failed:
                close = route
        if self._rooms.ended(room):
            self._log(
                LogLevel.DEBUG,
                f"dropping an ended room's transfer error (room {room}): {error}",
                room,
            )
        else:
            self._fail(room, Failure(cls, f"CachePD transfer failed: {error}"), now)
        if close is not None:
            # The Decode is probably gone: close its socket once the failure notices
            # just queued had their moment; a later message reopens it.
            self._commands.append(CloseRoute(*close))

    def send_failed(self, endpoint: str, port: int, error: str, now: float) -> None:
        """The shell cannot send to the route ``endpoint:port`` at all (libzmq refused
        the address, or the socket failed): every session replying there is dropped
        (registration and rejected route forgotten) and each room with one of them
        as a destination fails with the reason, its other destinations told. Other
        sessions are untouched; a new valid registration brings a session back."""
        route = (endpoint, port)
        sessions = {sid for sid, r in self._registrations.items() if r.route == route}
        sessions.update(sid for sid, r in self._rejected.items() if r == route)
        if not sessions:
            return
        self._log(
            LogLevel.ERROR,
            f"dropping Decode session(s) {', '.join(sorted(sessions))}: {error}",
        )
        for session_id in sessions:
            self._registrations.pop(session_id, None)
            self._proven.discard(session_id)
            self._rejected.pop(session_id, None)
        destinations = self._per_room.destinations
        affected = [
            room
            for room, dests in destinations.items()
            if any(d.session_id in sessions for d in dests)
        ]
        for room in affected:
            # Not notified: that route is the one that cannot be reached.
            kept = [d for d in destinations[room] if d.session_id not in sessions]
            destinations[room] = kept
            self._fail(room, Failure(ReasonClass.PEER_DEAD, f"Decode unreachable: {error}"), now)

    # ------------------------------------------------------------------ timers

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timeout` next has work: the earliest unclaimed-room expiry
        or failed-session expiry; ``None`` when neither exists. Bootstrap timeouts
        are seen by :meth:`poll_values`, which the scheduler runs every iteration.
        The shell reads it after every call: the unclaimed rooms' earliest clock is
        kept at hand (O(1) amortised), and the failed sessions are kept in the order
        they failed, so the first one expires first (with ``now`` never going back,
        as the shell's clock does not; a caller whose clock jumped back only has a
        session forgotten late, its fail-fast still ends on time)."""
        since = self._per_room.unclaimed.earliest()
        deadline = None if since is None else since + self.config.bootstrap_timeout
        ttl = self.config.failed_session_ttl
        if ttl > 0 and self._failed_sessions:
            session_deadline = next(iter(self._failed_sessions.values())) + ttl
            if deadline is None or session_deadline < deadline:
                deadline = session_deadline
        return deadline

    def _drop_unclaimed(self, room: int, now: float) -> None:
        """Forget a room no request claimed, telling each non-dummy destination of a
        room that had not failed."""
        if self._rooms.state(room) is not RoomState.FAILED:
            for destination in self._per_room.destinations.get(room, ()):
                if destination.manifest is None:
                    continue
                route = self._route_of(destination.session_id)
                if route is not None:
                    self._tell_failed(route, room)
        self._forget_room(room, Mark.DROPPED, now, PrefillTrigger.TTL_EXPIRED)

    def handle_timeout(self, now: float) -> None:
        """Drop rooms no request claimed within the TTL (= bootstrap timeout), in
        ascending room order, telling each non-dummy destination of a room that had
        not failed (docs/protocol.md#proto-unclaimed-rooms); expire failed-session marks past their
        TTL."""
        ttl = self.config.bootstrap_timeout
        self._expire_failed_rooms(now)
        expired = sorted(self._per_room.unclaimed.pop_expired(now, ttl))
        if expired:
            self._log(
                LogLevel.WARNING,
                f"dropping rooms no request on this rank claimed within {ttl:g}s: {expired}",
                limit_key="unclaimed-dropped",
            )
        for room in expired:
            self._drop_unclaimed(room, now)
        for session_id in [
            s
            for s, at in self._failed_sessions.items()
            if now - at >= self.config.failed_session_ttl
        ]:
            del self._failed_sessions[session_id]
