"""``tspd sim``: run the cluster simulator for one seed, or sweep many.

One run prints its outcome line; a run that breaks a strict invariant prints the
violation, the command that repeats it and the timeline of the room that broke,
and exits 1::

    tspd sim --seed 7 --rooms 300 --prefill 2xTP2 --decode 3xTP1 \\
        --faults loss=0.01,dup=0.01,reorder,partition,crash

``--seeds N`` sweeps seeds ``first .. first+N-1`` and prints the totals and every
failing seed (exit 1 if any). ``--layerwise`` streams KV layerwise (with
``--layers`` layers and ``--layerwise-interval`` producer steps per interval)
instead of handing over full transfers. ``--staging`` gives every instance (or
``--staging 0.5``: about half of them) a staging region, so that full transfers
between two that have one go staged (docs/wire.md#staged-transfers). Fencing
violations are counted and printed in ``--fencing report`` mode (the default) and
fail the run in ``strict`` mode. See docs/sim.md.
"""

from __future__ import annotations

import json

import click

from tspd.core.errors import ConfigError
from tspd.sim import SimConfig, SimResult, parse_faults, parse_shapes, run, sweep

__all__ = ["sim", "staging_option"]

#: ``--staging [SHARE]``, shared with ``tspd bench sim``.
staging_option = click.option(
    "--staging",
    type=click.FloatRange(0.0, 1.0),
    is_flag=False,
    flag_value=1.0,
    default=0.0,
    show_default=True,
    help="Staged transfers: the share of instances with a staging region (alone: 1, all).",
)


def _config(
    rooms: int,
    prefill: str,
    decode: str,
    faults: str,
    fencing: str,
    layers: int,
    layerwise: bool,
    layerwise_interval: int,
    staging: float = 0.0,
) -> SimConfig:
    try:
        return SimConfig(
            rooms=rooms,
            prefill=parse_shapes(prefill, what="Prefill", allow_dp=True),
            decode=parse_shapes(decode, what="Decode", allow_dp=True),
            faults=parse_faults(faults),
            fencing="strict" if fencing == "strict" else "report",
            layers=layers,
            layerwise=layerwise,
            layerwise_interval=layerwise_interval,
            staging=staging,
        )
    except ConfigError as err:
        raise click.UsageError(str(err)) from err


def _show_fencing(result: SimResult, limit: int) -> None:
    if not result.fenced:
        return
    click.echo(
        f"fencing: {len(result.fenced)} writes landed after their room ended "
        f"({result.fenced_corruptions} corrupted a later room's page); the first:"
    )
    for violation in result.fenced[:limit]:
        click.echo(f"  {violation}")
    room = result.fenced[0].room
    if room is not None and room in result.timelines:
        click.echo(result.timelines[room])


@click.command()
@click.option("--seed", type=int, default=0, show_default=True, help="The seed of one run.")
@click.option(
    "--seeds",
    type=click.IntRange(min=1),
    default=None,
    help="Sweep this many seeds, from --seed on.",
)
@click.option("--rooms", type=click.IntRange(min=0), default=200, show_default=True)
@click.option("--prefill", default="2xTP2", show_default=True, help="Prefill instances.")
@click.option("--decode", default="3xTP1", show_default=True, help="Decode instances.")
@click.option(
    "--faults",
    default="none",
    show_default=True,
    help="Comma-separated faults: loss, dup, reorder, partition, crash, xfail, hang, late, "
    "abort, hedge, bootstrap-crash, sleep, garble, rank-crash (name or name=rate); 'all' turns "
    "every one on.",
)
@click.option(
    "--fencing",
    type=click.Choice(["report", "strict"]),
    default="report",
    show_default=True,
    help="Fencing violations: counted and printed, or failing the run.",
)
@click.option(
    "--layers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Model layers (a K and a V field each).",
)
@click.option(
    "--layerwise",
    is_flag=True,
    help="Stream KV layerwise: chunked forwards, one producer step per layer.",
)
@click.option(
    "--layerwise-interval",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Producer steps per layerwise transfer interval.",
)
@staging_option
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def sim(
    seed: int,
    seeds: int | None,
    rooms: int,
    prefill: str,
    decode: str,
    faults: str,
    fencing: str,
    layers: int,
    layerwise: bool,
    layerwise_interval: int,
    staging: float,
    jobs: int,
    as_json: bool,
) -> None:
    """Simulate a whole PD cluster in virtual time and check its invariants."""
    config = _config(
        rooms, prefill, decode, faults, fencing, layers, layerwise, layerwise_interval, staging
    )
    if seeds is None:
        result = run(config, seed)
        if as_json:
            click.echo(json.dumps(_figures(result), indent=2))
        else:
            click.echo(result.summary())
            _show_fencing(result, 3)
        failure = result.failure()
        if failure is not None:
            click.echo(str(failure), err=True)
            raise SystemExit(1)
        return
    total = sweep(config, range(seed, seed + seeds), jobs=jobs)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "seeds": total.seeds,
                    "rooms": total.rooms,
                    "failing_seeds": [r.seed for r in total.failures],
                    "fenced": total.fenced,
                    "fenced_corruptions": total.fenced_corruptions,
                    "stale_registrations": total.stale_registrations,
                    "staged_rooms": total.staged_rooms,
                    "blobs_scattered": total.scattered,
                    "blobs_refused": total.refused,
                    "wall_seconds": total.wall_seconds,
                    "sim_seconds": total.sim_seconds,
                    "events": total.steps,
                    "seeds_per_second": total.seeds / max(total.wall_seconds, 1e-9),
                    "rooms_per_second": total.rooms / max(total.wall_seconds, 1e-9),
                },
                indent=2,
            )
        )
    else:
        click.echo(total.summary())
        if total.first_fenced is not None:
            click.echo(f"fencing example (seed {total.first_fenced.seed}):")
            _show_fencing(total.first_fenced, 1)
    for result in total.failures:
        click.echo(f"\n{result.failure()}", err=True)
    if total.failures:
        raise SystemExit(1)


def _figures(result: SimResult) -> dict[str, object]:
    o = result.outcomes
    return {
        "seed": result.seed,
        "ok": result.ok,
        "violations": [str(v) for v in result.violations],
        "rooms": result.rooms,
        "prefill_succeeded": o.prefill_succeeded,
        "prefill_failed": o.prefill_failed,
        "decode_succeeded": o.decode_succeeded,
        "decode_failed": o.decode_failed,
        "lost": o.lost,
        "fenced": len(result.fenced),
        "fenced_corruptions": result.fenced_corruptions,
        "stale_registrations": result.stale_registrations,
        "crashes": result.crashes,
        "partitions": result.partitions,
        "bootstrap_crashes": result.bootstrap_crashes,
        "sleeps": result.sleeps,
        "rank_crashes": result.rank_crashes,
        "step_waits": result.transfers.step_waits,
        "staging": {
            name: getattr(result.staging, name)
            for name in result.staging.__dataclass_fields__
            if name != "staged_rooms"
        },
        "sim_seconds": result.sim_seconds,
        "wall_seconds": result.wall_seconds,
        "events": result.steps,
        "command": result.config.command(result.seed),
    }
