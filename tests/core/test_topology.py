"""The accepted parallel topology (docs/protocol.md#proto-topology)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core.errors import ConfigError
from tspd.core.topology import (
    MAX_CACHE_TP_SIZE,
    ParallelTopology,
    require_single_dp_without_attention,
)

VALID = {
    "tp_size": 2,
    "tp_rank": 1,
    "cp_size": 1,
    "cp_rank": 0,
    "dp_size": 2,
    "dp_rank": 1,
    "world_size": 4,
    "global_rank": 3,
}


def make(**overrides: int) -> ParallelTopology:
    return ParallelTopology(**{**VALID, **overrides})


def test_valid_topology() -> None:
    topo = make()
    topo.validate()
    topo.require_no_context_parallel()
    assert MAX_CACHE_TP_SIZE == 1024


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tp_size": 0}, "tp_size must be greater than 0, got 0"),
        ({"tp_rank": 2}, "tp_rank must be in [0, 2), got 2"),
        ({"tp_rank": -1}, "tp_rank must be in [0, 2), got -1"),
        ({"cp_size": -1}, "cp_size must be greater than 0, got -1"),
        ({"cp_rank": 1}, "cp_rank must be in [0, 1), got 1"),
        ({"dp_size": 0}, "dp_size must be greater than 0, got 0"),
        ({"dp_rank": 5}, "dp_rank must be in [0, 2), got 5"),
        (
            {"world_size": 8},
            "world_size must equal tp_size * cp_size * dp_size: expected 4, got 8",
        ),
        ({"global_rank": 4}, "global_rank must be in [0, 4), got 4"),
        ({"global_rank": -1}, "global_rank must be in [0, 4), got -1"),
    ],
)
def test_messages(overrides: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        make(**overrides)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("overrides", "first"),
    [
        # tp size before tp rank, tp before cp, cp before dp, dims before world.
        ({"tp_size": 0, "tp_rank": 9}, "tp_size must be greater than 0, got 0"),
        ({"tp_rank": 9, "cp_size": 0}, "tp_rank must be in [0, 2), got 9"),
        ({"cp_rank": 3, "dp_size": 0}, "cp_rank must be in [0, 1), got 3"),
        ({"dp_rank": 3, "world_size": 1}, "dp_rank must be in [0, 2), got 3"),
        (
            {"world_size": 1, "global_rank": 7},
            "world_size must equal tp_size * cp_size * dp_size: expected 4, got 1",
        ),
    ],
)
def test_validation_order(overrides: dict[str, int], first: str) -> None:
    with pytest.raises(ConfigError) as info:
        make(**overrides)
    assert str(info.value) == first


def test_context_parallelism_is_refused_when_a_manager_starts() -> None:
    topo = make(cp_size=2, cp_rank=1, world_size=8, global_rank=7)
    with pytest.raises(ConfigError) as info:
        topo.require_no_context_parallel()
    assert str(info.value) == (
        "CachePD does not support context parallelism: cp_size=2; cp_size must be 1"
    )


def test_tp_rank_need_not_follow_global_rank() -> None:
    # tp_rank is the attention-TP coordinate, not global_rank % (world / dp).
    topo = make(tp_rank=0, dp_rank=0, global_rank=3)
    assert topo.tp_rank == 0
    assert dataclasses.replace(topo, tp_rank=1).tp_rank == 1
    with pytest.raises(ConfigError):
        dataclasses.replace(topo, tp_rank=2)


def test_dp_without_attention() -> None:
    require_single_dp_without_attention(1, dp_attention=False)
    require_single_dp_without_attention(4, dp_attention=True)
    with pytest.raises(
        ConfigError,
        match=r"^If dp_attention is not enabled, dp size must be 1 in disaggregation mode\.$",
    ):
        require_single_dp_without_attention(2, dp_attention=False)


@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 8), st.data())
def test_every_consistent_topology_is_accepted(
    tp: int, cp: int, dp: int, data: st.DataObject
) -> None:
    world = tp * cp * dp
    topo = ParallelTopology(
        tp_size=tp,
        tp_rank=data.draw(st.integers(0, tp - 1)),
        cp_size=cp,
        cp_rank=data.draw(st.integers(0, cp - 1)),
        dp_size=dp,
        dp_rank=data.draw(st.integers(0, dp - 1)),
        world_size=world,
        global_rank=data.draw(st.integers(0, world - 1)),
    )
    assert topo.world_size == world
