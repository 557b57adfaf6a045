"""PrefillCore: the Prefill rank's room lifecycle and every failure path of
docs/protocol.md#proto-failures, driven with a Decode core through CorePair in virtual
time."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tspd.core import wire
from tspd.core.commands import (
    Bootstrapped,
    Failed,
    LogLevel,
    RemotePrefillDone,
    SendFrames,
    StartTransfer,
    Succeeded,
)
from tspd.core.errors import ConfigError, PlanError, ProtocolError
from tspd.core.machines import RoomState
from tspd.core.poll import TransferPoll
from tspd.core.prefill import (
    MAX_FAILED_SESSIONS,
    ExtendRow,
    PrefillConfig,
    PrefillCore,
    epd_abort_reason,
)
from tspd.core.schedule import ProducerSchedule
from tspd.testing.core_pair import CorePair
from tspd.testing.layouts import multi_layer_contract, room_manifest, simple_contract

CONTRACT = simple_contract(num_pages=16, page_bytes=64)
PROMPT = 40  # three 16-token pages
DECODE_ROUTE = "127.0.0.1:8000"
DEAD = "Failed to get kvcache from prefill instance, it might be dead"


@pytest.fixture
def pair() -> Iterator[CorePair]:
    p = CorePair([CONTRACT], [CONTRACT])
    yield p
    p.close()


def _bootstrapped(pair: CorePair, rid: str, room: int, prompt: int = PROMPT) -> None:
    pair.register_decode(rid, room)
    pair.register_prefill(rid, room)
    assert pair.poll_decode() == [Bootstrapped(rid)]
    pair.preallocate(room, prompt)
    assert pair.poll_prefill() == [Bootstrapped(rid)]


def _logs(pair: CorePair, side: str = "prefill") -> list[str]:
    return [log.message for s, _, log in pair.logs if s == side]


def _statuses_to_decode(pair: CorePair) -> list[wire.StatusMessage]:
    return [
        wire.decode_status(list(cmd.frames))
        for side, _, cmd in pair.sent
        if side == "prefill" and cmd.port >= 8000
    ]


# --- success


def test_full_transfer_end_to_end_bytes_and_empty_tables(pair: CorePair) -> None:
    prefill_events, decode_events = pair.full_journey("r1", 1000000, PROMPT, token=11)
    assert prefill_events == [Bootstrapped("r1"), Succeeded("r1")]
    assert decode_events == [
        Bootstrapped("r1"),
        RemotePrefillDone("r1", 11, (), 0, None),
    ]
    assert pair.verify(1000000) == []
    assert pair.bytes_written == 3 * 64
    assert pair.room_tables_empty()
    # The three contiguous pages went out as one coalesced copy.
    (rank, start), *_ = pair.transfers
    assert rank == 0
    assert len(start.intervals[0].writes[0].plan) == 1


@pytest.mark.parametrize(
    ("prefill_tp", "decode_tp", "prefill_heads", "decode_heads", "global_heads"),
    [
        pytest.param(2, 1, 2, 4, 4, id="tp2-to-tp1"),
        pytest.param(1, 2, 4, 2, 4, id="tp1-to-tp2"),
        pytest.param(4, 1, 1, 2, 2, id="tp4-to-tp1-with-dummies"),
        pytest.param(2, 3, 3, 2, 6, id="tp2-to-tp3"),
    ],
)
def test_heterogeneous_tp_moves_every_shard(
    prefill_tp: int, decode_tp: int, prefill_heads: int, decode_heads: int, global_heads: int
) -> None:
    def contracts(tp: int, heads: int) -> list:  # type: ignore[type-arg]
        return [
            multi_layer_contract(
                layers=2,
                num_pages=8,
                heads=heads,
                head_dim=4,
                tp_size=tp,
                global_heads=global_heads,
                with_state_group=True,
            )
            for _ in range(tp)
        ]

    pair = CorePair(contracts(prefill_tp, prefill_heads), contracts(decode_tp, decode_heads))
    try:
        prefill_events, decode_events = pair.full_journey("r", 5, prompt_len=10, token=3)
        assert prefill_events == [Bootstrapped("r"), Succeeded("r")]
        assert decode_events[-1] == RemotePrefillDone("r", 3, (), 0, None)
        assert pair.verify(5) == []
        assert pair.bytes_written > 0
        assert pair.room_tables_empty()
        dummies = [
            msg for _, _, log in pair.logs for msg in [log.message] if "rendezvous-only" in msg
        ]
        assert bool(dummies) == (prefill_tp == 4)
    finally:
        pair.close()


def test_success_is_sent_before_success_is_set_and_carries_usage(pair: CorePair) -> None:
    _bootstrapped(pair, "r", 9)
    core = pair.prefill[0]
    core.record_usage(9, 24, -0.25)
    pair.prefill_tables(9, PROMPT)
    core.hand_over(9, pair.tables_of(9, 0), 42, (1, 2, 3), pair.now)
    commands = core.drain_commands()
    assert [type(c) for c in commands] == [StartTransfer]
    assert core.room_state(9) is RoomState.BOOTSTRAPPED
    core.transfer_succeeded(9, pair.now)
    sent = core.drain_commands()
    assert isinstance(sent[0], SendFrames)
    assert core.room_state(9) is RoomState.SUCCESS
    message = wire.decode_status(list(sent[0].frames))
    assert message == wire.StatusMessage(9, TransferPoll.SUCCESS, 0, 42, (1, 2, 3), 24, -0.25)
    # Failed always wins, even over Success; the dropped destinations hear nothing more.
    core.abort(9, "late", pair.now)
    assert core.room_state(9) is RoomState.FAILED
    assert not any(isinstance(c, SendFrames) for c in core.drain_commands())


def test_dummy_only_room_succeeds_at_hand_over_without_messages() -> None:
    p = [
        multi_layer_contract(layers=1, num_pages=8, heads=1, head_dim=4, tp_size=4, global_heads=2)
        for _ in range(4)
    ]
    d = [multi_layer_contract(layers=1, num_pages=8, heads=2, head_dim=4, tp_size=1)]
    pair = CorePair(p, d)
    try:
        _bootstrapped(pair, "r", 3, 10)
        pair.hand_over(3, 10)
        dummy_sends = [c for side, rank, c in pair.sent if side == "prefill" and rank in (1, 3)]
        assert dummy_sends == []
        assert [t for t in pair.transfers if t[0] in (1, 3)] == []
        assert pair.prefill[1].room_state(3) is RoomState.SUCCESS
        assert pair.poll_prefill() == [Succeeded("r")]
    finally:
        pair.close()


# --- abort (docs/protocol.md#proto-failure-epd-abort)


def test_epd_abort_before_register_answers_preallocation_and_fails_both_sides(
    pair: CorePair,
) -> None:
    reason = epd_abort_reason("r")
    pair.prefill[0].abort(4, reason, pair.now)
    pair.pump()
    assert pair.failures[0][2].reason == reason
    pair.register_decode("r", 4)
    pair.poll_decode()
    pair.preallocate(4, PROMPT)
    # The pre-allocation of a failed room is answered with a Failed notice at once.
    notices = _statuses_to_decode(pair)
    assert [(m.room, m.status) for m in notices] == [(4, TransferPoll.FAILED)]
    assert pair.decode[0].room_failure(4) == DEAD
    pair.register_prefill("r", 4)
    assert pair.poll_prefill() == [Failed("r", reason)]
    assert pair.poll_decode() == [Failed("r", DEAD)]
    assert pair.room_tables_empty()


def test_abort_notifies_every_destination_that_preallocated(pair: CorePair) -> None:
    _bootstrapped(pair, "r", 8)
    pair.prefill[0].abort(8, "operator gave up", pair.now)
    pair.pump()
    assert pair.decode[0].room_state(8) is RoomState.FAILED
    assert pair.poll_prefill() == [Failed("r", "operator gave up")]
    assert pair.poll_decode() == [Failed("r", DEAD)]
    assert pair.room_tables_empty()


def test_aborted_untracked_room_is_dropped_after_the_unclaimed_ttl(pair: CorePair) -> None:
    core = pair.prefill[0]
    core.abort(12, "gone", pair.now)
    pair.pump()
    assert core.next_deadline() == pytest.approx(120.0)
    pair.advance(119.0)
    assert core.room_state(12) is RoomState.FAILED
    pair.advance(1.0)
    assert core.room_state(12) is RoomState.ABSENT
    assert "dropping rooms no request on this rank claimed" in _logs(pair)[-1]
    # A Failed room had told its destinations already: no second notice.
    assert _statuses_to_decode(pair) == []
    assert pair.room_tables_empty()


# --- transfer failure (docs/protocol.md#proto-failure-decode-death)


def test_write_failure_fails_both_sides_and_fast_fails_the_session(pair: CorePair) -> None:
    pair.write_errors[CorePair.decode_session(0)] = "connection reset"
    _bootstrapped(pair, "a", 1)
    pair.hand_over(1, PROMPT)
    expected = (
        f"CachePD transfer failed: Mooncake transfer failed for {DECODE_ROUTE}: connection reset"
    )
    assert pair.poll_prefill() == [Failed("a", expected)]
    assert pair.poll_decode() == [Failed("a", DEAD)]
    core = pair.prefill[0]
    assert not core.session_alive(CorePair.decode_session(0), pair.now)
    # The next room to that session fails fast, without a write.
    del pair.write_errors[CorePair.decode_session(0)]
    _bootstrapped(pair, "b", 2)
    written = pair.bytes_written
    pair.hand_over(2, PROMPT)
    fast = f"CachePD transfer failed: Decode session {CorePair.decode_session(0)} is not alive"
    assert pair.poll_prefill() == [Failed("b", fast)]
    assert pair.bytes_written == written
    pair.poll_decode()
    # After the TTL the session works again.
    pair.advance(30.0)
    assert core.statistics()["failed_sessions"] == 0
    prefill_events, _ = pair.full_journey("c", 3, PROMPT)
    assert prefill_events[-1] == Succeeded("c")
    assert pair.room_tables_empty()


def test_identical_reregistration_clears_the_failed_session_mark(pair: CorePair) -> None:
    core = pair.prefill[0]
    _bootstrapped(pair, "a", 1)
    core.transfer_failed(1, CorePair.decode_session(0), "boom", pair.now)
    assert not core.session_alive(CorePair.decode_session(0), pair.now)
    registrations = [
        c.frames
        for side, _, c in pair.sent
        if side == "decode" and wire.is_registration(list(c.frames))
    ]
    core.receive_control(registrations[0], pair.now)
    assert core.session_alive(CorePair.decode_session(0), pair.now)
    assert core.is_registered(CorePair.decode_session(0))


def test_first_failure_wins_and_later_worker_errors_are_ignored(pair: CorePair) -> None:
    _bootstrapped(pair, "a", 1)
    core = pair.prefill[0]
    core.abort(1, "first", pair.now)
    core.transfer_failed(1, None, "second", pair.now)
    assert core.room_failure(1) == "first"
    failures = [f for f in core.drain_commands() if type(f).__name__ == "RoomFailed"]
    assert len(failures) == 1


def test_other_rooms_are_unaffected_by_one_rooms_failure(pair: CorePair) -> None:
    _bootstrapped(pair, "a", 1)
    _bootstrapped(pair, "b", 2)
    pair.prefill[0].abort(1, "only this one", pair.now)
    pair.pump()
    pair.hand_over(2, PROMPT)
    assert pair.poll_prefill() == [Failed("a", "only this one"), Succeeded("b")]
    assert pair.verify(2) == []
    assert [type(e) for e in pair.poll_decode()] == [Failed, RemotePrefillDone]
    assert pair.room_tables_empty()


def test_no_page_is_written_after_the_room_ended(pair: CorePair) -> None:
    pair.auto_transfer = False
    _bootstrapped(pair, "a", 1)
    pair.hand_over(1, PROMPT)
    pair.prefill[0].abort(1, "ended", pair.now)
    pair.run_transfers()
    assert pair.bytes_written == 0
    assert pair.poll_prefill() == [Failed("a", "ended")]


# --- registration (docs/protocol.md#proto-registration-handling)


def _registration(session: str, *, port: int = 8000, rank: int = 0, size: int = 1) -> list[bytes]:
    return wire.encode_registration(
        wire.Registration(
            endpoint="127.0.0.1",
            port=port,
            session_id=session,
            arena_base=0x10000,
            contract=CONTRACT,
            contract_bytes=CONTRACT.to_json(),
            decode_tp_size=size,
            decode_tp_rank=rank,
        )
    )


def test_conflicting_registration_rejects_the_session_and_its_rooms(pair: CorePair) -> None:
    _bootstrapped(pair, "a", 1)
    core = pair.prefill[0]
    session = CorePair.decode_session(0)
    core.receive_control(_registration(session, port=8000), pair.now)
    pair.pump()
    conflict = "conflicting registration for an active CachePD session"
    assert pair.poll_prefill() == [
        Failed("a", f"Decode session {session} registration rejected: {conflict}")
    ]
    assert not core.is_registered(session)
    assert pair.decode[0].room_failure(1) == DEAD
    # Later pre-allocations from the rejected session are answered via its route.
    core.receive_control(wire.encode_preallocation(2, session, None), pair.now)
    notices = core.drain_commands()
    assert any(isinstance(c, SendFrames) and c.port == 8000 for c in notices)
    assert core.room_failure(2) == (
        "invalid pre-allocation metadata: CachePD request references an unregistered Decode session"
    )
    assert pair.poll_decode() == [Failed("a", DEAD)]
    pair.advance(120.0)
    assert pair.room_tables_empty()


def test_malformed_registration_is_rejected_by_route_or_dropped(pair: CorePair) -> None:
    core = pair.prefill[0]
    bad = _registration("10.0.0.1:1")
    bad[4] = b"\x00" * 8
    core.receive_control(bad, pair.now)
    pair.pump()
    assert "CachePD slab pointer must be nonzero" in _logs(pair)[-1]
    assert core.statistics()["rejected"] == 1
    core.receive_control([b"None", b"x"], pair.now)
    pair.pump()
    assert _logs(pair)[-1].startswith("Rejecting malformed CachePD Decode registration")
    core.receive_control([b"\xff"], pair.now)
    core.receive_control([], pair.now)
    pair.pump()
    assert _logs(pair)[-2:] == ["Rejecting malformed Mooncake bootstrap message header"] * 2


def test_registration_for_the_wrong_prefill_rank_is_rejected(pair: CorePair) -> None:
    core = pair.prefill[0]
    # Decode TP2 rank 1 on an equal... Prefill TP1: rank 0 serves both; a TP1 Decode
    # of an incompatible contract is a planning error, rejected with its message.
    other = simple_contract(num_pages=16, page_bytes=128)
    frames = wire.encode_registration(
        wire.Registration("127.0.0.1", 8000, "s:1", 0x1000, other, other.to_json(), 1, 0)
    )
    core.receive_control(frames, pair.now)
    pair.pump()
    assert core.statistics()["rejected"] == 1
    assert "rejecting CachePD Decode registration of session s:1" in _logs(pair)[-1]


def test_inconsistent_fanout_aborts_the_room() -> None:
    c2 = [multi_layer_contract(layers=1, num_pages=8, heads=2, head_dim=4, tp_size=2)]
    p = [multi_layer_contract(layers=1, num_pages=8, heads=4, head_dim=4, tp_size=1)]
    core = PrefillCore(PrefillConfig(tp_size=1, tp_rank=0, contract=p[0], arena_base=0x1000))
    # Two sessions both claim Decode rank 0 of TP 2: the set {0, 0} is not {0, 1}.
    for session, port in (("a:1", 8000), ("b:2", 8001)):
        core.receive_control(
            wire.encode_registration(
                wire.Registration("h", port, session, 0x9000, c2[0], c2[0].to_json(), 2, 0)
            ),
            0.0,
        )
    manifest = room_manifest(c2[0], prompt_len=8)
    core.receive_control(wire.encode_preallocation(5, "a:1", manifest), 0.0)
    core.receive_control(wire.encode_preallocation(5, "b:2", manifest), 0.0)
    assert core.room_failure(5) == (
        "invalid pre-allocation metadata: Cache-transfer room destination ranks disagree "
        "with the typed route plan"
    )
    sent = [c for c in core.drain_commands() if isinstance(c, SendFrames)]
    # The first destination (committed) and the offender both hear Failed.
    assert sorted(c.port for c in sent) == [8000, 8001]


# --- pre-allocation (docs/protocol.md#proto-preallocation-checks)


def test_invalid_manifest_aborts_and_notifies(pair: CorePair) -> None:
    pair.register_decode("r", 6)
    pair.register_prefill("r", 6)
    core = pair.prefill[0]
    core.receive_control([b"6", CorePair.decode_session(0).encode(), b"{not json"], pair.now)
    pair.pump()
    reason = core.room_failure(6)
    assert reason is not None
    assert reason.startswith("invalid pre-allocation metadata: ")
    assert pair.decode[0].room_failure(6) == DEAD
    assert pair.poll_prefill() == [Failed("r", reason)]
    assert pair.poll_decode() == [Failed("r", DEAD)]
    assert pair.room_tables_empty()


def test_preallocation_for_a_failed_room_is_a_plain_notice_even_if_malformed(
    pair: CorePair,
) -> None:
    pair.register_decode("r", 6)
    core = pair.prefill[0]
    core.abort(6, "first", pair.now)
    pair.pump()
    core.receive_control([b"6", CorePair.decode_session(0).encode(), b"garbage"], pair.now)
    pair.pump()
    assert core.room_failure(6) == "first"
    assert [m.status for m in _statuses_to_decode(pair)] == [TransferPoll.FAILED]


def test_duplicate_and_wrong_kind_preallocations(pair: CorePair) -> None:
    _bootstrapped(pair, "r", 6)
    core = pair.prefill[0]
    session = CorePair.decode_session(0)
    manifest = room_manifest(CONTRACT, PROMPT)
    core.receive_control(wire.encode_preallocation(6, session, manifest), pair.now)
    assert core.room_failure(6) == (
        "invalid pre-allocation metadata: duplicate CachePD pre-allocation for Decode session"
    )
    core.receive_control(wire.encode_preallocation(7, session, None), pair.now)
    assert core.room_failure(7) == (
        "invalid pre-allocation metadata: CachePD request kind disagrees with its registration"
    )


def test_unregistered_session_cannot_be_notified(pair: CorePair) -> None:
    core = pair.prefill[0]
    core.receive_control(wire.encode_preallocation(3, "ghost:1", None), pair.now)
    pair.pump()
    assert "cannot notify a malformed Decode peer" in _logs(pair)[-1]
    assert core.room_state(3) is RoomState.FAILED
    core.receive_control([b"01", b"s", b""], pair.now)
    pair.pump()
    assert "rejecting a malformed CachePD pre-allocation" in _logs(pair)[-1]


# --- timeouts, sweep


def test_bootstrap_timeout_fails_with_reason_and_warns_once(pair: CorePair) -> None:
    pair.register_decode("a", 1)
    pair.register_decode("b", 2)
    pair.register_prefill("a", 1)
    pair.register_prefill("b", 2)
    pair.now = 120.0
    events = pair.poll_prefill()
    assert events == [
        Failed("a", "Request 1 timed out after 120.0s in TransferPoll.Bootstrapping"),
        Failed("b", "Request 2 timed out after 120.0s in TransferPoll.Bootstrapping"),
    ]
    warnings = [m for m in _logs(pair) if "TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT" in m]
    assert len(warnings) == 1
    assert {f.timeout_stage for _, _, f in pair.failures} == {"bootstrapping"}
    assert pair.prefill[0].statistics()["rooms"] == 0
    # Decode has no timeout before its manifest; when it pre-allocates late, the
    # room is unclaimed on Prefill and Decode hears Failed after the TTL.
    assert pair.poll_decode() == [Bootstrapped("a"), Bootstrapped("b")]
    pair.preallocate(1, PROMPT)
    pair.preallocate(2, PROMPT)
    pair.advance(120.0)
    assert pair.poll_decode() == [Failed("a", DEAD), Failed("b", DEAD)]
    assert pair.room_tables_empty()


def test_bootstrap_timeout_tells_the_destinations_that_did_preallocate() -> None:
    p = [multi_layer_contract(layers=1, num_pages=8, heads=4, head_dim=4, tp_size=1)]
    d = [multi_layer_contract(layers=1, num_pages=8, heads=2, head_dim=4, tp_size=2)] * 2
    pair = CorePair(p, d)
    try:
        pair.register_decode("a", 1)
        pair.register_prefill("a", 1)
        pair.poll_decode()
        # Only Decode rank 0 pre-allocates; rank 1 died before it could.
        pair.decode[0].send_preallocation(1, room_manifest(d[0], 8), pair.now)
        pair.pump()
        assert pair.prefill[0].room_state(1) is RoomState.BOOTSTRAPPING
        pair.now = 120.0
        reason = "Request 1 timed out after 120.0s in TransferPoll.Bootstrapping"
        assert pair.poll_prefill() == [Failed("a", reason)]
        assert pair.decode[0].room_failure(1) == DEAD
        assert pair.decode[1].room_state(1) is RoomState.BOOTSTRAPPED
        assert pair.prefill[0].statistics()["rooms"] == 0
    finally:
        pair.close()


def test_stall_warning_lists_old_bootstrapping_requests_every_ten_seconds(
    pair: CorePair,
) -> None:
    pair.register_prefill("a", 1)
    pair.now = 10.0
    pair.poll_prefill()
    assert "a(room=1, age=10s)" in _logs(pair)[-1]
    count = len(_logs(pair))
    pair.now = 15.0
    pair.poll_prefill()
    assert len(_logs(pair)) == count
    pair.now = 20.0
    pair.poll_prefill()
    assert "a(room=1, age=20s)" in _logs(pair)[-1]


def test_unclaimed_preallocation_is_dropped_and_its_decode_told(pair: CorePair) -> None:
    pair.register_decode("r", 6)
    pair.poll_decode()
    pair.preallocate(6, PROMPT)
    core = pair.prefill[0]
    assert core.statistics()["unclaimed"] == 1
    pair.advance(120.0)
    assert core.room_state(6) is RoomState.ABSENT
    assert pair.decode[0].room_failure(6) == DEAD
    assert pair.poll_decode() == [Failed("r", DEAD)]
    assert pair.room_tables_empty()


def test_unclaimed_deadlines_follow_claims_drops_and_failed_sessions(pair: CorePair) -> None:
    # Unclaimed clocks live in a heap: a claimed or dropped room stops counting and a
    # room left unclaimed again counts from then; failed sessions join the minimum.
    core = pair.prefill[0]
    core.abort(7, "x", 0.0)
    core.abort(8, "x", 5.0)
    assert core.next_deadline() == 120.0
    pair.now = 10.0
    pair.register_prefill("a", 7)
    assert core.next_deadline() == 125.0
    assert [type(e) for e in pair.poll_prefill()] == [Failed]
    core.abort(7, "again", 20.0)
    assert core.next_deadline() == 125.0
    core.transfer_failed(9, CorePair.decode_session(0), "refused", 30.0)
    assert core.next_deadline() == 60.0  # the failed session's 30 s TTL comes first
    pair.pump()
    pair.now = 60.0
    pair.run_timers()
    assert core.next_deadline() == 125.0
    pair.now = 125.0
    pair.run_timers()
    assert core.room_state(8) is RoomState.ABSENT
    assert core.room_state(7) is RoomState.FAILED
    assert core.next_deadline() == 140.0
    assert core.statistics()["unclaimed"] == 1


def test_a_session_that_fails_again_expires_from_its_last_failure(pair: CorePair) -> None:
    # The failed sessions are kept in the order they (last) failed, so the next
    # deadline is read off the first of them (O(1); the shell reads it per call).
    core = pair.prefill[0]
    core.transfer_failed(9, "127.0.0.1:7001", "refused", 30.0)
    core.transfer_failed(9, "127.0.0.1:7002", "refused", 40.0)
    assert core.next_deadline() == 60.0
    core.transfer_failed(9, "127.0.0.1:7001", "refused again", 50.0)
    assert core.next_deadline() == 70.0  # 7002's TTL now ends first
    pair.now = 70.0
    pair.run_timers()
    assert core.statistics()["failed_sessions"] == 1
    assert core.next_deadline() == 80.0
    assert not core.session_alive("127.0.0.1:7001", 79.0)
    assert core.session_alive("127.0.0.1:7001", 80.0)


def test_tracked_rooms_never_expire(pair: CorePair) -> None:
    _bootstrapped(pair, "r", 6)
    pair.prefill[0].abort(7, "x", pair.now)
    assert pair.prefill[0].rooms_by_state() == {"Bootstrapped": 1, "Failed": 1}
    assert pair.decode[0].rooms_by_state() == {"WaitingForInput": 1}
    pair.advance(1000.0)
    assert pair.prefill[0].room_state(6) is RoomState.BOOTSTRAPPED
    assert pair.prefill[0].next_deadline() is None


# --- release, API


def test_release_is_refused_while_requests_are_tracked(pair: CorePair) -> None:
    core = pair.prefill[0]
    core.check_release()
    pair.register_prefill("b", 20)
    pair.register_prefill("a", 3)
    core.abort(99, "unclaimed rooms do not block", pair.now)
    with pytest.raises(
        ProtocolError,
        match=r"^cannot release the cache while KV sends are in flight: rooms \[3, 20\]$",
    ):
        core.check_release()
    assert core.tracked_rooms() == [3, 20]


def test_caller_errors_raise(pair: CorePair) -> None:
    core = pair.prefill[0]
    core.register_request("r", 1, 0.0)
    with pytest.raises(ProtocolError, match="already registered"):
        core.register_request("r", 2, 0.0)
    with pytest.raises(ProtocolError, match="outside"):
        core.register_request("x", -1, 0.0)
    with pytest.raises(PlanError, match="Cache-transfer bootstrap token is unavailable"):
        core.hand_over(1, {}, -1, (), 0.0)
    with pytest.raises(PlanError, match="must be int32 token ids"):
        core.hand_over(1, {}, 1, (2**31,), 0.0)
    with pytest.raises(PlanError, match="token is unavailable"):
        core.hand_over(1, {}, 2**63, (), 0.0)
    with pytest.raises(ProtocolError, match="destination metadata is unavailable"):
        core.hand_over(1, {}, 1, (), 0.0)
    with pytest.raises(ProtocolError, match="2 values for 1 tracked"):
        core.conclude([1, 1], 0.0)
    with pytest.raises(ConfigError):
        PrefillConfig(tp_size=1, tp_rank=1, contract=CONTRACT, arena_base=1)


# --- layerwise


def test_layerwise_streams_intervals_and_reports_once_the_token_arrives() -> None:
    contracts = [multi_layer_contract(layers=3, num_pages=8, heads=2, head_dim=4)]
    schedule = ProducerSchedule.from_contract(contracts[0], 3)
    pair = CorePair(contracts, contracts, layerwise=schedule, layerwise_interval=2)
    try:
        _bootstrapped(pair, "r", 5, 12)
        pair.prefill_tables(5, 12)
        core = pair.prefill[0]
        begin = core.arm_layerwise([ExtendRow("r", 0, 12, pair.tables_of(5, 0))], pair.now)
        assert begin == 0
        pair.pump()
        (_, start) = pair.transfers[-1]
        assert [i.target_step for i in start.intervals] == [1, 2]
        assert start.final
        assert pair.bytes_written == 0
        pair.produce(2)
        first = pair.bytes_written
        assert first > 0
        pair.produce(1)
        assert pair.bytes_written > first
        # Written, but the token has not arrived: no Success yet.
        assert core.room_state(5) is RoomState.BOOTSTRAPPED
        assert core.statistics()["awaiting_token"] == 1
        core.hand_over(5, pair.tables_of(5, 0), 9, (4,), pair.now)
        pair.pump()
        assert pair.poll_prefill() == [Succeeded("r")]
        assert pair.poll_decode()[-1] == RemotePrefillDone("r", 9, (4,), 0, None)
        assert pair.verify(5) == []
        assert pair.room_tables_empty()
    finally:
        pair.close()


def test_layerwise_wait_fails_when_a_destination_session_fails() -> None:
    contracts = [multi_layer_contract(layers=2, num_pages=8, heads=2, head_dim=4)]
    schedule = ProducerSchedule.from_contract(contracts[0], 2)
    pair = CorePair(contracts, contracts, layerwise=schedule)
    try:
        _bootstrapped(pair, "a", 5, 12)
        _bootstrapped(pair, "b", 6, 12)
        pair.prefill_tables(5, 12)
        core = pair.prefill[0]
        core.arm_layerwise([ExtendRow("a", 0, 12, pair.tables_of(5, 0))], pair.now)
        pair.pump()
        core.transfer_failed(6, CorePair.decode_session(0), "peer reset", pair.now)
        pair.produce(2)
        assert core.room_failure(5) == (
            "CachePD transfer failed: Cache-transfer layerwise peer failed for room 5"
        )
        assert pair.bytes_written == 0
    finally:
        pair.close()


def test_arm_layerwise_refuses_the_whole_forward_on_a_bad_row() -> None:
    contracts = [multi_layer_contract(layers=2, num_pages=8, heads=2, head_dim=4)]
    schedule = ProducerSchedule.from_contract(contracts[0], 2)
    pair = CorePair(contracts, contracts, layerwise=schedule)
    try:
        _bootstrapped(pair, "r", 5, 12)
        pair.prefill_tables(5, 12)
        core = pair.prefill[0]
        bad = {gid: [0] * 8 for gid in contracts[0].group_ids}
        with pytest.raises(Exception, match="invalid block ID"):
            core.arm_layerwise([ExtendRow("r", 0, 12, bad)], pair.now)
        assert core.drain_commands() == []
        # Untracked rows are skipped; the forward still reserves its steps.
        assert core.arm_layerwise([ExtendRow("zzz", 0, 12, bad)], pair.now) == 0
        assert core.arm_layerwise([ExtendRow("zzz", 0, 12, bad)], pair.now) == 2
    finally:
        pair.close()


def test_late_token_for_an_ended_room_is_dropped(pair: CorePair) -> None:
    core = pair.prefill[0]
    core.hand_over(77, {}, 5, (), pair.now)
    logs = core.drain_commands()
    assert len(logs) == 1
    assert logs[0].level is LogLevel.DEBUG  # type: ignore[union-attr]
    assert "Dropping late prefill metadata for expired bootstrap_room=77" in logs[0].message  # type: ignore[union-attr]


def test_late_token_for_an_ended_layerwise_room_warns() -> None:
    contracts = [multi_layer_contract(layers=1, num_pages=8, heads=2, head_dim=4)]
    schedule = ProducerSchedule.from_contract(contracts[0], 1)
    pair = CorePair(contracts, contracts, layerwise=schedule)
    try:
        core = pair.prefill[0]
        core.hand_over(77, {}, 5, (), pair.now)
        (log,) = core.drain_commands()
        assert log.level is LogLevel.WARNING  # type: ignore[union-attr]
        assert log.message == "Dropping late prefill metadata for expired bootstrap_room=77"  # type: ignore[union-attr]
    finally:
        pair.close()


def test_failed_sessions_are_bounded_oldest_mark_dropped_first(pair: CorePair) -> None:
    # A TTL's worth of Decode churn must not grow the fast-fail table without bound.
    core = pair.prefill[0]
    sessions = [f"127.0.0.1:{10_000 + i}" for i in range(MAX_FAILED_SESSIONS + 3)]
    for i, session in enumerate(sessions):
        core.transfer_failed(9, session, "refused", 30.0 + i * 1e-6)
    assert core.statistics()["failed_sessions"] == MAX_FAILED_SESSIONS
    now = 30.0 + len(sessions) * 1e-6
    assert all(core.session_alive(s, now) for s in sessions[:3])  # the oldest marks
    assert not any(core.session_alive(s, now) for s in sessions[3:])
    pair.pump()
    assert any("are marked failed: forgetting the oldest mark" in m for m in _logs(pair))
    # The first remaining mark still sets the next deadline.
    assert core.next_deadline() == pytest.approx(30.0 + 3e-6 + core.config.failed_session_ttl)
