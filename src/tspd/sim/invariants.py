"""The invariants the simulator checks, and the violations it reports.

Each check has a name (:class:`Check`); a violation names its check, the room (when
there is one), the process and the virtual time. Checks run after every event,
on what that event touched:

* ``sticky`` — per room per rank, ``Failed`` is sticky and progress is monotonic
  (docs/protocol.md#proto-room-table): a state seen on a rank never goes back to
  an earlier one, and nothing but the room's end follows ``Failed``.
* ``outcome`` — every request ends on every side that knew it, exactly once,
  ``Succeeded``/``RemotePrefillDone`` or ``Failed`` with a non-empty reason, and
  every rank of a TP group concludes the same requests the same way
  (docs/protocol.md#proto-replica-agreement).
* ``deadline`` — it ends within the bound its timeouts imply (computed per
  request by the side that registered it, see :mod:`tspd.sim.cluster`).
* ``data`` — a Decode rank's room reaches ``Success`` only when every page of the
  room holds exactly the Prefill's data for that room and this rank's heads
  (:mod:`tspd.sim.arena`), and the request's first token is the one handed over.
* ``write-after-end`` — no write is issued by a Prefill rank for a room that is
  not active there (its workers check before each write, docs/protocol.md#proto-failure-worker).
* ``fencing`` — no write lands in a Decode page after its room ended there (or
  in a page another room owns). tspd's cores cannot promise this yet: a Decode
  that gives up never tells Prefill, and a hung write may land after its timeout.
  In ``report`` mode (the default) violations are counted and printed; in
  ``strict`` mode they fail the run.
* ``drained`` — once the cluster drains, every core's per-room tables are empty
  and its per-peer tables within their bounds.
* ``bounds`` — while it runs, no core table outgrows its bound.
* ``raised`` — no core raised into its shell while handling input.
* ``released`` — no write reads a Prefill arena whose registration was released
  for a sleep (docs/protocol.md#proto-sleep-wake): none is in flight when
  :meth:`~tspd.core.prefill.PrefillCore.check_release` lets the release happen,
  and none is issued until the wake; and a release is refused only while the
  scheduler tracks a request.
* ``staging`` — staged transfers (docs/wire.md#staged-transfers,
  :mod:`tspd.sim.staging`): no staging slot is offered to a room while another
  room's slot overlapping it is live (its pages not returned), and no Prefill blob
  overlaps one a chunk still holds; a Decode core's slot count is the slots it
  offered and has not taken back, and both sides hold none after the drain; a
  blob is gathered exactly as planned and scattered from its room's own slot, into
  pages the room still owns; and a blob that nothing but its own room's write
  touched is never refused.

A strict violation stops the run at once: :class:`SimulationFailed` carries the
seed, the configuration and the timeline of the room that broke.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass, field
from typing import Final

from tspd.core.machines import RoomState
from tspd.sim.clock import EventQueue
from tspd.sim.timeline import Timeline

__all__ = [
    "Check",
    "Checker",
    "SimulationFailed",
    "StopRun",
    "Violation",
]


class Check(enum.StrEnum):
    """The named invariants."""

    STICKY = "sticky"
    OUTCOME = "outcome"
    DEADLINE = "deadline"
    DATA = "data"
    WRITE_AFTER_END = "write-after-end"
    FENCING = "fencing"
    DRAINED = "drained"
    BOUNDS = "bounds"
    RAISED = "raised"
    RELEASED = "released"
    STAGING = "staging"


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant."""

    check: Check
    time: float
    where: str
    detail: str
    room: int | None = None

    def __str__(self) -> str:
        room = f" room {self.room}" if self.room is not None else ""
        return f"[{self.check}] t={self.time:.6f} {self.where}{room}: {self.detail}"


class StopRun(Exception):
    """Raised inside a run when a strict violation stops it (caught by the run)."""


class SimulationFailed(AssertionError):
    """A run broke an invariant: what, with the seed and configuration that repeat
    it and the timeline of the room that broke."""

    def __init__(self, seed: int, command: str, violation: Violation, timeline: str) -> None:
        self.seed = seed
        self.command = command
        self.violation = violation
        self.timeline = timeline
        super().__init__(
            f"seed {seed} violates {violation.check}: {violation}\n"
            f"repeat with: {command}\n{timeline}"
        )


