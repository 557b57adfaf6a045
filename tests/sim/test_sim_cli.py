"""``tspd sim`` and ``tspd bench sim``; and tspd.sim stays sans-IO."""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

import tspd.sim
from tspd.cli import main
from tspd.sim.transfers import SimEngine

FORBIDDEN_MODULES = ("trio", "zmq", "mooncake", "httpx", "hypercorn", "starlette", "anyio")


def test_importing_the_simulator_pulls_in_no_io_library() -> None:
    modules = [f"tspd.sim.{m.name}" for m in pkgutil.iter_modules(tspd.sim.__path__)]
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN_MODULES!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert out == "", f"tspd.sim imported I/O modules: {out}"


def test_one_run_prints_its_outcome() -> None:
    result = CliRunner().invoke(main, ["sim", "--seed", "3", "--rooms", "40"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("seed 3: ok; 40 rooms; prefill 40 ok 0 failed")


def test_a_violation_exits_1_with_the_seed_the_command_and_the_timeline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(SimEngine, "room_ended", lambda self, room: False)
    args = ["sim", "--seed", "5", "--rooms", "100", "--faults", "abort=0.3,hang=0.02"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "seed 5 violates write-after-end" in result.output
    assert "repeat with: tspd sim --seed 5 --rooms 100 --prefill 2xTP2 --decode 3xTP1" in (
        result.output
    )
    assert "timeline of room" in result.output


def test_a_sweep_totals_its_seeds_and_shows_a_fencing_example() -> None:
    args = ["sim", "--seeds", "3", "--rooms", "40", "--faults", "hang=0.3,late=1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "3 seeds, 120 rooms: 0 seeds broke a strict invariant" in result.output
    assert "fencing (report):" in result.output
    assert "seeds/s" in result.output


def test_bad_arguments_are_usage_errors() -> None:
    result = CliRunner().invoke(main, ["sim", "--prefill", "2xTQ2"])
    assert result.exit_code == 2
    assert "is not like 2xTP2" in result.output


def test_the_benchmark_prints_its_figures() -> None:
    args = ["bench", "sim", "--seeds", "1", "--rooms", "20", "--json"]
    result = CliRunner().invoke(main, args, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert '"seeds_per_second"' in result.output
    assert '"sim_seconds_per_wall_second"' in result.output
    assert '"rooms_per_second"' in result.output


def test_the_benchmark_runs_staged_transfers() -> None:
    args = ["bench", "sim", "--seeds", "2", "--rooms", "30", "--staging", "--json"]
    result = CliRunner().invoke(main, args, env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [row["failing_seeds"] for row in rows] == [0, 0]
    assert all(row["rooms"] == 60 for row in rows)


def test_the_newer_modes_run_from_the_command_line() -> None:
    args = [
        "sim",
        "--seed",
        "2",
        "--rooms",
        "30",
        "--prefill",
        "1xTP2,1xTP1DP2",
        "--decode",
        "1xTP1DP2,1xTP4",
        "--layers",
        "3",
        "--layerwise",
        "--layerwise-interval",
        "2",
        "--faults",
        "bootstrap-crash,sleep",
        "--json",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert '"ok": true' in result.output
    assert '"step_waits"' in result.output
    assert (
        "--decode 1xTP1DP2,1xTP4 --faults bootstrap-crash=1,sleep=1 --fencing report "
        "--layers 3 --layerwise --layerwise-interval 2"
    ) in result.output


def test_an_unknown_fault_lists_the_new_names() -> None:
    result = CliRunner().invoke(main, ["sim", "--faults", "bootstrap-crash,nap"])
    assert result.exit_code == 2
    assert "bootstrap-crash, sleep" in result.output


def test_a_run_replays_alike_in_a_new_process_whatever_its_hash_seed() -> None:
    """A printed ``repeat with:`` line must reproduce the run in a fresh shell: no
    core or model decision may follow the order of a set of strings (the Decode
    core's re-registrations once did, so runs differed between processes)."""
    args = [
        sys.executable, "-c", "from tspd.cli import main; main()",
        "sim", "--seed", "11", "--rooms", "100", "--prefill", "1xTP2,1xTP1DP2",
        "--decode", "1xTP1,1xTP2", "--faults", "all", "--json",
    ]  # fmt: skip
    runs = []
    for hash_seed in ("1", "2", "3"):
        done = subprocess.run(
            args,
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
            timeout=120,
        )
        result = json.loads(done.stdout)
        runs.append({k: v for k, v in result.items() if "wall" not in k and "per_second" not in k})
    assert runs[0] == runs[1] == runs[2]
