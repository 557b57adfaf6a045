"""``tspd bench hostile`` and ``tspd bench churn`` run end to end in their fast modes and
print their figures (figures only: nothing here checks a speed)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

pytest.importorskip("mooncake.engine")

from tspd.bench import churn, hostile
from tspd.cli import main

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]


def _json(args: list[str]) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["bench", *args, "--json"])
    assert result.exit_code == 0, result.output
    out: dict[str, Any] = json.loads(result.stdout[result.stdout.index("{") :])
    return out


def test_bench_hostile_quick_prints_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(["hostile", "--messages", "2000", "--quick"])
    assert out["messages"] == 2000
    assert set(out["sent_by_socket"]) == {"control", "status", "replay", "live"}
    assert out["messages_per_s"] > 0
    assert out["crashes"] == 0
    assert out["http_requests"] >= 1
    assert "replies_to_attacker_endpoints" in out
    assert "kv_replay_replies" in out
    for side in ("good_rooms_before", "good_rooms_after"):
        assert out[side]["decode"]["ok"] + out[side]["decode"]["failed"] == 5
    assert set(out["processes"]) == {"bootstrap", "prefill", "decode", "events"}
    for name, figures in out["processes"].items():
        for key in ("rss_before", "rss_peak", "rss_after", "fds_before", "fds_after"):
            assert figures[key] > 0, (name, key, figures)
        assert figures["log_lines_warning"] >= 0
    assert out["processes"]["prefill"]["stats_after"]["registrations"] >= 1
    # The same figures as tables (what the command prints without --json).
    hostile.render(out)
    printed = capsys.readouterr().out
    assert "tspd bench hostile" in printed
    assert "crashes" in printed


def test_bench_churn_quick_prints_the_prefill_over_time(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = _json(["churn", "--restarts", "50", "--samples", "5"])
    assert out["restarts"] == 50
    assert out["prefill_alive"] is True
    assert out["rooms_failed_per_restart"] >= 0
    assert sum(out["outcomes"].values()) == 50
    samples = out["samples"]
    assert [s["restarts"] for s in samples] == [0, 10, 20, 30, 40, 50]
    for sample in samples:
        assert sample["rss"] > 0
        assert sample["fds"] > 0
        assert {"sockets", "push_sockets", "registrations", "failed"} <= set(sample)
    churn.render(out)
    assert "restarts/s" in capsys.readouterr().out
