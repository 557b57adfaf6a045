"""``tspd bench events --quick`` runs end to end and prints every row (figures only)."""

from __future__ import annotations

from click.testing import CliRunner

from tspd.cli import main

ROWS = [
    "end to end, 1-event batches",
    "raw limit: plain PUB→SUB",
    "end to end, 16-event batches",
    "publish() from an engine thread",
    "publish() of 16-event batches, engine thread",
    "hand-off: bounded queue + run_sync_soon (tspd)",
    "hand-off: trio.from_thread.run(channel.send)",
    "replay of 1,000 batches to a DEALER",
]


def test_quick_run_prints_every_row_and_loses_nothing() -> None:
    result = CliRunner().invoke(main, ["bench", "events", "--quick"], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "tspd bench events" in out
    for row in ROWS:
        assert row in out
    assert out.count("of 2,000, lost 0") == 2
    assert "2 of 2 replays complete with the end marker" in out
