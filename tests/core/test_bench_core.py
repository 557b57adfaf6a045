"""``tspd bench core`` runs and prints its table (figures only, never timed asserts)."""

from __future__ import annotations

from click.testing import CliRunner

from tspd.bench.core import Sizes, measure, run_core_benchmarks
from tspd.cli import main

ROWS = [
    "pre-allocation decode + manifest",
    "status encode (7 frames)",
    "status decode (7 frames)",
    "plan_registration TP1→2",
    "whole copy TP1→1: plan_copies",
    "whole copy TP1→1: plan + coalesce",
    "fragments TP1→2: plan_copies",
    "fragments TP1→2: plan + coalesce",
    "hand_over plan, 1 page",
    "hand_over plan, 8 pages",
    "hand_over plan, 1,000 pages",
]


def test_quick_run_prints_every_row() -> None:
    result = CliRunner().invoke(main, ["bench", "core", "--quick"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "tspd bench core" in result.stdout
    for row in ROWS:
        assert row in result.stdout


def test_rows_and_descriptor_counts() -> None:
    sizes = Sizes(layers=1, pages=8, min_seconds=0.0, rounds=1)
    rows, caption = run_core_benchmarks(sizes)
    assert [r.what for r in rows] == ROWS
    assert "room of 8 pages" in caption
    by_name = {r.what: r for r in rows}
    whole = by_name["whole copy TP1→1: plan_copies"].descriptors
    whole_merged = by_name["whole copy TP1→1: plan + coalesce"].descriptors
    # One layer: K and V, one descriptor per page each, per 1,000 pages; contiguous
    # pages coalesce to one run per field.
    assert whole == 2 * 1000
    assert whole_merged == round(2 * 1000 / 8)
    fragments = by_name["fragments TP1→2: plan_copies"].descriptors
    assert fragments is not None
    assert fragments == 16 * whole  # a TP1→TP2 page is copied row by row (16 rows)
    assert all(r.micros >= 0 for r in rows)
    # Scattered pages: at most one descriptor a page after coalescing, at least one.
    for pages in (1, 8, 1000):
        label = f"hand_over plan, {pages:,} page{'s' if pages > 1 else ''}"
        descriptors = by_name[label].descriptors
        assert descriptors is not None
        assert 1 <= descriptors <= pages


def test_measure_calls_the_function_and_returns_seconds_per_call() -> None:
    calls = []
    seconds = measure(lambda: calls.append(1), min_seconds=0.0, rounds=2)
    assert seconds >= 0
    assert len(calls) == 3  # one warmup round and two measured rounds
