"""Room status tables: sticky failure, monotonic progress, first reason wins, forgetting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
)

from tspd.core.commands import Event, Failed, PagesReleased, RemotePrefillDone, Succeeded
from tspd.core.errors import ProtocolError
from tspd.core.machines import (
    DECODE_ROOM,
    DECODE_ROOM_TABLE,
    PREFILL_ROOM,
    PREFILL_ROOM_TABLE,
    CompiledMachine,
    MachineDeclaration,
    PrefillTrigger,
    RoomState,
)
from tspd.core.poll import TransferPoll
from tspd.core.reasons import Failure, ReasonClass
from tspd.core.rooms import RoomClocks, RoomTable
from tspd.testing.core_pair import CorePair
from tspd.testing.layouts import simple_contract


def test_absent_room_polls_failed_and_is_ended() -> None:
    table = RoomTable(PREFILL_ROOM_TABLE)
    assert table.status(7) is None
    assert table.poll(7) is TransferPoll.FAILED
    assert table.ended(7)
    assert len(table) == 0


def test_first_failure_reason_wins_and_fail_reports_once() -> None:
    table = RoomTable(PREFILL_ROOM_TABLE)
    table.fire(1, PrefillTrigger.REGISTER)
    first = Failure(ReasonClass.TRANSFER, "first")
    assert table.fail(1, first) is True
    assert table.fail(1, Failure(ReasonClass.ABORTED, "second")) is False
    assert table.failure(1) == first
    assert table.status(1) is TransferPoll.FAILED
    table.forget(1)
    assert table.failure(1) is None
    assert len(table) == 0


def test_timeout_reason_recorded_without_state_change_survives_later_abort() -> None:
    table = RoomTable(PREFILL_ROOM_TABLE)
    table.fire(3, PrefillTrigger.REGISTER)
    timed_out = Failure(ReasonClass.TIMEOUT_BOOTSTRAPPING, "timed out")
    assert table.record_failure(3, timed_out)
    assert table.state(3) is RoomState.BOOTSTRAPPING
    table.fail(3, Failure(ReasonClass.ABORTED, "aborted"))
    assert table.failure(3) == timed_out


def test_invalid_trigger_leaves_state_unchanged() -> None:
    table = RoomTable(PREFILL_ROOM_TABLE)
    table.fire(5, PrefillTrigger.REGISTER)
    with pytest.raises(ProtocolError):
        table.fire(5, PrefillTrigger.TRANSFER_SUCCEEDED)
    assert table.state(5) is RoomState.BOOTSTRAPPING
    assert table.counts() == {"Bootstrapping": 1}


def test_failed_before_any_state_then_forgotten_leaves_nothing() -> None:
    table = RoomTable(PREFILL_ROOM_TABLE)
    table.fail(
        9,
        Failure(
            ReasonClass.ABORTED, "EPD: prefill aborted request r (embedding receive timed out)"
        ),
    )
    assert 9 in table
    assert list(table.rooms()) == [9]
    table.forget(9)
    assert 9 not in table
    assert len(table) == 0


ROOMS = st.integers(min_value=0, max_value=4)


def _table_machine(declaration: MachineDeclaration, compiled: CompiledMachine) -> type:
    triggers = st.sampled_from(declaration.triggers)

    class TableMachine(RuleBasedStateMachine):
        """Random trigger sequences; the table must keep the rules of
        docs/protocol.md#proto-room-table."""

        def __init__(self) -> None:
            super().__init__()
            self.table = RoomTable(compiled)
            self.model: dict[int, RoomState] = {}
            self.reasons: dict[int, Failure] = {}
            self.counter = 0

        @rule(room=ROOMS, trigger=triggers)
        def fire(self, room: int, trigger: str) -> None:
            before = self.table.state(room)
            if not compiled.allowed(before, trigger):
                with pytest.raises(ProtocolError):
                    self.table.fire(room, trigger)
                assert self.table.state(room) is before
                return
            after = self.table.fire(room, trigger)
            if trigger in ("forget", "ttl_expired"):
                assert after is RoomState.ABSENT
                self.model.pop(room, None)
                self.reasons.pop(room, None)
                return
            if before is RoomState.FAILED:
                assert after is RoomState.FAILED
            elif after is not RoomState.FAILED and before.poll is not None:
                assert after.poll is not None
                assert after.poll >= before.poll
            if after is RoomState.ABSENT:
                self.model.pop(room, None)
            else:
                self.model[room] = after

        @rule(room=ROOMS)
        def fail(self, room: int) -> None:
            if not compiled.allowed(self.table.state(room), "fail"):
                return
            self.counter += 1
            reason = Failure(ReasonClass.OTHER, f"reason {self.counter}")
            was_failed = self.table.state(room) is RoomState.FAILED
            assert self.table.fail(room, reason) is (not was_failed)
            self.reasons.setdefault(room, reason)
            self.model[room] = RoomState.FAILED

        @rule(room=ROOMS)
        def forget(self, room: int) -> None:
            self.table.forget(room)
            self.model.pop(room, None)
            self.reasons.pop(room, None)
            assert self.table.status(room) is None
            assert self.table.failure(room) is None

        @invariant()
        def table_matches_model(self) -> None:
            for room in range(5):
                assert self.table.state(room) is self.model.get(room, RoomState.ABSENT)
                # The hot-loop int view agrees with the state after every transition.
                assert self.table.wire_values.get(room, 0) == int(self.table.poll(room))
                assert (room in self.table.wire_values) is (room in self.model)
                if room in self.reasons:
                    assert self.table.failure(room) == self.reasons[room]
            assert len(self.table) == len(self.model)

        def teardown(self) -> None:
            for room in range(5):
                self.table.forget(room)
            assert len(self.table) == 0
            assert self.table.counts() == {}

    return TableMachine


