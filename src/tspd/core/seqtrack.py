"""Per-publisher sequence tracking for a KV-event subscriber (sans-IO).

A :class:`SeqTracker` follows one publisher's stream (one attention-DP rank). The
shell feeds it what arrives -- live messages, replayed messages, replay end markers
-- and the time; it answers with commands, drained with :meth:`SeqTracker.poll_command`
or :meth:`SeqTracker.drain_commands`:

* :class:`Deliver` -- hand this batch to the application. Batches are delivered
  strictly in sequence order and each sequence number at most once.
* :class:`RequestReplay` -- send a replay request from ``start_seq``.
* :class:`GapUnhealable` -- the batches ``[first_missing, resumed_at)`` are lost
  for good (evicted from the publisher's buffer, no replay socket, replay failed).
  The application's view of this publisher is incomplete; a router should drop
  what it derived from it or resynchronise.
* :class:`PublisherRestarted` -- the sequence went back (a new publisher process):
  everything known about this publisher is stale.

Rules (docs/protocol.md#proto-kv-subscriber, with the failures routers keep hitting
designed out):

* A gap (live ``seq`` above the next expected) buffers live batches and requests a
  replay from the first missing sequence. Replayed batches below the next expected
  one are duplicates and dropped; a replayed batch *above* it means the publisher's
  buffer no longer holds the missing ones: that part of the gap is reported, not
  skipped silently.
* When the end marker arrives with the gap still open, a replay that made progress
  is asked again from the new first missing batch (the publisher cut it short);
  one that made none, or that timed out, ends in :class:`GapUnhealable`.
* A live ``seq`` at or below the highest live ``seq`` seen is a restart (live
  delivery over one connection is ordered, so it cannot be a duplicate). Batches
  delivered from a replay and later seen live are duplicates, not restarts.
* After a restart the new stream is expected from 0, so a late joiner to the new
  stream replays its beginning.

Call :meth:`SeqTracker.handle_timeout` at :meth:`SeqTracker.next_deadline`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

__all__ = [
    "Deliver",
    "GapReason",
    "GapUnhealable",
    "PublisherRestarted",
    "RequestReplay",
    "SeqTracker",
    "TrackerCommand",
    "TrackerStats",
]

GapReason: TypeAlias = Literal[
    "evicted", "no_replay_endpoint", "replay_incomplete", "replay_timeout", "too_many_pending"
]


@dataclass(frozen=True, slots=True)
class Deliver:
    """Deliver the batch ``seq`` (``replayed`` when it came from the replay socket)."""

    seq: int
    payload: bytes
    replayed: bool


@dataclass(frozen=True, slots=True)
class RequestReplay:
    """Ask the publisher's replay socket for every batch from ``start_seq``."""

    start_seq: int
    attempt: int


@dataclass(frozen=True, slots=True)
class GapUnhealable:
    """The batches ``first_missing`` .. ``resumed_at - 1`` are lost; delivery resumes."""

    first_missing: int
    resumed_at: int
    reason: GapReason

    @property
    def missing(self) -> int:
        """How many batches were lost."""
        return self.resumed_at - self.first_missing


@dataclass(frozen=True, slots=True)
class PublisherRestarted:
    """The publisher's sequence went back from ``last_seq`` to ``new_seq``: a new stream."""

    last_seq: int
    new_seq: int


TrackerCommand: TypeAlias = Deliver | RequestReplay | GapUnhealable | PublisherRestarted


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackerStats:
    """Counters of one tracker (for metrics and ``tspd events tail``)."""

    delivered: int
    replayed: int
    duplicates: int
    gaps: int
    replays_requested: int
    lost_batches: int
    restarts: int
    pending: int
    next_seq: int | None


@dataclass(slots=True)
class _Replay:
    start_seq: int
    deadline: float
    attempt: int
    progressed: bool = False


_DEFAULT_TIMEOUT: Final = 5.0


