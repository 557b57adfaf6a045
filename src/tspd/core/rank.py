"""What a Prefill rank's core and a Decode rank's core share, written once.

:class:`RankCore` is the base of :class:`~tspd.core.prefill.PrefillCore` and
:class:`~tspd.core.decode.DecodeCore`. It owns the parts of a rank that do not
depend on the side:

* the **room table** (:class:`~tspd.core.rooms.RoomTable`, driven by the side's
  room machine), the **tracer** (:mod:`tspd.core.trace`) and the **command queue**
  the shell drains after every call;
* the **failure path**: :meth:`RankCore._fail_room` records the room's first
  :class:`~tspd.core.reasons.Failure`, puts it on the trace and queues the one
  :class:`~tspd.core.commands.RoomFailed` a failure gets;
* the **tracked requests** and their :data:`~tspd.core.machines.REQUEST` machines,
  in registration order, and the two halves of the per-iteration poll: this
  rank's value per request (:meth:`RankCore._local_values`) and the events of the
  group's agreed values (:meth:`RankCore._conclude_requests`,
  docs/protocol.md#proto-prefill-poll, docs/protocol.md#proto-decode-poll);
* the queries every shell and test uses (room state and failure, traces, state
  counts).

A side supplies what differs through a few methods: the timeout check of an open
request, the events of a success and of a failure, what to forget when a request
ends, and what to do with a request still open after an agreement.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from tspd.core.commands import Bootstrapped, Command, Event, Log, LogLevel, RoomFailed
from tspd.core.machines import (
    CompiledMachine,
    RequestState,
    RequestTrigger,
    RoomState,
    fire_request,
)
from tspd.core.poll import FaultInjection, TransferPoll
from tspd.core.reasons import Failure, ReasonClass
from tspd.core.rooms import RoomTable
from tspd.core.trace import Mark, RoomTrace, RoomTracer, Side, TraceConfig

__all__ = ["RankCore", "TrackedRequest"]

#: TransferPoll values as plain ints: the per-iteration poll and conclude compare
#: these instead of building an enum per tracked request.
_FAILED: Final = int(TransferPoll.FAILED)
_SUCCESS: Final = int(TransferPoll.SUCCESS)
#: Room values that conclude a request, and the request trigger each fires.
_ROOM_CONCLUDED: Final = {
    _SUCCESS: RequestTrigger.ROOM_SUCCEEDED,
    _FAILED: RequestTrigger.ROOM_FAILED,
}
#: Request states whose poll value is fixed, and that value.
_CONCLUDED_VALUE: Final = {
    RequestState.SUCCEEDED_UNANNOUNCED: _SUCCESS,
    RequestState.SUCCEEDED: _SUCCESS,
    RequestState.FAILED: _FAILED,
}
#: Request states whose ``Bootstrapped`` event has not gone out.
_UNANNOUNCED: Final = frozenset({RequestState.REGISTERED, RequestState.SUCCEEDED_UNANNOUNCED})
#: Agreed values that are not ``Failed``: anything else (unknown values too) is.
_LIVE: Final = frozenset(int(p) for p in TransferPoll if p is not TransferPoll.FAILED)


@dataclass(slots=True)
class TrackedRequest:
    """One request the scheduler registered on this rank: its id, room, when it was
    registered, and its :data:`~tspd.core.machines.REQUEST` state."""

    rid: str
    room: int
    started: float
    state: RequestState = RequestState.REGISTERED

    @property
    def concluded(self) -> bool:
        """Whether this rank's value for the request is fixed (``Success``/``Failed``)."""
        return self.state in _CONCLUDED_VALUE

    def fire(self, trigger: RequestTrigger) -> None:
        """Move the request through its machine."""
        self.state = fire_request(self.state, trigger)


R = TypeVar("R", bound=TrackedRequest)
#: The side's command union (:data:`~tspd.core.commands.PrefillCommand` or
#: :data:`~tspd.core.commands.DecodeCommand`).
C = TypeVar("C", bound=Command)


