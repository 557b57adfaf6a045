"""DecodeCore: route planning, registrations, completions, heartbeats and every failure
reason of docs/protocol.md#proto-decode-room-table, driven with Prefill cores through
CorePair in virtual time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core import wire
from tspd.core.bootstrap import ParallelInfo
from tspd.core.commands import (
    Bootstrapped,
    Failed,
    FetchParallelInfo,
    FetchRankInfo,
    RemotePrefillDone,
    SendFrames,
)
from tspd.core.decode import DecodeConfig, DecodeCore
from tspd.core.errors import ConfigError, ProtocolError
from tspd.core.machines import RoomState
from tspd.core.poll import TransferPoll
from tspd.core.trace import Mark, ReasonClass
from tspd.testing.core_pair import CorePair
from tspd.testing.layouts import multi_layer_contract, room_manifest, simple_contract

CONTRACT = simple_contract(num_pages=16, page_bytes=64)
PROMPT = 40
ADDR = "127.0.0.1:8998"
DEAD = "Failed to get kvcache from prefill instance, it might be dead"


@pytest.fixture
def pair() -> Iterator[CorePair]:
    p = CorePair([CONTRACT], [CONTRACT])
    yield p
    p.close()


def _logs(pair: CorePair) -> list[str]:
    return [log.message for side, _, log in pair.logs if side == "decode"]


def _status(room: int, status: TransferPoll, rank: int, **kw: object) -> list[bytes]:
    return wire.encode_status(wire.StatusMessage(room, status, rank, **kw))  # type: ignore[arg-type]


def _bare_core(tp_size: int = 1, tp_rank: int = 0) -> DecodeCore:
    return DecodeCore(
        DecodeConfig(
            tp_size=tp_size,
            tp_rank=tp_rank,
            contract=CONTRACT,
            arena_base=0x10000,
            session_id="127.0.0.1:9000",
            endpoint="127.0.0.1",
            port=8000,
        )
    )


def _info(tp: int = 1, layout: str | None = None) -> ParallelInfo:
    return ParallelInfo(tp, 1, CONTRACT.to_json().decode() if layout is None else layout)


# --- bootstrap -----------------------------------------------------------------------


def test_parallel_info_is_fetched_once_per_address_and_registrations_once_per_rank(
    pair: CorePair,
) -> None:
    core = pair.decode[0]
    pair.register_decode("a", 1)
    pair.register_decode("b", 2)
    registrations = [
        c for side, _, c in pair.sent if side == "decode" and wire.is_registration(list(c.frames))
    ]
    assert len(registrations) == 1
    assert registrations[0].port == 7000
    assert core.room_state(1) is RoomState.BOOTSTRAPPED
    assert core.room_state(2) is RoomState.BOOTSTRAPPED
    assert core.bootstrap_addrs() == [ADDR]


def test_fetch_commands_and_pending_rooms() -> None:
    core = _bare_core()
    core.register_request("a", 1, ADDR, 0.0)
    core.register_request("b", 2, ADDR, 0.0)
    assert core.drain_commands() == [FetchParallelInfo(ADDR)]
    core.parallel_info(ADDR, _info(), 0.0)
    assert core.drain_commands() == [FetchRankInfo(ADDR, 0, 0)]
    assert core.statistics()["awaiting_rank"] == 2


def test_parallel_info_error_fails_waiting_rooms(pair: CorePair) -> None:
    pair.parallel_info_error = "connection refused"
    pair.register_decode("a", 1)
    pair.register_decode("b", 2)
    reason = f"Could not fetch prefill parallel info from bootstrap_addr: {ADDR}"
    assert pair.poll_decode() == [Failed("a", reason), Failed("b", reason)]
    assert pair.room_tables_empty()
    assert pair.decode[0].bootstrap_addrs() == []


def test_rank_info_error_fails_the_room() -> None:
    p = [
        multi_layer_contract(layers=1, num_pages=8, heads=2, head_dim=4, tp_size=2)
        for _ in range(2)
    ]
    d = [multi_layer_contract(layers=1, num_pages=8, heads=4, head_dim=4, tp_size=1)]
    pair = CorePair(p, d)
    try:
        pair.rank_info_errors[1] = "HTTP 500"
        pair.register_decode("a", 4)
        reason = "Could not fetch bootstrap info for engine rank: 1 and target_dp_group: 0"
        assert pair.poll_decode() == [Failed("a", reason)]
        assert pair.room_tables_empty()
    finally:
        pair.close()


def test_planning_errors_fail_the_room_instead_of_raising() -> None:
    core = _bare_core()
    core.register_request("a", 1, ADDR, 0.0)
    other = simple_contract(num_pages=16, page_bytes=128)
    core.parallel_info(ADDR, _info(layout=other.to_json().decode()), 0.0)
    assert core.room_state(1) is RoomState.FAILED
    reason = core.room_failure(1)
    assert reason
    core.register_request("b", 2, ADDR, 0.0)
    assert core.room_failure(2) == reason
    core.register_request("c", 3, "other:1", 0.0)
    core.parallel_info("other:1", _info(layout=""), 0.0)
    assert core.room_failure(3) == "Paged cache decode connected to a non-Paged cache prefill"
    core.register_request("d", 4, "bad:1", 0.0)
    core.parallel_info("bad:1", _info(layout="{}"), 0.0)
    assert core.room_state(4) is RoomState.FAILED
    values = core.poll_values(0.0)
    # Four Failed requests, then four "pages free" flags (none pre-allocated).
    assert values == [0, 0, 0, 0, 1, 1, 1, 1]
    events = core.conclude(values, 0.0)
    assert [type(e) for e in events] == [Failed] * 4
    assert core.statistics()["rooms"] == 0


# --- status messages -----------------------------------------------------------------


def test_failed_status_fails_the_room_and_later_success_does_not_overwrite(
    pair: CorePair,
) -> None:
    pair.register_decode("a", 1)
    core = pair.decode[0]
    core.receive_status(_status(1, TransferPoll.FAILED, 0), pair.now)
    core.receive_status(_status(1, TransferPoll.SUCCESS, 0), pair.now)
    assert core.room_state(1) is RoomState.FAILED
    assert core.room_failure(1) == DEAD
    assert pair.poll_decode() == [Failed("a", DEAD)]


def test_completion_before_route_and_from_unexpected_rank() -> None:
    core = _bare_core()
    core.register_request("a", 1, ADDR, 0.0)
    core.receive_status(_status(1, TransferPoll.SUCCESS, 0), 0.0)
    assert core.room_failure(1) == "Received KV completion before its transfer route was registered"
    core.register_request("b", 2, "x:1", 0.0)
    core.parallel_info("x:1", _info(), 0.0)
    core.receive_status(_status(2, TransferPoll.SUCCESS, 3), 0.0)
    assert core.room_failure(2) == "Received KV completion from an unexpected Prefill TP rank"


def test_malformed_unknown_and_unexpected_statuses(pair: CorePair) -> None:
    pair.register_decode("a", 1)
    core = pair.decode[0]
    core.receive_status([b"1"], pair.now)
    core.receive_status(_status(999, TransferPoll.SUCCESS, 0), pair.now)
    core.receive_status(_status(1, TransferPoll.TRANSFERRING, 0), pair.now)
    core.receive_status(_status(1, TransferPoll.BOOTSTRAPPING, 0), pair.now)
    pair.pump()
    logs = _logs(pair)
    assert any(m.startswith("Rejecting malformed Prefill status message") for m in logs)
    # Transferring before this rank pre-allocated cannot skip its own steps.
    assert any("reported Transferring for room 1 before this rank pre-allocated" in m for m in logs)
    assert core.room_state(1) is RoomState.BOOTSTRAPPED
    assert core.room_state(999) is RoomState.ABSENT


def _two_prefill_ranks() -> CorePair:
    """Prefill TP2 -> Decode TP1: room 4 expects Success from Prefill ranks 0 and 1."""
    p = [
        multi_layer_contract(layers=1, num_pages=8, heads=2, head_dim=4, tp_size=2)
        for _ in range(2)
    ]
    d = [multi_layer_contract(layers=1, num_pages=8, heads=4, head_dim=4, tp_size=1)]
    pair = CorePair(p, d)
    pair.dropped_ports.update({7000, 7001})  # the Prefill cores stay silent
    pair.register_decode("a", 4)
    assert pair.poll_decode() == [Bootstrapped("a")]
    pair.preallocate(4, 10)
    return pair


def test_transferring_from_an_expected_rank_is_a_monotonic_update() -> None:
    """docs/protocol.md#proto-decode-room-table: a status other than Success/Failed
    moves the room monotonically. It shows in the poll value and the trace, never
    completes the room, and a later lower status does not move it back."""
    pair = _two_prefill_ranks()
    try:
        core = pair.decode[0]
        core.receive_status(_status(4, TransferPoll.TRANSFERRING, 1), pair.now + 0.5)
        assert core.room_state(4) is RoomState.TRANSFERRING
        assert core.poll_values(pair.now)[0] == int(TransferPoll.TRANSFERRING)
        assert core.rooms_by_state() == {"Transferring": 1}
        trace = core.trace(4)
        assert trace is not None
        assert trace.at(Mark.TRANSFER_STARTED) == pair.now + 0.5
        pair.pump()
        assert any("Req(room=4) in Transferring" in m for m in _logs(pair))
        # Lower statuses from the same or the other expected rank: no step back.
        for status in (TransferPoll.WAITING_FOR_INPUT, TransferPoll.BOOTSTRAPPED):
            core.receive_status(_status(4, status, 0), pair.now)
            assert core.room_state(4) is RoomState.TRANSFERRING
        # Not complete: nothing for the scheduler until every expected rank's Success.
        assert pair.poll_decode() == []
        core.receive_status(_status(4, TransferPoll.SUCCESS, 0, bootstrap_token=9), pair.now)
        core.receive_status(_status(4, TransferPoll.TRANSFERRING, 0), pair.now)
        assert core.room_state(4) is RoomState.TRANSFERRING
        core.receive_status(_status(4, TransferPoll.SUCCESS, 1), pair.now)
        assert core.room_state(4) is RoomState.SUCCESS
        core.receive_status(_status(4, TransferPoll.TRANSFERRING, 1), pair.now)
        assert core.room_state(4) is RoomState.SUCCESS
        assert pair.poll_decode() == [RemotePrefillDone("a", 9, (), 0, None)]
        assert pair.room_tables_empty()
    finally:
        pair.close()


def test_progress_from_a_rank_outside_the_route_changes_nothing() -> None:
    pair = _two_prefill_ranks()
    try:
        core = pair.decode[0]
        core.receive_status(_status(4, TransferPoll.TRANSFERRING, 5), pair.now)
        assert core.room_state(4) is RoomState.WAITING_FOR_INPUT
        assert core.poll_values(pair.now)[0] == int(TransferPoll.WAITING_FOR_INPUT)
        pair.pump()
        assert any("not a rank of the room's transfer route" in m for m in _logs(pair))
    finally:
        pair.close()


def test_failed_stays_sticky_over_transferring() -> None:
    pair = _two_prefill_ranks()
    try:
        core = pair.decode[0]
        core.receive_status(_status(4, TransferPoll.TRANSFERRING, 0), pair.now)
        core.receive_status(_status(4, TransferPoll.FAILED, 1), pair.now)
        core.receive_status(_status(4, TransferPoll.TRANSFERRING, 0), pair.now)
        assert core.room_state(4) is RoomState.FAILED
        assert pair.poll_decode() == [Failed("a", DEAD)]
    finally:
        pair.close()


def test_a_transferring_room_still_times_out_and_fails_when_its_prefill_is_lost() -> None:
    pair = _two_prefill_ranks()
    try:
        core = pair.decode[0]
        core.receive_status(_status(4, TransferPoll.TRANSFERRING, 0), pair.now)
        pair.advance(300.0)
        reason = "Request 4 timed out after 300.0s in TransferPoll.Transferring"
        assert pair.poll_decode() == [Failed("a", reason)]
        assert [f.reason_class for s, _, f in pair.failures if s == "decode"] == [
            ReasonClass.TIMEOUT_WAITING
        ]
    finally:
        pair.close()
    pair = _two_prefill_ranks()
    try:
        core = pair.decode[0]
        core.receive_status(_status(4, TransferPoll.TRANSFERRING, 1), pair.now)
        core.heartbeat(ADDR, False, pair.now)
        core.heartbeat(ADDR, False, pair.now)
        lost = f"Losing connection with prefill instance (bootstrap_addr: {ADDR})"
        assert core.room_state(4) is RoomState.FAILED
        assert pair.poll_decode() == [Failed("a", lost)]
    finally:
        pair.close()


def test_completion_needs_every_expected_rank_and_keeps_first_metadata() -> None:
    p = [
        multi_layer_contract(layers=1, num_pages=8, heads=2, head_dim=4, tp_size=2)
        for _ in range(2)
    ]
    d = [multi_layer_contract(layers=1, num_pages=8, heads=4, head_dim=4, tp_size=1)]
    pair = CorePair(p, d)
    try:
        pair.register_decode("a", 4)
        pair.poll_decode()
        pair.preallocate(4, 10)
        core = pair.decode[0]
        core.receive_status(
            _status(4, TransferPoll.SUCCESS, 1, bootstrap_token=-1, cached_tokens=8), pair.now
        )
        assert core.room_state(4) is RoomState.WAITING_FOR_INPUT
        core.receive_status(
            _status(
                4,
                TransferPoll.SUCCESS,
                0,
                bootstrap_token=17,
                spec_candidate_ids=(5, 6),
                cached_tokens=4,
                bootstrap_logprob=-1.5,
            ),
            pair.now,
        )
        assert core.room_state(4) is RoomState.SUCCESS
        assert pair.poll_decode() == [RemotePrefillDone("a", 17, (5, 6), 8, -1.5)]
        assert pair.decode[0].statistics()["completions"] == 0
    finally:
        pair.close()


def test_dummy_ranks_get_empty_preallocations_and_are_not_expected() -> None:
    p = [
        multi_layer_contract(layers=1, num_pages=8, heads=1, head_dim=4, tp_size=4, global_heads=2)
        for _ in range(4)
    ]
    d = [multi_layer_contract(layers=1, num_pages=8, heads=2, head_dim=4, tp_size=1)]
    pair = CorePair(p, d)
    try:
        pair.register_decode("a", 4)
        pair.poll_decode()
        pair.preallocate(4, 10)
        prealloc = {
            c.port: c.frames[2]
            for side, _, c in pair.sent
            if side == "decode" and not wire.is_registration(list(c.frames))
        }
        assert sorted(prealloc) == [7000, 7001, 7002, 7003]
        assert prealloc[7001] == b""
        assert prealloc[7003] == b""
        assert prealloc[7000] != b""
        core = pair.decode[0]
        core.receive_status(_status(4, TransferPoll.SUCCESS, 0), pair.now)
        core.receive_status(_status(4, TransferPoll.SUCCESS, 2), pair.now)
        assert core.room_state(4) is RoomState.SUCCESS
    finally:
        pair.close()


# --- pre-allocation and waiting --------------------------------------------------------


def test_invalid_manifest_fails_the_room(pair: CorePair) -> None:
    pair.register_decode("a", 1)
    core = pair.decode[0]
    other = simple_contract(num_pages=16, page_bytes=64, group_id="other")
    core.send_preallocation(1, room_manifest(other, PROMPT), pair.now)
    reason = core.room_failure(1)
    assert reason is not None
    assert reason.startswith("invalid pre-allocation metadata: ")
    assert not [c for c in core.drain_commands() if isinstance(c, SendFrames)]


def test_preallocation_from_tables_and_caller_errors(pair: CorePair) -> None:
    core = pair.decode[0]
    pair.register_decode("a", 1)
    with pytest.raises(ProtocolError, match="needs prompt_len"):
        core.send_preallocation(1, {"full": [1, 2, 3]}, pair.now)
    core.send_preallocation(1, {"full": [1, 2, 3]}, pair.now, prompt_len=PROMPT)
    assert core.room_state(1) is RoomState.WAITING_FOR_INPUT
    with pytest.raises(ProtocolError, match="only after its Bootstrapped event"):
        core.send_preallocation(1, {"full": [1, 2, 3]}, pair.now, prompt_len=PROMPT)
    core.send_preallocation(555, {}, pair.now)  # unknown room: nothing to do
    with pytest.raises(ProtocolError, match="already registered"):
        core.register_request("a", 2, ADDR, 0.0)
    with pytest.raises(ProtocolError, match="already used"):
        core.register_request("z", 1, ADDR, 0.0)
    with pytest.raises(ConfigError):
        DecodeConfig(1, 0, CONTRACT, 1, "s", "h", 1, heartbeat_max_failures=0)
    with pytest.raises(ConfigError, match="cannot register with Prefill ranks"):
        DecodeCore(DecodeConfig(1, 0, CONTRACT, 0, "s", "h", 1))


def test_waiting_timeout_via_timer_and_poll(pair: CorePair) -> None:
    pair.register_decode("a", 1)
    pair.poll_decode()
    pair.preallocate(1, PROMPT)
    core = pair.decode[0]
    assert core.next_deadline() == pytest.approx(300.0)
    pair.advance(300.0)
    assert core.next_deadline() is None
    reason = "Request 1 timed out after 300.0s in TransferPoll.WaitingForInput"
    assert pair.poll_decode() == [Failed("a", reason)]
    assert [f.timeout_stage for s, _, f in pair.failures if s == "decode"] == ["waiting_for_input"]
    assert sum("TOKENSPEED_DISAGGREGATION_WAITING_TIMEOUT" in m for m in _logs(pair)) == 1
    pair.register_decode("b", 2)
    pair.poll_decode()
    pair.preallocate(2, PROMPT)
    pair.now += 301.0
    assert pair.poll_decode() == [
        Failed("b", "Request 2 timed out after 301.0s in TransferPoll.WaitingForInput")
    ]
    assert sum("TOKENSPEED_DISAGGREGATION_WAITING_TIMEOUT" in m for m in _logs(pair)) == 1


def test_waiting_deadlines_follow_forgotten_and_reused_rooms() -> None:
    # The waiting clocks live in a heap: a room that ends must stop counting, and a
    # room number used again counts from its new pre-allocation only.
    pair = CorePair([CONTRACT], [CONTRACT], waiting_timeout=100.0)
    pair.dropped_ports.add(7000)  # Prefill stays silent: only the waiting clocks act.
    core = pair.decode[0]
    for offset, room in enumerate((1, 2, 3)):
        pair.now = 10.0 * offset
        pair.register_decode(f"r{room}", room)
        pair.poll_decode()
        pair.preallocate(room, 8)
    assert core.next_deadline() == 100.0
    core.receive_status(_status(1, TransferPoll.SUCCESS, 0), pair.now)
    assert [type(e) for e in pair.poll_decode()] == [RemotePrefillDone]
    assert core.next_deadline() == 110.0
    pair.release_room(1)
    pair.now = 50.0
    pair.register_decode("again", 1)
    assert pair.poll_decode() == [Bootstrapped("again")]
    pair.preallocate(1, 8)
    assert core.next_deadline() == 110.0
    # The poll finds room 2 expired (its clock, not room 1's old one) and nothing else.
    pair.now = 111.0
    assert pair.poll_decode() == [
        Failed("r2", "Request 2 timed out after 101.0s in TransferPoll.WaitingForInput")
    ]
    assert core.next_deadline() == 120.0
    assert core.room_state(1) is RoomState.WAITING_FOR_INPUT
    # The timer path alone concludes room 3; the reused room 1 is still waiting.
    pair.advance(10.0)
    assert core.next_deadline() == 150.0
    assert pair.poll_decode() == [
        Failed("r3", "Request 3 timed out after 101.0s in TransferPoll.WaitingForInput")
    ]
    # Room 1 waits (its pages written by nobody yet: flag 0, held should it fail);
    # rooms 2 and 3 timed out with their writes possibly coming, so their pages
    # stay held (one value each after the requests' flags: 0 = hold).
    assert core.poll_values(pair.now) == [int(TransferPoll.WAITING_FOR_INPUT), 0, 0, 0]
    assert core.statistics()["waiting"] == 1
    assert core.statistics()["held_rooms"] == 2
    pair.close()


def test_no_timeout_before_the_manifest_is_sent(pair: CorePair) -> None:
    pair.register_decode("a", 1)
    pair.advance(10_000.0)
    assert pair.poll_decode() == [Bootstrapped("a")]
    assert pair.decode[0].next_deadline() is None


# --- heartbeat -------------------------------------------------------------------------


def test_heartbeat_failures_fail_unfinished_rooms_and_drop_the_address(pair: CorePair) -> None:
    core = pair.decode[0]
    pair.register_decode("a", 1)
    pair.register_decode("b", 2)
    pair.poll_decode()
    core.receive_status(_status(2, TransferPoll.SUCCESS, 0), pair.now)
    core.heartbeat(ADDR, False, pair.now)
    core.heartbeat(ADDR, True, pair.now)
    core.heartbeat(ADDR, False, pair.now)
    assert core.room_state(1) is RoomState.BOOTSTRAPPED
    core.heartbeat(ADDR, False, pair.now)
    pair.pump()
    reason = f"Losing connection with prefill instance (bootstrap_addr: {ADDR})"
    assert core.room_failure(1) == reason
    assert core.room_state(2) is RoomState.SUCCESS
    assert f"{reason}, affected 1 requests" in _logs(pair)
    assert core.bootstrap_addrs() == []
    events = pair.poll_decode()
    assert events[0] == Failed("a", reason)
    assert isinstance(events[1], RemotePrefillDone)
    # The next request re-fetches the parallel info and registers again.
    sent_before = len(pair.sent)
    pair.register_decode("c", 3)
    assert core.room_state(3) is RoomState.BOOTSTRAPPED
    assert any(wire.is_registration(list(c.frames)) for _, _, c in pair.sent[sent_before:])
    core.heartbeat("unknown:1", False, pair.now)
    assert pair.decode[0].statistics()["addresses"] == 1


def test_full_journey_leaves_no_room_state(pair: CorePair) -> None:
    prefill_events, decode_events = pair.full_journey("a", 1, PROMPT)
    assert decode_events == [Bootstrapped("a"), RemotePrefillDone("a", 7, (), 0, None)]
    assert prefill_events[-1].rid == "a"
    stats = pair.decode[0].statistics()
    assert stats["rooms"] == stats["routes"] == stats["tracker_rooms"] == 0
    assert pair.decode[0].tracked_rooms() == []
    assert not pair.decode[0].has_in_flight()


@given(
    frames=st.lists(st.binary(max_size=12), max_size=8),
    room=st.integers(0, 3),
    status=st.sampled_from(list(TransferPoll)),
    rank=st.integers(0, 3),
)
def test_any_status_frames_never_raise(
    frames: list[bytes], room: int, status: TransferPoll, rank: int
) -> None:
    core = _bare_core()
    core.register_request("a", 1, ADDR, 0.0)
    core.parallel_info(ADDR, _info(), 0.0)
    core.receive_status(frames, 0.0)
    core.receive_status(_status(room, status, rank), 0.0)
    state = core.room_state(1)
    if state is RoomState.FAILED:
        assert core.room_failure(1)
    if room != 1:
        # A status for an unknown room never creates one.
        assert core.room_state(room) is RoomState.ABSENT
