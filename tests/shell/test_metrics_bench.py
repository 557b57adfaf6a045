"""``tspd bench observe`` runs and prints every row (a smoke run; no speed asserted)."""

from __future__ import annotations

from click.testing import CliRunner

from tspd.bench.observe import run_observe_benchmarks
from tspd.cli import main


def test_observe_benchmark_quick_run_prints_every_row() -> None:
    rows = run_observe_benchmarks(quick=True)
    assert [row.per for row in rows] == ["room", "room", "command", "failure", "failure", "scrape"]
    assert all(row.micros > 0 for row in rows)
    result = CliRunner().invoke(main, ["bench", "observe", "--quick"])
    assert result.exit_code == 0, result.output
    for what in ("room trace", "finished room", "nothing configured", "key=value", "scrape"):
        assert what in result.output
