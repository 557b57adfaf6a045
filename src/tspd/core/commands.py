"""What the Prefill and Decode cores ask of their shell, and tell their scheduler.

The cores (:mod:`tspd.core.prefill`, :mod:`tspd.core.decode`) perform no I/O: every
action is a frozen *command* queued in order and drained with ``drain_commands()``.
The shell executes them in that order:

* :class:`SendFrames` — push ``frames`` to the PULL socket at ``address``.
* :class:`CloseRoute` — the socket to a route is no longer needed (Prefill).
* :class:`StartTransfer` — run one room's planned writes on worker ``shard``.
* :class:`FetchParallelInfo` / :class:`FetchRankInfo` — bootstrap-server lookups
  (Decode); answer with ``parallel_info(...)`` / ``rank_info(...)``.
* :class:`ScatterStaged` — a staged room's blob arrived (Decode): check it and copy
  it into the room's pages, then answer with ``staged_done(...)``.
* :class:`RoomFailed` — a room failed (once per room): log and count it.
* :class:`Log` — an operator-facing message the core wants logged.
* :class:`Rejected` — a message from a peer was refused: log (rate-limited) and count it.

Each side queues only its own: :data:`PrefillCommand` (no lookups) and
:data:`DecodeCommand` (no route closes, no transfers), so a shell's executor can be
checked exhaustively; :data:`Command` is either.

The scheduler gets *events* back from ``conclude()``: :class:`Bootstrapped`,
:class:`Succeeded`, :class:`Failed` and (Decode) :class:`RemotePrefillDone`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tspd.core.copies import CopyPlan, Int64Array
from tspd.core.reasons import ReasonClass

__all__ = [
    "Bootstrapped",
    "CloseRoute",
    "Command",
    "DecodeCommand",
    "DestinationWrite",
    "Event",
    "Failed",
    "FetchParallelInfo",
    "FetchRankInfo",
    "Log",
    "LogLevel",
    "PagesReleased",
    "PrefillCommand",
    "RejectReason",
    "Rejected",
    "RemotePrefillDone",
    "RoomFailed",
    "ScatterStaged",
    "SendFrames",
    "StagedWrite",
    "StartTransfer",
    "Succeeded",
    "TransferInterval",
]


# ---------------------------------------------------------------------------- commands


@dataclass(frozen=True, slots=True)
class SendFrames:
    """Push one multipart message to a peer's PULL socket at ``tcp://{host}:{port}``.

    ``endpoint`` is the address the peer published (a Decode registration's frame 1,
    or a Prefill rank's ``rank_ip``); only its part before any ``:`` is the host
    (docs/protocol.md#proto-zmq). ``room`` names the room the message is about, for
    logs.
    """

    endpoint: str
    port: int
    frames: tuple[bytes, ...]
    room: int | None = None

    @property
    def address(self) -> str:
        """The ZMQ address to connect a PUSH socket to."""
        return f"tcp://{self.endpoint.split(':', 1)[0]}:{self.port}"


@dataclass(frozen=True, slots=True)
class CloseRoute:
    """Prefill: no Decode session needs the route ``tcp://{host}:{port}`` any more (its
    session was replaced or failed). Close the socket to it once what was just sent
    there had a moment to leave; a later :class:`SendFrames` to the route opens a
    new one. Queued after the failure notices that still go there."""

    endpoint: str
    port: int


@dataclass(frozen=True, slots=True)
class StagedWrite:
    """A destination write sent staged (docs/wire.md#staged-transfers): gather the
    plan's copies into the blob at ``source_offset`` of this rank's staging region
    (:func:`tspd.core.staging.gather_blob`; a copy's source offset is its ``src``
    minus ``src_base``, its table entry's destination offset its ``dst`` minus
    ``dst_base``), then write the ``length`` blob bytes from ``source_addr`` to
    ``dest_addr`` (the Decode's slot) instead of the plan's copies."""

    source_offset: int
    source_addr: int
    dest_addr: int
    length: int
    src_base: int
    dst_base: int


@dataclass(frozen=True, slots=True)
class DestinationWrite:
    """One destination's copies in one interval of a transfer.

    ``plan`` is coalesced and checked against both registered arenas; cut it into
    engine calls with :func:`tspd.core.copies.batches`. An empty plan needs no call.
    ``endpoint``/``port`` are the destination's status route, for error messages.
    """

    session_id: str
    endpoint: str
    port: int
    plan: CopyPlan
    #: Send the plan staged instead of copy by copy (tspd peers that offered it).
    staged: StagedWrite | None = None


@dataclass(frozen=True, slots=True)
class TransferInterval:
    """Writes that may start once the producer step counter is strictly past
    ``target_step`` (:func:`tspd.core.schedule.step_ready`); ``None``: at once (a full
    transfer). Destinations are written one after another in order."""

    target_step: int | None
    writes: tuple[DestinationWrite, ...]


@dataclass(frozen=True, slots=True)
class StartTransfer:
    """One chunk of a room's KV, every copy planned before the first write.

    Run it on transfer worker ``shard`` (sum of the room's destination session ports
    mod the worker count, docs/protocol.md#proto-batching), after every earlier chunk
    queued on that worker: a room's chunks must stay in order. For each interval in order: wait for
    ``target_step`` (while waiting, every ~100 ms stop if the core says the room
    ended, and report ``transfer_failed(room, None, f"Cache-transfer layerwise peer
    failed for room {room}", now)`` if a session in ``sessions`` is no longer alive),
    then write every destination. A failed write: ``transfer_failed(room,
    session_id, str(error), now)`` and stop. When every interval is written and
    ``final`` is set, call ``transfer_succeeded(room, now)``; the core then sends the
    success status messages (once the bootstrap token is known) and marks ``Success``.
    A non-final layerwise chunk needs no report.
    """

    room: int
    shard: int
    intervals: tuple[TransferInterval, ...]
    final: bool
    sessions: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes this chunk writes, over every interval and destination."""
        total = 0
        for interval in self.intervals:  # loops: a generator costs more here
            for write in interval.writes:
                total += write.plan.total_bytes
        return total

    @property
    def descriptors(self) -> int:
        """Copies this chunk writes, over every interval and destination."""
        count = 0
        for interval in self.intervals:
            for write in interval.writes:
                count += len(write.plan)
        return count


@dataclass(frozen=True, slots=True)
class FetchParallelInfo:
    """Decode: ``GET /route?engine_rank=-1&target_dp_group=-1`` on ``bootstrap_addr``
    (``host:port``), then call ``parallel_info(bootstrap_addr, info_or_error, now)``."""

    bootstrap_addr: str


@dataclass(frozen=True, slots=True)
class FetchRankInfo:
    """Decode: ``GET /route?engine_rank={engine_rank}&target_dp_group={dp_group}`` on
    ``bootstrap_addr``, then call ``rank_info(bootstrap_addr, dp_group, engine_rank,
    info_or_error, now)``."""

    bootstrap_addr: str
    engine_rank: int
    dp_group: int


@dataclass(frozen=True, slots=True)
class RoomFailed:
    """A room failed on this rank (emitted once per room). ``timeout_stage`` names
    the phase when a timeout caused it (``"bootstrapping"``, ``"waiting_for_input"``),
    for the timeout metric; ``reason_class`` is the failure's class, typed where the
    failure arose (:class:`~tspd.core.reasons.Failure`), for the failure metric and
    the log line."""

    room: int
    reason: str
    timeout_stage: str | None = None
    reason_class: ReasonClass = ReasonClass.OTHER


class LogLevel(enum.StrEnum):
    """Severity of a :class:`Log` command (the names of :mod:`logging` levels)."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Log:
    """An operator-facing message: what happened, to which room or peer."""

    level: LogLevel
    message: str
    room: int | None = None
    #: Set on lines peers can cause at will (a registration, a sweep of rooms
    #: nobody claimed): the shell writes at most a few per key every few seconds,
    #: with the count of the others.
    limit_key: str | None = None


class RejectReason(enum.StrEnum):
    """Why a message from a peer was refused (a metric label and a log key)."""

    #: Frame 0 unreadable: neither a registration nor a pre-allocation.
    MALFORMED_HEADER = "malformed-header"
    #: A registration whose frames do not decode.
    MALFORMED_REGISTRATION = "malformed-registration"
    #: A well-formed registration refused (unplannable route, conflict).
    REGISTRATION_REFUSED = "registration-refused"
    #: A pre-allocation whose route header does not decode.
    MALFORMED_PREALLOCATION = "malformed-preallocation"
    #: A well-formed pre-allocation refused (unregistered session, bad manifest...).
    PREALLOCATION_REFUSED = "preallocation-refused"
    #: A status message that does not decode.
    MALFORMED_STATUS = "malformed-status"
    #: A table a peer fills was full: the oldest entry made room.
    TABLE_FULL = "table-full"
    #: Secure mode: the message's authenticated sender (its CURVE identity) is not
    #: the peer the message speaks for (a status from another than the room's
    #: Prefill rank, a session another identity registered). Nothing changes.
    WRONG_IDENTITY = "wrong-identity"


@dataclass(frozen=True, slots=True)
class Rejected:
    """A message from a peer was refused. One line for the operator, which the shell
    writes rate-limited per ``(peer, reason)`` (a peer can repeat it at will), and
    a count in ``tspd_rejected_messages_total{reason}``. ``peer`` is the sending
    session when the message names one, else ``"unknown"``."""

    reason: RejectReason
    peer: str
    message: str
    room: int | None = None
    level: LogLevel = LogLevel.ERROR


#: What :class:`~tspd.core.prefill.PrefillCore` queues: the shared commands, and route
#: closes and transfers. Its shell executes it with an exhaustive ``match``.
@dataclass(frozen=True, slots=True)
class ScatterStaged:
    """Decode: Prefill rank ``prefill_rank`` wrote room ``room``'s blob of
    ``staged_bytes`` into this rank's staging slot at ``slot_offset`` (of
    ``slot_length`` bytes). Read and check its table
    (:func:`tspd.core.staging.read_blob_table`, every range inside ``starts``/``ends``,
    the room's own page bytes: :func:`tspd.core.staging.check_within`), copy its
    data into the arena (:func:`tspd.core.staging.scatter_blob`), then call
    ``staged_done(room, prefill_rank, error_or_None, now)``. Until then the room's
    pages stay held and the room is not complete."""

    room: int
    prefill_rank: int
    slot_offset: int
    slot_length: int
    staged_bytes: int
    starts: Int64Array = field(repr=False, compare=False)
    ends: Int64Array = field(repr=False, compare=False)


PrefillCommand = SendFrames | CloseRoute | StartTransfer | RoomFailed | Log | Rejected

#: What :class:`~tspd.core.decode.DecodeCore` queues: the shared commands, and
#: bootstrap-server lookups.
DecodeCommand = (
    SendFrames | FetchParallelInfo | FetchRankInfo | ScatterStaged | RoomFailed | Log | Rejected
)

#: Any core's command, for consumers that take either side's (the simulator, the
#: observers, the logs and metrics).
Command = (
    SendFrames
    | CloseRoute
    | StartTransfer
    | FetchParallelInfo
    | FetchRankInfo
    | ScatterStaged
    | RoomFailed
    | Log
    | Rejected
)


# ------------------------------------------------------------------------------ events
#
# Every event names its request (``rid``) and, beside it, its ``room`` and ``at``:
# when the outcome happened on this rank (Prefill ``Succeeded``: when ``Success`` went
# to the destinations; Decode ``RemotePrefillDone``: when the completing ``Success``
# arrived; ``Failed``: when the room failed here; ``Bootstrapped``: when the group
# agreed), on the clock the shell sets (a peer: the host's monotonic clock,
# ``time.monotonic()``, docs/architecture.md#event-times). Neither takes part in
# equality: an event is identified by its request.


@dataclass(frozen=True, slots=True)
class Bootstrapped:
    """Every rank of the TP group has the request's destinations (Prefill) or its
    route (Decode): the scheduler may go on with it."""

    rid: str
    room: int = field(default=-1, compare=False)
    at: float = field(default=0.0, compare=False)


@dataclass(frozen=True, slots=True)
class Succeeded:
    """Prefill: the request's KV reached every destination; it is forgotten."""

    rid: str
    room: int = field(default=-1, compare=False)
    at: float = field(default=0.0, compare=False)


@dataclass(frozen=True, slots=True)
class Failed:
    """The request failed on some rank of the group; it is forgotten. ``reason`` is
    this rank's first recorded reason for the room.

    ``pages_held`` (Decode): the room's pages were handed to the Prefill with a
    pre-allocation and a Prefill rank may still write them; keep them allocated
    until :class:`PagesReleased` names the request (write fencing). ``False``:
    reuse them now."""

    rid: str
    reason: str
    pages_held: bool = field(default=False, compare=False)
    room: int = field(default=-1, compare=False)
    at: float = field(default=0.0, compare=False)


@dataclass(frozen=True, slots=True)
class PagesReleased:
    """Decode: the pages of failed request ``rid`` (room ``room``) may be reused: every
    Prefill rank that could write them has reported the room ended, or the
    quarantine bound passed (``timed_out``)."""

    rid: str
    room: int
    timed_out: bool = False


@dataclass(frozen=True, slots=True)
class RemotePrefillDone:
    """Decode: the request's KV arrived from every expected Prefill rank; decoding may
    start from ``bootstrap_token`` (``-1``: none)."""

    rid: str
    bootstrap_token: int
    spec_candidate_ids: tuple[int, ...]
    cached_tokens: int
    bootstrap_logprob: float | None
    room: int = field(default=-1, compare=False)
    at: float = field(default=0.0, compare=False)


Event = Bootstrapped | Succeeded | Failed | RemotePrefillDone | PagesReleased
