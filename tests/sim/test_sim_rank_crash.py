"""The ``rank-crash`` fault: one rank of a TP group dies alone.

Its siblings run on (their workers finish their writes and send their statuses)
until the group's scheduler stalls on the dead rank and, the agreement timeout
later, the group goes down and restarts as in a crash. Every strict invariant must
hold through it; in particular a Decode whose Prefill peers sent ``Success`` while
the dead rank's part never came must fail the room, never complete it.
"""

from __future__ import annotations

import os

from tspd.sim import SimConfig, parse_faults, parse_shapes, run, sweep
from tspd.sim.cluster import Cluster
from tspd.sim.config import FAULT_DEFAULTS, fault_name

PREFILL = parse_shapes("1xTP2,1xTP4", what="Prefill", allow_dp=True)
DECODE = parse_shapes("1xTP2,1xTP1", what="Decode", allow_dp=False)
CONFIG = SimConfig(rooms=100, prefill=PREFILL, decode=DECODE, faults=parse_faults("all"))
#: Every fault but ``rank-crash``, at its default rate.
OTHERS = ",".join(fault_name(name) for name in FAULT_DEFAULTS if name != "rank_crash")


def test_rank_crashes_under_every_fault_keep_every_strict_invariant() -> None:
    assert CONFIG.faults.rank_crash == 1.0
    total = sweep(CONFIG, range(40), jobs=min(2, os.cpu_count() or 1))
    assert total.failures == [], "\n\n".join(str(r.failure()) for r in total.failures[:3])
    assert total.rank_crashes > 0
    assert "rank crashes:" in total.summary()


def test_a_dead_prefill_rank_never_lets_the_decode_complete_the_room() -> None:
    """Surviving Prefill ranks send ``Success`` for rooms the dead rank was writing:
    the Decode must end those rooms ``Failed`` (or lose them with a crash)."""
    config = SimConfig(
        rooms=100,
        prefill=parse_shapes("1xTP4", what="Prefill", allow_dp=False),
        decode=DECODE,
        faults=parse_faults("rank-crash=4"),
    )
    partial: list[tuple[int, int, str]] = []
    for seed in range(30):
        cluster = Cluster(config, seed)
        result = cluster.run()
        assert result.ok, result.failure()
        for room in cluster.sent_to:
            lines = cluster.timeline.lines(room)
            deaths = [(t, w) for t, w, what in lines if what == "the rank dies alone"]
            deaths = [(t, w) for t, w in deaths if w.startswith("p")]
            if not deaths:
                continue
            died, name = deaths[0]
            group = name.rsplit("r", 1)[0]
            if not any(
                t >= died and w.startswith(f"{group}r") and what.endswith("-> Success")
                for t, w, what in lines
            ):
                continue
            ends = [what for _, w, what in lines if w.startswith("d") and "request ends" in what]
            lost = any(w.startswith("d") and "request lost" in what for _, w, what in lines)
            partial.append((seed, room, ends[-1] if ends else "lost"))
            assert lost or (ends and ends[-1].startswith("request ends: Failed: ")), (
                f"seed {seed} room {room}: {ends}\n{cluster.timeline.format(room)}"
            )
    assert partial, "no rank crash hit a room in the middle of its transfer"


def test_a_run_with_rank_crashes_repeats_exactly() -> None:
    seed = next(s for s in range(20) if run(CONFIG.with_(rooms=60), s).rank_crashes)
    first, second = run(CONFIG.with_(rooms=60), seed), run(CONFIG.with_(rooms=60), seed)
    assert first.rank_crashes > 0
    assert first.summary().split(" in ")[0] == second.summary().split(" in ")[0]
    assert (first.steps, first.sim_seconds) == (second.steps, second.sim_seconds)
    assert (first.network, first.transfers) == (second.network, second.transfers)
    assert first.events == second.events


def test_without_a_tp_group_to_hit_the_fault_changes_nothing() -> None:
    """The fault draws after every other one: on TP 1 shapes (nothing to hit) a run
    is the run without it, event for event."""
    shapes = {
        "prefill": parse_shapes("1xTP1,1xTP1DP2", what="Prefill", allow_dp=True),
        "decode": parse_shapes("2xTP1", what="Decode", allow_dp=False),
    }
    for seed in range(3):
        with_it = run(SimConfig(rooms=60, faults=parse_faults("all"), **shapes), seed)  # type: ignore[arg-type]
        without = run(SimConfig(rooms=60, faults=parse_faults(OTHERS), **shapes), seed)  # type: ignore[arg-type]
        assert with_it.rank_crashes == 0
        assert with_it.steps == without.steps
        assert (with_it.network, with_it.transfers) == (without.network, without.transfers)
        assert with_it.events == without.events
        cut = " in "
        assert (
            with_it.summary().split(cut)[0].replace("; rank crashes 0", "")
            == (without.summary().split(cut)[0])
        )


def test_the_fault_is_parsed_formatted_and_counted() -> None:
    faults = parse_faults("rank-crash=2,crash")
    assert (faults.rank_crash, faults.crash) == (2.0, 1.0)
    assert parse_faults("all").rank_crash == FAULT_DEFAULTS["rank_crash"] == 1.0
    config = SimConfig(faults=faults)
    assert "--faults crash=1,rank-crash=2 " in config.command(3)
    assert config.timings.agreement_timeout == 1.0
