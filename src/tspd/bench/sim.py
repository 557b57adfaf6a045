"""``tspd bench sim``: how fast the cluster simulator runs.

Sweeps a few seeds of one configuration (by default the shape the CI sweep uses,
with and without faults) in this process and prints, per configuration: seeds per
second, simulated seconds per wall second, simulated rooms per second and events
per second. A seed's work is its rooms' events plus the timeouts they run into;
simulated time is nearly free, so the faults' timeouts show up as simulated
seconds, not wall seconds. Figures only; nothing here asserts a speed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import click
from rich.console import Console
from rich.table import Table

from tspd.cli.sim import staging_option
from tspd.sim import SimConfig, format_faults, parse_faults, parse_shapes, sweep

__all__ = ["SimFigures", "run_sim_benchmark", "sim"]

#: The faults of the "faults" row: every fault but late writes, at default rates.
BENCH_FAULTS = "loss,dup,reorder,partition,crash,xfail,hang,abort,hedge"


@dataclass(frozen=True, slots=True)
class SimFigures:
    """One configuration's throughput."""

    what: str
    seeds: int
    rooms: int
    failing_seeds: int
    wall_seconds: float
    sim_seconds: float
    events: int

    @property
    def seeds_per_second(self) -> float:
        return self.seeds / self.wall_seconds

    @property
    def sim_per_wall(self) -> float:
        return self.sim_seconds / self.wall_seconds

    @property
    def rooms_per_second(self) -> float:
        return self.rooms / self.wall_seconds

    @property
    def events_per_second(self) -> float:
        return self.events / self.wall_seconds


def run_sim_benchmark(config: SimConfig, seeds: int, what: str) -> SimFigures:
    """Sweep ``seeds`` seeds of ``config`` and time it."""
    total = sweep(config, range(seeds))
    return SimFigures(
        what=what,
        seeds=total.seeds,
        rooms=total.rooms,
        failing_seeds=len(total.failures),
        wall_seconds=max(total.wall_seconds, 1e-9),
        sim_seconds=total.sim_seconds,
        events=total.steps,
    )


@click.command()
@click.option("--seeds", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--rooms", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--prefill", default="2xTP2", show_default=True)
@click.option("--decode", default="3xTP1", show_default=True)
@click.option("--faults", default=BENCH_FAULTS, show_default=True, help="Faults of the second row.")
@click.option("--layers", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--layerwise", is_flag=True, help="Stream KV layerwise (see tspd sim).")
@click.option("--layerwise-interval", type=click.IntRange(min=1), default=1, show_default=True)
@staging_option
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def sim(
    seeds: int,
    rooms: int,
    prefill: str,
    decode: str,
    faults: str,
    layers: int,
    layerwise: bool,
    layerwise_interval: int,
    staging: float,
    as_json: bool,
) -> None:
    """Simulator throughput: seeds/s, simulated s per wall s, rooms/s (figures only)."""
    base = SimConfig(
        rooms=rooms,
        prefill=parse_shapes(prefill, what="Prefill", allow_dp=True),
        decode=parse_shapes(decode, what="Decode", allow_dp=True),
        layers=layers,
        layerwise=layerwise,
        layerwise_interval=layerwise_interval,
        staging=staging,
    )
    with_faults = base.with_(faults=parse_faults(faults))
    rows = [
        run_sim_benchmark(base, seeds, "no faults"),
        run_sim_benchmark(with_faults, seeds, "faults"),
    ]
    if as_json:
        click.echo(
            json.dumps(
                [
                    {
                        "what": r.what,
                        "seeds": r.seeds,
                        "rooms": r.rooms,
                        "failing_seeds": r.failing_seeds,
                        "seeds_per_second": r.seeds_per_second,
                        "sim_seconds_per_wall_second": r.sim_per_wall,
                        "rooms_per_second": r.rooms_per_second,
                        "events_per_second": r.events_per_second,
                    }
                    for r in rows
                ],
                indent=2,
            )
        )
        return
    mode = f", layerwise ({layers} layers, interval {layerwise_interval})" if layerwise else ""
    if staging:
        mode += f", staging on {staging:.0%} of instances"
    table = Table(
        title=f"tspd bench sim: {seeds} seeds of {rooms} rooms, {prefill} -> {decode}{mode}",
        caption=f"faults: {format_faults(with_faults.faults)}",
    )
    for column in ("what", "seeds/s", "sim s / wall s", "rooms/s", "events/s", "failing seeds"):
        table.add_column(column, justify="left" if column == "what" else "right")
    for r in rows:
        table.add_row(
            r.what,
            f"{r.seeds_per_second:,.1f}",
            f"{r.sim_per_wall:,.0f}",
            f"{r.rooms_per_second:,.0f}",
            f"{r.events_per_second:,.0f}",
            str(r.failing_seeds),
        )
    Console().print(table)
