"""Staged transfers in the simulator (docs/wire.md#staged-transfers, docs/sim.md).

With ``SimConfig.staging`` some instances have a staging region: the real cores
negotiate staged transfers, the simulated engine gathers each staged write's blob
with the real :func:`~tspd.core.staging.gather_blob_parts` and lands it in the
Decode's slot, and the simulated Decode checks it with the real
:func:`~tspd.core.staging.read_blob_table` / :func:`~tspd.core.staging.check_within`
before scattering it into its pages and calling ``staged_done``. These tests
require staging to happen and every invariant (the ``staging`` ones included) to
hold under every fault, and seeded staging bugs to be caught.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pytest
from click.testing import CliRunner

from tspd.cli import main
from tspd.core.commands import DestinationWrite
from tspd.core.decode import DecodeCore
from tspd.core.errors import ConfigError
from tspd.core.prefill import PrefillCore
from tspd.core.wire import StatusMessage
from tspd.sim import Check, SimConfig, SimResult, Timings, parse_faults, parse_shapes, run, sweep
from tspd.sim.cluster import Cluster
from tspd.sim.staging import decode_cells, encode_cells

PREFILL = parse_shapes("1xTP2,1xTP1DP2", what="Prefill", allow_dp=True)
DECODE = parse_shapes("1xTP1,1xTP2,1xTP4", what="Decode", allow_dp=False)
#: The CI sweep's cluster, about seven instances in ten with a staging region.
MIXED = SimConfig(rooms=100, prefill=PREFILL, decode=DECODE, staging=0.7)
#: Every instance has one.
ALL = MIXED.with_(staging=1.0, rooms=60)
JOBS = min(2, os.cpu_count() or 1)


def _failures(config: SimConfig, seeds: int) -> list[SimResult]:
    return [result for seed in range(seeds) if not (result := run(config, seed)).ok]


def _caught(failures: Sequence[SimResult], check: Check, text: str) -> SimResult:
    assert failures, "the seeded bug went unnoticed"
    first = failures[0]
    violation = first.violations[0]
    assert violation.check is check, str(violation)
    assert text in violation.detail, str(violation)
    failure = first.failure()
    assert failure is not None
    assert f"repeat with: tspd sim --seed {first.seed} " in str(failure)
    assert "--staging 1" in str(failure)
    return first


# ---------------------------------------------------------------------- the model


def test_cells_travel_as_tags_in_their_first_eight_bytes() -> None:
    cells = [None, 0, 7, 1 << 40]
    data = encode_cells(cells, 16)
    assert len(data) == 64
    assert data[16:24].tobytes() == (1).to_bytes(8, "little")
    assert not data[24:32].any()
    assert decode_cells(data, 16) == cells


def test_staging_is_off_by_default_and_draws_nothing() -> None:
    """A run without staging builds no region and gives the cores none: its seeds
    replay as before staging existed (the staging draws have a generator of their
    own)."""
    cluster = Cluster(SimConfig(rooms=20), 3)
    assert not any(cluster.prefill_staging)
    assert not any(cluster.decode_staging)
    result = cluster.run()
    assert result.ok
    assert result.staging.slots_offered == 0
    assert result.staging.rooms == 0
    assert "staged" not in result.summary()
    for ranks in (g.ranks for groups in cluster.prefill for g in groups):
        assert all(r.staging is None and r.core.config.staging_bytes == 0 for r in ranks)


def test_a_config_refuses_a_share_outside_zero_to_one() -> None:
    with pytest.raises(ConfigError, match="share of instances"):
        SimConfig(staging=1.5)
    with pytest.raises(ConfigError, match="staging_part_bytes"):
        SimConfig(staging=1.0, staging_part_bytes=0)
    assert SimConfig(staging=0.5).command(4).endswith("--fencing report --staging 0.5")


def test_between_two_staging_instances_every_full_transfer_is_staged() -> None:
    result = run(SimConfig(rooms=40, staging=1.0), 1)
    assert result.ok, result.failure()
    staging = result.staging
    assert staging.prefill_instances == 2
    assert staging.decode_instances == 3
    assert result.outcomes.decode_succeeded == 40
    # 2xTP2 -> 3xTP1: both Prefill ranks of a room write every Decode page.
    assert staging.rooms == 40
    assert staging.scattered == staging.staged_writes == 80
    assert staging.refused == 0
    assert staging.in_place == 0
    assert "; staged 40 rooms (80 blobs scattered, 0 refused)" in result.summary()


def test_a_mixed_cluster_runs_the_negotiated_and_the_declined_paths() -> None:
    """Some instances have a region and some not; rooms too small for a slot, a
    full region and Prefill ranks without staging all fall back to writes in place,
    and every room still gets its data."""
    seen = {"offered": 0, "declined": 0, "to_plain": 0, "in_place": 0, "staged_rooms": 0}
    for seed in range(4):
        result = run(MIXED.with_(staging_bytes=24 << 10), seed)
        assert result.ok, result.failure()
        s = result.staging
        seen["offered"] += s.slots_offered
        seen["declined"] += s.slots_declined
        seen["to_plain"] += s.to_plain_prefill
        seen["in_place"] += s.in_place
        seen["staged_rooms"] += s.rooms
        assert s.scattered == s.scatters
        assert s.refused == 0
    assert all(seen.values()), seen


def test_layerwise_rooms_are_offered_slots_but_never_staged() -> None:
    config = ALL.with_(layers=3, layerwise=True, layerwise_interval=2, rooms=30)
    result = run(config, 2)
    assert result.ok, result.failure()
    assert result.staging.slots_offered > 0
    assert result.staging.staged_writes == 0
    assert result.staging.rooms == 0


# ---------------------------------------------------------------------- faults


def test_a_garbled_blob_is_refused_and_fails_only_its_room() -> None:
    """The ``garble`` fault damages a blob's magic as it lands: the Decode's real
    checks refuse it, the room fails with the refusal, nothing is scattered."""
    results = [run(ALL.with_(faults=parse_faults("garble=0.3")), seed) for seed in range(2)]
    assert all(r.ok for r in results), [r.failure() for r in results]
    refused = sum(r.staging.refused for r in results)
    # A garbled blob whose room failed meanwhile is never scattered.
    assert 0 < refused <= sum(r.staging.garbled for r in results)
    assert all(r.staging.scatters == r.staging.scattered + r.staging.refused for r in results)
    assert sum(r.outcomes.decode_failed for r in results) >= refused / 2


def test_staged_writes_take_every_engine_fault_and_crashes_hit_scatters() -> None:
    config = ALL.with_(
        rooms=100,
        staging_part_bytes=256,
        faults=parse_faults("xfail=0.05,hang=0.02,late=1,crash=2,partition"),
        timings=Timings(scatter_time=0.002),
    )
    results = [run(config, seed) for seed in range(8)]
    assert all(r.ok for r in results), next(r.failure() for r in results if not r.ok)
    assert sum(r.staging.rooms for r in results) > 0
    assert sum(r.staging.scatter_crashes for r in results) > 0
    assert sum(r.transfers.failed for r in results) > 0
    assert sum(r.transfers.hung for r in results) > 0


def test_fifty_seeds_with_staging_and_every_fault_keep_every_strict_invariant() -> None:
    """The staging sweep: the CI sweep's cluster, seven instances in ten with a
    staging region, every fault (garbled blobs included) at its default rate."""
    config = MIXED.with_(faults=parse_faults("all"))
    total = sweep(config, range(50), jobs=JOBS)
    assert total.ok, "\n\n".join(str(r.failure()) for r in total.failures[:3])
    assert total.seeds == 50
    assert total.staged_rooms > 0, "no room was staged"
    assert total.scattered > total.refused


def test_without_late_writes_staging_keeps_fencing_strictly() -> None:
    """Every fault but the engine's own late writes and sleeps: no staged blob lands
    in a slot its room gave up, and no page is written after its room ended."""
    config = MIXED.with_(
        staging=1.0,
        fencing="strict",
        faults=parse_faults(
            "loss,dup,reorder,partition,crash,xfail,hang,abort,hedge,bootstrap-crash,garble"
        ),
    )
    total = sweep(config, range(20), jobs=JOBS)
    assert total.ok, "\n\n".join(str(r.failure()) for r in total.failures[:3])
    assert total.fenced == 0
    assert total.staged_rooms > 0


def test_late_staged_writes_land_in_slots_their_rooms_gave_up_and_are_reported() -> None:
    config = ALL.with_(faults=parse_faults("hang=0.2,late=1"))
    results = [run(config, seed) for seed in range(4)]
    assert all(r.ok for r in results), [r.failure() for r in results]
    late = [v for r in results for v in r.fenced if "late staged write" in v.detail]
    assert late, [str(v) for r in results for v in r.fenced]
    assert "after the room gave its slot up here" in late[0].detail


# ---------------------------------------------------------------------- seeded bugs


def test_a_staged_room_completed_before_its_scatter_is_caught_by_the_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seeded bug: the Decode completes a staged room for a Prefill rank as
    soon as its staged Success arrives, before the blob is scattered."""
    original = DecodeCore._staged_success

    def eager(self: DecodeCore, message: StatusMessage, now: float) -> None:
        original(self, message, now)
        if message.prefill_rank in self._scattering.get(message.room, {}):
            self._completed_by(message.room, message, now)

    monkeypatch.setattr(DecodeCore, "_staged_success", eager)
    _caught(_failures(ALL, 2), Check.DATA, "Success, but page")


