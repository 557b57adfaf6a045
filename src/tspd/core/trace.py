"""Per-room traces: when each room passed each milestone on one rank, sans-IO.

Operators ask two things of a room that failed or ran slow: *where did the time
go* and *why did it fail*. A :class:`RoomTracer` answers both from inside the
cores, with the ``now`` every core call already receives (the shell's clock):

* while a room lives, it records the first time the room reached each
  :class:`Mark` (registered, bootstrapped, transfer started, written, notified,
  failed...), the bytes and descriptors its chunks planned, and its first failure
  reason with a :class:`ReasonClass`;
* when the room ends, the trace is frozen into a :class:`RoomTrace`, queued for
  the shell's metrics (``drain_finished()`` on the cores) and, if the room failed,
  was dropped or took at least :attr:`TraceConfig.slow_after` seconds, kept in a
  bounded ring of recent traces for ``trace(room)`` / ``recent_traces()``.

Memory stays bounded: live traces exist only for rooms the core's room table
holds (they end together), each keeps at most one timestamp per :class:`Mark`,
and both the finished queue and the ring have fixed capacities (the oldest entry
makes way; a queue overflow is counted in :attr:`RoomTracer.finished_dropped`).

Phase durations (:attr:`RoomTrace.phases`) are the gaps between milestones:

============================== ======================================================
Prefill phase                  from → to
============================== ======================================================
``bootstrapping``              registered → every Decode pre-allocation arrived
``waiting_for_input``          Bootstrapped → the first chunk went to the workers
``transfer``                   first chunk queued → final chunk written
``notification``               final chunk written → ``Success`` sent to Decode
============================== ======================================================

============================== ======================================================
Decode phase                   from → to
============================== ======================================================
``bootstrapping``              registered → route planned, registrations sent
``waiting_for_preallocation``  Bootstrapped → pre-allocations sent (pages allocated)
``transfer``                   pre-allocations sent → every expected rank's ``Success``
``notification``               KV complete → the scheduler got ``RemotePrefillDone``
============================== ======================================================

A phase appears only when both its milestones were reached; a milestone reached
before the one that opens its phase (Decode pre-allocated before the Prefill
scheduler registered the request) gives a zero-length phase. Times come from the
shell's clock: durations compare across processes, absolute times only within one.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from tspd.core.errors import ConfigError
from tspd.core.machines import RoomState
from tspd.core.reasons import Failure, ReasonClass

__all__ = [
    "PHASES",
    "Mark",
    "Outcome",
    "ReasonClass",
    "RoomTrace",
    "RoomTracer",
    "Side",
    "TraceConfig",
]


class Side(enum.StrEnum):
    """Which end of the transfer a rank is."""

    PREFILL = "prefill"
    DECODE = "decode"


class Mark(enum.StrEnum):
    """A milestone in a room's life; each is recorded once, the first time."""

    #: The scheduler registered the room's request on this rank.
    REGISTERED = "registered"
    #: Prefill: the first Decode pre-allocation was accepted. Decode: every target
    #: Prefill rank was sent its pre-allocation.
    PREALLOCATED = "preallocated"
    #: Prefill: the destination fan-out is complete. Decode: the route is planned
    #: and every registration went out.
    BOOTSTRAPPED = "bootstrapped"
    #: Prefill: the room's first chunk was handed to the transfer workers. Decode: an
    #: expected Prefill rank reported ``Transferring`` after the pre-allocation (a
    #: TokenSpeed Prefill never does; other implementations may).
    TRANSFER_STARTED = "transfer_started"
    #: Prefill: the final chunk's writes all succeeded.
    WRITTEN = "written"
    #: Prefill: ``Success`` went to every destination and the room is ``Success``.
    NOTIFIED = "notified"
    #: Decode: every expected Prefill rank reported ``Success``.
    COMPLETED = "completed"
    #: The room failed (its first failure; the reason is on the trace).
    FAILED = "failed"
    #: The scheduler received the request's final event; the room ended.
    CONCLUDED = "concluded"
    #: Prefill: no request on this rank claimed the room within the TTL; dropped.
    DROPPED = "dropped"


