"""``tspd trace`` against two real metrics endpoints (one per side, as two processes
would serve), merging a failed room's traces into one timeline."""

from __future__ import annotations

import json

import pytest
import trio
from click.testing import CliRunner, Result

from tspd.cli import main
from tspd.shell.metrics import TspdMetrics, open_metrics_server
from tspd.testing.core_pair import CorePair
from tspd.testing.layouts import simple_contract

CONTRACT = simple_contract(num_pages=16, page_bytes=64)
PROMPT = 40


def _failed_room(pair: CorePair, room: int) -> None:
    pair.write_errors[CorePair.decode_session(0)] = "connection reset"
    pair.register_decode("bad", room)
    pair.register_prefill("bad", room)
    pair.poll_decode()
    pair.now += 0.002
    pair.preallocate(room, PROMPT)
    pair.poll_prefill()
    pair.now += 0.003
    pair.hand_over(room, PROMPT)
    pair.poll_prefill()
    pair.poll_decode()


async def _invoke(*args: str) -> Result:
    # The endpoints run in this Trio loop: the CLI's blocking client runs in a thread.
    return await trio.to_thread.run_sync(lambda: CliRunner().invoke(main, ["trace", *args]))


async def test_trace_merges_both_sides_and_lists_recent_rooms() -> None:
    pair = CorePair([CONTRACT], [CONTRACT])
    try:
        pair.now = trio.current_time()
        _failed_room(pair, 42)
        prefill_metrics, decode_metrics = TspdMetrics(), TspdMetrics()
        for metrics, side, core in (
            (prefill_metrics, "prefill", pair.prefill[0]),
            (decode_metrics, "decode", pair.decode[0]),
        ):
            metrics.peer(side, 0).watch(trace=core.trace, recent_traces=core.recent_traces)
        async with (
            open_metrics_server(prefill_metrics) as p,
            open_metrics_server(decode_metrics) as d,
        ):
            endpoints = ["--from", p.address, "--from", f"{d.url}"]
            shown = await _invoke("42", *endpoints)
            as_json = await _invoke("42", "--json", *endpoints)
            recent = await _invoke(*endpoints)
            missing = await _invoke("43", *endpoints)
            unreachable = await _invoke("42", "--from", p.address, "--from", "127.0.0.1:1")
    finally:
        pair.close()

    assert shown.exit_code == 0, shown.output
    text = " ".join(shown.output.split())
    assert "room 42: milestones on every rank" in text
    assert "prefill rank 0" in text
    assert "decode rank 0" in text
    assert "[transfer] CachePD transfer failed" in text
    assert "[peer-failed] Failed to get kvcache from prefill instance" in text

    entries = json.loads(as_json.output)
    assert sorted(e["side"] for e in entries) == ["decode", "prefill"]
    prefill = next(e for e in entries if e["side"] == "prefill")
    # The Unix-clock marks keep the core's spacing (5 ms from registration to hand-over).
    unix = dict(prefill["marks_unix"])
    assert abs(unix["transfer_started"] - unix["registered"] - 0.005) < 1e-6
    assert prefill["reason_class"] == "transfer"

    assert recent.exit_code == 0, recent.output
    assert "recently kept traces" in recent.output
    assert "peer-failed" in recent.output

    assert missing.exit_code == 1
    assert "no endpoint holds a trace of room 43" in missing.output

    assert unreachable.exit_code == 0
    assert "warning: http://127.0.0.1:1/traces/42" in unreachable.output


def test_peer_text_is_printed_as_it_is_not_as_markup(capsys: pytest.CaptureFixture[str]) -> None:
    """What an endpoint sends is text: rich must not eat ``[...]`` in it."""
    from tspd.cli.trace import _print_recent, _print_room

    entry = {
        "room": 9,
        "side": "decode",
        "rank": 0,
        "endpoint": "127.0.0.1:1",
        "outcome": "failed",
        "reason_class": "other",
        "reason": "install 'tspd[mooncake-cpu]' [bold]now[/bold]",
        "marks_unix": [["registered", 1.0], ["[failed]", 1.5]],
        "phases": {"[bootstrapping]": 0.5},
        "bytes": 0,
        "descriptors": 0,
        "chunks": 0,
        "started_unix": 1.0,
        "duration": 0.5,
    }
    _print_room(9, [entry])
    _print_recent([entry])
    out = " ".join(capsys.readouterr().out.split())
    assert "install 'tspd[mooncake-cpu]' [bold]now[/bold]" in out
    assert "[failed]" in out
    assert "[bootstrapping] 500.000 ms" in out
