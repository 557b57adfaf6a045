"""The demo's JSON-line reporter, its per-session failure log, its Decode check of a
finished room, ``--spec-candidates`` and how its summary prints operator text."""

from __future__ import annotations

import io
import json
import logging
import sys

import pytest
from click.testing import CliRunner

from tspd.core.commands import RemotePrefillDone
from tspd.core.errors import ConfigError
from tspd.core.interop import bootstrap_token_and_candidates
from tspd.core.manifest import build_manifest
from tspd.demo.failures import SessionFailures, reason_kind
from tspd.demo.orchestrate import DemoOptions, DemoSummary, _role_args
from tspd.demo.report import Reporter
from tspd.demo.roles import RoleOptions, _finish
from tspd.demo.workload import DEFAULT_SPEC_CANDIDATES, MAX_SPEC_CANDIDATES, Workload
from tspd.shell.arena import HostArena, fill_room
from tspd.testing.layouts import PageAllocator


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


# --- failed rooms per Prefill session (tspd.demo.failures) ---------------------------

SESSION = "127.0.0.1:8998"


def _session_failures() -> tuple[SessionFailures, logging.Logger, list[logging.LogRecord]]:
    peer_log = logging.getLogger("tspd.test-demo-collapse")
    peer_log.setLevel(logging.DEBUG)
    peer_log.propagate = False
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    for handler in list(peer_log.handlers):
        peer_log.removeHandler(handler)
    peer_log.addHandler(_Keep())
    return SessionFailures(lambda room: SESSION, [SESSION]), peer_log, records


def test_a_failed_session_is_logged_once_with_its_count_not_once_per_room() -> None:
    failures, peer_log, records = _session_failures()
    lost = f"Losing connection with prefill instance (bootstrap_addr: {SESSION})"
    fetch = f"fetching parallel info from Prefill bootstrap {SESSION} failed: refused"
    with failures.collapse(peer_log):
        peer_log.error("%s, affected %d requests", lost, 3)
        for room in range(100, 400):
            # The peer's own per-room line (tspd.log.log_command's RoomFailed form).
            peer_log.warning("room %d failed: %s", room, lost, extra={"room": room})
            failures.add(room, lost)
            if room % 3 == 0:
                peer_log.error(fetch)
        peer_log.warning("something about another peer")
        peer_log.info("room %d succeeded slowly", 7, extra={"room": 7})
    shown = [r.getMessage() for r in records]
    assert shown == [
        f"{lost}, affected 3 requests",
        f"room 100 failed: {lost}",
        fetch,
        "something about another peer",
        "room 7 succeeded slowly",
    ]
    assert failures.counts() == {SESSION: 300}
    assert failures.held_back[SESSION] == 299 + 99
    summary = failures.as_dict()[SESSION]
    assert (summary["rooms"], summary["first_room"], summary["first_reason"]) == (300, 100, lost)
    assert summary["reasons"] == {reason_kind(lost): 300}

    demo_log = logging.getLogger("tspd.test-demo-summary")
    demo_log.propagate = False
    kept: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record)

    demo_log.addHandler(_Keep())
    failures.log_summary(demo_log, 500)
    assert len(kept) == 1, "one line per failed session"
    line = kept[0].getMessage()
    assert line.startswith(f"Prefill {SESSION} failed 300 of 500 rooms (first: room 100: {lost})")
    assert "398 repeated log lines about it were not shown" in line
    assert kept[0].__dict__["rooms_failed"] == 300
    # The filter is gone once the block ends.
    peer_log.warning("room %d failed: %s", 999, lost, extra={"room": 999})
    assert records[-1].getMessage() == f"room 999 failed: {lost}"


def test_no_failure_no_summary_line() -> None:
    failures, _, _ = _session_failures()
    quiet = logging.getLogger("tspd.test-demo-quiet")
    kept: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record)

    quiet.addHandler(_Keep())
    failures.log_summary(quiet, 10)
    assert kept == []
    assert failures.as_dict() == {}


# --- the Decode rank's check of a finished room -----------------------------------------

ROOM = 1_000_000


def _finished(
    *, written_seed: int, token_seed: int, sent: int, expected: int
) -> tuple[bool, str | None, int]:
    """A Decode rank's check of room ROOM whose bytes follow ``written_seed``'s pattern
    and whose token/candidates ``token_seed``'s, ``sent`` candidates of them."""
    workload = Workload(
        rooms=range(ROOM, ROOM + 1), layers=1, head_dim=8, num_pages=8, candidates=expected
    )
    contract = workload.contract(1)
    prompt = workload.prompt_len(ROOM, contract)
    row = PageAllocator(contract).allocate(prompt)
    manifest = build_manifest(contract, row, 0, prompt)
    token, candidates = bootstrap_token_and_candidates(token_seed, ROOM, sent)
    with HostArena.for_contract(contract) as arena:
        fill_room(arena, contract, manifest, seed=written_seed, room=ROOM)
        event = RemotePrefillDone(Workload.rid(ROOM), token, candidates, 0, None)
        return _finish(event, ROOM, (row, manifest), arena, contract, RoleOptions(workload))