TestPrefillRoomTable = _table_machine(PREFILL_ROOM, PREFILL_ROOM_TABLE).TestCase
TestDecodeRoomTable = _table_machine(DECODE_ROOM, DECODE_ROOM_TABLE).TestCase


# --- per-room clocks against a brute-force dict ---------------------------------------

CLOCK_ROOMS = st.integers(min_value=0, max_value=60)
TIMES = st.integers(min_value=0, max_value=50).map(float)
CLOCK_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("start"), CLOCK_ROOMS, TIMES),
        st.tuples(st.just("setdefault"), CLOCK_ROOMS, TIMES),
        st.tuples(st.just("pop"), CLOCK_ROOMS, TIMES),
        st.tuples(st.just("expire"), CLOCK_ROOMS, TIMES),
    ),
    max_size=300,
)


@given(CLOCK_OPS)
def test_room_clocks_earliest_and_expiry_match_a_brute_force_scan(
    ops: list[tuple[str, int, float]],
) -> None:
    clocks = RoomClocks()
    model: dict[int, float] = {}
    for op, room, at in ops:
        if op == "start":
            clocks.start(room, at)
            model[room] = at
        elif op == "setdefault":
            assert clocks.setdefault(room, at) == model.setdefault(room, at)
        elif op == "pop":
            assert clocks.pop(room) == model.pop(room, None)
        else:
            # ``room`` doubles as a TTL: rooms whose clock ran that long end.
            ttl = float(room)
            expired = clocks.pop_expired(at, ttl)
            want = {r for r, since in model.items() if at - since >= ttl}
            assert sorted(expired) == sorted(want)
            assert [model[r] for r in expired] == sorted(model[r] for r in expired)
            for r in want:
                del model[r]
        assert clocks.earliest() == min(model.values(), default=None)
        assert len(clocks) == len(model)
        assert dict(clocks.items()) == model
        # Stale heap entries are compacted: memory follows the live clocks.
        assert len(clocks._heap) <= 2 * len(model) + 32


def test_room_clocks_restart_and_readd_keep_the_newest_start() -> None:
    clocks = RoomClocks()
    clocks.start(1, 5.0)
    clocks.start(2, 7.0)
    clocks.start(1, 9.0)  # restarted: its stale 5.0 entry must not count
    assert clocks.earliest() == 7.0
    assert clocks.pop_expired(20.0, 12.0) == [2]
    assert clocks.earliest() == 9.0
    clocks.pop(1)
    clocks.start(1, 5.0)  # re-added with an old start
    assert clocks.earliest() == 5.0
    assert clocks.pop_expired(6.0, 1.0) == [1]
    assert clocks.earliest() is None
    assert 1 not in clocks


# --- both cores under random event sequences ------------------------------------------

