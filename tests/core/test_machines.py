"""The compiled machine tables agree with a real ``transitions.Machine`` on every pair."""

from __future__ import annotations

import pytest
from transitions import Machine, MachineError

from tspd.core.errors import ProtocolError
from tspd.core.machines import (
    DECODE_ROOM,
    DECODE_ROOM_TABLE,
    PREFILL_ADDRESS_HEALTH,
    PREFILL_ADDRESS_HEALTH_TABLE,
    PREFILL_ROOM,
    PREFILL_ROOM_TABLE,
    PREFILL_TRANSFER,
    PREFILL_TRANSFER_TABLE,
    REQUEST,
    REQUEST_TABLE,
    CompiledMachine,
    DecodeTrigger,
    MachineDeclaration,
    PrefillTrigger,
    RequestState,
    RequestTrigger,
    RoomState,
    TransferState,
    TransferTrigger,
    compile_machine,
    fire_request,
    fire_transfer,
)
from tspd.core.poll import TransferPoll

MACHINES = [
    pytest.param(PREFILL_ROOM, PREFILL_ROOM_TABLE, id="prefill-room"),
    pytest.param(DECODE_ROOM, DECODE_ROOM_TABLE, id="decode-room"),
    pytest.param(PREFILL_ADDRESS_HEALTH, PREFILL_ADDRESS_HEALTH_TABLE, id="address-health"),
    pytest.param(REQUEST, REQUEST_TABLE, id="request"),
    pytest.param(PREFILL_TRANSFER, PREFILL_TRANSFER_TABLE, id="prefill-transfer"),
]
ROOM_MACHINES = MACHINES[:2]

_NOT_ALLOWED = "not allowed"
#: The triggers that end a room (→ ``Absent``): the only way out of ``Failed``.
_ENDINGS = frozenset({"forget", "ttl_expired"})


class _Model:
    state: str


def _via_transitions(declaration: MachineDeclaration, state: str, trigger: str) -> str:
    model = _Model()
    Machine(model=model, auto_transitions=False, **declaration.as_kwargs())
    model.state = state
    try:
        model.trigger(trigger)  # type: ignore[attr-defined]
    except MachineError:
        return _NOT_ALLOWED
    return model.state


def _via_table(table: CompiledMachine, state: str, trigger: str) -> str:
    try:
        return table.fire(state, trigger)
    except ProtocolError:
        return _NOT_ALLOWED


@pytest.mark.parametrize(("declaration", "table"), MACHINES)
def test_every_state_trigger_pair_matches_transitions(
    declaration: MachineDeclaration, table: CompiledMachine
) -> None:
    checked = 0
    for state in declaration.states:
        for trigger in declaration.triggers:
            expected = _via_transitions(declaration, state, trigger)
            assert _via_table(table, state, trigger) == expected, (state, trigger)
            assert table.allowed(state, trigger) == (expected != _NOT_ALLOWED)
            checked += 1
    assert checked == len(declaration.states) * len(declaration.triggers)


@pytest.mark.parametrize(("declaration", "table"), ROOM_MACHINES)
def test_failed_is_sticky_and_only_an_ending_ends_it(
    declaration: MachineDeclaration, table: CompiledMachine
) -> None:
    for trigger in declaration.triggers:
        expected = RoomState.ABSENT if trigger in _ENDINGS else RoomState.FAILED
        assert table.fire(RoomState.FAILED, trigger) == expected


@pytest.mark.parametrize(("declaration", "table"), ROOM_MACHINES)
def test_progress_is_monotonic_outside_failure_and_forget(
    declaration: MachineDeclaration, table: CompiledMachine
) -> None:
    for (source, trigger), dest in table.table.items():
        if trigger in _ENDINGS or RoomState(dest) is RoomState.FAILED:
            continue
        before, after = RoomState(source).poll, RoomState(dest).poll
        if before is None:
            continue
        assert after is not None
        assert after >= before, (source, trigger, dest)


