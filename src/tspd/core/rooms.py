"""Room status tables (docs/protocol.md#proto-room-table): one per rank, keyed by
``bootstrap_room``.

A :class:`RoomTable` holds each known room's :class:`~tspd.core.machines.RoomState`
and at most one failure reason. Every state change goes through the room's compiled
machine (:mod:`tspd.core.machines`), so the table inherits its rules:

* ``Failed`` is sticky: a late success never resurrects a failed room;
* other progress is monotonic;
* the **first** failure reason wins (a later abort, or a worker error for a room
  that already failed, never replaces it), and it is the reason the peer hears;
* a room that ends is forgotten entirely — state and reason — so the table holds
  nothing once its rooms have ended (:meth:`RoomTable.__len__`).

Beside each state the table keeps the room's :class:`TransferPoll` value as a plain
``int`` (:attr:`RoomTable.wire_values`), updated on every transition: the cores'
per-iteration polls read hundreds of rooms and need neither the state nor an enum.

:class:`RoomClocks` keeps per-room timers (start times) with the earliest one at
hand, for the cores' deadlines.

Neither is thread-safe: the shell owns them from one task.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping

from tspd.core.machines import CompiledMachine, RoomState
from tspd.core.poll import TransferPoll
from tspd.core.reasons import Failure

__all__ = ["RoomClocks", "RoomTable"]

#: Stale heap entries a :class:`RoomClocks` tolerates beyond twice its live clocks.
_COMPACT_SLACK = 32
_FAIL = "fail"
_FORGET = "forget"

#: The wire value of every state that has an entry.
_WIRE_VALUE: dict[RoomState, int] = {
    state: int(poll) for state in RoomState if (poll := state.poll) is not None
}


class RoomTable:
    """Room states and failure reasons of one rank, driven through ``machine``.

    ``machine`` must declare the triggers ``fail`` and ``forget`` (both room machines
    do).
    """

    __slots__ = ("_machine", "_next", "_reasons", "_states", "_values")

    def __init__(self, machine: CompiledMachine) -> None:
        self._machine = machine
        #: The machine's table with its destinations as :class:`RoomState` members,
        #: so a transition costs one lookup and no enum construction.
        self._next: dict[tuple[str, str], RoomState] = {
            key: RoomState(dest) for key, dest in machine.table.items()
        }
        self._states: dict[int, RoomState] = {}
        self._values: dict[int, int] = {}
        self._reasons: dict[int, Failure] = {}

    @property
    def wire_values(self) -> Mapping[int, int]:
        """Each room with an entry -> its :class:`TransferPoll` value as an ``int``.

        A live read-only view for hot loops: ``wire_values.get(room, 0)`` is
        :meth:`poll` without the enum (an absent room reads ``FAILED`` = 0).
        """
        return self._values

    def state(self, room: int) -> RoomState:
        """The room's state; ``ABSENT`` when it has no entry."""
        return self._states.get(room, RoomState.ABSENT)

    def status(self, room: int) -> TransferPoll | None:
        """The room's :class:`TransferPoll`, or ``None`` when it has no entry."""
        return self.state(room).poll

    def poll(self, room: int) -> TransferPoll:
        """The value a scheduler poll reads: an absent room reads as ``FAILED``
        (R-pd's poll; S1 would raise)."""
        return self.status(room) or TransferPoll.FAILED

    def ended(self, room: int) -> bool:
        """Whether the room is absent or ``Failed``: nothing more may be sent for it."""
        return self.state(room) in (RoomState.ABSENT, RoomState.FAILED)

    def allowed(self, room: int, trigger: str) -> bool:
        """Whether ``trigger`` may fire for the room now."""
        return self._machine.allowed(self.state(room), trigger)

    def fire(self, room: int, trigger: str) -> RoomState:
        """Apply ``trigger`` to the room and return its new state.

        Raises :class:`~tspd.core.errors.ProtocolError` (state unchanged) when the
        machine does not allow it. A room whose new state is ``ABSENT`` is forgotten
        together with its reason.
        """
        key = (self.state(room), trigger)
        new = self._next.get(key)
        if new is None:
            # Not allowed: the machine raises its operator-facing ProtocolError.
            new = RoomState(self._machine.fire(*key))
        if new is RoomState.ABSENT:
            self._states.pop(room, None)
            self._values.pop(room, None)
            self._reasons.pop(room, None)
        else:
            self._states[room] = new
            self._values[room] = _WIRE_VALUE[new]
        return new

    def record_failure(self, room: int, failure: Failure) -> bool:
        """Keep ``failure`` unless the room already has one; ``True`` if it was kept.

        Used alone where the request concludes ``Failed`` but the room's status is
        left alone (bootstrap and waiting timeouts), and by :meth:`fail`.
        """
        if room in self._reasons:
            return False
        self._reasons[room] = failure
        return True

    def fail(self, room: int, failure: Failure, trigger: str = _FAIL) -> bool:
        """Fail the room with ``failure`` (first failure wins) through ``trigger``.

        Returns ``True`` when this call failed the room (it was not ``Failed``
        before), so callers count a failure once per room and notify peers once.
        """
        newly = self.state(room) is not RoomState.FAILED
        self.record_failure(room, failure)
        self.fire(room, trigger)
        return newly

    def failure(self, room: int) -> Failure | None:
        """The room's first failure, if one was recorded."""
        return self._reasons.get(room)

    def forget(self, room: int, trigger: str = _FORGET) -> None:
        """End the room through ``trigger`` (``forget`` unless given): drop its state
        and reason."""
        self.fire(room, trigger)
        # A reason recorded for a room that never had a state is dropped too.
        self._reasons.pop(room, None)

    def rooms(self) -> Iterator[int]:
        """The rooms with an entry, in insertion order."""
        return iter(list(self._states))

    def __contains__(self, room: object) -> bool:
        return room in self._states

    def __len__(self) -> int:
        return len(self._states) + sum(1 for r in self._reasons if r not in self._states)

    def counts(self) -> dict[str, int]:
        """Rooms per state name, for ``statistics()`` and metrics."""
        counts: dict[str, int] = {}
        for state in self._states.values():
            counts[state.value] = counts.get(state.value, 0) + 1
        return counts