#: Progress order of the live states (``Failed`` and ``Absent`` are ends).
_ORDER: Final = {
    RoomState.BOOTSTRAPPING: 1,
    RoomState.BOOTSTRAPPED: 2,
    RoomState.WAITING_FOR_INPUT: 3,
    RoomState.TRANSFERRING: 4,
    RoomState.SUCCESS: 5,
}
_FAILED = RoomState.FAILED
_ABSENT = RoomState.ABSENT


@dataclass(slots=True)
class Checker:
    """Collects violations for one run; strict ones stop it (:class:`StopRun`)."""

    queue: EventQueue
    timeline: Timeline
    fencing_strict: bool
    #: Strict violations (a run stops at the first, so at most one in practice).
    violations: list[Violation] = field(default_factory=list)
    #: Fencing violations seen in ``report`` mode (all of them).
    fenced: list[Violation] = field(default_factory=list)
    #: Data mismatches explained by a fenced write (a late write of an ended room).
    fenced_corruptions: int = 0
    _deadlines: list[tuple[float, str, int]] = field(default_factory=list)
    _due: dict[str, tuple[float, int]] = field(default_factory=dict)

    def violate(self, check: Check, where: str, detail: str, room: int | None = None) -> None:
        """Record a strict violation and stop the run."""
        violation = Violation(check, self.queue.now, where, detail, room)
        self.violations.append(violation)
        if room is not None:
            self.timeline.note(room, self.queue.now, where, f"VIOLATION {check}: {detail}")
        raise StopRun(str(violation))

    def fencing(self, where: str, detail: str, room: int) -> None:
        """A write landed in a Decode page after its room ended there."""
        violation = Violation(Check.FENCING, self.queue.now, where, detail, room)
        self.timeline.note(room, self.queue.now, where, f"FENCING: {detail}")
        if self.fencing_strict:
            self.violations.append(violation)
            raise StopRun(str(violation))
        self.fenced.append(violation)

    # ------------------------------------------------------------------ room states

    def observe(
        self, seen: dict[int, RoomState], where: str, state: RoomState, room: int
    ) -> RoomState | None:
        """Rank ``where`` now has ``room`` in ``state``; ``seen`` is the last state
        it was seen in there. Returns the state when it changed, else ``None``."""
        last = seen.get(room, _ABSENT)
        if state is last:
            return None
        now = self.queue.now
        self.timeline.note(room, now, where, f"{last.value} -> {state.value}")
        if state is _ABSENT:
            del seen[room]
            return state
        seen[room] = state
        if last is _FAILED:
            self.violate(
                Check.STICKY, where, f"Failed is sticky, but the room went to {state.value}", room
            )
        if last is not _ABSENT and state is not _FAILED and _ORDER[state] < _ORDER[last]:
            self.violate(
                Check.STICKY, where, f"progress went back from {last.value} to {state.value}", room
            )
        return state

    # ------------------------------------------------------------------ deadlines

    def expect_end(self, key: str, room: int, deadline: float) -> None:
        """Request ``key`` (one side's request) must end by ``deadline`` (or by a
        later one given here again)."""
        current = self._due.get(key)
        if current is not None and current[0] >= deadline:
            return
        self._due[key] = (deadline, room)
        heapq.heappush(self._deadlines, (deadline, key, room))

    def extend(self, key: str, seconds: float) -> None:
        """Request ``key``'s deadline moves ``seconds`` later (if it has one)."""
        current = self._due.get(key)
        if current is not None:
            self.expect_end(key, current[1], current[0] + seconds)

    def ended(self, key: str) -> None:
        """Request ``key`` ended (or was lost with its process): no deadline."""
        self._due.pop(key, None)

    def check_deadlines(self) -> None:
        """Fail a request still live past its deadline."""
        heap, due, now = self._deadlines, self._due, self.queue.now
        while heap and heap[0][0] < now:
            deadline, key, room = heapq.heappop(heap)
            if due.get(key) == (deadline, room):
                self.violate(
                    Check.DEADLINE,
                    key,
                    f"still live {now - deadline:.3f}s after the {deadline:.3f}s its timeouts "
                    "allow",
                    room,
                )

    def outstanding(self) -> list[tuple[str, int]]:
        """Requests that have not ended: ``(key, room)``."""
        return [(key, room) for key, (_, room) in self._due.items()]
