"""Producer schedule and step counter (docs/protocol.md#proto-producer-schedule,
docs/protocol.md#proto-step-counter)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core.contract import (
    CacheContract,
    CacheMemoryPlan,
    FieldSpec,
    GroupSpec,
    Plane,
    PlanGroup,
)
from tspd.core.errors import ConfigError, ContractError
from tspd.core.schedule import (
    STEP_MODULUS,
    ProducerSchedule,
    StepReservation,
    interval_steps,
    interval_targets,
    reserve,
    step_ready,
)
from tspd.testing.layouts import multi_layer_contract

F = frozenset


def contract_with(field_ids: list[str]) -> CacheContract:
    width = max(1, len(field_ids))
    plan = CacheMemoryPlan(
        prefix_granularity=1,
        lcm_block_bytes=width,
        num_lcm_blocks=1,
        groups=(PlanGroup("g", 1, 2),),
        planes=(Plane("p", width, 0),),
        fields=tuple(
            FieldSpec("g", fid, "p", (1,), "uint8", n, width) for n, fid in enumerate(field_ids)
        ),
    )
    spec = GroupSpec("g", "full_history", 1, 1, None, "history", "full_suffix", None)
    return CacheContract(plan, (spec,))


def test_modulus() -> None:
    assert STEP_MODULUS == 2**62


# --------------------------------------------------------------------- schedule


def test_schedule_validation() -> None:
    with pytest.raises(
        ContractError, match=r"^cache producer schedule must contain at least one step$"
    ):
        ProducerSchedule(())
    with pytest.raises(ContractError, match=r"^cache producer field IDs must be non-empty$"):
        ProducerSchedule((F({"a"}), F({""})))
    with pytest.raises(
        ContractError, match=r"^a cache field cannot be produced by multiple steps$"
    ):
        ProducerSchedule((F({"a", "b"}), F(), F({"b"})))
    assert len(ProducerSchedule((F(), F({"a"})))) == 2


def test_fields_in_range() -> None:
    schedule = ProducerSchedule((F({"a"}), F(), F({"b", "c"}), F({"d"})))
    assert schedule.fields_in_range(0, 4) == F("abcd")
    assert schedule.fields_in_range(1, 3) == F("bc")
    assert schedule.fields_in_range(2, 2) == F()
    assert schedule.field_ids == F("abcd")
    for begin, end in ((-1, 2), (3, 2), (0, 5)):
        with pytest.raises(ContractError) as info:
            schedule.fields_in_range(begin, end)
        assert str(info.value) == f"cache producer step range [{begin}, {end}) is outside [0, 4)"


def test_cover_rule() -> None:
    schedule = ProducerSchedule((F({"a"}), F({"b"})))
    schedule.require_covers(["b", "a"])
    for resident in (["a"], ["a", "b", "c"]):
        with pytest.raises(
            ContractError, match=r"^cache producer schedule must cover every resident field$"
        ):
            schedule.require_covers(resident)


def test_s1_derivation_one_step_per_layer() -> None:
    contract = multi_layer_contract(
        layers=3, num_pages=2, heads=1, head_dim=1, with_state_group=True
    )
    schedule = ProducerSchedule.from_contract(contract, 3)
    assert schedule.steps == tuple(
        F({f"layer.{n}.k", f"layer.{n}.v", f"layer.{n}.state"}) for n in range(3)
    )


def test_s1_derivation_draft_layers_share_one_final_step() -> None:
    contract = contract_with(["layer.0.k", "layer.2.k", "layer.3.k", "layer.5.k", "layer.5.v"])
    schedule = ProducerSchedule.from_contract(contract, 3)
    # Layer 1 owns nothing but still records a step; layers 3 and 5 are the drafter's.
    assert schedule.steps == (
        F({"layer.0.k"}),
        F(),
        F({"layer.2.k"}),
        F({"layer.3.k", "layer.5.k", "layer.5.v"}),
    )
    assert len(ProducerSchedule.from_contract(contract, 6)) == 6


@pytest.mark.parametrize("count", [0, -1, 7, True, 2.0])
def test_s1_derivation_target_layer_bounds(count: object) -> None:
    contract = contract_with(["layer.0.k", "layer.5.k"])
    with pytest.raises(ContractError, match=r"^PD target layer count is outside the cache plan$"):
        ProducerSchedule.from_contract(contract, count)  # type: ignore[arg-type]


def test_s1_derivation_needs_fields_owned_by_layers() -> None:
    with pytest.raises(ContractError, match=r"^layerwise PD requires at least one cache field$"):
        ProducerSchedule.from_contract(contract_with([]), 1)
    with pytest.raises(ContractError, match="is not owned by a model layer"):
        ProducerSchedule.from_contract(contract_with(["kv"]), 1)


# --------------------------------------------------------------------- counter


def test_step_ready_is_strict_and_wrap_safe() -> None:
    """R-pd `step_readiness_is_strict_and_survives_the_wrap`."""
    assert not step_ready(0, 0)
    assert not step_ready(STEP_MODULUS - 1, 0)
    assert step_ready(1, 0)
    assert step_ready(0, STEP_MODULUS - 1)
    assert step_ready(10, 3)
    assert not step_ready(3, 10)


@given(st.integers(0, STEP_MODULUS - 1), st.integers(1, 2**61 - 1))
def test_step_ready_within_half_the_range(target: int, ahead: int) -> None:
    past = (target + ahead) % STEP_MODULUS
    behind = (target - ahead) % STEP_MODULUS
    assert step_ready(past, target)
    assert not step_ready(behind, target)
    assert not step_ready(target, target)


def test_interval_targets_examples() -> None:
    """docs/protocol.md#proto-step-counter and R-pd
    `each_interval_completes_at_its_last_producer_step`."""
    assert interval_steps(0, 5, 2) == [1, 3, 4]
    assert interval_steps(0, 3, 1) == [0, 1, 2]
    assert interval_steps(3, 3, 1) == [3, 4, 5]
    assert interval_steps(STEP_MODULUS - 1, 2, 1) == [STEP_MODULUS - 1, 0]
    assert interval_steps(0, 3, 10) == [2]
    assert interval_steps(0, 0, 1) == []
    schedule = ProducerSchedule(tuple(F({f"layer.{n}.k"}) for n in range(5)))
    assert interval_targets(0, schedule, 2) == [
        (1, F({"layer.0.k", "layer.1.k"})),
        (3, F({"layer.2.k", "layer.3.k"})),
        (4, F({"layer.4.k"})),
    ]


@pytest.mark.parametrize("interval", [0, -3])
def test_interval_must_be_positive(interval: int) -> None:
    schedule = ProducerSchedule((F({"a"}),))
    with pytest.raises(ConfigError, match="at least 1"):
        interval_targets(0, schedule, interval)
    with pytest.raises(ConfigError, match="at least 1"):
        interval_steps(0, 1, interval)


@given(st.integers(0, STEP_MODULUS - 1), st.integers(1, 12), st.integers(1, 5))
def test_intervals_cover_every_step_once(begin: int, count: int, interval: int) -> None:
    schedule = ProducerSchedule(tuple(F({f"f{n}"}) for n in range(count)))
    targets = interval_targets(begin, schedule, interval)
    assert [t for t, _ in targets] == interval_steps(begin, count, interval)
    assert targets[-1][0] == (begin + count - 1) % STEP_MODULUS
    seen: set[str] = set()
    for _, fields in targets:
        assert seen.isdisjoint(fields)
        seen |= fields
    assert seen == schedule.field_ids


def test_reservations_advance_modulo() -> None:
    assert reserve(0, 5) == (0, 5)
    assert reserve(STEP_MODULUS - 2, 5) == (STEP_MODULUS - 2, 3)
    assert StepReservation.reserve(7, 0) == (7, 7)
    with pytest.raises(ConfigError):
        reserve(0, -1)
    host = StepReservation()
    assert [host.take(3), host.take(3), host.take(2)] == [0, 3, 6]
    assert host.reserved == 8
    # A forward's targets follow its reservation: the second forward waits on 3, 4, 5.
    assert interval_steps(3, 3, 1) == [3, 4, 5]
