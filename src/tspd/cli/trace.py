"""``tspd trace``: one room's milestones on every rank, from their metrics endpoints.

Each Prefill and Decode process serving metrics (``--metrics-port``) also serves
the traces its cores keep: live rooms, and rooms that failed or ran slow. Point
this command at every endpoint of a deployment and it merges one room's traces
into a single timeline on the Unix clock (each process converts its own clock),
then prints each rank's outcome, failure reason and phase durations::

    tspd trace 1000042 --from 127.0.0.1:9100 --from 127.0.0.1:9101

Without a room it lists the recently kept traces of every endpoint. Times across
hosts are only as close as the hosts' clocks.
"""

from __future__ import annotations

import json
from typing import Any

import click
import httpx

__all__ = ["fetch_traces", "trace"]


def _base(endpoint: str) -> str:
    endpoint = endpoint.rstrip("/")
    if endpoint.endswith("/metrics"):
        endpoint = endpoint[: -len("/metrics")]
    return endpoint if "://" in endpoint else f"http://{endpoint}"


def fetch_traces(
    endpoints: list[str], room: int | None, *, timeout: float = 5.0
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every trace of ``room`` (every kept trace when ``None``) the endpoints hold,
    and a line per endpoint that could not answer."""
    traces: list[dict[str, Any]] = []
    problems: list[str] = []
    path = "/traces" if room is None else f"/traces/{room}"
    with httpx.Client(timeout=timeout) as client:
        for endpoint in endpoints:
            url = _base(endpoint) + path
            try:
                response = client.get(url)
            except httpx.HTTPError as err:
                problems.append(f"{url}: {err}")
                continue
            if response.status_code == 404:
                continue
            if response.status_code != 200:
                problems.append(f"{url}: HTTP {response.status_code}: {response.text.strip()}")
                continue
            for entry in response.json():
                entry["endpoint"] = endpoint
                traces.append(entry)
    return traces, problems


def _who(entry: dict[str, Any]) -> str:
    return f"{entry['side']} rank {entry['rank']}"


def _print_room(room: int, traces: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    marks = sorted(
        (when, _who(entry), mark) for entry in traces for mark, when in entry["marks_unix"]
    )
    start = marks[0][0]
    timeline = Table(title=f"room {room}: milestones on every rank")
    timeline.add_column("+ms", justify="right")
    timeline.add_column("rank")
    timeline.add_column("milestone")
    # What the endpoints sent is text, never markup (rich would eat "[...]" in it).
    for when, who, mark in marks:
        timeline.add_row(f"{(when - start) * 1e3:.3f}", escape(who), escape(str(mark)))
    console.print(timeline)
    for entry in sorted(traces, key=_who):
        outcome = escape(str(entry["outcome"] or "live"))
        line = f"[bold]{escape(_who(entry))}[/bold] ({escape(entry['endpoint'])}): {outcome}"
        if entry["reason"]:
            why = f"[{entry['reason_class']}] {entry['reason']}"
            line += f" [red]{escape(why)}[/red]"
        console.print(line)
        phases = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in entry["phases"].items())
        if phases:
            console.print(f"  phases: {phases}", markup=False)
        if entry["bytes"]:
            console.print(
                f"  {entry['bytes']} bytes in {entry['descriptors']} descriptors, "
                f"{entry['chunks']} chunk(s)"
            )


def _print_recent(traces: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="recently kept traces (failed, dropped or slow rooms)")
    for column in ("room", "rank", "outcome", "class", "ms", "reason"):
        table.add_column(column, justify="right" if column in ("room", "ms") else "left")
    for entry in sorted(traces, key=lambda e: e["started_unix"]):
        table.add_row(
            str(entry["room"]),
            escape(_who(entry)),
            escape(str(entry["outcome"] or "live")),
            escape(str(entry["reason_class"] or "")),
            f"{entry['duration'] * 1e3:.1f}",
            escape(entry["reason"] or ""),
        )
    Console().print(table)


@click.command()
@click.argument("room", type=int, required=False)
@click.option(
    "--from",
    "endpoints",
    multiple=True,
    required=True,
    help="A metrics endpoint, host:port or URL (repeat for every process).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the traces as JSON.")
@click.option("--timeout", default=5.0, show_default=True, help="Seconds per endpoint.")
def trace(room: int | None, endpoints: tuple[str, ...], as_json: bool, timeout: float) -> None:
    """Show ROOM's trace on every rank (or, without ROOM, every kept trace)."""
    traces, problems = fetch_traces(list(endpoints), room, timeout=timeout)
    for problem in problems:
        click.echo(f"warning: {problem}", err=True)
    if as_json:
        click.echo(json.dumps(traces, indent=2))
    elif room is None:
        _print_recent(traces)
    elif traces:
        _print_room(room, traces)
    if room is not None and not traces:
        raise click.ClickException(
            f"no endpoint holds a trace of room {room}: it may never have reached them, "
            "or it succeeded quickly (only live, failed and slow rooms are kept)"
        )