class RankCore(ABC, Generic[R, C]):
    """The side-independent half of a rank's core. ``R`` is the side's request type,
    ``C`` the union of the commands the side queues: :meth:`drain_commands` returns
    only those (and the :class:`~tspd.core.commands.Log` and
    :class:`~tspd.core.commands.RoomFailed` this half queues, in every side's union),
    so a shell's executor can be checked exhaustively.

    ``announcing``: the agreed values that announce ``Bootstrapped`` (Prefill:
    ``Bootstrapped`` and ``Success``; Decode: anything from ``Bootstrapped`` on).
    """

    def __init__(
        self,
        side: Side,
        tp_rank: int,
        machine: CompiledMachine,
        trace: TraceConfig,
        announcing: frozenset[int],
        fault_prob: float = 0.0,
        fault_seed: int | None = None,
    ) -> None:
        self._rooms = RoomTable(machine)
        self._trace = RoomTracer(side, tp_rank, trace)
        self._commands: list[C | Log | RoomFailed] = []
        #: Tracked requests by rid, in registration order.
        self._requests: dict[str, R] = {}
        self._announcing = announcing
        #: Subtracted from the core's times in the events' ``at``: the shell sets it
        #: so that ``at`` reads on the host's monotonic clock (its own clock minus
        #: ``time.monotonic()``); 0 leaves the core's clock.
        self.event_clock_offset = 0.0
        self._faults = FaultInjection(fault_prob, fault_seed) if fault_prob > 0 else None

    # ------------------------------------------------------------------ outputs

    def drain_commands(self) -> list[C | Log | RoomFailed]:
        """Every command queued since the last drain, in order."""
        commands, self._commands = self._commands, []
        return commands

    def drain_finished(self) -> list[RoomTrace]:
        """The trace of every room that ended since the last drain, in order: its
        outcome, failure class, phase durations (and, on Prefill, bytes and
        descriptors), for metrics. Drain it after :meth:`drain_commands`; undrained
        traces are bounded (the configuration's ``trace``)."""
        return self._trace.drain_finished()

    def _log(
        self,
        level: LogLevel,
        message: str,
        room: int | None = None,
        limit_key: str | None = None,
    ) -> None:
        self._commands.append(Log(level, message, room, limit_key))

    # ------------------------------------------------------------------ queries

    def room_state(self, room: int) -> RoomState:
        """The room's state on this rank (``ABSENT`` if it has none)."""
        return self._rooms.state(room)

    def tracked_requests(self) -> int:
        """How many requests this rank tracks: what a poll's values and a
        conclusion go over."""
        return len(self._requests)

    def event_pending(self, rid: str | None) -> bool:
        """Whether a poll now would bring request ``rid`` an event -- its
        ``Bootstrapped``, its success or its failure -- with no further input and no
        time passing (``False`` for a request this rank does not track). A shell
        that concludes eagerly asks it after a scheduler call, to conclude at once
        only when that is so."""
        request = None if rid is None else self._requests.get(rid)
        if request is None:
            return False
        value = _CONCLUDED_VALUE.get(request.state)
        if value is None:
            value = self._rooms.wire_values.get(request.room, _FAILED)
        return value in _ROOM_CONCLUDED or (
            request.state in _UNANNOUNCED and value in self._announcing
        )

    def room_failure(self, room: int) -> str | None:
        """The room's first recorded failure reason."""
        failure = self._rooms.failure(room)
        return None if failure is None else failure.message

    def room_failure_class(self, room: int) -> ReasonClass | None:
        """The class of the room's first recorded failure."""
        failure = self._rooms.failure(room)
        return None if failure is None else failure.cls

    def rooms_by_state(self) -> dict[str, int]:
        """How many rooms are in each state (``"Bootstrapping"``, ``"Failed"``...), for
        gauges; states without rooms are left out."""
        return self._rooms.counts()

    def trace(self, room: int) -> RoomTrace | None:
        """The room's trace on this rank: live, or kept after it failed, was dropped
        or ran slow; ``None`` when neither (see :mod:`tspd.core.trace`)."""
        return self._trace.trace(room)

    def recent_traces(self) -> list[RoomTrace]:
        """Traces of recently ended rooms that failed, were dropped or ran slow,
        oldest first (bounded by the configuration's ``trace``)."""
        return self._trace.recent()

    # ------------------------------------------------------------------ failures

    def _fail(self, room: int, failure: Failure, now: float, trigger: str = "fail") -> None:
        """Fail ``room`` (the side adds what a failure means there: Prefill tells
        the room's destinations)."""
        self._fail_room(room, failure, now, trigger)

    def _fail_room(self, room: int, failure: Failure, now: float, trigger: str) -> bool:
        """Fail ``room`` through ``trigger`` (the first failure wins). When this call
        made the room ``Failed``, the failure goes on its trace and one
        :class:`RoomFailed` is queued (the failure's one log line, tspd.log) and
        ``True`` is returned; a trigger that keeps the room's state (a Decode room
        that already succeeded when its Prefill died) records nothing more, and a
        room the machine cannot fail (no Decode entry) is left alone."""
        rooms = self._rooms
        if not rooms.allowed(room, trigger):
            return False
        if not rooms.fail(room, failure, trigger) or rooms.state(room) is not RoomState.FAILED:
            return False
        kept = self._trace.fail(room, rooms.failure(room) or failure, now)
        self._commands.append(RoomFailed(room, kept.message, kept.timeout_stage, kept.cls))
        return True

    def _event_time(self, room: int, mark: Mark, now: float) -> float:
        """When ``room`` reached ``mark`` here (``now`` if it has no such mark), on
        the events' clock."""
        when = self._trace.when(room, mark)
        return (now if when is None else when) - self.event_clock_offset

    def _conclusion(self, request: R) -> str:
        """The reason a failed request's event carries."""
        failure = self._rooms.failure(request.room)
        return f"Request {request.room} failed" if failure is None else failure.message

    # ------------------------------------------------------------------ polling

    def _local_values(self, now: float) -> list[int]:
        """This rank's value per tracked request, in registration order: the
        concluded value, else the room's status (absent reads ``Failed``), where
        ``Success`` and ``Failed`` conclude the request; an open request may time out
        (:meth:`_timed_out`) or, in tests, fail by injection."""
        values: list[int] = []
        append = values.append
        value_of = self._rooms.wire_values.get
        fixed = _CONCLUDED_VALUE.get
        concluded = _ROOM_CONCLUDED
        failed = _FAILED
        for request in self._requests.values():
            value = fixed(request.state)
            if value is None:
                value = value_of(request.room, failed)
                trigger = concluded.get(value)
                if trigger is not None:
                    request.state = fire_request(request.state, trigger)
                elif self._timed_out(request, value, now):
                    value = failed
                elif self._faults is not None and self._faults.fires():
                    room = request.room
                    self._fail(room, Failure(ReasonClass.INJECTED, self._faults.reason(room)), now)
                    request.fire(RequestTrigger.FAULT_INJECTED)
                    value = failed
            append(value)
        return values

    def _conclude_requests(
        self, requests: Sequence[R], agreed: Sequence[int], now: float
    ) -> list[Event]:
        """Apply the group's agreed value per request: the ``Bootstrapped`` event
        once, then the side's success event, or its failure event; ended requests
        are forgotten (:meth:`_forget_request`)."""
        events: list[Event] = []
        live, success, unannounced, announcing = _LIVE, _SUCCESS, _UNANNOUNCED, self._announcing
        for index, (request, value) in enumerate(zip(requests, agreed, strict=True)):
            if value in live:
                if request.state in unannounced and value in announcing:
                    # A room may succeed before its Bootstrapped event went out: the
                    # event comes first, the success on a later poll.
                    request.fire(RequestTrigger.ANNOUNCE)
                    at = now - self.event_clock_offset
                    events.append(Bootstrapped(request.rid, request.room, at))
                elif value == success and request.state not in unannounced:
                    request.fire(RequestTrigger.GROUP_SUCCEEDED)
                    events.append(self._succeeded(request, now))
                    self._forget_request(request, now)
                else:
                    self._still_open(request, value, now)
            else:
                self._fail_concluded(request, now)
                event = self._failed(request, self._conclusion(request), index, now)
                request.fire(RequestTrigger.GROUP_FAILED)
                events.append(event)
                self._forget_request(request, now)
        return events

    def _fail_concluded(self, request: R, now: float) -> None:
        """The group failed ``request``: a room this rank has not failed itself
        (another rank failed it, or a timeout concluded it here) fails now, with the
        recorded reason, else as a replica failure."""
        room = request.room
        if self._rooms.state(room) is RoomState.FAILED:
            return
        failure = self._rooms.failure(room) or Failure(
            ReasonClass.REPLICA,
            f"Request {room} failed on another rank of the {self._group} TP group",
        )
        self._fail(room, failure, now)

    # ------------------------------------------------------------------ per side

    #: The name of this side's TP group in replica-failure reasons.
    _group = "Prefill"

    def _timed_out(self, request: R, value: int, now: float) -> bool:
        """Whether an open request whose room reads ``value`` times out now (then
        it is concluded ``Failed`` here). Default: never."""
        return False

    def _still_open(self, request: R, value: int, now: float) -> None:
        """A live agreed value that neither announces nor ends ``request``."""

    @abstractmethod
    def _succeeded(self, request: R, now: float) -> Event:
        """The scheduler's event for a request the group agreed succeeded."""

    @abstractmethod
    def _failed(self, request: R, reason: str, index: int, now: float) -> Event:
        """The scheduler's event for a request the group agreed failed (``index``:
        its position in this poll), called before it is forgotten."""

    @abstractmethod
    def _forget_request(self, request: R, now: float) -> None:
        """Drop an ended request and whatever this side keeps for it."""
