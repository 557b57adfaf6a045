"""Secure mode in the cores (docs/security.md): a message's CURVE identity must be
the peer it speaks for. Statuses must come from the key the bootstrap route gave for
the Prefill rank they name; a session belongs to the identity that registered it. A
mismatch is a ``wrong-identity`` rejection that changes nothing."""

from __future__ import annotations

from tspd.core import wire
from tspd.core.bootstrap import ParallelInfo, RankInfo
from tspd.core.commands import Rejected, RejectReason, SendFrames
from tspd.core.decode import DecodeConfig, DecodeCore
from tspd.core.machines import RoomState
from tspd.core.poll import TransferPoll
from tspd.core.prefill import PrefillConfig, PrefillCore
from tspd.testing.layouts import room_manifest, simple_contract

CONTRACT = simple_contract(num_pages=16, page_bytes=64)
ADDR = "127.0.0.1:8998"
PREFILL_KEY = "P" * 40
DECODE_KEY = "D" * 40
ROGUE_KEY = "R" * 40


def _rejections(commands: list[object]) -> list[Rejected]:
    return [c for c in commands if isinstance(c, Rejected)]


def _waiting_decode(room: int = 7) -> DecodeCore:
    core = DecodeCore(
        DecodeConfig(
            tp_size=1,
            tp_rank=0,
            contract=CONTRACT,
            arena_base=0x10000,
            session_id="127.0.0.1:9000",
            endpoint="127.0.0.1",
            port=8000,
        )
    )
    core.register_request("r", room, ADDR, 0.0)
    core.parallel_info(ADDR, ParallelInfo(1, 1, CONTRACT.to_json().decode()), 0.0)
    core.rank_info(ADDR, 0, 0, RankInfo("127.0.0.1", 7000, PREFILL_KEY), 0.0)
    core.conclude(core.poll_values(0.0), 0.0)
    core.send_preallocation(room, room_manifest(CONTRACT, 40), 0.0)
    core.drain_commands()
    assert core.room_state(room) is RoomState.WAITING_FOR_INPUT
    return core


def _success(room: int, rank: int = 0, token: int = 5) -> list[bytes]:
    return wire.encode_status(
        wire.StatusMessage(room, TransferPoll.SUCCESS, rank, bootstrap_token=token)
    )


def test_a_status_from_another_identity_is_rejected_and_the_room_untouched() -> None:
    core = _waiting_decode()
    for sender in (ROGUE_KEY, DECODE_KEY, ""):
        core.receive_status(_success(7, token=99), 1.0, sender)
        rejected = _rejections(core.drain_commands())
        assert [r.reason for r in rejected] == [RejectReason.WRONG_IDENTITY]
        assert rejected[0].room == 7
        assert core.room_state(7) is RoomState.WAITING_FOR_INPUT
    # A Failed from a wrong identity does not fail the room either.
    failed = wire.failure_notice(7, 0)
    core.receive_status(failed, 1.0, ROGUE_KEY)
    assert len(_rejections(core.drain_commands())) == 1
    assert core.room_state(7) is RoomState.WAITING_FOR_INPUT
    # The real Prefill rank completes it.
    core.receive_status(_success(7), 2.0, PREFILL_KEY)
    assert not _rejections(core.drain_commands())
    assert core.room_state(7) is RoomState.SUCCESS


def test_a_status_naming_a_rank_outside_the_route_is_rejected_in_secure_mode() -> None:
    core = _waiting_decode()
    core.receive_status(_success(7, rank=3), 1.0, PREFILL_KEY)
    assert [r.reason for r in _rejections(core.drain_commands())] == [RejectReason.WRONG_IDENTITY]
    assert core.room_state(7) is RoomState.WAITING_FOR_INPUT


def test_plain_mode_checks_no_identity() -> None:
    core = _waiting_decode()
    core.receive_status(_success(7), 1.0)  # no sender: plain mode, as before
    assert core.room_state(7) is RoomState.SUCCESS


def _registration(session: str, port: int = 8000) -> list[bytes]:
    return wire.encode_registration(
        wire.Registration(
            endpoint="127.0.0.1",
            port=port,
            session_id=session,
            arena_base=0x10000,
            contract=CONTRACT,
            contract_bytes=CONTRACT.to_json(),
            decode_tp_size=1,
            decode_tp_rank=0,
        )
    )


def _prefill() -> PrefillCore:
    return PrefillCore(PrefillConfig(tp_size=1, tp_rank=0, contract=CONTRACT, arena_base=0x1000))


def test_a_session_belongs_to_the_identity_that_registered_it() -> None:
    core = _prefill()
    core.receive_control(_registration("s1"), 0.0, DECODE_KEY)
    core.drain_commands()
    assert core.is_registered("s1")
    assert core.route_identity("127.0.0.1", 8000) == DECODE_KEY
    # Another identity cannot re-register the session (with a conflicting body that
    # would reject it and fail its rooms), nor claim its status endpoint.
    core.receive_control(_registration("s1", port=9999), 0.0, ROGUE_KEY)
    core.receive_control(_registration("s2", port=8000), 0.0, ROGUE_KEY)
    assert [r.reason for r in _rejections(core.drain_commands())] == [
        RejectReason.WRONG_IDENTITY,
        RejectReason.WRONG_IDENTITY,
    ]
    assert core.is_registered("s1")
    assert not core.is_registered("s2")
    assert core.route_identity("127.0.0.1", 8000) == DECODE_KEY
    # Its pre-allocations come only from its identity.
    frames = wire.encode_preallocation(3, "s1", room_manifest(CONTRACT, 40))
    core.receive_control(frames, 0.0, ROGUE_KEY)
    assert [r.reason for r in _rejections(core.drain_commands())] == [RejectReason.WRONG_IDENTITY]
    assert core.room_state(3) is RoomState.ABSENT
    core.receive_control(frames, 0.0, DECODE_KEY)
    assert not _rejections(core.drain_commands())
    assert core.room_state(3) is not RoomState.ABSENT


def test_a_preallocation_for_an_unregistered_session_touches_no_room_in_secure_mode() -> None:
    core = _prefill()
    core.register_request("r", 4, 0.0)
    core.receive_control(wire.encode_preallocation(4, "nobody", None), 0.0, ROGUE_KEY)
    commands = core.drain_commands()
    assert [r.reason for r in _rejections(commands)] == [RejectReason.WRONG_IDENTITY]
    assert not [c for c in commands if isinstance(c, SendFrames)]
    assert core.room_state(4) is RoomState.BOOTSTRAPPING
