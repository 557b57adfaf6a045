"""Whole runs of ``tspd.sim``: deterministic, complete, drained; and the models."""

from __future__ import annotations

import random

from tspd.sim import SimConfig, parse_faults, parse_shapes, run
from tspd.sim.arena import PagePool, TagCodec, check, fill, geometry_for, zero


def _shapes(prefill: str, decode: str) -> dict[str, object]:
    return {
        "prefill": parse_shapes(prefill, what="Prefill", allow_dp=True),
        "decode": parse_shapes(decode, what="Decode", allow_dp=False),
    }


def test_without_faults_every_request_succeeds_on_both_sides() -> None:
    result = run(SimConfig(rooms=120), seed=3)
    assert result.ok, result.failure()
    o = result.outcomes
    assert (o.prefill_succeeded, o.decode_succeeded) == (120, 120)
    assert (o.prefill_failed, o.decode_failed, o.lost) == (0, 0, 0)
    assert result.transfers.landed == result.transfers.writes > 0
    assert not result.fenced
    assert result.stale_registrations == 0


def test_a_seed_repeats_exactly() -> None:
    config = SimConfig(rooms=80, faults=parse_faults("all"))
    first, second = run(config, seed=11), run(config, seed=11)
    assert first.summary().split(" in ")[0] == second.summary().split(" in ")[0]
    assert (first.steps, first.sim_seconds) == (second.steps, second.sim_seconds)
    assert first.network == second.network
    assert first.transfers == second.transfers


def test_the_workload_does_not_depend_on_the_faults() -> None:
    calm = run(SimConfig(rooms=40), seed=5)
    stormy = run(SimConfig(rooms=40, faults=parse_faults("loss=0.2,xfail=0.2")), seed=5)
    assert calm.rooms == stormy.rooms == 40
    assert stormy.network.lost > 0


def test_mixed_tp_sizes_and_dp_groups_move_data() -> None:
    config = SimConfig(rooms=90, **_shapes("1xTP1,1xTP2DP2,1xTP8", "1xTP1,1xTP2,1xTP4"))  # type: ignore[arg-type]
    result = run(config, seed=2)
    assert result.ok, result.failure()
    assert result.outcomes.decode_succeeded == 90


def test_hedged_requests_never_succeed_twice_with_wrong_data() -> None:
    config = SimConfig(
        rooms=100,
        faults=parse_faults("hedge=0.5"),
        **_shapes("1xTP2", "1xTP1,1xTP2"),  # type: ignore[arg-type]
    )
    for seed in range(4):
        result = run(config, seed)
        assert result.ok, result.failure()


def test_crashes_lose_requests_and_restarted_processes_serve_again() -> None:
    config = SimConfig(rooms=150, faults=parse_faults("crash=4"))
    results = [run(config, seed) for seed in range(3)]
    for result in results:
        assert result.ok, result.failure()
    assert sum(r.crashes for r in results) > 0
    assert sum(r.outcomes.lost for r in results) > 0
    assert all(r.outcomes.decode_succeeded > 0 for r in results)


def test_partitions_and_message_faults_end_every_room_with_an_outcome() -> None:
    config = SimConfig(rooms=120, faults=parse_faults("loss=0.05,dup=0.05,reorder=0.3,partition=3"))
    for seed in range(3):
        result = run(config, seed)
        assert result.ok, result.failure()
        o = result.outcomes
        assert o.decode_succeeded + o.decode_failed + o.lost >= 120


def test_an_arena_page_holds_exactly_its_room_and_heads() -> None:
    codec = TagCodec(fields=2, slots=8, page_tokens=4, kv_heads=4)
    wide = geometry_for(1, 0, 4, 8, 4, 16)
    narrow = geometry_for(2, 1, 4, 8, 4, 16)
    assert (wide.local_heads, narrow.local_heads) == (4, 2)
    arena: list[int | None] = [None] * wide.cells
    fill(arena, wide, codec, room_index=7, pages=[3, 5])
    assert check(arena, wide, codec, 7, [3, 5], prompt_len=8) is None
    mismatch = check(arena, wide, codec, 8, [3, 5], prompt_len=8)
    assert mismatch is not None
    assert codec.room_of(mismatch.found or 0) == 7
    zero(arena, wide, [5])
    missing = check(arena, wide, codec, 7, [3, 5], prompt_len=8)
    assert missing is not None
    assert (missing.slot, missing.found) == (1, None)
    # Tokens past the prompt are not checked.
    assert check(arena, wide, codec, 7, [3, 5], prompt_len=4) is None


def test_the_page_pool_hands_out_distinct_pages_and_takes_them_back() -> None:
    pool = PagePool(10, random.Random(0))
    first = pool.take(6)
    assert first is not None
    assert len(set(first)) == 6
    assert 0 not in first
    assert pool.take(5) is None
    assert len(pool) == 4
    pool.give(first)
    assert len(pool) == 10


def test_a_late_write_that_empties_a_later_rooms_page_is_a_fenced_corruption() -> None:
    """Found by a 10,000-seed sweep: a hung write, reported failed, lands seconds
    later with the bytes of a Prefill arena a sleep had emptied, into a page the
    Decode had given to a new room. The engine landing a write after reporting it
    failed is beyond the control plane (docs/architecture.md#write-fencing): the
    mismatch is reported as a fenced corruption, not a broken data invariant."""
    config = SimConfig(
        rooms=100,
        faults=parse_faults(
            "loss=0.01,dup=0.01,reorder=0.1,partition=2,crash=1,xfail=0.01,hang=0.005,"
            "late=0.5,abort=0.02,hedge=0.02,bootstrap-crash=1,sleep=1,garble=0.01"
        ),
        staging=0.5,
        **_shapes("2xTP2", "3xTP1"),  # type: ignore[arg-type]
    )
    result = run(config, 4339)
    assert result.ok, result.failure()
    assert result.fenced_corruptions >= 1
