"""The simulator can fail: bugs seeded into the rules are caught within a few seeds.

Each test patches one rule of the cores (or of the simulated engine) the way a
plausible bug would break it, runs a few seeds, and requires the named invariant
to catch it, with the seed, the command that repeats it and the room's timeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from tspd.core import manifest as manifest_module
from tspd.core import prefill as prefill_module
from tspd.core import schedule as schedule_module
from tspd.core.bootstrap import ParallelInfo, RankInfo
from tspd.core.copies import CopyPlan, plan_steps
from tspd.core.decode import DecodeCore
from tspd.core.machines import RoomState, TransferState, TransferTrigger
from tspd.core.prefill import PrefillCore
from tspd.core.rooms import RoomTable
from tspd.core.schedule import STEP_MODULUS, ProducerSchedule
from tspd.sim import Check, SimConfig, SimResult, Timings, parse_faults, parse_shapes, run
from tspd.sim.transfers import SimEngine

SEEDS = 12
LAYERWISE = SimConfig(rooms=40, layers=3, layerwise=True, layerwise_interval=2)


def _first_violations(config: SimConfig, seeds: int = SEEDS) -> list[SimResult]:
    return [result for seed in range(seeds) if not (result := run(config, seed)).ok]


def _caught(failures: Sequence[SimResult], check: Check) -> SimResult:
    caught = [r for r in failures if r.violations[0].check is check]
    assert caught, f"no seed caught the bug as {check}: {[str(r.violations[0]) for r in failures]}"
    result = caught[0]
    failure = result.failure()
    assert failure is not None
    text = str(failure)
    assert f"seed {result.seed} violates {check}" in text
    assert f"repeat with: tspd sim --seed {result.seed} " in text
    assert "timeline of room" in text
    return result


def test_a_failed_room_that_a_late_success_resurrects_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seeded bug: the room table lets Success follow Failed, ``ended`` forgets
    that a failed room ended, and a failure does not stop the room's transfer, so a
    transfer finishing after an abort marks the room Success."""
    original_fire = prefill_module._PerRoom.fire

    def fire(self: Any, room: int, trigger: TransferTrigger) -> TransferState:
        if trigger is TransferTrigger.STOPPED:
            return self.transfer(room)  # type: ignore[no-any-return]
        return original_fire(self, room, trigger)

    monkeypatch.setattr(prefill_module._PerRoom, "fire", fire)
    original_init = RoomTable.__init__

    def init(self: RoomTable, machine: Any) -> None:
        original_init(self, machine)
        self._next[(RoomState.FAILED, "transfer_succeeded")] = RoomState.SUCCESS

    monkeypatch.setattr(RoomTable, "__init__", init)
    monkeypatch.setattr(RoomTable, "ended", lambda self, room: self.state(room) is RoomState.ABSENT)
    failures = _first_violations(SimConfig(rooms=100, faults=parse_faults("abort=0.2")))
    result = _caught(failures, Check.STICKY)
    assert "Failed is sticky, but the room went to Success" in result.violations[0].detail