class SeqTracker:
    """Orders, deduplicates and heals one publisher's batches. See the module docstring.

    ``replay``: whether the publisher has a replay socket. ``catch_up``: replay the
    publisher's buffer from 0 when the first live batch is not 0 (a late joiner's
    catch-up); the part older than the buffer is then reported as a gap.
    ``replay_timeout``: how long a replay may take to reach its end marker.
    ``max_pending``: live batches held while a gap is open, before giving up on it.
    ``max_attempts``: replay requests for one gap before it is declared lost.
    """

    __slots__ = (
        "_catch_up",
        "_commands",
        "_delivered",
        "_duplicates",
        "_gaps",
        "_live_high",
        "_lost",
        "_max_attempts",
        "_max_pending",
        "_next",
        "_pending",
        "_replay",
        "_replay_enabled",
        "_replay_timeout",
        "_replayed",
        "_replays_requested",
        "_restarts",
    )

    def __init__(
        self,
        *,
        replay: bool,
        catch_up: bool = False,
        replay_timeout: float = _DEFAULT_TIMEOUT,
        max_pending: int = 100_000,
        max_attempts: int = 4,
    ) -> None:
        if replay_timeout <= 0:
            raise ValueError(f"replay_timeout must be positive, got {replay_timeout}")
        if max_pending < 1 or max_attempts < 1:
            raise ValueError("max_pending and max_attempts must be at least 1")
        self._replay_enabled = replay
        self._catch_up = catch_up
        self._replay_timeout = replay_timeout
        self._max_pending = max_pending
        self._max_attempts = max_attempts
        self._commands: deque[TrackerCommand] = deque()
        # The next sequence number to deliver; None before the first batch.
        self._next: int | None = None
        # The highest sequence number seen on the live socket (restart detection).
        self._live_high: int | None = None
        # Live batches above a gap, waiting for it to close.
        self._pending: dict[int, bytes] = {}
        self._replay: _Replay | None = None
        self._delivered = 0
        self._replayed = 0
        self._duplicates = 0
        self._gaps = 0
        self._replays_requested = 0
        self._lost = 0
        self._restarts = 0

    # -- inputs ------------------------------------------------------------------

    def live(self, seq: int, payload: bytes, now: float) -> None:
        """A batch arrived on the SUB socket."""
        if self._live_high is not None and seq <= self._live_high:
            self._restart(seq)
        self._live_high = seq
        if self._next is None:
            self._next = 0 if (self._catch_up and self._replay_enabled) else seq
        if seq < self._next:
            # Already delivered from a replay.
            self._duplicates += 1
            return
        if seq == self._next and not self._pending:
            self._deliver(seq, payload, replayed=False)
            return
        self._pending[seq] = payload
        self._open_gap(now)

    def replayed(self, seq: int, payload: bytes, now: float) -> None:
        """A batch arrived on the replay socket."""
        replay = self._replay
        if replay is None or self._next is None:
            # A stray reply (after a timeout or a restart): its batches are either
            # delivered already or belong to an abandoned stream.
            self._duplicates += 1
            return
        if seq < self._next:
            self._duplicates += 1
            return
        replay.progressed = True
        if seq > self._next:
            # The buffer no longer holds what is below ``seq``; live batches held
            # below it still count, so lose only the holes between them.
            while self._pending and min(self._pending) < seq:
                low = min(self._pending)
                if low < self._next:
                    del self._pending[low]
                    continue
                if low > self._next:
                    self._lose(self._next, low, "evicted")
                self._flush()
            if seq < self._next:
                self._duplicates += 1
                return
            if seq > self._next:
                self._lose(self._next, seq, "evicted")
        self._pending.pop(seq, None)
        self._deliver(seq, payload, replayed=True)
        self._flush()

    def replay_end(self, now: float) -> None:
        """The replay's end marker arrived."""
        if self._replay is None:
            return
        self._finish_replay(now, timed_out=False)

    def handle_timeout(self, now: float) -> None:
        """Expire a replay that did not end in time."""
        replay = self._replay
        if replay is not None and now >= replay.deadline:
            self._finish_replay(now, timed_out=True)

    # -- outputs -----------------------------------------------------------------

    def poll_command(self) -> TrackerCommand | None:
        """The next command, or ``None``; poll again after every input."""
        return self._commands.popleft() if self._commands else None

    def drain_commands(self) -> list[TrackerCommand]:
        """Every queued command, in order."""
        out = list(self._commands)
        self._commands.clear()
        return out

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timeout` must be called, or ``None``."""
        return self._replay.deadline if self._replay is not None else None

    @property
    def next_seq(self) -> int | None:
        """The next sequence number this tracker will deliver (``None`` before any)."""
        return self._next

    @property
    def replay_in_flight(self) -> int | None:
        """The ``start_seq`` of the replay being waited for, or ``None``."""
        return self._replay.start_seq if self._replay is not None else None

    def statistics(self) -> TrackerStats:
        """The tracker's counters."""
        return TrackerStats(
            delivered=self._delivered,
            replayed=self._replayed,
            duplicates=self._duplicates,
            gaps=self._gaps,
            replays_requested=self._replays_requested,
            lost_batches=self._lost,
            restarts=self._restarts,
            pending=len(self._pending),
            next_seq=self._next,
        )

    # -- internals ---------------------------------------------------------------

    def _deliver(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        self._commands.append(Deliver(seq, payload, replayed))
        self._next = seq + 1
        self._delivered += 1
        if replayed:
            self._replayed += 1

    def _flush(self) -> None:
        """Deliver pending live batches that are now in order."""
        pending = self._pending
        while pending and self._next in pending:
            seq = self._next
            assert seq is not None
            self._deliver(seq, pending.pop(seq), replayed=False)

    def _lose(self, first: int, resumed_at: int, reason: GapReason) -> None:
        self._commands.append(GapUnhealable(first, resumed_at, reason))
        self._lost += resumed_at - first
        self._next = resumed_at

    def _skip_gap(self, reason: GapReason, now: float) -> None:
        """Give up on the open gap: report it and deliver what waits behind it.

        Live batches held behind it may have holes of their own: each gets a replay
        of its own, or, without one, is reported the same way.
        """
        assert self._next is not None
        self._lose(self._next, min(self._pending), reason)
        self._flush()
        while self._pending:
            if self._replay_enabled and reason != "too_many_pending":
                self._gaps += 1
                self._request(now, attempt=1)
                return
            self._lose(self._next, min(self._pending), reason)
            self._flush()

    def _open_gap(self, now: float) -> None:
        if self._replay is not None:
            if len(self._pending) > self._max_pending:
                self._replay = None
                self._skip_gap("too_many_pending", now)
            return
        self._gaps += 1
        if not self._replay_enabled:
            self._skip_gap("no_replay_endpoint", now)
            return
        self._request(now, attempt=1)

    def _request(self, now: float, *, attempt: int) -> None:
        assert self._next is not None
        self._replay = _Replay(self._next, now + self._replay_timeout, attempt)
        self._replays_requested += 1
        self._commands.append(RequestReplay(self._next, attempt))

    def _finish_replay(self, now: float, *, timed_out: bool) -> None:
        replay = self._replay
        assert replay is not None
        self._replay = None
        if not self._pending:
            return
        if replay.progressed and replay.attempt < self._max_attempts:
            self._request(now, attempt=replay.attempt + 1)
            return
        self._skip_gap("replay_timeout" if timed_out else "replay_incomplete", now)

    def _restart(self, seq: int) -> None:
        last = self._live_high
        assert last is not None
        self._commands.append(PublisherRestarted(last, seq))
        self._restarts += 1
        self._pending.clear()
        self._replay = None
        # The new stream starts at 0: a replay fetches whatever of it was missed, and
        # without a replay socket the missed beginning is reported as lost.
        self._next = 0
        self._live_high = None
