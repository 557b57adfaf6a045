"""Structured logging: quiet by default, fields rendered as key=value or JSON, and one
line per room failure from the cores' commands."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tspd.core.commands import Log, LogLevel, RoomFailed, SendFrames
from tspd.core.trace import ReasonClass
from tspd.log import component_logger, configure_logging, fields, log_command
from tspd.testing.core_pair import CorePair
from tspd.testing.layouts import simple_contract

CONTRACT = simple_contract(num_pages=16, page_bytes=64)


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    """Configure tspd's logging onto a string; restore the logger afterwards."""
    root = logging.getLogger("tspd")
    handlers, level = list(root.handlers), root.level
    out = io.StringIO()
    configure_logging("WARNING", stream=out)
    yield out
    root.handlers[:] = handlers
    root.setLevel(level)


def test_the_library_is_silent_until_configured() -> None:
    code = (
        "import logging, tspd.log\n"
        "logging.getLogger('tspd.prefill').warning('room 1 failed: boom')\n"
        "logging.getLogger('tspd.prefill').error('still nothing')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stderr == ""
    assert run.stdout == ""


def test_configured_lines_carry_their_fields(stream: io.StringIO) -> None:
    log = component_logger("prefill")
    log.warning(
        "room %d failed: %s",
        5,
        "boom",
        extra=fields(room=5, peer="127.0.0.1:9001 (rank 0)", rid=None, side="prefill"),
    )
    log.info("not shown at WARNING", extra=fields(room=6))
    (line,) = stream.getvalue().splitlines()
    assert " WARNING tspd.prefill: room 5 failed: boom " in line
    assert line.endswith(' room=5 peer="127.0.0.1:9001 (rank 0)" side=prefill')
    assert "rid=" not in line


def test_json_lines_and_reconfiguration(stream: io.StringIO) -> None:
    out = io.StringIO()
    configure_logging(logging.INFO, json=True, stream=out)
    streams = [
        h for h in logging.getLogger("tspd").handlers if isinstance(h, logging.StreamHandler)
    ]
    assert [h.stream for h in streams] == [out]
    component_logger("events").info("gap healed", extra=fields(source="dp0", batches=3))
    entry = json.loads(out.getvalue())
    assert entry["level"] == "info"
    assert entry["logger"] == "tspd.events"
    assert entry["message"] == "gap healed"
    assert (entry["source"], entry["batches"]) == ("dp0", 3)
    # The first configuration's handler was replaced, not kept beside the new one.
    assert stream.getvalue() == ""


def test_each_failure_is_one_warning_line_with_its_class(stream: io.StringIO) -> None:
    pair = CorePair([CONTRACT], [CONTRACT])
    try:
        pair.write_errors[CorePair.decode_session(0)] = "connection reset"
        pair.register_decode("a", 1)
        pair.register_prefill("a", 1)
        pair.poll_decode()
        pair.preallocate(1, 40)
        pair.poll_prefill()
        pair.hand_over(1, 40)
        pair.poll_prefill()
        pair.poll_decode()
        # Route every command the cores produced, in order, as a shell would.
        for side, rank, command in [*pair.logs, *pair.failures]:
            assert log_command(component_logger(side), command, side=side, rank=rank)
    finally:
        pair.close()
    lines = stream.getvalue().splitlines()
    failures = [line for line in lines if " failed: " in line]
    assert len(failures) == 2
    prefill_line = next(line for line in failures if "tspd.prefill" in line)
    assert "room 1 failed: CachePD transfer failed: Mooncake transfer failed for" in prefill_line
    assert prefill_line.endswith("room=1 reason_class=transfer side=prefill rank=0")
    decode_line = next(line for line in failures if "tspd.decode" in line)
    assert "reason_class=peer-failed" in decode_line
    # Other warnings (the failed-session mark) still show; nothing per room at INFO.
    assert any("marked failed for 30s" in line for line in lines)
    assert not any("registered" in line for line in lines)


def test_log_command_levels_and_other_commands(stream: io.StringIO) -> None:
    log = component_logger("decode")
    assert log_command(log, Log(LogLevel.ERROR, "fetch failed", None), side="decode")
    assert log_command(log, Log(LogLevel.DEBUG, "ignored status", 3))
    timeout = RoomFailed(
        3, "Request 3 timed out after 300.0s", "waiting_for_input", ReasonClass.TIMEOUT_WAITING
    )
    assert log_command(log, timeout)
    assert not log_command(log, SendFrames("h", 1, (b"x",), 3))
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("fetch failed side=decode")
    assert lines[1].endswith("room=3 reason_class=timeout-waiting timeout_stage=waiting_for_input")
