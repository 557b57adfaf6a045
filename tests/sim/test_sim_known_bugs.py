"""Core bugs the simulator found, each reproduced on the cores alone: a regression
test once fixed, a strict ``xfail`` while open.

:data:`KNOWN_CORE_BUGS` holds the violation signatures the CI sweep
(``test_sim_sweep.py``) tolerates and reports instead of failing on, for a bug
found and not fixed yet (with a strict ``xfail`` test here): today none. The last
one, a sleep's release accepted while a failed room's write was still in flight,
is fixed (``check_release`` also waits for the chunks with the workers).
"""

from __future__ import annotations

from tspd.core import wire
from tspd.core.bootstrap import ParallelInfo, RankInfo
from tspd.core.commands import (
    Bootstrapped,
    Failed,
    FetchParallelInfo,
    FetchRankInfo,
    SendFrames,
    StartTransfer,
)
from tspd.core.decode import DEAD_ROUTE_TIMEOUTS, DecodeConfig, DecodeCore
from tspd.core.errors import ProtocolError
from tspd.core.manifest import build_manifest
from tspd.core.poll import TransferPoll
from tspd.core.prefill import PrefillConfig, PrefillCore
from tspd.sim.arena import contract_for

#: ``(check, text in the violation)`` of each known core bug; see the tests below.
KNOWN_CORE_BUGS: dict[str, tuple[str, str]] = {}

ADDR = "10.3.0.1:8998"


def _decode() -> DecodeCore:
    contract = contract_for(1, 4, 8, 4, 64)
    return DecodeCore(
        DecodeConfig(
            tp_size=1,
            tp_rank=0,
            contract=contract,
            arena_base=1 << 32,
            session_id="10.2.0.1:30000",
            endpoint="10.2.0.1",
            port=30001,
            waiting_timeout=1.0,
        )
    )


def _route(core: DecodeCore, now: float) -> None:
    """Answer the core's bootstrap lookups (one Prefill rank of TP 1)."""
    layout = contract_for(1, 4, 8, 4, 64).to_json().decode("ascii")
    commands = core.drain_commands()
    while commands:
        for command in commands:
            if isinstance(command, FetchParallelInfo):
                core.parallel_info(ADDR, ParallelInfo(1, 1, layout), now)
            elif isinstance(command, FetchRankInfo):
                core.rank_info(ADDR, 0, 0, RankInfo("10.1.0.1", 20001), now)
        commands = core.drain_commands()


def _iterate(core: DecodeCore, now: float) -> list[object]:
    return list(core.conclude(core.poll_values(now), now))


def test_a_room_routed_before_its_route_is_forgotten_fails_instead_of_raising() -> None:
    """Found by tspd sim --seed 44 --rooms 300 --faults loss=0.01,dup=0.01,reorder,
    partition,crash,xfail=0.01,hang=0.005,abort,hedge: send_preallocation raised
    KeyError for a room routed before the third waiting timeout dropped the
    address's cached route."""
    core = _decode()
    # Requests waiting for KV that never comes, one per dead-route timeout.
    for i in range(DEAD_ROUTE_TIMEOUTS):
        core.register_request(f"r{i}", 100 + i, ADDR, 0.0)
        _route(core, 0.0)
    assert _iterate(core, 0.0) == [Bootstrapped(f"r{i}") for i in range(DEAD_ROUTE_TIMEOUTS)]
    for i in range(DEAD_ROUTE_TIMEOUTS):
        core.send_preallocation(100 + i, {"kv": [1 + i]}, 0.0, prompt_len=4)
    # A new request at the same address is routed at once, from the cached route.
    core.register_request("late", 200, ADDR, 0.5)
    _route(core, 0.5)
    # The next iteration times the waiting ones out (the third drops the cached
    # route) and announces the new one in the same breath.
    events = _iterate(core, 1.5)
    assert Bootstrapped("late") in events
    assert sum(isinstance(e, Failed) for e in events) == DEAD_ROUTE_TIMEOUTS
    core.send_preallocation(200, {"kv": [9]}, 1.5, prompt_len=4)
    assert "was dropped before room 200 pre-allocated" in (core.room_failure(200) or "")


