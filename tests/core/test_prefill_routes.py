"""PrefillCore and its Decode routes: a route no session needs is released
(CloseRoute, after the notices still going there), a route the shell cannot send to
fails only its sessions' rooms, and a status can always carry the candidates."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tspd.core import wire
from tspd.core.commands import CloseRoute, Failed, PrefillCommand, RoomFailed, SendFrames
from tspd.core.errors import PlanError
from tspd.core.poll import TransferPoll
from tspd.testing.core_pair import CorePair
from tspd.testing.layouts import simple_contract

CONTRACT = simple_contract(num_pages=16, page_bytes=64)
PROMPT = 40
ROUTE = ("127.0.0.1", 8000)


@pytest.fixture
def pair() -> Iterator[CorePair]:
    p = CorePair([CONTRACT], [CONTRACT])
    yield p
    p.close()


def _bootstrapped(pair: CorePair, rid: str, room: int) -> None:
    pair.register_decode(rid, room)
    pair.register_prefill(rid, room)
    pair.poll_decode()
    pair.preallocate(room, PROMPT)
    pair.poll_prefill()


def _registration(session: str, port: int, *, size: int = 1) -> list[bytes]:
    return wire.encode_registration(
        wire.Registration(
            endpoint="127.0.0.1",
            port=port,
            session_id=session,
            arena_base=0x10000,
            contract=CONTRACT,
            contract_bytes=CONTRACT.to_json(),
            decode_tp_size=size,
            decode_tp_rank=0,
        )
    )


def _kinds(commands: list[PrefillCommand]) -> list[str]:
    out = []
    for c in commands:
        if isinstance(c, SendFrames):
            out.append(f"send {c.port} {wire.decode_status(list(c.frames)).status.name}")
        elif isinstance(c, CloseRoute):
            out.append(f"close {c.port}")
        elif isinstance(c, RoomFailed):
            out.append(f"failed {c.room}")
    return out


def test_a_replaced_registration_releases_its_old_route_after_the_notices(
    pair: CorePair,
) -> None:
    _bootstrapped(pair, "a", 1)
    core = pair.prefill[0]
    session = CorePair.decode_session(0)
    core.receive_control(_registration(session, 8001), pair.now)
    assert _kinds(core.drain_commands()) == ["failed 1", "send 8000 FAILED", "close 8000"]
    # The rejected session's new route is still answered (not released).
    core.receive_control(wire.encode_preallocation(2, session, None), pair.now)
    assert "send 8001 FAILED" in _kinds(core.drain_commands())
    # Rejected again on the same route: nothing to release.
    core.receive_control(_registration(session, 8001, size=2), pair.now)
    assert not any(isinstance(c, CloseRoute) for c in core.drain_commands())


def test_a_route_another_session_still_uses_is_not_released(pair: CorePair) -> None:
    core = pair.prefill[0]
    core.receive_control(_registration("other:1", ROUTE[1]), pair.now)
    _bootstrapped(pair, "a", 1)
    core.receive_control(_registration(CorePair.decode_session(0), 8001), pair.now)
    assert not any(isinstance(c, CloseRoute) for c in core.drain_commands())


def test_a_failed_session_releases_its_route_once_after_the_notice(pair: CorePair) -> None:
    _bootstrapped(pair, "a", 1)
    _bootstrapped(pair, "b", 2)
    core = pair.prefill[0]
    session = CorePair.decode_session(0)
    core.transfer_failed(1, session, "boom", pair.now)
    assert _kinds(core.drain_commands()) == ["failed 1", "send 8000 FAILED", "close 8000"]
    # Within the failed-session TTL: the route was released already.
    core.transfer_failed(2, session, "boom again", pair.now)
    assert _kinds(core.drain_commands()) == ["failed 2", "send 8000 FAILED"]


def test_an_unreachable_route_fails_only_its_sessions_rooms(pair: CorePair) -> None:
    core = pair.prefill[0]
    core.receive_control(_registration("other:1", 9000), pair.now)
    _bootstrapped(pair, "a", 1)
    session = CorePair.decode_session(0)
    error = "cannot send to tcp://127.0.0.1:8000: Too many open files"
    core.send_failed("127.0.0.1", 8000, error, pair.now)
    commands = core.drain_commands()
    assert not any(isinstance(c, SendFrames) for c in commands)  # not to that route again
    assert core.room_failure(1) == f"Decode unreachable: {error}"
    assert not core.is_registered(session)
    assert core.is_registered("other:1")
    # Unknown route: nothing happens.
    core.send_failed("127.0.0.1", 8123, error, pair.now)
    assert core.drain_commands() == []
    # A later pre-allocation from the dropped session has nowhere to be answered.
    core.receive_control(wire.encode_preallocation(5, session, None), pair.now)
    assert not any(isinstance(c, SendFrames) for c in core.drain_commands())
    assert pair.poll_prefill() == [Failed("a", f"Decode unreachable: {error}")]


def test_hand_over_refuses_more_candidates_than_a_status_carries(pair: CorePair) -> None:
    _bootstrapped(pair, "a", 1)
    too_many = list(range(wire.MAX_SPEC_CANDIDATES + 1))
    with pytest.raises(PlanError, match="4097 speculative candidate ids, more than the 4096"):
        pair.hand_over(1, PROMPT, candidates=too_many)
    pair.hand_over(1, PROMPT, candidates=too_many[:-1])
    statuses = [wire.decode_status(list(c.frames)) for side, _, c in pair.sent if side == "prefill"]
    assert statuses[-1].status is TransferPoll.SUCCESS
    assert len(statuses[-1].spec_candidate_ids) == wire.MAX_SPEC_CANDIDATES
