"""A Decode notices a Prefill rank that restarted behind a bootstrap server that did
not (its cached route is dead) and recovers without being restarted itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tspd.core import wire
from tspd.core.commands import Bootstrapped, Failed, Succeeded
from tspd.core.decode import DEAD_ROUTE_TIMEOUTS
from tspd.core.machines import RoomState
from tspd.testing.core_pair import CorePair
from tspd.testing.layouts import simple_contract

CONTRACT = simple_contract(num_pages=32, page_bytes=64)
PROMPT = 40
ADDR = "127.0.0.1:8998"


@pytest.fixture
def pair() -> Iterator[CorePair]:
    p = CorePair([CONTRACT], [CONTRACT], waiting_timeout=10.0)
    yield p
    p.close()


def _ok(pair: CorePair, rid: str, room: int) -> None:
    prefill_events, decode_events = pair.full_journey(rid, room, PROMPT)
    assert prefill_events[-1] == Succeeded(rid)
    assert decode_events[-1].rid == rid  # type: ignore[union-attr]
    assert not isinstance(decode_events[-1], Failed)


def test_a_heartbeat_refetches_routes_and_a_moved_rank_is_registered_again(
    pair: CorePair,
) -> None:
    _ok(pair, "a", 1)
    # A request in flight when the Prefill rank dies and comes back on a new port.
    pair.register_decode("b", 2)
    pair.register_prefill("b", 2)
    pair.poll_decode()
    pair.preallocate(2, PROMPT)
    pair.restart_prefill(0)
    decode = pair.decode[0]
    decode.heartbeat(ADDR, True, pair.now)
    pair.pump()
    # The room the dead process had taken fails at once, with the reason.
    assert decode.room_state(2) is RoomState.FAILED
    assert "restarted: its control endpoint moved from 127.0.0.1:7000 to 127.0.0.1:7100" in (
        decode.room_failure(2) or ""
    )
    assert [type(e) for e in pair.poll_decode()] == [Failed]
    # New requests reach the new process, which has the Decode's registration.
    _ok(pair, "c", 3)


def test_an_unchanged_route_is_left_alone_and_the_registration_is_refreshed(
    pair: CorePair,
) -> None:
    _ok(pair, "a", 1)
    sent = len(pair.sent)
    pair.decode[0].heartbeat(ADDR, True, pair.now)
    pair.pump()
    # Only the registration went again (no failure, no new route).
    (again,) = [c for _, _, c in pair.sent[sent:]]
    assert wire.is_registration(list(again.frames))
    assert pair.prefill[0].statistics()["registrations"] == 1
    _ok(pair, "b", 2)


def test_a_prefill_that_forgot_the_session_has_it_back_after_one_heartbeat(
    pair: CorePair,
) -> None:
    _ok(pair, "a", 1)
    prefill = pair.prefill[0]
    prefill._registrations.clear()  # as a full table would have forgotten it
    assert not prefill.is_registered(CorePair.decode_session(0))
    pair.decode[0].heartbeat(ADDR, True, pair.now)
    pair.pump()
    assert prefill.is_registered(CorePair.decode_session(0))
    _ok(pair, "b", 2)


def test_repeated_waiting_timeouts_drop_the_cached_route(pair: CorePair) -> None:
    _ok(pair, "a", 1)
    # The Prefill restarts and its bootstrap server is not asked (no heartbeat runs):
    # every pre-allocation goes to the dead port and times out.
    pair.restart_prefill(0)
    for i in range(DEAD_ROUTE_TIMEOUTS):
        room = 10 + i
        pair.register_decode(f"t{i}", room)
        pair.register_prefill(f"t{i}", room)
        assert pair.poll_decode() == [Bootstrapped(f"t{i}")]
        pair.preallocate(room, PROMPT)
        pair.advance(10.0)
        (failed,) = pair.poll_decode()
        assert isinstance(failed, Failed)
        pair.poll_prefill()
    warnings = [log.message for side, _, log in pair.logs if side == "decode"]
    assert any("dropping its cached route" in m for m in warnings)
    # The next request fetches the route again, registers with the new process and
    # succeeds.
    pair.advance(200.0)  # past the restarted Prefill's unclaimed TTL for the lost rooms
    _ok(pair, "d", 20)