class Outcome(enum.StrEnum):
    """How a room ended."""

    SUCCESS = "success"
    FAILED = "failed"
    #: An unclaimed Prefill room that had not failed, dropped after the TTL.
    DROPPED = "dropped"


#: Per side: ``(phase, opening mark, closing mark)``. A room that was never
#: registered on this rank (a Prefill room created by a pre-allocation) opens its
#: first phase at its first milestone.
PHASES: Final[Mapping[Side, tuple[tuple[str, Mark, Mark], ...]]] = MappingProxyType(
    {
        Side.PREFILL: (
            ("bootstrapping", Mark.REGISTERED, Mark.BOOTSTRAPPED),
            ("waiting_for_input", Mark.BOOTSTRAPPED, Mark.TRANSFER_STARTED),
            ("transfer", Mark.TRANSFER_STARTED, Mark.WRITTEN),
            ("notification", Mark.WRITTEN, Mark.NOTIFIED),
        ),
        Side.DECODE: (
            ("bootstrapping", Mark.REGISTERED, Mark.BOOTSTRAPPED),
            ("waiting_for_preallocation", Mark.BOOTSTRAPPED, Mark.PREALLOCATED),
            ("transfer", Mark.PREALLOCATED, Mark.COMPLETED),
            ("notification", Mark.COMPLETED, Mark.CONCLUDED),
        ),
    }
)


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """How much a tracer keeps.

    ``keep``: finished traces kept for ``trace(room)``/``recent_traces()`` (only
    rooms that failed, were dropped, or lasted at least ``slow_after`` seconds from
    their first milestone to their end). ``pending``: finished traces waiting for
    the shell's ``drain_finished()``; a shell that never drains loses the oldest.
    """

    keep: int = 256
    slow_after: float = 5.0
    pending: int = 4096

    def __post_init__(self) -> None:
        if self.keep < 0 or self.pending < 0:
            raise ConfigError(
                f"trace capacities must not be negative, got keep={self.keep}, "
                f"pending={self.pending}"
            )
        if not self.slow_after > 0:
            raise ConfigError(
                f"the slow-room threshold must be positive seconds, got {self.slow_after}"
            )


