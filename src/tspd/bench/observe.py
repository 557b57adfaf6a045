"""``tspd bench observe``: what observability costs per room, per failure, per scrape.

TokenSpeed's INFO logging costs ~30 % of its rooms/s, so tspd logs per failure, never
per room, and keeps per-room data in traces and metrics instead
(docs/configuration.md#logging). This measures what that data costs, with the same loops
as ``tspd bench rooms`` (best of a few rounds after a warmup):

* a room's trace in a core: seven milestones, a transfer chunk and the finish;
* the metrics of one finished room (outcome, duration, four phases, latency) and
  of one drained command that is not a failure (the common case: ignored);
* one failure's log line through :func:`tspd.log.log_command`: with nothing
  configured (the library's quiet default) and with a ``key=value`` handler
  writing to a discarding stream;
* one scrape of a registry holding a Prefill and a Decode peer.

Figures only; nothing here asserts a speed.
"""

from __future__ import annotations

import io
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import click
from rich.console import Console
from rich.table import Table

from tspd.bench.core import measure
from tspd.core.commands import RoomFailed, SendFrames
from tspd.core.machines import RoomState
from tspd.core.trace import Mark, ReasonClass, RoomTracer, Side
from tspd.log import KeyValueFormatter, log_command
from tspd.shell.metrics import TspdMetrics

__all__ = ["ObserveRow", "observe", "run_observe_benchmarks"]


@dataclass(frozen=True, slots=True)
class ObserveRow:
    """One line of the table."""

    what: str
    micros: float
    per: str


class _Discard(io.TextIOBase):
    """A text stream that drops what it is given (the formatting cost stays)."""

    def write(self, text: str) -> int:
        return len(text)


def _micros(fn: Callable[[], object], quick: bool) -> float:
    return measure(fn, min_seconds=0.002 if quick else 0.2, rounds=1 if quick else 5) * 1e6


def _traced_room(tracer: RoomTracer, room: int) -> None:
    tracer.mark(room, Mark.REGISTERED, 0.0, rid="r")
    tracer.mark(room, Mark.PREALLOCATED, 0.001)
    tracer.mark(room, Mark.BOOTSTRAPPED, 0.001)
    tracer.transfer(room, 4096, 1, 0.002)
    tracer.mark(room, Mark.WRITTEN, 0.003)
    tracer.mark(room, Mark.NOTIFIED, 0.003)
    tracer.finish(room, RoomState.SUCCESS, Mark.CONCLUDED, 0.004)


def run_observe_benchmarks(quick: bool = False) -> list[ObserveRow]:
    """Every measurement, in table order."""
    rows: list[ObserveRow] = []
    tracer = RoomTracer(Side.PREFILL, 0)
    rooms = itertools.count()

    def trace_room() -> None:
        _traced_room(tracer, next(rooms))
        tracer.drain_finished()

    rows.append(
        ObserveRow("room trace: 7 milestones, a chunk, finish", _micros(trace_room, quick), "room")
    )

    metrics = TspdMetrics()
    prefill = metrics.peer("prefill", 0)
    decode = metrics.peer("decode", 0)
    _traced_room(tracer, -1)
    (finished,) = tracer.drain_finished()
    rows.append(
        ObserveRow(
            "metrics: one finished room observed",
            _micros(lambda: prefill.observe_finished(finished), quick),
            "room",
        )
    )
    frames = SendFrames("127.0.0.1", 8000, (b"x",), 1)
    rows.append(
        ObserveRow(
            "metrics: one other command passed over",
            _micros(lambda: prefill.observe_command(frames), quick),
            "command",
        )
    )

    failure = RoomFailed(1, "CachePD transfer failed: benchmark", None, ReasonClass.TRANSFER)
    quiet = logging.getLogger("tspd.bench.quiet")
    quiet.propagate = False
    quiet.addHandler(logging.NullHandler())
    quiet.setLevel(logging.WARNING)
    rows.append(
        ObserveRow(
            "log: failure line, nothing configured",
            _micros(lambda: log_command(quiet, failure, side="prefill", rank=0), quick),
            "failure",
        )
    )
    shown = logging.getLogger("tspd.bench.shown")
    shown.propagate = False
    handler = logging.StreamHandler(_Discard())
    handler.setFormatter(KeyValueFormatter())
    shown.addHandler(handler)
    shown.setLevel(logging.WARNING)
    rows.append(
        ObserveRow(
            "log: failure line, key=value handler",
            _micros(lambda: log_command(shown, failure, side="prefill", rank=0), quick),
            "failure",
        )
    )

    for _ in range(64):
        prefill.observe_command(failure)
        decode.observe_finished(finished)
    counts = {"Bootstrapping": 3, "Bootstrapped": 5, "Failed": 1}
    prefill.watch(rooms_by_state=lambda: counts, statistics=lambda: {"rooms": 9, "traces": 9})
    decode.watch(rooms_by_state=lambda: counts, statistics=lambda: {"rooms": 9, "heartbeats": 4})
    rows.append(ObserveRow("scrape: two peers rendered", _micros(metrics.render, quick), "scrape"))
    return rows


@click.command()
@click.option("--quick", is_flag=True, help="One short round (a smoke run).")
def observe(quick: bool) -> None:
    """Traces, metrics and failure logging costs (figures only)."""
    table = Table(title="tspd observability costs")
    table.add_column("what")
    table.add_column("µs", justify="right")
    table.add_column("per")
    for row in run_observe_benchmarks(quick):
        table.add_row(row.what, f"{row.micros:,.2f}", row.per)
    Console().print(table)
