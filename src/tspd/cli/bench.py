"""``tspd bench ...``: benchmarks that print figures (never pass/fail)."""

from __future__ import annotations

import click

from tspd.cli import LazyGroup

__all__ = ["bench"]

# name -> "module:attribute" of the benchmark's click command.
_BENCHMARKS: dict[str, str] = {
    "core": "tspd.bench.core:core",
    "pd": "tspd.bench.pd:pd",
    "events": "tspd.bench.events:events",
    "rooms": "tspd.bench.rooms:rooms",
    "observe": "tspd.bench.observe:observe",
    "hostile": "tspd.bench.hostile:hostile",
    "churn": "tspd.bench.churn:churn",
    "sim": "tspd.bench.sim:sim",
}


@click.group(cls=LazyGroup, lazy=_BENCHMARKS)
def bench() -> None:
    """Measure tspd (figures only; nothing here asserts a speed)."""