def test_a_skipped_fanout_check_is_caught_by_the_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded bug: a Prefill rank accepts any complete-looking destination set
    (docs/protocol.md#proto-fanout), so a room retried on a Decode instance of
    another TP size gets a Success it has no data for."""
    monkeypatch.setattr(prefill_module, "validate_fanout", lambda members: None)
    config = SimConfig(
        rooms=100,
        prefill=parse_shapes("1xTP1", what="Prefill", allow_dp=True),
        decode=parse_shapes("1xTP1,1xTP2", what="Decode", allow_dp=False),
        faults=parse_faults("hedge=0.5"),
    )
    result = _caught(_first_violations(config), Check.DATA)
    assert "Success, but page" in result.violations[0].detail


def test_the_same_hedged_runs_pass_with_the_fanout_check() -> None:
    config = SimConfig(
        rooms=100,
        prefill=parse_shapes("1xTP1", what="Prefill", allow_dp=True),
        decode=parse_shapes("1xTP1,1xTP2", what="Decode", allow_dp=False),
        faults=parse_faults("hedge=0.5"),
    )
    assert _first_violations(config) == []


def test_an_engine_that_ignores_room_active_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded bug: the transfer workers never check that a room is still
    active, so a room aborted while its transfer waits is written anyway."""
    monkeypatch.setattr(SimEngine, "room_ended", lambda self, room: False)
    failures = _first_violations(SimConfig(rooms=100, faults=parse_faults("abort=0.3,hang=0.02")))
    result = _caught(failures, Check.WRITE_AFTER_END)
    assert "issued after the room ended on this rank" in result.violations[0].detail


def test_a_plan_that_misses_a_copy_is_caught_by_the_data(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded bug: copy planning drops each plan's last copy; every status
    still says Success."""

    def short(**kwargs: Any) -> list[CopyPlan]:
        return [
            CopyPlan(p.src[:-1], p.dst[:-1], p.length[:-1]) if len(p) else p
            for p in plan_steps(**kwargs)
        ]

    monkeypatch.setattr(prefill_module, "plan_steps", short)
    result = _caught(_first_violations(SimConfig(rooms=30), seeds=2), Check.DATA)
    assert "holds nothing" in result.violations[0].detail


def test_a_waiting_timeout_that_never_fires_is_caught_by_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seeded bug: Decode never concludes a request waiting for KV that will
    not come (its pre-allocation was lost, so no Prefill rank will ever answer)."""
    monkeypatch.setattr(DecodeCore, "_check_waiting", lambda self, receiver, now: False)
    failures = _first_violations(SimConfig(rooms=100, faults=parse_faults("loss=0.05")), seeds=4)
    result = _caught(failures, Check.DEADLINE)
    assert "its timeouts allow" in result.violations[0].detail


def test_a_table_that_leaks_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded bug: a Prefill room's recorded usage is never forgotten."""
    original = prefill_module._PerRoom.clear

    def leaky(self: Any, room: int) -> None:
        usage = self.usage.get(room)
        original(self, room)
        if usage is not None:
            self.usage[room] = usage

    monkeypatch.setattr(prefill_module._PerRoom, "clear", leaky)
    failures = _first_violations(SimConfig(rooms=40), seeds=1)
    assert failures, "a leaking table went unnoticed"
    violation = failures[0].violations[0]
    assert violation.check in (Check.BOUNDS, Check.DRAINED)
    assert "usage" in violation.detail


def test_late_writes_break_fencing_reported_by_default_and_failing_when_strict() -> None:
    """A hung write that lands after the engine reported it failed lands in pages
    the Decode already released: no control-plane fencing can stop that."""
    faults = parse_faults("hang=0.2,late=1")
    reported = [run(SimConfig(rooms=60, faults=faults), seed) for seed in range(4)]
    assert all(r.ok for r in reported), [r.failure() for r in reported]
    assert sum(len(r.fenced) for r in reported) > 0
    fenced = next(r for r in reported if r.fenced)
    assert "landed in" in fenced.fenced[0].detail
    assert fenced.fenced[0].room in fenced.timelines
    strict = _first_violations(SimConfig(rooms=60, faults=faults, fencing="strict"), seeds=4)
    _caught(strict, Check.FENCING)


# ---------------------------------------------------------------------- layerwise


def test_an_engine_that_writes_before_its_producer_step_is_caught_by_the_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seeded bug: transfer workers do not wait for an interval's producer step,
    so they copy layers the forward has not computed yet."""
    monkeypatch.setattr(SimEngine, "step_ready", lambda self, target: True)
    result = _caught(_first_violations(LAYERWISE, seeds=2), Check.DATA)
    assert "holds nothing" in result.violations[0].detail


def test_intervals_that_wait_one_step_too_few_are_caught_by_the_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seeded bug: the core's interval targets are one producer step early (an
    off-by-one in the wait), so each interval's last layer is read unwritten."""
    original = schedule_module.interval_targets

    def early(
        begin: int, schedule: ProducerSchedule, interval: int
    ) -> list[tuple[int, frozenset[str]]]:
        return [
            ((step - 1) % STEP_MODULUS, fields)
            for step, fields in original(begin, schedule, interval)
        ]

    monkeypatch.setattr("tspd.core.prefill.interval_targets", early)
    _caught(_first_violations(LAYERWISE, seeds=2), Check.DATA)


def test_a_first_chunk_that_skips_the_cached_prefix_is_caught_by_the_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seeded bug: a room's first layerwise chunk starts at its own boundary
    (docs/protocol.md#proto-layerwise-selection), so the blocks the Prefill found in
    its own prefix cache never reach the Decode."""
    original = manifest_module.select_chunk

    def forgetful(*args: Any, first: bool, **kwargs: Any) -> Any:
        return original(*args, first=False, **kwargs)

    monkeypatch.setattr("tspd.core.prefill.select_chunk", forgetful)
    _caught(_first_violations(LAYERWISE, seeds=2), Check.DATA)


# ---------------------------------------------------------------------- bootstrap crashes


def test_lookup_errors_that_leave_rooms_waiting_are_caught_by_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seeded bug: a Decode rank whose bootstrap lookup fails (the server is
    down, or restarted and waits for its Prefill ranks) leaves the rooms waiting
    for it as they are, instead of failing them with a reason."""
    parallel_info, rank_info = DecodeCore.parallel_info, DecodeCore.rank_info

    def info(self: DecodeCore, addr: str, answer: ParallelInfo | str, now: float) -> None:
        if not isinstance(answer, str):
            parallel_info(self, addr, answer, now)

    def rank(
        self: DecodeCore, addr: str, dp: int, engine_rank: int, answer: RankInfo | str, now: float
    ) -> None:
        if not isinstance(answer, str):
            rank_info(self, addr, dp, engine_rank, answer, now)

    monkeypatch.setattr(DecodeCore, "parallel_info", info)
    monkeypatch.setattr(DecodeCore, "rank_info", rank)
    # Slow arrivals and Decode restarts: ranks look routes up while a server is down
    # or waits for its Prefill ranks.
    config = SimConfig(
        rooms=60,
        prefill=parse_shapes("1xTP2,1xTP1DP2", what="Prefill", allow_dp=True),
        decode=parse_shapes("1xTP1,1xTP2,1xTP4", what="Decode", allow_dp=False),
        faults=parse_faults("bootstrap-crash=3,crash=2"),
        timings=Timings(arrival_rate=10.0),
    )
    result = _caught(_first_violations(config, seeds=3), Check.DEADLINE)
    assert result.bootstrap_crashes > 0


# ---------------------------------------------------------------------- sleep / wake


def test_a_release_check_that_never_refuses_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded bug: ``check_release`` lets a sleep release the arena while
    requests are tracked (docs/protocol.md#proto-sleep-wake), so their KV would be
    sent from freed memory."""
    monkeypatch.setattr(PrefillCore, "check_release", lambda self: None)
    failures = _first_violations(SimConfig(rooms=60, faults=parse_faults("sleep=2")), seeds=4)
    result = _caught(failures, Check.RELEASED)
    assert "accepted while the scheduler tracks" in result.violations[0].detail