def test_a_slot_freed_while_its_room_is_held_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded bug: a failed room's staging slots go back at once, though its
    pages are held because a Prefill rank may still write them, so a late blob
    could land in another room's slot."""
    original = DecodeCore._hold

    def hold(self: DecodeCore, receiver: Any, now: float) -> None:
        original(self, receiver, now)
        self._free_slots(receiver.room)

    monkeypatch.setattr(DecodeCore, "_hold", hold)
    config = ALL.with_(faults=parse_faults("hang=0.05,xfail=0.05"))
    _caught(_failures(config, 3), Check.STAGING, "still holds")


def test_a_scatter_whose_room_is_released_meanwhile_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seeded bug: a staged Success counts its Prefill rank as done with the
    room's pages at once, so a room failing during the scatter returns its pages
    and slot while the scatter still writes them."""
    original = DecodeCore._staged_success

    def early(self: DecodeCore, message: StatusMessage, now: float) -> None:
        original(self, message, now)
        self._ended_by(message.room, message.prefill_rank)

    monkeypatch.setattr(DecodeCore, "_staged_success", early)
    config = ALL.with_(
        faults=parse_faults("xfail=0.1,hang=0.05"), timings=Timings(scatter_time=0.05)
    )
    _caught(_failures(config, 4), Check.STAGING, "before the scatter")


def test_a_prefill_blob_freed_before_its_write_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seeded bug: the Prefill frees a blob's staging bytes as soon as it is
    planned, so the next room's blob is gathered over one still being written."""
    original = PrefillCore._stage

    def stage(
        self: PrefillCore, room: int, destinations: Any, writes: tuple[DestinationWrite, ...]
    ) -> tuple[DestinationWrite, ...]:
        out = original(self, room, destinations, writes)
        for offset in self._staging_held.pop(room, ()):
            self._staging.free(offset)  # type: ignore[union-attr]
        return out

    monkeypatch.setattr(PrefillCore, "_stage", stage)
    _caught(_failures(ALL, 2), Check.STAGING, "blob still holds")


