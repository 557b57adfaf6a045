"""``tspd bench pd --quick`` runs end to end and prints every figure beside its raw limit."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("mooncake.engine")

from tspd.bench.pd import STAGED_ROW
from tspd.bench.raw import measure_thread_wake
from tspd.cli import main

pytestmark = [pytest.mark.mooncake, pytest.mark.slow, pytest.mark.timeout(300)]


def test_bench_pd_quick_reports_every_figure_with_its_limit() -> None:
    result = CliRunner().invoke(main, ["bench", "pd", "--quick", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output[result.output.index("{") :])
    assert len(figures) == 8
    for name, value in figures.items():
        assert "FAILED" not in value["tspd"], (name, value)
        assert value["raw"]
    assert "rooms/s, 1 × 4 KiB page, 64 in flight" in figures
    assert figures["64 MiB room, 16,384 × 4 KiB pages, contiguous"]["tspd"].endswith("GB/s")
    # The schedulers as plain threads, beside a bare thread wake-up; readers
    # of --json find the plain hand-over row as the one row starting "hand-over".
    assert [name for name in figures if name.startswith("hand-over")] == [
        "hand-over → Decode done, 1 in flight, p50 / p99"
    ]
    assert "thread schedulers: hand-over → Decode done, 1 in flight, p50 / p99" in figures
    lag = figures["room ended → Decode scheduler has it, p50 / p99: Trio task; plain thread"]
    assert lag["tspd"].count("µs") + lag["tspd"].count("ms") == 4, lag
    assert lag["raw"].startswith("bare thread wake-up p50 "), lag


def test_bench_pd_large_only_prints_the_64_mib_rows_beside_both_raw_limits() -> None:
    result = CliRunner().invoke(
        main, ["bench", "pd", "--quick", "--large-only", "--large-rooms", "1", "--json"]
    )
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output[result.output.index("{") :])
    assert sorted(figures) == sorted(
        [
            "64 MiB room, 16,384 × 4 KiB pages, contiguous",
            "64 MiB room, 16,384 × 4 KiB pages, scattered",
            STAGED_ROW,
        ]
    )
    # Readers of --json find the in-place rows by these words: one row each.
    assert [name for name in figures if "scattered" in name] == [
        "64 MiB room, 16,384 × 4 KiB pages, scattered"
    ]
    assert [name for name in figures if "contiguous" in name] == [
        "64 MiB room, 16,384 × 4 KiB pages, contiguous"
    ]
    # The staged row's room really went staged, as one blob.
    staged = figures[STAGED_ROW]
    assert "1 of 1 rooms staged" in staged["tspd"], staged
    for name, value in figures.items():
        assert "FAILED" not in value["tspd"], (name, value)
        assert " sync / " in value["raw"], (name, value)
        assert " GB/s pipelined" in value["raw"], (name, value)
        # Which TCP congestion control the host runs decides how fast a room's
        # write starts after the pause before it (docs/configuration.md).
        assert "; host TCP congestion control " in value["raw"], (name, value)


def test_a_bare_thread_wake_up_is_timed_from_the_set_to_the_waiter() -> None:
    """The thread wake-up limit: each sample runs from one ``Event.set()`` to the
    blocked waiter's return, so it is positive and far below a second."""
    wake = measure_thread_wake(repeats=50, warmup=5)
    assert 0 < wake.p50 <= wake.p99 < 1.0