@pytest.mark.parametrize(("declaration", "table"), ROOM_MACHINES)
def test_every_room_state_can_fail_and_be_forgotten(
    declaration: MachineDeclaration, table: CompiledMachine
) -> None:
    for state in declaration.states:
        assert table.fire(state, "forget") == RoomState.ABSENT
        if state != RoomState.ABSENT or declaration is PREFILL_ROOM:
            assert table.fire(state, "fail") == RoomState.FAILED


def test_prefill_room_happy_path_and_waiting_for_input_never_set() -> None:
    state: str = RoomState.ABSENT
    for trigger, expected in [
        (PrefillTrigger.REGISTER, RoomState.BOOTSTRAPPING),
        (PrefillTrigger.PREALLOCATE, RoomState.BOOTSTRAPPING),
        (PrefillTrigger.FANOUT_COMPLETE, RoomState.BOOTSTRAPPED),
        (PrefillTrigger.TRANSFER_SUCCEEDED, RoomState.SUCCESS),
        (PrefillTrigger.FAIL, RoomState.FAILED),
    ]:
        state = PREFILL_ROOM_TABLE.fire(state, trigger)
        assert state == expected
    assert RoomState.WAITING_FOR_INPUT not in PREFILL_ROOM.states
    # Pre-allocations completed the room before its request registered: monotonic.
    assert PREFILL_ROOM_TABLE.fire(RoomState.BOOTSTRAPPED, PrefillTrigger.REGISTER) == (
        RoomState.BOOTSTRAPPED
    )


def test_decode_room_happy_path() -> None:
    state: str = RoomState.ABSENT
    for trigger, expected in [
        (DecodeTrigger.REGISTER, RoomState.BOOTSTRAPPING),
        (DecodeTrigger.ROUTED, RoomState.BOOTSTRAPPED),
        (DecodeTrigger.PREALLOCATED, RoomState.WAITING_FOR_INPUT),
        (DecodeTrigger.RANK_DONE, RoomState.WAITING_FOR_INPUT),
        (DecodeTrigger.COMPLETED, RoomState.SUCCESS),
        (DecodeTrigger.PREFILL_LOST, RoomState.SUCCESS),
    ]:
        state = DECODE_ROOM_TABLE.fire(state, trigger)
        assert state == expected


def test_a_timeout_concludes_the_request_failed_and_leaves_the_room_alone() -> None:
    """The machines say how a timeout ends a request: the room tables have no
    timeout trigger (its status is unchanged, peers may still report it); the
    request machine moves the request to ``Failed``, and the group's agreement
    then fails the room (``fail``) and forgets it."""
    for table in (PREFILL_ROOM_TABLE, DECODE_ROOM_TABLE):
        assert not any("timeout" in trigger for trigger in table.triggers)
    for timeout in (RequestTrigger.BOOTSTRAP_TIMEOUT, RequestTrigger.WAITING_TIMEOUT):
        for state in (RequestState.REGISTERED, RequestState.ANNOUNCED):
            assert fire_request(state, timeout) is RequestState.FAILED
        assert not REQUEST_TABLE.allowed(RequestState.SUCCEEDED, timeout)
    assert fire_request(RequestState.FAILED, RequestTrigger.GROUP_FAILED) is RequestState.ABSENT
    assert not REQUEST_TABLE.allowed(RequestState.FAILED, RequestTrigger.GROUP_SUCCEEDED)


def test_request_happy_paths() -> None:
    state = RequestState.ABSENT
    for trigger, expected in [
        (RequestTrigger.REGISTER, RequestState.REGISTERED),
        (RequestTrigger.ANNOUNCE, RequestState.ANNOUNCED),
        (RequestTrigger.ROOM_SUCCEEDED, RequestState.SUCCEEDED),
        (RequestTrigger.GROUP_SUCCEEDED, RequestState.ABSENT),
    ]:
        state = fire_request(state, trigger)
        assert state is expected
    # A room that succeeds before the group announced it: the announcement first.
    state = fire_request(RequestState.REGISTERED, RequestTrigger.ROOM_SUCCEEDED)
    assert state is RequestState.SUCCEEDED_UNANNOUNCED
    assert not REQUEST_TABLE.allowed(state, RequestTrigger.GROUP_SUCCEEDED)
    assert fire_request(state, RequestTrigger.ANNOUNCE) is RequestState.SUCCEEDED


