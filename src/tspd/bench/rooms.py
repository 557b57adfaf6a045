"""``tspd bench rooms``: what the room machines and the protocol cores cost.

Measured, with ``time.perf_counter`` loops after a warmup (best of a few rounds):

* one room trigger through the compiled table (:mod:`tspd.core.machines`) against
  the same trigger through a ``transitions.Machine`` built from the same
  declaration — the reason the hot path uses the table (docs/state-machines.md);
* one request's whole control-plane journey through a Prefill core and a Decode
  core wired by :class:`~tspd.bench.pair.WiredCores` (registration, route,
  pre-allocation, hand-over, copy planning, status, polls), with tiny pages so the
  byte copies do not dominate, for equal TP and for Prefill TP2 → Decode TP1;
* one pre-allocation handled by a Prefill core (decode, registration lookup,
  manifest validation, fan-out), for a room of ``pages`` pages;
* one scheduler iteration's ``poll_values`` + ``conclude`` with ``N`` requests
  tracked and in flight (Prefill rooms ``Bootstrapped``, Decode rooms
  ``WaitingForInput``: nothing concludes), per side — what every engine iteration
  pays — and one ``next_deadline()`` with ``N`` rooms holding a deadline (Decode:
  waiting for input; Prefill: pre-allocated but not yet claimed), which the shell
  reads after every call into a core.

Figures only; nothing here asserts a speed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import click
from rich.console import Console
from rich.table import Table

from tspd.bench.core import fresh_manifest, measure
from tspd.bench.pair import WiredCores
from tspd.core import wire
from tspd.core.machines import PREFILL_ROOM, PREFILL_ROOM_TABLE, PrefillTrigger, RoomState
from tspd.core.prefill import PrefillConfig, PrefillCore
from tspd.layouts import mha_contract

__all__ = ["RoomRow", "RoomSizes", "rooms", "run_room_benchmarks"]


@dataclass(frozen=True, slots=True)
class RoomSizes:
    """Pages in the pre-allocated room, seconds per round, rounds, and the tracked
    request counts of the poll and deadline rows."""

    pages: int
    min_seconds: float
    rounds: int
    tracked: tuple[int, ...] = (256, 1024)


FULL = RoomSizes(pages=1024, min_seconds=0.2, rounds=5)
QUICK = RoomSizes(pages=16, min_seconds=0.002, rounds=1, tracked=(16,))


@dataclass(frozen=True, slots=True)
class RoomRow:
    """One line of the table."""

    what: str
    micros: float
    per: str


def _micros(fn: Callable[[], object], sizes: RoomSizes) -> float:
    return measure(fn, min_seconds=sizes.min_seconds, rounds=sizes.rounds) * 1e6


def _trigger_rows(sizes: RoomSizes) -> list[RoomRow]:
    cycle = [
        (RoomState.ABSENT, PrefillTrigger.REGISTER),
        (RoomState.BOOTSTRAPPING, PrefillTrigger.FANOUT_COMPLETE),
        (RoomState.BOOTSTRAPPED, PrefillTrigger.TRANSFER_SUCCEEDED),
        (RoomState.SUCCESS, PrefillTrigger.FORGET),
    ]

    def table() -> None:
        for state, trigger in cycle:
            PREFILL_ROOM_TABLE.fire(state, trigger)

    rows = [RoomRow("room trigger, compiled table", _micros(table, sizes) / 4, "trigger")]
    try:
        from transitions import Machine
    except ImportError:  # pragma: no cover - transitions is a dependency
        return rows

    class _Model:
        state: str

    model = _Model()
    Machine(model=model, auto_transitions=False, **PREFILL_ROOM.as_kwargs())

    def machine() -> None:
        for _, trigger in cycle:
            model.trigger(trigger)  # type: ignore[attr-defined]

    rows.append(
        RoomRow("room trigger, transitions.Machine", _micros(machine, sizes) / 4, "trigger")
    )
    return rows


def _journey_row(label: str, prefill_tp: int, decode_tp: int, sizes: RoomSizes) -> RoomRow:
    def contracts(tp: int) -> list:  # type: ignore[type-arg]
        return [
            mha_contract(
                num_layers=2,
                num_kv_heads=4,
                head_dim=1,
                page_tokens=4,
                num_pages=64,
                dtype="uint8",
                tp_size=tp,
            )
            for _ in range(tp)
        ]

    pair = WiredCores(contracts(prefill_tp), contracts(decode_tp))
    rooms = itertools.count()

    def journey() -> None:
        room = next(rooms)
        pair.journey(f"r{room}", room, prompt_len=16)

    try:
        return RoomRow(label, _micros(journey, sizes), "request")
    finally:
        pair.close()


def _preallocation_row(sizes: RoomSizes) -> RoomRow:
    contract = mha_contract(
        num_layers=4,
        num_kv_heads=1,
        head_dim=1,
        page_tokens=16,
        num_pages=sizes.pages,
        dtype="uint8",
    )
    core = PrefillCore(PrefillConfig(tp_size=1, tp_rank=0, contract=contract, arena_base=0x1000))
    session = "127.0.0.1:9000"
    core.receive_control(
        wire.encode_registration(
            wire.Registration(
                "127.0.0.1", 8000, session, 0x9000, contract, contract.to_json(), 1, 0
            )
        ),
        0.0,
    )
    frames = wire.encode_preallocation(0, session, fresh_manifest(contract, sizes.pages * 16))
    rooms = itertools.count()

    def preallocate() -> None:
        room = next(rooms)
        frames[0] = wire.encode_uint(room)
        core.receive_control(frames, 0.0)
        core.abort(room, "benchmark", 0.0)
        core.handle_timeout(1e9)
        core.drain_commands()

    return RoomRow(
        f"pre-allocation handled, {sizes.pages}-page room", _micros(preallocate, sizes), "message"
    )


def _in_flight_pair(tracked: int, *, claimed: bool) -> WiredCores:
    """A TP1 -> TP1 pair with ``tracked`` requests pre-allocated, one 4-token page
    each, and never handed over. ``claimed``: Prefill registered them too (its rooms
    are ``Bootstrapped``); otherwise its rooms are unclaimed (each holds a TTL)."""

    def contract() -> list:  # type: ignore[type-arg]
        return [
            mha_contract(
                num_layers=1,
                num_kv_heads=1,
                head_dim=1,
                page_tokens=4,
                num_pages=tracked + 1,
                dtype="uint8",
            )
        ]

    pair = WiredCores(contract(), contract())
    for room in range(tracked):
        pair.register_decode(f"r{room}", room)
        if claimed:
            pair.register_prefill(f"r{room}", room)
    pair.poll_decode()
    for room in range(tracked):
        pair.preallocate(room, prompt_len=4)
    pair.poll_prefill()
    pair.advance(1.0)
    return pair


def _poll_rows(tracked: int, sizes: RoomSizes) -> list[RoomRow]:
    pair = _in_flight_pair(tracked, claimed=True)
    prefill, decode, now = pair.prefill[0], pair.decode[0], pair.now

    def prefill_round() -> None:
        if prefill.conclude(prefill.poll_values(now), now):
            raise AssertionError("a Prefill request concluded: the benchmark state is wrong")

    def decode_round() -> None:
        if decode.conclude(decode.poll_values(now), now):
            raise AssertionError("a Decode request concluded: the benchmark state is wrong")

    unclaimed = _in_flight_pair(tracked, claimed=False)
    try:
        return [
            RoomRow(
                f"Prefill poll_values + conclude, {tracked} tracked",
                _micros(prefill_round, sizes),
                "iteration",
            ),
            RoomRow(
                f"Decode poll_values + conclude, {tracked} tracked",
                _micros(decode_round, sizes),
                "iteration",
            ),
            RoomRow(
                f"Prefill next_deadline, {tracked} unclaimed rooms",
                _micros(unclaimed.prefill[0].next_deadline, sizes),
                "call",
            ),
            RoomRow(
                f"Decode next_deadline, {tracked} rooms waiting",
                _micros(decode.next_deadline, sizes),
                "call",
            ),
        ]
    finally:
        pair.close()
        unclaimed.close()


def run_room_benchmarks(sizes: RoomSizes) -> list[RoomRow]:
    """Every measurement, in table order."""
    return [
        *_trigger_rows(sizes),
        _journey_row("request journey, TP1 -> TP1", 1, 1, sizes),
        _journey_row("request journey, TP2 -> TP1", 2, 1, sizes),
        _preallocation_row(sizes),
        *(row for tracked in sizes.tracked for row in _poll_rows(tracked, sizes)),
    ]


@click.command()
@click.option("--quick", is_flag=True, help="Tiny sizes and one short round (a smoke run).")
def rooms(quick: bool) -> None:
    """Room machines and Prefill/Decode core costs (figures only)."""
    sizes = QUICK if quick else FULL
    table = Table(title="tspd rooms and protocol cores")
    table.add_column("what")
    table.add_column("µs", justify="right")
    table.add_column("per")
    for row in run_room_benchmarks(sizes):
        table.add_row(row.what, f"{row.micros:,.2f}", row.per)
    Console().print(table)