_PAIR_CONTRACT = simple_contract(num_pages=64, page_bytes=32)
_PROMPT = 16
_TERMINAL = (Failed, Succeeded, RemotePrefillDone)
PAIR_ROOMS = st.integers(min_value=1, max_value=4)


class PairMachine(RuleBasedStateMachine):
    """A Prefill core and a Decode core under random requests, pre-allocations,
    hand-overs, aborts, write failures, lost messages, delayed writes and time, with
    a Decode scheduler that reuses a room's pages as soon as it is allowed.
    Invariants: Failed is sticky, progress is monotonic, an ended request is never
    reported again, no write lands on pages its room does not own (write fencing),
    and nothing is left once every room ended."""

    def __init__(self) -> None:
        super().__init__()
        self.pair = CorePair([_PAIR_CONTRACT], [_PAIR_CONTRACT], failed_session_ttl=5.0)
        self.generation = 0
        self.rid_of: dict[int, str] = {}
        self.ended_rids: set[str] = set()
        #: Failed requests whose pages the Decode must keep until PagesReleased.
        self.held: set[str] = set()
        self.handed: set[str | None] = set()
        self.ended_on: set[tuple[str, str]] = set()
        self.seen: dict[tuple[str, int], RoomState] = {}

    # rules --------------------------------------------------------------------------

    @rule(room=PAIR_ROOMS, on_prefill=st.booleans())
    def start(self, room: int, on_prefill: bool) -> None:
        if room in self.rid_of:
            return
        self.generation += 1
        rid = f"r{room}.{self.generation}"
        self.rid_of[room] = rid
        self.pair.register_decode(rid, room)
        if on_prefill:
            self.pair.register_prefill(rid, room)

    @rule(room=PAIR_ROOMS)
    def prefill_registers_late(self, room: int) -> None:
        rid = self.rid_of.get(room)
        if rid is None or room in self.pair.prefill[0].tracked_rooms():
            return
        if self.pair.prefill[0].room_state(room) is not RoomState.ABSENT or rid in self.ended_rids:
            return
        self.pair.register_prefill(rid, room)

    @rule(room=PAIR_ROOMS)
    def preallocate(self, room: int) -> None:
        if self.pair.decode[0].room_state(room) is RoomState.BOOTSTRAPPED:
            self.pair.preallocate(room, _PROMPT)

    @rule(room=PAIR_ROOMS)
    def hand_over(self, room: int) -> None:
        core = self.pair.prefill[0]
        rid = self.rid_of.get(room)
        if (
            rid not in self.handed
            and core.room_state(room) is RoomState.BOOTSTRAPPED
            and room in core.tracked_rooms()
        ):
            self.handed.add(rid)
            self.pair.hand_over(room, _PROMPT)

    @rule(room=PAIR_ROOMS)
    def abort(self, room: int) -> None:
        self.pair.prefill[0].abort(room, f"test abort {room}", self.pair.now)
        self.pair.pump()

    @rule(broken=st.booleans())
    def decode_session_breaks(self, broken: bool) -> None:
        session = CorePair.decode_session(0)
        if broken:
            self.pair.write_errors[session] = "injected"
        else:
            self.pair.write_errors.pop(session, None)

    @rule(lost=st.booleans())
    def status_messages_get_lost(self, lost: bool) -> None:
        if lost:
            self.pair.dropped_ports.add(8000)
        else:
            self.pair.dropped_ports.discard(8000)

    @rule(delayed=st.booleans())
    def writes_are_delayed(self, delayed: bool) -> None:
        """Delayed: transfers wait in their workers' queues until run_transfers."""
        self.pair.auto_transfer = not delayed
        if not delayed:
            self.pair.run_transfers()
            self.pair.pump()

    @rule()
    def delayed_writes_land(self) -> None:
        self.pair.run_transfers()
        self.pair.pump()

    @invariant()
    def no_write_lands_on_pages_its_room_does_not_own(self) -> None:
        assert not self.pair.fencing_violations, self.pair.fencing_violations[:4]

    @rule(frames=st.lists(st.binary(max_size=12), max_size=4))
    def garbage_control(self, frames: list[bytes]) -> None:
        self.pair.prefill[0].receive_control(frames, self.pair.now)
        self.pair.pump()

    @rule(seconds=st.sampled_from([1.0, 10.0, 60.0, 130.0, 310.0]))
    def time_passes(self, seconds: float) -> None:
        self.pair.advance(seconds)

    @rule()
    def poll(self) -> None:
        self._record("prefill", self.pair.poll_prefill())
        self._record("decode", self.pair.poll_decode())

    # checks -------------------------------------------------------------------------

    def _record(self, side: str, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, PagesReleased):
                assert side == "decode", event
                assert event.rid in self.held, event
                self.held.discard(event.rid)
                continue
            assert (side, event.rid) not in self.ended_on, f"{side}: {event} after it ended"
            if side == "decode" and isinstance(event, Failed) and event.pages_held:
                self.held.add(event.rid)
            if isinstance(event, _TERMINAL):
                self.ended_on.add((side, event.rid))
                self.ended_rids.add(event.rid)
            if isinstance(event, Failed):
                assert event.reason
        for room, rid in list(self.rid_of.items()):
            if (
                rid in self.ended_rids
                and rid not in self.held
                and room not in self.pair.decode[0].tracked_rooms()
                and room not in self.pair.prefill[0].tracked_rooms()
            ):
                del self.rid_of[room]
                self.pair.release_room(room)

    @invariant()
    def failed_is_sticky_and_progress_monotonic(self) -> None:
        for side, core in (("prefill", self.pair.prefill[0]), ("decode", self.pair.decode[0])):
            for room in range(1, 5):
                now = core.room_state(room)
                before = self.seen.get((side, room))
                if now is RoomState.ABSENT:
                    self.seen.pop((side, room), None)
                    continue
                if before is RoomState.FAILED:
                    assert now is RoomState.FAILED, (side, room, before, now)
                elif before is not None and now is not RoomState.FAILED:
                    assert now.poll is not None
                    assert before.poll is not None
                    assert now.poll >= before.poll, (side, room, before, now)
                self.seen[(side, room)] = now
                if now is RoomState.FAILED:
                    assert core.room_failure(room), (side, room)

    @invariant()
    def next_deadline_is_the_brute_force_earliest_expiry(self) -> None:
        # The cores keep their deadlines in heaps; the dicts behind them are the
        # truth, scanned here the way next_deadline used to.
        prefill, decode = self.pair.prefill[0], self.pair.decode[0]
        ttl = prefill.config.bootstrap_timeout
        expiries = [since + ttl for _, since in prefill._per_room.unclaimed.items()]
        session_ttl = prefill.config.failed_session_ttl
        expiries += [at + session_ttl for at in prefill._failed_sessions.values()]
        assert prefill.next_deadline() == min(expiries, default=None)
        waiting = decode.config.waiting_timeout
        want = min((s + waiting for _, s in decode._waiting_since.items()), default=None)
        assert decode.next_deadline() == want

    def teardown(self) -> None:
        pair = self.pair
        pair.write_errors.clear()
        pair.dropped_ports.clear()
        pair.auto_transfer = True
        pair.run_transfers()
        pair.pump()
        for _ in range(12):
            for room in range(1, 5):
                if pair.decode[0].room_state(room) is RoomState.BOOTSTRAPPED:
                    pair.preallocate(room, _PROMPT)
                core = pair.prefill[0]
                if (
                    core.room_state(room) is RoomState.BOOTSTRAPPED
                    and room in core.tracked_rooms()
                    and not core.statistics()["transfers_in_flight"]
                ):
                    pair.hand_over(room, _PROMPT)
            self.poll()
            pair.advance(400.0)
            self.poll()
            if not pair.prefill[0].has_in_flight() and not pair.decode[0].has_in_flight():
                break
        pair.advance(400.0)
        assert not pair.prefill[0].has_in_flight()
        assert not pair.decode[0].has_in_flight()
        assert pair.room_tables_empty(), pair.statistics()
        pair.close()


TestPairMachine = PairMachine.TestCase
TestPairMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_rooms_benchmark_quick_run_prints_every_row() -> None:
    from click.testing import CliRunner

    from tspd.cli import main

    result = CliRunner().invoke(main, ["bench", "rooms", "--quick"])
    assert result.exit_code == 0, result.output
    for what in (
        "compiled table",
        "transitions.Machine",
        "TP2 -> TP1",
        "pre-allocation",
        "Prefill poll_values + conclude, 16 tracked",
        "Decode poll_values + conclude, 16 tracked",
        "Prefill next_deadline, 16 unclaimed",
        "Decode next_deadline, 16 rooms waiting",
    ):
        assert what in result.output