def test_a_layerwise_transfer_reports_once_written_and_the_token_known() -> None:
    state = TransferState.ABSENT
    for trigger, expected in [
        (TransferTrigger.ARM_CHUNK, TransferState.STREAMING),
        (TransferTrigger.ARM_CHUNK, TransferState.STREAMING),
        (TransferTrigger.ARM_FINAL_CHUNK, TransferState.FINAL_IN_FLIGHT),
        (TransferTrigger.WRITTEN, TransferState.AWAITING_TOKEN),
        (TransferTrigger.REPORTED, TransferState.STREAMED),
    ]:
        state = fire_transfer(state, trigger)
        assert state is expected
    # Nothing goes out after the final chunk; a full transfer is handed over once.
    assert not PREFILL_TRANSFER_TABLE.allowed(TransferState.STREAMED, TransferTrigger.ARM_CHUNK)
    sending = fire_transfer(TransferState.ABSENT, TransferTrigger.HAND_OVER)
    assert not PREFILL_TRANSFER_TABLE.allowed(sending, TransferTrigger.HAND_OVER)
    assert fire_transfer(sending, TransferTrigger.REPORTED) is TransferState.ABSENT
    for any_state in TransferState:
        assert fire_transfer(any_state, TransferTrigger.STOPPED) is TransferState.ABSENT


def test_abort_and_ttl_expiry_are_transitions_of_the_prefill_room() -> None:
    for state in PREFILL_ROOM.states:
        assert PREFILL_ROOM_TABLE.fire(state, PrefillTrigger.ABORT) == RoomState.FAILED
        assert PREFILL_ROOM_TABLE.fire(state, PrefillTrigger.TTL_EXPIRED) == RoomState.ABSENT


def test_invalid_pair_raises_protocol_error_naming_machine_and_state() -> None:
    with pytest.raises(ProtocolError, match=r"PrefillRoom: trigger 'transfer_succeeded'"):
        PREFILL_ROOM_TABLE.fire(RoomState.BOOTSTRAPPING, PrefillTrigger.TRANSFER_SUCCEEDED)
    with pytest.raises(ProtocolError, match="'Absent'"):
        DECODE_ROOM_TABLE.fire(RoomState.ABSENT, DecodeTrigger.COMPLETED)


def test_room_state_maps_to_transfer_poll() -> None:
    assert RoomState.ABSENT.poll is None
    assert RoomState.FAILED.poll is TransferPoll.FAILED
    assert RoomState.WAITING_FOR_INPUT.poll is TransferPoll.WAITING_FOR_INPUT
    assert RoomState.SUCCESS.poll is TransferPoll.SUCCESS


def test_compile_rejects_malformed_declarations() -> None:
    ambiguous = MachineDeclaration(
        name="X",
        states=("a", "b"),
        initial="a",
        triggers=("go",),
        transitions=(
            {"trigger": "go", "source": "a", "dest": "b"},
            {"trigger": "go", "source": "a", "dest": "a"},
        ),
    )
    with pytest.raises(ProtocolError, match="ambiguous"):
        compile_machine(ambiguous)
    undeclared = MachineDeclaration(
        name="X",
        states=("a",),
        initial="a",
        triggers=("go",),
        transitions=({"trigger": "go", "source": "a", "dest": "z"},),
    )
    with pytest.raises(ProtocolError, match="undeclared"):
        compile_machine(undeclared)
    with pytest.raises(ProtocolError, match="initial"):
        compile_machine(
            MachineDeclaration(name="X", states=("a",), initial="q", triggers=(), transitions=())
        )