@dataclass(frozen=True, slots=True)
class RoomTrace:
    """One room's milestones on one rank; ``outcome`` is ``None`` while it lives.

    ``marks`` holds each milestone reached, with the time it was first reached, in
    the order they happened; it is built from ``kinds`` (the milestones) and
    ``times`` (their times), which the trace keeps instead: a scheduler that keeps
    thousands of traces then holds two tuples each, one of them shared, not a pair
    per milestone for the garbage collector to scan. :meth:`of` builds a trace from
    ``(mark, time)`` pairs. ``bytes``/``descriptors``/``chunks`` count what the
    room's transfer chunks planned (Prefill; all of it was written when the room
    succeeded). ``reason``/``reason_class``/``timeout_stage`` describe the first
    failure.
    """

    room: int
    side: Side
    rank: int
    rid: str | None
    kinds: tuple[Mark, ...]
    times: tuple[float, ...]
    outcome: Outcome | None = None
    reason: str | None = None
    reason_class: ReasonClass | None = None
    timeout_stage: str | None = None
    bytes: int = 0
    descriptors: int = 0
    chunks: int = 0

    @classmethod
    def of(
        cls,
        room: int,
        side: Side,
        rank: int,
        rid: str | None,
        marks: Mapping[Mark, float] | tuple[tuple[Mark, float], ...],
        *,
        outcome: Outcome | None = None,
        reason: str | None = None,
        reason_class: ReasonClass | None = None,
        timeout_stage: str | None = None,
        bytes: int = 0,
        descriptors: int = 0,
        chunks: int = 0,
    ) -> RoomTrace:
        """A trace whose milestones are ``marks``: ``(mark, time)`` pairs in the order
        reached, or a mapping in that order."""
        if isinstance(marks, Mapping):
            kinds, times = tuple(marks), tuple(marks.values())
        else:
            kinds, times = tuple(m for m, _ in marks), tuple(t for _, t in marks)
        return cls(
            room,
            side,
            rank,
            rid,
            _shared_kinds(kinds),
            times,
            outcome,
            reason,
            reason_class,
            timeout_stage,
            bytes,
            descriptors,
            chunks,
        )

    @property
    def marks(self) -> tuple[tuple[Mark, float], ...]:
        """Each milestone reached, with the time it was first reached, in order."""
        return tuple(zip(self.kinds, self.times, strict=True))

    def at(self, mark: Mark) -> float | None:
        """When the room first reached ``mark``, or ``None``."""
        for reached, when in zip(self.kinds, self.times, strict=True):
            if reached is mark:
                return when
        return None

    @property
    def started(self) -> float:
        """The time of the first milestone."""
        return self.times[0] if self.times else 0.0

    @property
    def duration(self) -> float:
        """From the first milestone to the last (the room's whole life once ended)."""
        return self.times[-1] - self.times[0] if self.times else 0.0

    @property
    def phases(self) -> dict[str, float]:
        """Seconds spent in each phase whose closing milestone was reached (see the
        module docstring), in phase order."""
        phases: dict[str, float] = {}
        for phase, opening, closing in PHASES[self.side]:
            end = self.at(closing)
            if end is None:
                continue
            begin = self.at(opening)
            if begin is None:
                if opening is not Mark.REGISTERED:
                    continue
                begin = self.started
            phases[phase] = max(0.0, end - begin)
        return phases

    def as_dict(self) -> dict[str, object]:
        """The trace as plain JSON-ready data (for an HTTP endpoint or a report)."""
        return {
            "room": self.room,
            "side": str(self.side),
            "rank": self.rank,
            "rid": self.rid,
            "outcome": None if self.outcome is None else str(self.outcome),
            "reason": self.reason,
            "reason_class": None if self.reason_class is None else str(self.reason_class),
            "timeout_stage": self.timeout_stage,
            "marks": [[str(mark), when] for mark, when in self.marks],
            "phases": self.phases,
            "duration": self.duration,
            "bytes": self.bytes,
            "descriptors": self.descriptors,
            "chunks": self.chunks,
        }

    def describe(self) -> str:
        """One line for a log or a terminal: what the room is, how it ended, and each
        milestone as seconds since the first."""
        who = f"{self.side} rank {self.rank} room {self.room}"
        if self.rid is not None:
            who += f" (request {self.rid})"
        state = "live" if self.outcome is None else str(self.outcome)
        if self.reason is not None:
            state += f" [{self.reason_class}] {self.reason}"
        steps = ", ".join(f"{mark} +{when - self.started:.3f}s" for mark, when in self.marks)
        return f"{who}: {state}; {steps}"


#: Milestone sequences seen, each kept once and shared by every trace that has it
#: (rooms mostly pass the same milestones in the same order); bounded.
_KINDS: Final[dict[tuple[Mark, ...], tuple[Mark, ...]]] = {}
_KINDS_MAX: Final = 1024


def _shared_kinds(kinds: tuple[Mark, ...]) -> tuple[Mark, ...]:
    """The shared copy of ``kinds`` (``kinds`` itself once the table is full)."""
    shared = _KINDS.get(kinds)
    if shared is not None:
        return shared
    if len(_KINDS) < _KINDS_MAX:
        _KINDS[kinds] = kinds
    return kinds


@dataclass(slots=True)
class _Live:
    rid: str | None = None
    marks: dict[Mark, float] = field(default_factory=dict)
    reason: str | None = None
    reason_class: ReasonClass | None = None
    timeout_stage: str | None = None
    bytes: int = 0
    descriptors: int = 0
    chunks: int = 0


_OUTCOMES: Final[Mapping[RoomState, Outcome]] = MappingProxyType(
    {RoomState.SUCCESS: Outcome.SUCCESS, RoomState.FAILED: Outcome.FAILED}
)