def test_a_success_announcing_the_wrong_blob_length_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The seeded bug: the Prefill's staged Success announces its blob 16 bytes
    short, so the Decode refuses every blob, though nothing damaged them."""
    original = PrefillCore._stage

    def stage(
        self: PrefillCore, room: int, destinations: Any, writes: tuple[DestinationWrite, ...]
    ) -> tuple[DestinationWrite, ...]:
        out = original(self, room, destinations, writes)
        sizes = self._per_room.staged.get(room, {})
        for session in sizes:
            sizes[session] -= 16
        return out

    monkeypatch.setattr(PrefillCore, "_stage", stage)
    result = _caught(_failures(ALL, 2), Check.STAGING, "refused the staged blob")
    assert "lengths sum to" in result.violations[0].detail


# ---------------------------------------------------------------------- the command line


def test_the_command_line_turns_staging_on() -> None:
    result = CliRunner().invoke(main, ["sim", "--seed", "3", "--rooms", "30", "--staging"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("seed 3: ok; 30 rooms; prefill 30 ok 0 failed")
    assert "; staged 30 rooms (" in result.output
    args = ["sim", "--seeds", "2", "--rooms", "30", "--staging", "0.5", "--faults", "garble"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "staged transfers: " in result.output
    args = ["sim", "--seed", "1", "--rooms", "20", "--staging", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert '"scattered": 40' in result.output
    assert "--staging 1" in result.output


def test_a_share_outside_zero_to_one_is_a_usage_error() -> None:
    result = CliRunner().invoke(main, ["sim", "--staging", "2"])
    assert result.exit_code == 2
    assert "--staging" in result.output
