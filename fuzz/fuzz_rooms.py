"""Fuzz target for the Prefill rank's room tables (``tspd.core.prefill.PrefillCore``).

One input is a script: each step's first byte picks an operation and the following
bytes are its arguments. Operations feed arbitrary or lightly mutated control
frames (registrations and pre-allocations built from a real contract), register
requests, run the poll/agreement/conclude cycle, abort, hand over, report worker
outcomes, record usage, arm layerwise chunks and move time.

What may happen is exactly what the core documents:

* peer input (``receive_control``), timers, polls, aborts, worker feedback and
  usage never raise;
* the scheduler and forward APIs raise only :class:`~tspd.core.errors.TspdError`
  subclasses, for caller errors;
* a failed room always has a reason, ``Failed`` never turns back into progress, and
  once every request concludes and the unclaimed TTL passes, every per-room table
  is empty.

Short runs are part of the test suite (``tests/core/test_fuzz_targets_rooms.py``,
hypothesis). Long runs, by hand, with atheris::

    pip install atheris
    python fuzz/fuzz_rooms.py [libFuzzer flags]
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Final

from tspd.core import wire
from tspd.core.commands import Event, PrefillCommand, SendFrames, StartTransfer
from tspd.core.errors import TspdError
from tspd.core.machines import RoomState
from tspd.core.manifest import build_manifest
from tspd.core.poll import TransferPoll
from tspd.core.prefill import ExtendRow, PrefillConfig, PrefillCore
from tspd.core.schedule import ProducerSchedule
from tspd.testing.layouts import multi_layer_contract

__all__ = ["OPERATIONS", "SEED_MESSAGES", "run_script", "test_one_input"]

CONTRACT: Final = multi_layer_contract(layers=2, num_pages=12, heads=2, head_dim=2)
SCHEDULE: Final = ProducerSchedule.from_contract(CONTRACT, 2)
SESSIONS: Final = ("127.0.0.1:9000", "127.0.0.1:9001")
ROOMS: Final = 4
TTL: Final = 10.0
#: Per-peer tables that legitimately outlive every room.
#: Per Decode session, or bounded memory kept on purpose (failed rooms, each for the
#: bootstrap timeout, so a late pre-allocation hears Failed at once).
PER_PEER: Final = frozenset({"registrations", "rejected", "failed_sessions", "failed_room_memory"})


def _registration(session: str, port: int) -> list[bytes]:
    return wire.encode_registration(
        wire.Registration(
            endpoint="127.0.0.1",
            port=port,
            session_id=session,
            arena_base=0x100000,
            contract=CONTRACT,
            contract_bytes=CONTRACT.to_json(),
            decode_tp_size=1,
            decode_tp_rank=0,
        )
    )


def _tables(first_page: int) -> dict[str, list[int]]:
    return {gid: [first_page + i for i in range(3)] for gid in CONTRACT.group_ids}


def _preallocation(room: int, session: str) -> list[bytes]:
    manifest = build_manifest(CONTRACT, _tables(1), 0, 12)
    return wire.encode_preallocation(room, session, manifest)


#: Valid messages the script can send as is or with one frame replaced.
SEED_MESSAGES: Final[tuple[list[bytes], ...]] = (
    _registration(SESSIONS[0], 8000),
    _registration(SESSIONS[1], 8001),
    _registration(SESSIONS[0], 8002),  # conflicts with the first
    *(_preallocation(room, SESSIONS[0]) for room in range(ROOMS)),
    *(_preallocation(room, SESSIONS[1]) for room in range(ROOMS)),
    wire.encode_preallocation(0, SESSIONS[0], None),
)


class _Reader:
    """Consumes a script's bytes; reads past the end give zeros."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._at = 0

    @property
    def done(self) -> bool:
        return self._at >= len(self._data)

    def byte(self) -> int:
        value = self._data[self._at] if self._at < len(self._data) else 0
        self._at += 1
        return value

    def blob(self) -> bytes:
        size = self.byte() % 24
        chunk = self._data[self._at : self._at + size]
        self._at += size
        return chunk


class _Run:
    """One script's core, clock and observations."""

    def __init__(self) -> None:
        self.core = PrefillCore(
            PrefillConfig(
                tp_size=1,
                tp_rank=0,
                contract=CONTRACT,
                arena_base=0x200000,
                transfer_workers=2,
                bootstrap_timeout=TTL,
                failed_session_ttl=3.0,
                layerwise=SCHEDULE,
            )
        )
        self.now = 0.0
        self.rids = 0
        self.seen: dict[int, RoomState] = {}
        self.events: list[Event] = []
        #: Rooms of chunks handed to "workers" and not yet reported done.
        self.pending: list[int] = []

    def check(self) -> None:
        core = self.core
        for room in range(ROOMS):
            state = core.room_state(room)
            before = self.seen.get(room)
            if state is RoomState.FAILED:
                assert core.room_failure(room), f"room {room} failed without a reason"
            if before is RoomState.FAILED and state is not RoomState.ABSENT:
                assert state is RoomState.FAILED, f"room {room} left Failed for {state}"
            self.seen[room] = state
        self.observe(core.drain_commands())

    def observe(self, commands: list[PrefillCommand]) -> None:
        """Track chunks handed to workers, and check write fencing: no Failed status
        goes to a Decode while a chunk of that room may still write."""
        for command in commands:
            if isinstance(command, StartTransfer):
                self.pending.append(command.room)
            elif isinstance(command, SendFrames) and not wire.is_registration(list(command.frames)):
                status = wire.decode_status(list(command.frames))
                if status.status is TransferPoll.FAILED:
                    assert status.room not in self.pending, (
                        f"Failed sent for room {status.room} while a write of it is in flight"
                    )

    def finish_chunk(self, index: int) -> None:
        """The worker is done with pending chunk ``index``."""
        room = self.pending.pop(index)
        self.core.transfer_done(room, self.now)


