"""The demo's JSON-line reporter, live and holding its per-room lines."""

from __future__ import annotations

import io
import json

from tspd.demo.report import Reporter


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_a_live_reporter_writes_every_line_at_once() -> None:
    out = io.StringIO()
    reporter = Reporter("prefill", 1, out)
    reporter.emit("ready", control="tcp://127.0.0.1:1")
    reporter.emit("room", room=3, ok=True)
    assert [r["event"] for r in _lines(out)] == ["ready", "room"]
    assert _lines(out)[1]["role"] == "prefill"
    assert _lines(out)[1]["rank"] == 1


def test_a_holding_reporter_writes_per_room_lines_before_the_next_other_line() -> None:
    out = io.StringIO()
    reporter = Reporter("decode", 0, out, hold=True)
    reporter.emit("ready", status="tcp://127.0.0.1:2")
    reporter.emit("handover", room=1)
    reporter.emit("preallocated", room=1)
    reporter.emit("room", room=1, ok=True, latency=0.001)
    assert [r["event"] for r in _lines(out)] == ["ready"], "per-room lines are held"
    reporter.emit("done", failed=0)
    records = _lines(out)
    assert [r["event"] for r in records] == ["ready", "handover", "preallocated", "room", "done"]
    times = [float(r["t"]) for r in records]  # type: ignore[arg-type]
    assert times == sorted(times), "timestamps are taken when emitted, not when written"
    assert records[3]["latency"] == 0.001


def test_flush_writes_what_is_held_once() -> None:
    out = io.StringIO()
    reporter = Reporter("prefill", 0, out, hold=True)
    reporter.emit("room", room=7, ok=False, reason="x")
    reporter.flush()
    reporter.flush()
    assert [r["room"] for r in _lines(out)] == [7]
