"""The producer schedule and the step counter: when layerwise KV is readable.

The rules are those of docs/protocol.md#proto-producer-schedule and
docs/protocol.md#proto-step-counter. A Prefill forward writes the KV cache one *producer
step* at a time (each attention layer records a step once it has written its pages; a
drafter records one final step). The device counts completed steps modulo
:data:`STEP_MODULUS` into a pinned host word; the host reserves each forward's whole
range of steps up front and waits for the last step of every transfer interval before
sending that interval's fields.

Everything here is Prefill-local; nothing travels on the wire.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from tspd.core.contract import CacheContract
from tspd.core.errors import ConfigError, ContractError

__all__ = [
    "STEP_MODULUS",
    "ProducerSchedule",
    "StepReservation",
    "interval_steps",
    "interval_targets",
    "reserve",
    "step_ready",
]

STEP_MODULUS: Final = 1 << 62
"""Producer steps are counted modulo this (TokenSpeed's ``COUNT_NUM_MAX``)."""

_HALF: Final = STEP_MODULUS // 2


@dataclass(frozen=True, slots=True)
class ProducerSchedule:
    """Ordered producer steps, each the set of field ids readable once it completes.

    A step may be empty (a layer that owns no cache field still records a step).
    """

    steps: tuple[frozenset[str], ...]

    def __post_init__(self) -> None:
        if not self.steps:
            raise ContractError("cache producer schedule must contain at least one step")
        seen: set[str] = set()
        for step in self.steps:
            if any(not fid for fid in step):
                raise ContractError("cache producer field IDs must be non-empty")
            if not seen.isdisjoint(step):
                raise ContractError("a cache field cannot be produced by multiple steps")
            seen |= step

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def field_ids(self) -> frozenset[str]:
        """Every field some step produces."""
        return frozenset().union(*self.steps)

    def fields_in_range(self, begin: int, end: int) -> frozenset[str]:
        """The fields produced by steps ``[begin, end)``."""
        count = len(self.steps)
        if not 0 <= begin <= end <= count:
            raise ContractError(
                f"cache producer step range [{begin}, {end}) is outside [0, {count})"
            )
        return frozenset().union(*self.steps[begin:end])

    def require_covers(self, field_ids: Iterable[str]) -> None:
        """Refuse a schedule that does not produce exactly ``field_ids`` (the rank's
        resident fields), each once (S3)."""
        if self.field_ids != frozenset(field_ids):
            raise ContractError("cache producer schedule must cover every resident field")

    @classmethod
    def from_contract(cls, contract: CacheContract, num_target_layers: int) -> ProducerSchedule:
        """S1's derivation: one step per target layer holding that layer's fields, then,
        when draft layers exist, one final step holding every draft-layer field (a
        drafter may run its layers repeatedly; all are released at one barrier)."""
        by_layer: defaultdict[int, set[str]] = defaultdict(set)
        for f in contract.plan.fields:
            by_layer[f.layer].add(f.field_id)
        if not by_layer:
            raise ContractError("layerwise PD requires at least one cache field")
        merged = max(by_layer) + 1
        if (
            isinstance(num_target_layers, bool)
            or not isinstance(num_target_layers, int)
            or not 0 < num_target_layers <= merged
        ):
            raise ContractError("PD target layer count is outside the cache plan")
        steps = [frozenset(by_layer.get(layer, ())) for layer in range(num_target_layers)]
        if merged > num_target_layers:
            steps.append(
                frozenset().union(
                    *(ids for layer, ids in by_layer.items() if layer >= num_target_layers)
                )
            )
        return cls(tuple(steps))


def step_ready(counter: int, target: int) -> bool:
    """Whether producer step ``target`` has completed given the counter value
    ``counter``: the counter is strictly past the target, modulo the wrap."""
    return target != counter and (target + STEP_MODULUS - counter) % STEP_MODULUS > _HALF


def _check_interval(interval: int) -> None:
    if interval < 1:
        raise ConfigError(
            f"layerwise transfer interval must be at least 1 producer step, got {interval}; "
            "an interval <= 0 selects the non-layerwise path"
        )


def interval_steps(begin: int, step_count: int, interval: int) -> list[int]:
    """The counter value each interval of a forward is complete at: the forward's
    ``step_count`` steps start at ``begin``; an interval ends at its last step."""
    _check_interval(interval)
    return [
        (begin + min(first + interval, step_count) - 1) % STEP_MODULUS
        for first in range(0, step_count, interval)
    ]


def interval_targets(
    begin: int, schedule: ProducerSchedule, interval: int
) -> list[tuple[int, frozenset[str]]]:
    """Each transfer interval of a forward: the step to wait for and the fields it
    makes readable. ``begin=0`` with 5 steps and interval 2 gives targets 1, 3, 4."""
    _check_interval(interval)
    count = len(schedule)
    return [
        (
            (begin + min(first + interval, count) - 1) % STEP_MODULUS,
            schedule.fields_in_range(first, min(first + interval, count)),
        )
        for first in range(0, count, interval)
    ]


@dataclass(slots=True)
class StepReservation:
    """The host half of the step counter: each forward that runs an extend reserves
    its whole range of producer steps up front, even if no request armed a chunk."""

    reserved: int = 0

    @staticmethod
    def reserve(reserved: int, step_count: int) -> tuple[int, int]:
        """Reserve ``step_count`` steps after ``reserved``: ``(begin, new_reserved)``."""
        if step_count < 0:
            raise ConfigError(f"a forward cannot reserve {step_count} producer steps")
        return reserved, (reserved + step_count) % STEP_MODULUS

    def take(self, step_count: int) -> int:
        """Reserve the next forward's ``step_count`` steps; returns its first step."""
        begin, self.reserved = self.reserve(self.reserved, step_count)
        return begin


reserve = StepReservation.reserve