def test_a_wrong_seed_is_reported_as_wrong_token_and_wrong_bytes() -> None:
    ok, reason, nbytes = _finished(written_seed=1, token_seed=1, sent=2, expected=2)
    assert (ok, nbytes) == (False, 0)
    assert reason is not None
    assert "bootstrap token/candidates" in reason
    assert "differ from the pattern" in reason
    assert "byte mismatch" in reason
    assert "another seed's pattern (this rank checks seed 0: --seed)" in reason


def test_token_and_bytes_are_reported_apart() -> None:
    ok, reason, _ = _finished(written_seed=1, token_seed=0, sent=2, expected=2)
    assert not ok
    assert reason is not None
    assert reason.startswith("byte mismatch")
    assert "token" not in reason
    ok, reason, _ = _finished(written_seed=0, token_seed=1, sent=2, expected=2)
    assert not ok
    assert reason is not None
    assert "differ from the pattern" in reason
    assert "byte mismatch" not in reason


def test_spec_candidates_zero_and_a_count_mismatch() -> None:
    ok, reason, nbytes = _finished(written_seed=0, token_seed=0, sent=0, expected=0)
    assert (ok, reason) == (True, None)
    assert nbytes > 0
    ok, reason, _ = _finished(written_seed=0, token_seed=0, sent=0, expected=2)
    assert not ok
    assert reason is not None
    assert "this rank expects 2 speculative candidates: --spec-candidates" in reason
    assert "byte mismatch" not in reason


# --- --spec-candidates -------------------------------------------------------------------


@pytest.mark.parametrize("count", [-1, MAX_SPEC_CANDIDATES + 1])
def test_spec_candidates_out_of_range_is_refused(count: int) -> None:
    with pytest.raises(ConfigError, match=r"--spec-candidates must be between 0 and 1024"):
        Workload(rooms=range(1), candidates=count)
    from tspd.cli import main

    for role in ([], ["prefill"], ["decode"]):
        result = CliRunner().invoke(main, ["demo", *role, "--spec-candidates", str(count)])
        assert result.exit_code == 2, result.output
        assert "--spec-candidates must be between 0 and 1024" in result.output


def test_spec_candidates_reach_both_roles_and_default_to_two() -> None:
    assert Workload(rooms=range(1)).candidates == DEFAULT_SPEC_CANDIDATES == 2
    options = DemoOptions(workload=Workload(rooms=range(5, 9), candidates=0))
    for role in ("prefill", "decode"):
        args = _role_args(options, role, 0, 1, "127.0.0.1:1", "")
        assert args[args.index("--spec-candidates") + 1] == "0"
    captured: dict[str, Workload] = {}

    def fake_run(options: DemoOptions, *, quiet: bool) -> DemoSummary:
        captured["workload"] = options.workload
        return DemoSummary(rooms=0)

    from tspd.cli import demo as demo_cli
    from tspd.cli import main

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(demo_cli, "_run_with_progress", fake_run)
        CliRunner().invoke(main, ["demo", "--spec-candidates", "0", "--json"])
        assert captured["workload"].candidates == 0
        CliRunner().invoke(main, ["demo", "--json"])
        assert captured["workload"].candidates == 2


# --- operator text is printed as it is, not as rich markup ------------------------------


def test_the_mooncake_install_hint_keeps_its_extras(capsys: pytest.CaptureFixture[str]) -> None:
    from tspd.cli.demo import _print_summary
    from tspd.engines.base import EngineUnavailable
    from tspd.engines.mooncake import load_mooncake

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "mooncake.engine", None)  # "not installed"
        with pytest.raises(EngineUnavailable) as caught:
            load_mooncake()
    hint = str(caught.value)
    assert "pip install 'tspd[mooncake-cpu]'" in hint
    summary = DemoSummary(
        rooms=1,
        failed=1,
        reasons={7: "peer said [bold]no[/bold] [mooncake-gpu]"},
        errors=[f"prefill-0 did not start or register:\nError: {hint}"],
        failed_sessions={
            "decode-0": {"[::1]:8998": {"rooms": 1, "first_room": 7, "first_reason": "[x] y"}}
        },
    )
    _print_summary(DemoOptions(workload=Workload(rooms=range(7, 8)), host="[red]h"), summary)
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines at spaces
    assert "pip install 'tspd[mooncake-cpu]'" in out
    assert "pip install 'tspd[mooncake-gpu]'" in out
    assert "peer said [bold]no[/bold] [mooncake-gpu]" in out
    assert "decode-0: 1 rooms from Prefill [::1]:8998 failed, first room 7: [x] y" in out
    assert "Mooncake TCP on [red]h" in out
