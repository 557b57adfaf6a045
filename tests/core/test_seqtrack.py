"""The subscriber's per-publisher tracker: order, gaps, replay, dedup, restarts."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tspd.core.seqtrack import (
    Deliver,
    GapUnhealable,
    PublisherRestarted,
    RequestReplay,
    SeqTracker,
    TrackerCommand,
)


def p(seq: int) -> bytes:
    return f"b{seq}".encode()


def delivered(commands: list[TrackerCommand]) -> list[int]:
    return [c.seq for c in commands if isinstance(c, Deliver)]


def test_in_order_batches_are_delivered_at_once() -> None:
    t = SeqTracker(replay=True)
    for seq in range(3):
        t.live(seq, p(seq), now=0.0)
    assert t.drain_commands() == [Deliver(s, p(s), False) for s in range(3)]
    assert t.next_seq == 3
    assert t.next_deadline() is None
    assert t.poll_command() is None


def test_a_late_joiner_starts_at_the_first_batch_it_sees() -> None:
    t = SeqTracker(replay=True)
    t.live(40, p(40), now=0.0)
    assert t.drain_commands() == [Deliver(40, p(40), False)]


def test_gap_requests_replay_then_delivers_in_order_without_duplicates() -> None:
    t = SeqTracker(replay=True, replay_timeout=2.0)
    t.live(0, p(0), 0.0)
    t.live(3, p(3), 1.0)
    t.live(4, p(4), 1.0)
    assert t.drain_commands() == [Deliver(0, p(0), False), RequestReplay(1, 1)]
    assert t.replay_in_flight == 1
    assert t.next_deadline() == 3.0
    for seq in (1, 2, 3, 4):  # the replay covers live batches too
        t.replayed(seq, p(seq), 1.1)
    t.replay_end(1.2)
    assert t.drain_commands() == [
        Deliver(1, p(1), True),
        Deliver(2, p(2), True),
        Deliver(3, p(3), False),  # held live copies go out as soon as the gap closes
        Deliver(4, p(4), False),
    ]
    t.live(5, p(5), 1.3)
    assert delivered(t.drain_commands()) == [5]
    stats = t.statistics()
    assert (stats.gaps, stats.replayed, stats.lost_batches, stats.pending) == (1, 2, 0, 0)
    assert stats.duplicates == 2
    assert t.next_deadline() is None


def test_replayed_batches_already_delivered_are_dropped() -> None:
    t = SeqTracker(replay=True)
    t.live(0, p(0), 0.0)
    t.live(2, p(2), 0.0)
    t.drain_commands()
    t.replayed(0, p(0), 0.0)  # below the next expected: a duplicate
    t.replayed(1, p(1), 0.0)
    t.replay_end(0.0)
    assert delivered(t.drain_commands()) == [1, 2]
    assert t.statistics().duplicates == 1


def test_replay_starting_past_the_gap_reports_the_evicted_batches() -> None:
    t = SeqTracker(replay=True)
    t.live(0, p(0), 0.0)
    t.live(10, p(10), 0.0)
    t.drain_commands()
    t.replayed(7, p(7), 0.0)
    t.replayed(8, p(8), 0.0)
    t.replayed(9, p(9), 0.0)
    t.replay_end(0.0)
    assert t.drain_commands() == [
        GapUnhealable(1, 7, "evicted"),
        Deliver(7, p(7), True),
        Deliver(8, p(8), True),
        Deliver(9, p(9), True),
        Deliver(10, p(10), False),
    ]
    assert t.statistics().lost_batches == 6


def test_live_batches_held_below_an_evicted_replay_are_not_lost() -> None:
    t = SeqTracker(replay=True)
    t.live(0, p(0), 0.0)
    t.live(5, p(5), 0.0)
    t.live(6, p(6), 0.0)
    t.drain_commands()
    t.replayed(8, p(8), 0.0)  # the buffer starts at 8 (it evicted up to 7)
    assert t.drain_commands() == [
        GapUnhealable(1, 5, "evicted"),
        Deliver(5, p(5), False),
        Deliver(6, p(6), False),
        GapUnhealable(7, 8, "evicted"),
        Deliver(8, p(8), True),
    ]


def test_a_replay_cut_short_is_asked_again_from_where_it_stopped() -> None:
    t = SeqTracker(replay=True, max_attempts=2)
    t.live(0, p(0), 0.0)
    t.live(5, p(5), 0.0)
    t.drain_commands()
    t.replayed(1, p(1), 0.0)
    t.replayed(2, p(2), 0.0)
    t.replay_end(0.0)
    assert t.drain_commands() == [
        Deliver(1, p(1), True),
        Deliver(2, p(2), True),
        RequestReplay(3, 2),
    ]
    t.replayed(3, p(3), 0.0)
    t.replay_end(0.0)  # progressed, but this was the last attempt
    assert t.drain_commands() == [
        Deliver(3, p(3), True),
        GapUnhealable(4, 5, "replay_incomplete"),
        Deliver(5, p(5), False),
    ]


def test_a_replay_with_nothing_useful_ends_the_gap_explicitly() -> None:
    t = SeqTracker(replay=True)
    t.live(0, p(0), 0.0)
    t.live(3, p(3), 0.0)
    t.drain_commands()
    t.replay_end(0.0)
    assert t.drain_commands() == [GapUnhealable(1, 3, "replay_incomplete"), Deliver(3, p(3), False)]


def test_a_replay_that_never_ends_times_out() -> None:
    t = SeqTracker(replay=True, replay_timeout=1.0)
    t.live(0, p(0), 10.0)
    t.live(2, p(2), 10.0)
    t.drain_commands()
    t.handle_timeout(10.5)
    assert t.drain_commands() == []
    t.handle_timeout(11.0)
    assert t.drain_commands() == [GapUnhealable(1, 2, "replay_timeout"), Deliver(2, p(2), False)]
    t.replayed(1, p(1), 11.5)  # a late reply to the abandoned request
    t.replay_end(11.5)
    assert t.drain_commands() == []


def test_without_a_replay_socket_a_gap_is_reported_at_once() -> None:
    t = SeqTracker(replay=False)
    t.live(0, p(0), 0.0)
    t.live(4, p(4), 0.0)
    assert t.drain_commands() == [
        Deliver(0, p(0), False),
        GapUnhealable(1, 4, "no_replay_endpoint"),
        Deliver(4, p(4), False),
    ]


def test_restart_to_zero_is_reported_and_the_new_stream_delivered() -> None:
    t = SeqTracker(replay=True)
    for seq in range(3):
        t.live(seq, p(seq), 0.0)
    t.drain_commands()
    t.live(0, b"new0", 0.0)
    assert t.drain_commands() == [PublisherRestarted(2, 0), Deliver(0, b"new0", False)]
    assert t.statistics().restarts == 1


def test_restart_seen_late_replays_the_new_streams_beginning() -> None:
    t = SeqTracker(replay=True)
    for seq in range(10):
        t.live(seq, p(seq), 0.0)
    t.drain_commands()
    t.live(3, b"new3", 0.0)
    assert t.drain_commands() == [PublisherRestarted(9, 3), RequestReplay(0, 1)]


def test_restart_while_a_gap_is_open_abandons_the_gap() -> None:
    t = SeqTracker(replay=False)
    t.live(5, p(5), 0.0)
    t.live(1, b"new1", 0.0)
    assert t.drain_commands() == [
        Deliver(5, p(5), False),
        PublisherRestarted(5, 1),
        GapUnhealable(0, 1, "no_replay_endpoint"),
        Deliver(1, b"new1", False),
    ]


def test_a_batch_seen_live_after_its_replay_is_a_duplicate_not_a_restart() -> None:
    t = SeqTracker(replay=True)
    t.live(0, p(0), 0.0)
    t.live(2, p(2), 0.0)
    t.drain_commands()
    for seq in (1, 2, 3):
        t.replayed(seq, p(seq), 0.0)
    t.replay_end(0.0)
    t.live(3, p(3), 0.0)
    t.live(4, p(4), 0.0)
    assert delivered(t.drain_commands()) == [1, 2, 3, 4]
    assert t.statistics().restarts == 0
    assert t.statistics().duplicates == 2  # replayed 2 (held live) and live 3 (replayed)


def test_catch_up_replays_the_buffer_before_the_first_live_batch() -> None:
    t = SeqTracker(replay=True, catch_up=True)
    t.live(5, p(5), 0.0)
    assert t.drain_commands() == [RequestReplay(0, 1)]
    for seq in range(3, 5):
        t.replayed(seq, p(seq), 0.0)
    t.replay_end(0.0)
    assert t.drain_commands() == [
        GapUnhealable(0, 3, "evicted"),
        Deliver(3, p(3), True),
        Deliver(4, p(4), True),
        Deliver(5, p(5), False),
    ]


def test_too_many_pending_batches_abandon_the_gap() -> None:
    t = SeqTracker(replay=True, max_pending=2)
    t.live(0, p(0), 0.0)
    for seq in (2, 3, 4):
        t.live(seq, p(seq), 0.0)
    assert t.drain_commands() == [
        Deliver(0, p(0), False),
        RequestReplay(1, 1),
        GapUnhealable(1, 2, "too_many_pending"),
        Deliver(2, p(2), False),
        Deliver(3, p(3), False),
        Deliver(4, p(4), False),
    ]
    assert t.replay_in_flight is None


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="replay_timeout"):
        SeqTracker(replay=True, replay_timeout=0)
    with pytest.raises(ValueError, match="at least 1"):
        SeqTracker(replay=True, max_pending=0)


class TrackerMachine(RuleBasedStateMachine):
    """The tracker against a model publisher with a bounded buffer and a lossy network."""

    @initialize(
        replay=st.booleans(),
        faults=st.booleans(),
        capacity=st.sampled_from([0, 2, 5]),
        limit=st.sampled_from([None, 0, 1, 3]),
    )
    def start(self, replay: bool, faults: bool, capacity: int, limit: int | None) -> None:
        """Half the runs are fault-free (big buffer, whole replays, no restarts, no lost
        replies), where nothing may be lost; the rest inject faults."""
        self.tracker = SeqTracker(replay=replay, replay_timeout=1.0, max_pending=50)
        self.replay = replay
        self.faults = faults
        self.capacity = capacity if faults else 1000
        self.limit = limit if faults else None
        self.stream = 0
        self.published: list[bytes] = []
        self.requests: list[int] = []
        self.now = 0.0
        self.commands: list[TrackerCommand] = []
        # Whether nothing happened that may legitimately lose batches.
        self.clean = self.limit is None

    def _pump(self) -> None:
        for command in self.tracker.drain_commands():
            self.commands.append(command)
            if isinstance(command, RequestReplay):
                self.requests.append(command.start_seq)

    @rule(live=st.booleans())
    def publish(self, live: bool) -> None:
        seq = len(self.published)
        payload = f"{self.stream}:{seq}".encode()
        self.published.append(payload)
        if len(self.published) > self.capacity:
            self.clean = False
        if live:
            self.tracker.live(seq, payload, self.now)
        self._pump()

    @precondition(lambda self: self.faults)
    @rule()
    def restart(self) -> None:
        self.stream += 1
        self.published = []
        self.clean = False

    @rule()
    def serve_replay(self) -> None:
        if not self.requests:
            return
        start = self.requests.pop(0)
        kept = list(enumerate(self.published))[-self.capacity :] if self.capacity else []
        batch = [(s, body) for s, body in kept if s >= start]
        if self.limit is not None:
            batch = batch[: self.limit]
        for seq, payload in batch:
            self.tracker.replayed(seq, payload, self.now)
        self.tracker.replay_end(self.now)
        self._pump()

    @precondition(lambda self: self.faults)
    @rule()
    def lose_replay(self) -> None:
        if self.requests:
            self.requests.pop(0)
            self.clean = False

    @rule(dt=st.sampled_from([0.25, 1.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        before = self.tracker.replay_in_flight
        self.tracker.handle_timeout(self.now)
        if before is not None and self.tracker.replay_in_flight != before:
            self.clean = False
        self._pump()

    @invariant()
    def delivery_is_ordered_and_every_hole_is_reported(self) -> None:
        expected: int | None = None
        for command in self.commands:
            if isinstance(command, PublisherRestarted):
                expected = 0
            elif isinstance(command, GapUnhealable):
                assert expected is None or command.first_missing == expected
                assert command.resumed_at > command.first_missing
                expected = command.resumed_at
            elif isinstance(command, Deliver):
                assert expected is None or command.seq == expected
                assert command.payload.endswith(f":{command.seq}".encode())
                expected = command.seq + 1

    @invariant()
    def a_clean_run_loses_nothing(self) -> None:
        if self.clean and self.replay:
            assert not any(isinstance(c, GapUnhealable) for c in self.commands)

    @invariant()
    def an_open_gap_always_has_a_replay_in_flight(self) -> None:
        stats = self.tracker.statistics()
        assert stats.pending <= 51
        if stats.pending:
            assert self.tracker.replay_in_flight is not None


TestTrackerMachine = TrackerMachine.TestCase