def _op_control_raw(run: _Run, reader: _Reader) -> None:
    frames = [reader.blob() for _ in range(reader.byte() % 9)]
    run.core.receive_control(frames, run.now)


def _op_control_seed(run: _Run, reader: _Reader) -> None:
    frames = list(SEED_MESSAGES[reader.byte() % len(SEED_MESSAGES)])
    if reader.byte() % 3 == 0 and frames:
        frames[reader.byte() % len(frames)] = reader.blob()
    run.core.receive_control(frames, run.now)


def _op_register(run: _Run, reader: _Reader) -> None:
    run.rids += 1
    room = reader.byte() % ROOMS
    with contextlib.suppress(TspdError):
        run.core.register_request(f"r{run.rids}", room, run.now)


def _op_poll(run: _Run, reader: _Reader) -> None:
    values = run.core.poll_values(run.now)
    lower = reader.byte()
    agreed = [min(v, lower % 6) if lower & 0x80 else v for v in values]
    for event in run.core.conclude(agreed, run.now):
        assert event.rid
        run.events.append(event)


def _op_abort(run: _Run, reader: _Reader) -> None:
    run.core.abort(reader.byte() % ROOMS, "fuzz abort", run.now)


def _op_hand_over(run: _Run, reader: _Reader) -> None:
    room = reader.byte() % ROOMS
    token = reader.byte() - 8
    with contextlib.suppress(TspdError):
        run.core.hand_over(room, _tables(1 + reader.byte() % 4), token, (), run.now)


def _op_worker(run: _Run, reader: _Reader) -> None:
    """A worker reports one pending chunk (or, with none pending, any room)."""
    index = reader.byte() % len(run.pending) if run.pending else None
    room = run.pending[index] if index is not None else reader.byte() % ROOMS
    choice = reader.byte() % 3
    if choice == 0:
        run.core.transfer_succeeded(room, run.now)
    elif choice == 1:
        run.core.transfer_failed(room, SESSIONS[reader.byte() % 2], "fuzz write error", run.now)
    else:
        run.core.transfer_failed(room, None, "fuzz worker error", run.now)
    if index is not None:
        run.observe(run.core.drain_commands())
        run.finish_chunk(index)


def _op_time(run: _Run, reader: _Reader) -> None:
    run.now += float(reader.byte() % 16)
    run.core.handle_timeout(run.now)
    run.core.session_alive(SESSIONS[0], run.now)


def _op_usage(run: _Run, reader: _Reader) -> None:
    run.core.record_usage(reader.byte() % ROOMS, reader.byte(), -float(reader.byte()))


def _op_arm(run: _Run, reader: _Reader) -> None:
    rid = f"r{1 + reader.byte() % max(run.rids, 1)}"
    begin = reader.byte() % 12
    length = 1 + reader.byte() % 12
    with contextlib.suppress(TspdError):
        run.core.arm_layerwise([ExtendRow(rid, begin, length, _tables(1))], run.now)


def _op_release(run: _Run, reader: _Reader) -> None:
    refusal = ""
    try:
        run.core.check_release()
    except TspdError as err:
        refusal = str(err)
    if run.core.tracked_rooms() or run.core.statistics()["writing_rooms"]:
        assert refusal.startswith("cannot release the cache while KV sends are in flight")
    else:
        assert refusal == ""


OPERATIONS: Final = (
    _op_control_raw,
    _op_control_seed,
    _op_control_seed,
    _op_register,
    _op_poll,
    _op_abort,
    _op_hand_over,
    _op_worker,
    _op_time,
    _op_usage,
    _op_arm,
    _op_release,
)


def run_script(data: bytes) -> list[Event]:
    """Run one script, then end every request and room and check nothing is left.
    Returns the scheduler events the script's polls produced."""
    run = _Run()
    reader = _Reader(data)
    steps = 0
    while not reader.done and steps < 200:
        OPERATIONS[reader.byte() % len(OPERATIONS)](run, reader)
        run.check()
        steps += 1
    core = run.core
    values = core.poll_values(run.now)
    core.conclude([0] * len(values), run.now)
    run.observe(core.drain_commands())
    while run.pending:
        run.finish_chunk(0)
    run.now += TTL + 4.0
    core.handle_timeout(run.now)
    core.drain_commands()
    assert not core.has_in_flight()
    leftovers = {k: v for k, v in core.statistics().items() if v and k not in PER_PEER}
    assert not leftovers, f"tables not empty after every room ended: {leftovers}"
    return run.events


def test_one_input(data: bytes) -> None:
    """The atheris entry point."""
    run_script(data)


def main(argv: list[str]) -> None:
    """Run under atheris/libFuzzer."""
    atheris = importlib.import_module("atheris")
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
