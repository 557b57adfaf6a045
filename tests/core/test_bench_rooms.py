"""``tspd bench rooms`` runs its journeys on public modules (figures only, never timed
asserts), and the cores it wires conclude every journey with empty room tables."""

from __future__ import annotations

from click.testing import CliRunner

from tspd.bench.pair import WiredCores
from tspd.bench.rooms import QUICK, run_room_benchmarks
from tspd.cli import main
from tspd.core.contract import CacheContract
from tspd.layouts import mha_contract

ROWS = [
    "room trigger, compiled table",
    "room trigger, transitions.Machine",
    "request journey, TP1 -> TP1",
    "request journey, TP2 -> TP1",
    "pre-allocation handled, 16-page room",
    "Prefill poll_values + conclude, 16 tracked",
    "Decode poll_values + conclude, 16 tracked",
    "Prefill next_deadline, 16 unclaimed rooms",
    "Decode next_deadline, 16 rooms waiting",
]

#: Room tables that must be empty once every journey ended (per-peer tables such as
#: registrations stay, as do bounded failure memories).
ROOM_TABLES = ("rooms", "tracked_requests", "unclaimed", "destinations", "routes", "waiting")


def _contracts(tp: int) -> list[CacheContract]:
    return [
        mha_contract(
            num_layers=2,
            num_kv_heads=4,
            head_dim=1,
            page_tokens=4,
            num_pages=16,
            dtype="uint8",
            tp_size=tp,
        )
        for _ in range(tp)
    ]


def test_quick_run_has_every_row() -> None:
    rows = run_room_benchmarks(QUICK)
    assert [r.what for r in rows] == ROWS
    assert all(r.micros >= 0 for r in rows)


def test_quick_run_prints_its_table() -> None:
    result = CliRunner().invoke(main, ["bench", "rooms", "--quick"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "request journey, TP2 -> TP1" in result.stdout


def test_journeys_conclude_and_leave_no_room_behind() -> None:
    for prefill_tp in (1, 2):
        pair = WiredCores(_contracts(prefill_tp), _contracts(1))
        try:
            # More journeys than the arena has pages for one at a time: pages come back.
            for room in range(12):
                pair.journey(f"r{room}", room, prompt_len=16)
            for core in (*pair.prefill, *pair.decode):
                stats = core.statistics()
                assert all(stats.get(name, 0) == 0 for name in ROOM_TABLES), stats
        finally:
            pair.close()