class RoomTracer:
    """The traces of one rank's rooms. The owning core calls it at each milestone;
    nothing here is thread-safe (the core's task owns it)."""

    __slots__ = ("_config", "_live", "_pending", "_recent", "finished_dropped", "rank", "side")

    def __init__(self, side: Side, rank: int, config: TraceConfig | None = None) -> None:
        self.side = side
        self.rank = rank
        self._config = config or TraceConfig()
        self._live: dict[int, _Live] = {}
        self._pending: deque[RoomTrace] = deque(maxlen=self._config.pending)
        self._recent: deque[RoomTrace] = deque(maxlen=self._config.keep)
        #: Finished traces lost because nobody drained them in time.
        self.finished_dropped = 0

    def __len__(self) -> int:
        """How many rooms have a live trace."""
        return len(self._live)

    # -- recording ---------------------------------------------------------------

    def mark(self, room: int, mark: Mark, now: float, *, rid: str | None = None) -> None:
        """The room reached ``mark`` at ``now`` (kept only the first time)."""
        live = self._live.get(room)
        if live is None:
            live = self._live[room] = _Live()
        live.marks.setdefault(mark, now)
        if rid is not None and live.rid is None:
            live.rid = rid

    def transfer(self, room: int, nbytes: int, descriptors: int, now: float) -> None:
        """A chunk of the room went to the workers (the first one starts the transfer)."""
        self.mark(room, Mark.TRANSFER_STARTED, now)
        live = self._live[room]
        live.bytes += nbytes
        live.descriptors += descriptors
        live.chunks += 1

    def fail(self, room: int, failure: Failure, now: float) -> Failure:
        """The room failed; its first failure is kept and returned."""
        self.mark(room, Mark.FAILED, now)
        live = self._live[room]
        if live.reason is None:
            live.reason = failure.message
            live.timeout_stage = failure.timeout_stage
            live.reason_class = failure.cls
            return failure
        assert live.reason_class is not None
        return Failure(live.reason_class, live.reason)

    def finish(self, room: int, state: RoomState, mark: Mark, now: float) -> RoomTrace | None:
        """The room ended in ``state``, its last milestone ``mark``: freeze its trace,
        queue it for :meth:`drain_finished` and keep it if it failed or ran slow."""
        live = self._live.pop(room, None)
        if live is None:
            return None
        live.marks.setdefault(mark, now)
        outcome = _OUTCOMES.get(state, Outcome.DROPPED)
        reason, reason_class = live.reason, live.reason_class
        if outcome is Outcome.DROPPED and reason is None:
            reason, reason_class = "no request on this rank claimed the room", ReasonClass.UNCLAIMED
        trace = RoomTrace.of(
            room,
            self.side,
            self.rank,
            live.rid,
            live.marks,
            outcome=outcome,
            reason=reason,
            reason_class=reason_class,
            timeout_stage=live.timeout_stage,
            bytes=live.bytes,
            descriptors=live.descriptors,
            chunks=live.chunks,
        )
        if self._config.pending:
            if len(self._pending) == self._pending.maxlen:
                self.finished_dropped += 1
            self._pending.append(trace)
        else:
            self.finished_dropped += 1
        if outcome is not Outcome.SUCCESS or trace.duration >= self._config.slow_after:
            self._recent.append(trace)
        return trace

    # -- queries -------------------------------------------------------------------

    def when(self, room: int, mark: Mark) -> float | None:
        """When the live room first reached ``mark``, or ``None`` (cheap: no trace is
        built)."""
        live = self._live.get(room)
        return None if live is None else live.marks.get(mark)

    def trace(self, room: int) -> RoomTrace | None:
        """The room's live trace, else its most recent kept one, else ``None``."""
        live = self._live.get(room)
        if live is not None:
            return RoomTrace.of(
                room,
                self.side,
                self.rank,
                live.rid,
                live.marks,
                reason=live.reason,
                reason_class=live.reason_class,
                timeout_stage=live.timeout_stage,
                bytes=live.bytes,
                descriptors=live.descriptors,
                chunks=live.chunks,
            )
        for kept in reversed(self._recent):
            if kept.room == room:
                return kept
        return None

    def recent(self) -> list[RoomTrace]:
        """The kept traces of rooms that failed, were dropped or ran slow, oldest first."""
        return list(self._recent)

    def drain_finished(self) -> list[RoomTrace]:
        """Every room that ended since the last drain, in order (for metrics)."""
        finished = list(self._pending)
        self._pending.clear()
        return finished
