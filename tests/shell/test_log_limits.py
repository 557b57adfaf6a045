"""What peers can make a rank log is bounded: rejected messages one line per
(peer, reason) per interval, failed rooms per reason class beyond a burst, every
one still counted in the metrics."""

from __future__ import annotations

import logging

import pytest

from tspd.core.commands import Log, LogLevel, Rejected, RejectReason, RoomFailed
from tspd.core.trace import ReasonClass
from tspd.shell.metrics import TspdMetrics
from tspd.shell.observe import PeerObserver


def _lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("tspd")]


def test_a_flood_of_rejected_messages_writes_a_few_lines_per_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = TspdMetrics()
    observer = PeerObserver("prefill", 0, metrics=metrics)
    caplog.set_level(logging.INFO, logger="tspd")
    for i in range(10_000):
        reason = RejectReason.MALFORMED_HEADER if i % 2 else RejectReason.PREALLOCATION_REFUSED
        # Every message names another session: the key is the reason alone.
        assert observer.command(Rejected(reason, f"10.0.0.{i % 250}:{i}", f"garbage {i}"))
    lines = _lines(caplog)
    burst = observer.log_limits.rejections.burst
    assert len(lines) == 2 * burst
    assert {getattr(r, "reason", None) for r in lines} == {
        "malformed-header",
        "preallocation-refused",
    }
    value = metrics.registry.get_sample_value(
        "tspd_rejected_messages_total",
        {"side": "prefill", "rank": "0", "reason": "malformed-header"},
    )
    assert value == 5_000
    assert observer.log_limits.rejections.suppressed_total == 10_000 - 2 * burst


def test_failed_room_lines_pass_up_to_a_burst_then_are_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    observer = PeerObserver("decode", 1)
    caplog.set_level(logging.INFO, logger="tspd")
    for room in range(1_000):
        observer.command(RoomFailed(room, "bad", None, ReasonClass.PREALLOCATION))
    observer.command(
        RoomFailed(5_000, "timed out", "waiting_for_input", ReasonClass.TIMEOUT_WAITING)
    )
    burst = observer.log_limits.failures.burst
    lines = _lines(caplog)
    assert len(lines) == burst + 1
    assert lines[-1].getMessage() == "room 5000 failed: timed out"


def test_other_log_lines_are_not_limited(caplog: pytest.LogCaptureFixture) -> None:
    observer = PeerObserver("prefill", 0)
    caplog.set_level(logging.INFO, logger="tspd")
    for i in range(50):
        observer.command(Log(LogLevel.WARNING, f"operator line {i}"))
    assert len(_lines(caplog)) == 50


def test_an_internal_error_is_logged_with_its_traceback_a_few_times_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    observer = PeerObserver("prefill", 0)
    caplog.set_level(logging.INFO, logger="tspd")
    for _ in range(100):
        try:
            raise OverflowError("a bug")
        except OverflowError:
            observer.internal_error("a control message")
    lines = _lines(caplog)
    assert len(lines) == observer.log_limits.rejections.burst
    assert "tspd failed handling a control message" in lines[0].getMessage()
    assert lines[0].exc_info is not None
