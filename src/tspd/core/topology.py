"""The attention-parallel topology a PD rank runs in (docs/protocol.md#proto-topology)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from tspd.core.errors import ConfigError

__all__ = ["MAX_CACHE_TP_SIZE", "ParallelTopology", "require_single_dp_without_attention"]

MAX_CACHE_TP_SIZE: Final = 1024
"""Largest Prefill or Decode TP size a transfer route may plan for."""


@dataclass(frozen=True, slots=True)
class ParallelTopology:
    """A rank's place in the attention mapping (TokenSpeed's ``PDParallelTopology``).

    ``tp_rank`` is the attention-TP coordinate, not in general
    ``global_rank % (world_size / dp_size)``. Construction validates the fields in the
    specification's order: for tp, cp, dp the size then the rank, then the world size,
    then the global rank.
    """

    tp_size: int
    tp_rank: int
    cp_size: int
    cp_rank: int
    dp_size: int
    dp_rank: int
    world_size: int
    global_rank: int

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first inconsistent value."""
        for name, size, rank in (
            ("tp", self.tp_size, self.tp_rank),
            ("cp", self.cp_size, self.cp_rank),
            ("dp", self.dp_size, self.dp_rank),
        ):
            if size <= 0:
                raise ConfigError(f"{name}_size must be greater than 0, got {size}")
            if not 0 <= rank < size:
                raise ConfigError(f"{name}_rank must be in [0, {size}), got {rank}")
        expected = self.tp_size * self.cp_size * self.dp_size
        if self.world_size != expected:
            raise ConfigError(
                "world_size must equal tp_size * cp_size * dp_size: "
                f"expected {expected}, got {self.world_size}"
            )
        if not 0 <= self.global_rank < self.world_size:
            raise ConfigError(
                f"global_rank must be in [0, {self.world_size}), got {self.global_rank}"
            )

    def require_no_context_parallel(self) -> None:
        """CachePD transfers whole sequences per rank; refuse context parallelism
        (checked when a PD manager starts)."""
        if self.cp_size != 1:
            raise ConfigError(
                "CachePD does not support context parallelism: "
                f"cp_size={self.cp_size}; cp_size must be 1"
            )


def require_single_dp_without_attention(dp_size: int, *, dp_attention: bool) -> None:
    """Without DP attention, disaggregation serves one DP group only
    (docs/protocol.md#proto-room-routing)."""
    if not dp_attention and dp_size != 1:
        raise ConfigError(
            "If dp_attention is not enabled, dp size must be 1 in disaggregation mode."
        )
