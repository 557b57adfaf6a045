"""PrefillCore under hostile or churning peers: a room failed by someone else's
message is reported to its real Decode at once, and the tables a peer can fill are
bounded (docs/configuration.md, hardening)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tspd.core import wire
from tspd.core.commands import Bootstrapped, Failed
from tspd.core.machines import RoomState
from tspd.core.prefill import (
    FAILED_ROOM_MEMORY,
    MAX_REGISTRATIONS,
    MAX_UNCLAIMED_ROOMS,
    REJECTED_SESSION_MEMORY,
)
from tspd.testing.core_pair import CorePair
from tspd.testing.layouts import room_manifest, simple_contract

CONTRACT = simple_contract(num_pages=16, page_bytes=64)
PROMPT = 40
DEAD = "Failed to get kvcache from prefill instance, it might be dead"


@pytest.fixture
def pair() -> Iterator[CorePair]:
    p = CorePair([CONTRACT], [CONTRACT])
    yield p
    p.close()


def _forged_preallocation(pair: CorePair, room: int) -> None:
    """A pre-allocation from a session nobody registered (spec: it aborts the room)."""
    frames = wire.encode_preallocation(room, "203.0.113.9:1", room_manifest(CONTRACT, 3))
    pair.prefill[0].receive_control(frames, pair.now)
    pair.pump()


def test_a_room_failed_by_a_forged_message_fails_its_late_decode_at_once(
    pair: CorePair,
) -> None:
    pair.register_decode("a", 1)
    pair.register_prefill("a", 1)
    assert pair.poll_decode() == [Bootstrapped("a")]
    _forged_preallocation(pair, 1)
    (failed,) = pair.poll_prefill()
    assert isinstance(failed, Failed)
    assert pair.prefill[0].room_state(1) is RoomState.ABSENT
    # The real Decode pre-allocates after the Prefill forgot the room: it hears
    # Failed at once, not at its waiting timeout.
    pair.preallocate(1, PROMPT)
    assert pair.poll_decode() == [Failed("a", DEAD)]
    assert pair.prefill[0].room_state(1) is RoomState.ABSENT


def test_a_decode_that_had_preallocated_hears_failed_at_once(pair: CorePair) -> None:
    pair.register_decode("a", 1)
    pair.poll_decode()
    pair.preallocate(1, PROMPT)
    _forged_preallocation(pair, 1)
    assert pair.poll_decode() == [Failed("a", DEAD)]


def test_a_new_request_for_a_remembered_room_starts_afresh(pair: CorePair) -> None:
    _forged_preallocation(pair, 1)
    pair.register_prefill("x", 1)
    pair.poll_prefill()
    assert pair.prefill[0].statistics()["failed_room_memory"] == 1
    prefill_events, decode_events = pair.full_journey("a", 1, PROMPT)
    assert not any(isinstance(e, Failed) for e in [*prefill_events, *decode_events])


def test_failed_room_memory_is_bounded_in_count_and_time(pair: CorePair) -> None:
    core = pair.prefill[0]
    for room in range(FAILED_ROOM_MEMORY + 50):
        core.register_request(f"r{room}", room, pair.now)
        core.abort(room, "test", pair.now)
    core.conclude(core.poll_values(pair.now), pair.now)
    pair.pump()
    assert core.statistics()["failed_room_memory"] == FAILED_ROOM_MEMORY
    pair.advance(core.config.bootstrap_timeout + 1)
    core.handle_timeout(pair.now)
    assert core.statistics()["failed_room_memory"] == 0


def test_rejected_sessions_are_bounded(pair: CorePair) -> None:
    core = pair.prefill[0]
    for i in range(REJECTED_SESSION_MEMORY + 100):
        frames = [
            wire.REGISTRATION_MARKER,
            b"127.0.0.1",
            str(20000 + i % 40000).encode(),
            f"127.0.0.1:{i + 1}".encode(),
            b"\x01" * 8,
            b"not a contract",
            b"1",
            b"0",
        ]
        core.receive_control(frames, pair.now)
    pair.pump()
    assert core.statistics()["rejected"] == REJECTED_SESSION_MEMORY


def test_rooms_failed_by_forged_preallocations_are_bounded(pair: CorePair) -> None:
    core = pair.prefill[0]
    for room in range(MAX_UNCLAIMED_ROOMS + 10):
        frames = wire.encode_preallocation(room, "203.0.113.9:1", None)
        core.receive_control(frames, pair.now)
        core.drain_commands()
    stats = core.statistics()
    assert stats["rooms"] == MAX_UNCLAIMED_ROOMS
    assert stats["unclaimed"] == MAX_UNCLAIMED_ROOMS
    # The oldest went first; the newest is still there.
    assert core.room_state(0) is RoomState.ABSENT
    assert core.room_state(MAX_UNCLAIMED_ROOMS + 9) is RoomState.FAILED


def test_registrations_are_bounded_and_a_flood_does_not_push_out_a_working_decode(
    pair: CorePair,
) -> None:
    core = pair.prefill[0]
    pair.full_journey("a", 1, PROMPT)  # the real Decode's session is registered
    real = CorePair.decode_session(0)
    assert core.is_registered(real)
    frames = list(wire.encode_registration(_registration_like(pair)))
    for i in range(MAX_REGISTRATIONS + 20):
        frames[3] = f"127.0.0.1:{30000 + i}".encode()  # a restarted Decode's session
        core.receive_control(frames, pair.now)
        core.drain_commands()
    assert core.statistics()["registrations"] == MAX_REGISTRATIONS
    # The real Decode had rooms accepted: the made-up sessions that never did are
    # forgotten first, however recent; the real one still works.
    assert core.is_registered(real)
    prefill_events, _ = pair.full_journey("b", 2, PROMPT)
    assert not any(isinstance(e, Failed) for e in prefill_events)


def test_a_full_table_of_busy_sessions_refuses_new_ones(pair: CorePair) -> None:
    import tspd.core.prefill as prefill_module

    core = pair.prefill[0]
    pair.register_decode("a", 1)
    pair.poll_decode()
    pair.preallocate(1, PROMPT)  # the real session now has a room in flight
    frames = list(wire.encode_registration(_registration_like(pair)))
    limit = prefill_module.MAX_REGISTRATIONS
    prefill_module.MAX_REGISTRATIONS = 1
    try:
        frames[3] = b"127.0.0.1:39999"
        core.receive_control(frames, pair.now)
        refused = [c for c in core.drain_commands() if getattr(c, "message", "")]
    finally:
        prefill_module.MAX_REGISTRATIONS = limit
    assert core.is_registered(CorePair.decode_session(0))
    assert not core.is_registered("127.0.0.1:39999")
    assert any("every one with a room in flight" in c.message for c in refused)  # type: ignore[attr-defined]


def _registration_like(pair: CorePair) -> wire.Registration:
    frames = pair.decode[0]._registration_frames
    return wire.decode_registration(list(frames))