def _register(core: PrefillCore, tp_size: int, tp_rank: int, port: int) -> str:
    """Decode rank ``tp_rank`` of a TP group of ``tp_size`` registers with ``core``;
    returns its session id."""
    contract = contract_for(tp_size, 4, 8, 4, 64)
    session = f"10.2.{tp_size}.{tp_rank + 1}:{port}"
    frames = wire.encode_registration(
        wire.Registration(
            endpoint=f"10.2.{tp_size}.{tp_rank + 1}",
            port=port + 1,
            session_id=session,
            arena_base=(port + 1) << 32,
            contract=contract,
            contract_bytes=contract.to_json(),
            decode_tp_size=tp_size,
            decode_tp_rank=tp_rank,
        )
    )
    core.receive_control(frames, 0.0)
    return session


def _preallocate(core: PrefillCore, room: int, session: str, tp_size: int) -> None:
    manifest = build_manifest(contract_for(tp_size, 4, 8, 4, 64), {"kv": [5]}, 0, 4)
    core.receive_control(wire.encode_preallocation(room, session, manifest), 0.0)


def test_a_destination_that_joins_a_complete_room_gets_no_unwritten_success() -> None:
    """Found by tspd sim --seed 124 --rooms 200 --prefill 1xTP2,1xTP1DP2 --decode
    1xTP1,1xTP2,1xTP4 --faults all: a pre-allocation from a Decode of another TP size
    joined a room whose destination set was complete (2 destinations <= the
    newcomer's expected 4, so no fan-out check ran) and got Success with no byte
    written to it. Now the set is checked again with the newcomer, which fails the
    room."""
    contract = contract_for(1, 4, 8, 4, 64)
    core = PrefillCore(PrefillConfig(tp_size=1, tp_rank=0, contract=contract, arena_base=1 << 40))
    tp1 = _register(core, 1, 0, 21000)
    tp4 = _register(core, 4, 0, 22000)
    core.register_request("r", 7, 0.0)
    _preallocate(core, 7, tp1, 1)  # completes the room for the TP1 Decode
    core.hand_over(7, {"kv": [3]}, 11, (), 0.0)
    (transfer,) = [c for c in core.drain_commands() if isinstance(c, StartTransfer)]
    written = {w.session_id for i in transfer.intervals for w in i.writes}
    assert written == {tp1}
    _preallocate(core, 7, tp4, 4)  # the same room, retried on a TP4 Decode
    core.drain_commands()
    core.transfer_succeeded(7, 0.1)
    told = [
        c.port
        for c in core.drain_commands()
        if isinstance(c, SendFrames)
        and wire.decode_status(list(c.frames)).status is TransferPoll.SUCCESS
    ]
    assert 22001 not in told, f"Success went to ports {told}; the TP4 Decode was not written"


def test_a_release_waits_for_the_writes_of_a_failed_room() -> None:
    """Found by tspd sim --seed 4 --rooms 150 --prefill 1xTP2,1xTP1DP2 --decode
    1xTP1,1xTP2,1xTP4 --faults crash=1,xfail=0.01,hang=0.005,abort=0.02,sleep=2: a
    room failed (another rank of the group lost its Decode) while this rank's write
    hung; the request concluded and was forgotten, so ``check_release()`` let a sleep
    release the arena while the write still read it (until the transfer timeout).
    docs/protocol.md#proto-sleep-wake promises no release "while KV sends are in
    flight"; the core knows the room's chunks are with the workers (``_writing``,
    until ``transfer_done``)."""
    core = PrefillCore(
        PrefillConfig(
            tp_size=1, tp_rank=0, contract=contract_for(1, 4, 8, 4, 64), arena_base=1 << 40
        )
    )
    session = _register(core, 1, 0, 21000)
    core.register_request("r", 7, 0.0)
    _preallocate(core, 7, session, 1)
    core.conclude(core.poll_values(0.0), 0.0)
    core.hand_over(7, {"kv": [3]}, 11, (), 0.0)
    assert any(isinstance(c, StartTransfer) for c in core.drain_commands())
    # The write is in flight; the room fails and its request concludes.
    core.abort(7, "sim: the scheduler aborted r", 0.1)
    assert [type(e) for e in core.conclude(core.poll_values(0.1), 0.1)] == [Failed]
    assert core.statistics()["writing_rooms"] == 1
    try:
        core.check_release()
    except ProtocolError:
        return
    raise AssertionError("the release was accepted while a write from the arena was in flight")
