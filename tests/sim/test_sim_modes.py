"""The simulator's newer modes: layerwise streaming, bootstrap server crashes,
Decode attention DP and Prefill sleep/wake. Each runs a few dozen seeds with every
strict invariant held (a known core bug, :mod:`test_sim_known_bugs`, tolerated by
its signature where a mode can reach it) and shows that it models what it claims
to."""

from __future__ import annotations

from collections.abc import Iterable

from test_sim_known_bugs import KNOWN_CORE_BUGS

from tspd.sim import (
    Cluster,
    SimConfig,
    SimResult,
    Timings,
    parse_faults,
    parse_shapes,
    run,
)
from tspd.sim.config import fault_name

PREFILL = parse_shapes("1xTP2,1xTP1DP2", what="Prefill", allow_dp=True)
DECODE = parse_shapes("1xTP1,1xTP2,1xTP4", what="Decode", allow_dp=False)
#: Every fault the modes before these had, at its default rate.
OLD_FAULTS = "loss,dup,reorder,partition,crash,xfail,hang,late,abort,hedge"
LAYERWISE = SimConfig(
    rooms=50, layers=3, layerwise=True, layerwise_interval=2, prefill=PREFILL, decode=DECODE
)
#: Requests arrive slowly enough for outages to overlap them and for heartbeats to
#: notice a dead server.
SLOW = Timings(arrival_rate=20.0)


def _known(result: SimResult) -> bool:
    violation = result.violations[0]
    return any(
        violation.check == check and text in violation.detail
        for check, text in KNOWN_CORE_BUGS.values()
    )


def _runs(
    config: SimConfig, seeds: Iterable[int], *, tolerate_known: bool = False
) -> list[SimResult]:
    results = [run(config, seed) for seed in seeds]
    broken = [r for r in results if not r.ok and not (tolerate_known and _known(r))]
    assert not broken, "\n\n".join(str(r.failure()) for r in broken[:2])
    return results


# ---------------------------------------------------------------------- layerwise


def test_layerwise_without_faults_streams_every_room() -> None:
    result = run(LAYERWISE.with_(rooms=80), seed=4)
    assert result.ok, result.failure()
    o = result.outcomes
    assert (o.prefill_succeeded, o.decode_succeeded) == (80, 80)
    # Chunked forwards: more chunks than rooms, and writes that waited for their step.
    assert result.transfers.chunks > 80 * 1.5
    assert result.transfers.step_waits > 0
    assert result.transfers.landed == result.transfers.writes
    assert "--layers 3 --layerwise --layerwise-interval 2" in result.config.command(4)


def test_layerwise_under_every_fault_keeps_every_strict_invariant() -> None:
    results = _runs(LAYERWISE.with_(faults=parse_faults(OLD_FAULTS)), range(24))
    assert sum(r.transfers.step_waits for r in results) > 0
    assert sum(r.outcomes.decode_succeeded for r in results) > 0


def test_layerwise_with_one_layer_interval_and_mixed_tp_sizes() -> None:
    config = LAYERWISE.with_(
        layers=2,
        layerwise_interval=1,
        prefill=parse_shapes("1xTP1,1xTP8", what="Prefill", allow_dp=True),
        faults=parse_faults("abort=0.2,hedge=0.2,xfail"),
    )
    _runs(config, range(8))


# ---------------------------------------------------------------------- bootstrap crashes


def _bootstrap_failures(config: SimConfig, seeds: Iterable[int]) -> tuple[int, int, set[str]]:
    """Bootstrap crashes, Decode failures and the Decode failure reasons (digits
    dropped) over ``seeds``."""
    crashes = failures = 0
    reasons: set[str] = set()
    for seed in seeds:
        cluster = Cluster(config, seed)
        result = cluster.run()
        assert result.ok, result.failure()
        crashes += result.bootstrap_crashes
        failures += result.outcomes.decode_failed
        for room in cluster.room_index:
            for _, where, what in cluster.timeline.lines(room):
                if where.startswith("d") and what.startswith("failed: "):
                    reasons.add("".join(c for c in what[8:] if not c.isdigit())[:60])
    return crashes, failures, reasons


