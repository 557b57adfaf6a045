"""Room status tables: sticky failure, monotonic progress, first reason wins, forgetting."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
)

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
from tspd.core.rooms import RoomTable


def test_absent_room_polls_failed_and_is_ended() -> None:
    table = RoomTable(PREFILL_ROOM_TABLE)
    assert table.status(7) is None
    assert table.poll(7) is TransferPoll.FAILED
    assert table.ended(7)
    assert len(table) == 0


def test_first_failure_reason_wins_and_fail_reports_once() -> None:
    table = RoomTable(PREFILL_ROOM_TABLE)
    table.fire(1, PrefillTrigger.REGISTER)
    assert table.fail(1, "first") is True
    assert table.fail(1, "second") is False
    assert table.failure(1) == "first"
    assert table.status(1) is TransferPoll.FAILED
    table.forget(1)
    assert table.failure(1) is None
    assert len(table) == 0


def test_timeout_reason_recorded_without_state_change_survives_later_abort() -> None:
    table = RoomTable(PREFILL_ROOM_TABLE)
    table.fire(3, PrefillTrigger.REGISTER)
    assert table.record_failure(3, "timed out")
    assert table.state(3) is RoomState.BOOTSTRAPPING
    table.fail(3, "aborted")
    assert table.failure(3) == "timed out"


def test_invalid_trigger_leaves_state_unchanged() -> None:
    table = RoomTable(PREFILL_ROOM_TABLE)
    table.fire(5, PrefillTrigger.REGISTER)
    with pytest.raises(ProtocolError):
        table.fire(5, PrefillTrigger.TRANSFER_SUCCEEDED)
    assert table.state(5) is RoomState.BOOTSTRAPPING
    assert table.counts() == {"Bootstrapping": 1}


def test_failed_before_any_state_then_forgotten_leaves_nothing() -> None:
    table = RoomTable(PREFILL_ROOM_TABLE)
    table.fail(9, "EPD: prefill aborted request r (embedding receive timed out)")
    assert 9 in table
    assert list(table.rooms()) == [9]
    table.forget(9)
    assert 9 not in table
    assert len(table) == 0


ROOMS = st.integers(min_value=0, max_value=4)


def _table_machine(declaration: MachineDeclaration, compiled: CompiledMachine) -> type:
    triggers = st.sampled_from(declaration.triggers)

    class TableMachine(RuleBasedStateMachine):
        """Random trigger sequences; the table must keep §7.2's rules."""

        def __init__(self) -> None:
            super().__init__()
            self.table = RoomTable(compiled)
            self.model: dict[int, RoomState] = {}
            self.reasons: dict[int, str] = {}
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
            if trigger == "forget":
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
            reason = f"reason {self.counter}"
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