@pytest.mark.parametrize(("declaration", "table"), MACHINES)
def test_declaration_renders_as_a_mermaid_diagram_with_every_edge(
    declaration: MachineDeclaration, table: CompiledMachine
) -> None:
    from transitions.extensions import GraphMachine

    model = _Model()
    GraphMachine(  # type: ignore[no-untyped-call]
        model=model, graph_engine="mermaid", auto_transitions=False, **declaration.as_kwargs()
    )
    text = model.get_graph().draw(None)  # type: ignore[attr-defined]
    assert "stateDiagram-v2" in text
    for (source, trigger), dest in table.table.items():
        line = next(
            (ln for ln in text.splitlines() if ln.strip().startswith(f"{source} --> {dest}:")),
            None,
        )
        assert line is not None, (source, dest)
        assert trigger in line.split(":", 1)[1].replace(" ", "").split("|")


def test_committed_state_diagrams_are_current() -> None:
    from pathlib import Path

    from tspd.cli.diagrams import DEFAULT_DIR, stale

    root = Path(__file__).resolve().parents[2]
    assert stale(root / DEFAULT_DIR) == [], "run `tspd diagrams` and commit docs/state-machines"


def test_a_stale_diagram_is_reported(tmp_path: object) -> None:
    from pathlib import Path

    from click.testing import CliRunner

    from tspd.cli import main

    directory = Path(str(tmp_path))
    runner = CliRunner()
    assert runner.invoke(main, ["diagrams", "--dir", str(directory)]).exit_code == 0
    assert runner.invoke(main, ["diagrams", "--dir", str(directory), "--check"]).exit_code == 0
    (directory / "PrefillRoom.mmd").write_text("stateDiagram-v2\n", encoding="utf-8")
    result = runner.invoke(main, ["diagrams", "--dir", str(directory), "--check"])
    assert result.exit_code != 0
    assert "PrefillRoom.mmd" in result.output
    assert "svg" not in result.output
    svg = directory / "DecodeRoom.svg"
    svg.write_text(svg.read_text(encoding="utf-8").replace(">fail<", ">fial<"), encoding="utf-8")
    result = runner.invoke(main, ["diagrams", "--dir", str(directory), "--check"])
    assert result.exit_code != 0
    assert "DecodeRoom.svg" in result.output


def test_svg_from_another_graphviz_is_compared_by_content_not_layout(tmp_path: object) -> None:
    import re
    from pathlib import Path

    from tspd.cli.diagrams import DEFAULT_DIR, render_svg, stale, svg_signature

    rendered = render_svg(DECODE_ROOM)
    assert "Generated by graphviz" not in rendered
    assert rendered == render_svg(DECODE_ROOM)
    # Another Graphviz: other coordinates, same states, edges and triggers.
    moved = re.sub(r'(x|y)="-?[0-9.]+"', r'\1="1.5"', rendered)
    moved = re.sub(r"with graphviz \S+ -->", "with graphviz 99.0 -->", moved)
    assert moved != rendered
    assert svg_signature(moved) == svg_signature(rendered)
    titles = {title for kind, title, _ in svg_signature(rendered) if kind == "edge"}
    assert "WaitingForInput->Success" in titles
    root = Path(__file__).resolve().parents[2] / DEFAULT_DIR
    directory = Path(str(tmp_path))
    for path in root.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    (directory / "DecodeRoom.svg").write_text(moved, encoding="utf-8")
    assert stale(directory) == []
    # The same Graphviz version must reproduce the file byte for byte.
    same_version = re.sub(r'(x|y)="-?[0-9.]+"', r'\1="1.5"', rendered)
    (directory / "DecodeRoom.svg").write_text(same_version, encoding="utf-8")
    assert stale(directory) == [directory / "DecodeRoom.svg"]