def test_bootstrap_crashes_fail_lookups_with_a_reason_and_keep_every_invariant() -> None:
    config = SimConfig(
        rooms=50,
        faults=parse_faults("bootstrap-crash=2,crash"),
        timings=SLOW,
        prefill=PREFILL,
        decode=DECODE,
    )
    crashes, failures, reasons = _bootstrap_failures(config, range(12))
    assert crashes > 0
    assert failures > 0
    assert any(r.startswith("Could not fetch") for r in reasons), reasons
    assert config.command(0).split("--faults ")[1].startswith("crash=1,bootstrap-crash=2")


def test_bootstrap_crashes_under_every_fault_keep_every_strict_invariant() -> None:
    config = SimConfig(
        rooms=40,
        faults=parse_faults(OLD_FAULTS + ",bootstrap-crash=2"),
        timings=SLOW,
        prefill=PREFILL,
        decode=DECODE,
    )
    results = _runs(config, range(24))
    assert sum(r.bootstrap_crashes for r in results) > 0


def test_prefill_ranks_that_register_again_bring_a_restarted_server_back() -> None:
    """The shell registers only when a rank starts, so an instance whose bootstrap
    server restarted stays unknown to Decode ranks without a cached route; ranks
    that ``PUT`` again every few seconds bring it back."""
    config = SimConfig(
        rooms=50,
        faults=parse_faults("bootstrap-crash=2"),
        timings=SLOW,
        prefill=PREFILL,
        decode=DECODE,
    )
    again = config.with_(timings=Timings(arrival_rate=20.0, reregister_interval=2.0))
    crashes, once, _ = _bootstrap_failures(config, range(8))
    crashes_again, periodically, _ = _bootstrap_failures(again, range(8))
    assert crashes == crashes_again > 0
    assert periodically < once


# ---------------------------------------------------------------------- Decode DP


def test_decode_dp_groups_serve_their_rooms_and_crash_together() -> None:
    config = SimConfig(
        rooms=60,
        prefill=PREFILL,
        decode=parse_shapes("1xTP1DP2,1xTP2DP2", what="Decode", allow_dp=True),
        faults=parse_faults("crash=2"),
        timings=SLOW,
    )
    crashes = 0
    for seed in range(12):
        cluster = Cluster(config, seed)
        result = cluster.run()
        assert result.ok, result.failure()
        for request in cluster.requests:
            sent = cluster.sent_to.get(request.room)
            if sent:
                assert sent[0] == f"d{request.decode}.{request.room % 2}"
        groups = [g.crashes for groups in cluster.decode_instances for g in groups]
        # The two groups of an instance crash as often as each other.
        assert groups[0::2] == groups[1::2]
        crashes += sum(groups)
    assert crashes > 0


def test_decode_dp_under_every_fault_keeps_every_strict_invariant() -> None:
    config = SimConfig(
        rooms=50,
        prefill=PREFILL,
        decode=parse_shapes("1xTP1DP2,1xTP4,1xTP2DP2", what="Decode", allow_dp=True),
        faults=parse_faults(OLD_FAULTS + ",bootstrap-crash"),
    )
    _runs(config, range(24))


# ---------------------------------------------------------------------- sleep / wake


def test_sleeping_groups_release_and_wake_and_serve_again() -> None:
    config = SimConfig(rooms=100, faults=parse_faults("sleep=2"), prefill=PREFILL, decode=DECODE)
    results = _runs(config, range(12))
    assert sum(r.sleeps for r in results) > 0
    # Without other faults requests still succeed: the sleep only delays them
    # (a few fail as without it: a Decode rank asking before every Prefill rank of
    # an instance registered).
    rooms = sum(r.rooms for r in results)
    assert sum(r.outcomes.decode_succeeded for r in results) >= 0.97 * rooms


def test_sleep_under_every_fault_keeps_every_strict_invariant_but_a_known_bug() -> None:
    config = SimConfig(
        rooms=60,
        faults=parse_faults(OLD_FAULTS + ",sleep=2,bootstrap-crash"),
        prefill=PREFILL,
        decode=DECODE,
    )
    results = _runs(config, range(24), tolerate_known=True)
    assert sum(r.sleeps for r in results) > 0


def test_every_new_fault_has_a_command_line_name() -> None:
    assert fault_name("bootstrap_crash") == "bootstrap-crash"
    assert parse_faults("bootstrap-crash=0.5,sleep").bootstrap_crash == 0.5
    assert parse_faults("bootstrap_crash").sleep == 0.0
