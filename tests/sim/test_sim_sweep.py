"""The CI sweep: 200 seeds of a mixed cluster with every fault on.

Prefill: one TP2 instance and one instance of two TP1 DP groups; Decode: TP1,
TP2 and TP4 instances; faults: all of them at their default rates, late writes,
bootstrap server crashes, Prefill sleeps and lone rank crashes included. 160 seeds
hand KV over in full transfers (300 rooms each; half the instances, drawn per seed,
have a staging region, so staged and plain rooms and the fallbacks between them
all run) and 40 stream it layerwise (3 layers, 2 per interval; 150 rooms each, a
layerwise room costing about twice as much). No seed
may break a strict invariant, except a core bug the simulator found and
:mod:`test_sim_known_bugs` reproduces (tolerated by its signature, and counted).
Late writes the engine itself lands after reporting them failed can reach released
pages: they are counted and reported as a warning, as are stale registrations;
without them, fencing is checked strictly.
"""

from __future__ import annotations

import os
import warnings

from test_sim_known_bugs import KNOWN_CORE_BUGS

from tspd.sim import SimConfig, SimResult, SweepResult, parse_faults, parse_shapes, sweep

SEEDS = 200
LAYERWISE_SEEDS = 40
CONFIG = SimConfig(
    rooms=300,
    prefill=parse_shapes("1xTP2,1xTP1DP2", what="Prefill", allow_dp=True),
    decode=parse_shapes("1xTP1,1xTP2,1xTP4", what="Decode", allow_dp=False),
    faults=parse_faults("all"),
    staging=0.5,
)
LAYERWISE = CONFIG.with_(rooms=150, layers=3, layerwise=True, layerwise_interval=2, staging=0.0)


class SimReport(UserWarning):
    """What the CI sweep reports without failing on it."""


def _known(result: SimResult) -> str | None:
    violation = result.violations[0]
    for name, (check, text) in KNOWN_CORE_BUGS.items():
        if violation.check == check and text in violation.detail:
            return name
    return None


def test_two_hundred_seeds_keep_every_strict_invariant() -> None:
    jobs = min(2, os.cpu_count() or 1)
    full = sweep(CONFIG, range(SEEDS - LAYERWISE_SEEDS), jobs=jobs)
    layerwise = sweep(LAYERWISE, range(SEEDS - LAYERWISE_SEEDS, SEEDS), jobs=jobs)
    total = SweepResult(CONFIG)
    for part in (full, layerwise):
        for name in ("seeds", "rooms", "fenced", "fenced_seeds", "fenced_corruptions"):
            setattr(total, name, getattr(total, name) + getattr(part, name))
        total.stale_registrations += part.stale_registrations
        total.wall_seconds += part.wall_seconds
        total.failures += part.failures
    assert total.seeds == SEEDS
    unknown = [r for r in total.failures if _known(r) is None]
    assert not unknown, "\n\n".join(str(r.failure()) for r in unknown[:3])
    known: dict[str, list[int]] = {}
    for result in total.failures:
        known.setdefault(_known(result) or "", []).append(result.seed)
    assert total.fenced > 0, "late writes were on: the fencing check should have seen some"
    assert full.staged_rooms > 0, "half the instances stage: some rooms should have gone staged"
    warnings.warn(
        SimReport(
            f"tspd.sim CI sweep: {total.seeds} seeds ({layerwise.seeds} layerwise), "
            f"{total.rooms} rooms ({full.staged_rooms} staged) in {total.wall_seconds:.1f}s; "
            f"fencing ({CONFIG.fencing}): "
            f"{total.fenced} late writes in {total.fenced_seeds} seeds "
            f"({total.fenced_corruptions} corrupted a later room's page); stale "
            f"registrations: {total.stale_registrations}; known core bugs tolerated: "
            f"{known or 'none'}"
        ),
        stacklevel=1,
    )


def test_without_engine_late_writes_fencing_holds_strictly() -> None:
    """Every fault but the engine's own late writes (a write reported failed that
    lands anyway, which no control plane can stop) and sleeps (which can reach the
    known core bug): tspd's write fencing keeps every write inside pages its room
    still owns (docs/architecture.md#write-fencing)."""
    config = SimConfig(
        rooms=200,
        prefill=CONFIG.prefill,
        decode=CONFIG.decode,
        faults=parse_faults(
            "loss,dup,reorder,partition,crash,xfail,hang,abort,hedge,bootstrap-crash"
        ),
        fencing="strict",
    )
    total = sweep(config, range(100), jobs=min(2, os.cpu_count() or 1))
    assert total.failures == [], "\n\n".join(str(r.failure()) for r in total.failures[:3])
    assert total.fenced == 0