class RoomClocks:
    """Rooms -> when their clock started, with the earliest start at hand.

    The cores keep per-room timers (Prefill's unclaimed-room TTL, Decode's waiting
    timeout) and the shell asks for the next deadline after every call into a core,
    so the earliest start must not cost a scan of every room. A dict holds each
    room's start; a min-heap of ``(start, room)`` orders them. A removed or
    restarted room leaves a stale heap entry behind, dropped when it reaches the
    top; the heap is rebuilt from the dict once stale entries outnumber live ones,
    so memory stays proportional to the rooms held and every operation is
    O(log rooms) amortised.
    """

    __slots__ = ("_heap", "_since")

    def __init__(self) -> None:
        self._since: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []

    def start(self, room: int, now: float) -> None:
        """Start (or restart) the room's clock at ``now``."""
        self._since[room] = now
        if not self._compact():
            heapq.heappush(self._heap, (now, room))

    def setdefault(self, room: int, now: float) -> float:
        """Start the room's clock at ``now`` unless it runs; its start either way."""
        since = self._since.get(room)
        if since is None:
            self.start(room, now)
            return now
        return since

    def get(self, room: int) -> float | None:
        """When the room's clock started, or ``None`` when it has none."""
        return self._since.get(room)

    def pop(self, room: int) -> float | None:
        """Stop the room's clock; its start, or ``None`` when it had none."""
        since = self._since.pop(room, None)
        self._compact()
        return since

    def earliest(self) -> float | None:
        """The earliest start of a running clock, or ``None`` when none runs."""
        heap, since = self._heap, self._since
        while heap:
            start, room = heap[0]
            if since.get(room) == start:
                return start
            heapq.heappop(heap)
        return None

    def pop_earliest(self) -> int | None:
        """Stop the clock that started first and return its room (``None`` if none)."""
        if self.earliest() is None:
            return None
        _, room = heapq.heappop(self._heap)
        del self._since[room]
        self._compact()
        return room

    def pop_expired(self, now: float, ttl: float) -> list[int]:
        """Stop and return every room whose clock has run ``ttl`` or longer at
        ``now`` (``now - start >= ttl``, the cores' own test), earliest start first."""
        heap, since = self._heap, self._since
        expired: list[int] = []
        while heap and now - heap[0][0] >= ttl:
            start, room = heapq.heappop(heap)
            if since.get(room) == start:
                del since[room]
                expired.append(room)
        self._compact()
        return expired

    def items(self) -> list[tuple[int, float]]:
        """Every running clock as ``(room, start)``, in the order they started."""
        return list(self._since.items())

    def __contains__(self, room: object) -> bool:
        return room in self._since

    def __len__(self) -> int:
        return len(self._since)

    def _compact(self) -> bool:
        """Rebuild the heap from the running clocks when stale entries outnumber
        them; ``True`` if it did. Each rebuild follows at least as many removals or
        restarts as it costs, so the cost is O(1) amortised."""
        heap = self._heap
        if len(heap) < 2 * len(self._since) + _COMPACT_SLACK:
            return False
        heap[:] = [(start, room) for room, start in self._since.items()]
        heapq.heapify(heap)
        return True
