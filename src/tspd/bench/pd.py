"""``tspd bench pd``: the PD control plane's figures beside the raw limits of the same run.

Every tspd figure comes from real processes on 127.0.0.1 — a bootstrap server, one
Prefill rank and one Decode rank (``tspd demo`` roles), Mooncake over TCP, bytes
verified on the Decode side — and is printed beside the raw limit measured in the
same run, straight through Mooncake and pyzmq with no tspd code in between:

* **rooms/s** with small rooms (one 4 KiB page each) and many in flight, and the
  **CPU seconds per room** of each side over that run; beside them, a bare 4 KiB
  Mooncake write and a bare ZMQ round trip;
* **hand-over → Decode completion** p50/p99 with one room in flight (the Prefill's
  hand-over call to the Decode scheduler's completion event); beside it, the same
  bare write and round trip. It runs twice: with each rank's scheduler a Trio task
  beside its peer, and a plain thread reaching its peer through
  :mod:`tspd.hosts.threads` (``tspd demo prefill|decode --driver thread``), as
  TokenSpeed's, SGLang's and vLLM's schedulers are threads; for both, how long
  after a room ended on the Decode peer its scheduler saw it, beside a bare thread
  wake-up (:func:`~tspd.bench.raw.measure_thread_wake`);
* **effective GB/s for a 64 MiB room** of 16,384 × 4 KiB pages, allocated
  contiguously and scattered (bytes / hand-over → completion); beside them, one
  64 MiB write and the same bytes as 16,384 separate descriptors, each timed two
  ways (:mod:`tspd.bench.raw`): in Mooncake's sync calls (1,024 descriptors a
  call, one after another, each busy-spinning its thread) and pipelined as tspd
  writes (batches submitted without waiting, two in flight, waited for without
  spinning). On a 2-core host the spinning sync calls are the slower, so the
  pipelined figure is the tighter limit. Both are timed back to back, while each
  room's write follows a pause (the forward before it, the byte check after the
  room before): with BBR as the host's TCP congestion control such a write starts
  slow (docs/configuration.md, "Host settings"), so the rows' raw column names the
  host's setting.

With ``--secure`` the rooms/s and hand-over runs are repeated in tspd's secure mode
(CURVE on every socket, the bootstrap server over TLS with a token;
docs/security.md) and printed beside the plain figures, with the difference.

Nothing here asserts a speed; the figures depend on the machine (on a 2-core VM
every Mooncake write busy-spins a core, so the processes compete for CPU).

The ranks hold their per-room report lines until they finish (``--hold-reports``):
the timestamps are taken as things happen, but no pipe write, and no wake-up of
the orchestrator reading it, lands inside the measured hand-over → completion
window (on a 2-core host those cost ~100 µs of a ~700 µs p50).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import click
import trio

from tspd.bench.core import one_field_contract
from tspd.bench.raw import (
    MooncakeLimit,
    ThreadWake,
    ZmqLimit,
    measure_mooncake,
    measure_thread_wake,
    measure_zmq_rtt,
    tcp_congestion_control,
)
from tspd.demo.orchestrate import DemoOptions, DemoSummary, percentile, run_demo
from tspd.demo.workload import Workload

__all__ = ["STAGED_ROW", "PdFigures", "pd", "run_pd_bench"]

PAGE = 4096
BIG_PAGES = 16384  # 64 MiB in 4 KiB pages
#: Each rank's staging region for the staged row: one 64 MiB room's blob, with room
#: for the next one's (docs/wire.md#staged-transfers).
STAGING_MIB = 160
_HOLD = ("--hold-reports",)


@dataclass(frozen=True, slots=True)
class PdFigures:
    """Everything ``tspd bench pd`` measured."""

    throughput: DemoSummary | None
    latency: DemoSummary | None
    contiguous: DemoSummary
    scattered: DemoSummary
    in_flight: int
    small_write: MooncakeLimit | None
    big_write: MooncakeLimit
    big_scattered_write: MooncakeLimit
    zmq: ZmqLimit | None
    #: The same two writes pipelined (see the module docstring), else ``None``.
    big_write_pipelined: MooncakeLimit | None = None
    big_scattered_pipelined: MooncakeLimit | None = None
    #: The rooms/s and hand-over runs in secure mode (``--secure``), else ``None``.
    secure_throughput: DemoSummary | None = None
    secure_latency: DemoSummary | None = None
    #: The scattered 64 MiB rooms sent staged between the two tspd peers.
    staged: DemoSummary | None = None
    #: The hand-over run again with both schedulers plain threads
    #: (``tspd demo prefill|decode --driver thread``), and a bare thread wake-up.
    thread_latency: DemoSummary | None = None
    thread_wake: ThreadWake | None = None
    #: The host's TCP congestion control (:func:`~tspd.bench.raw.tcp_congestion_control`).
    tcp_congestion_control: str = "unknown"


def _contract_file(directory: str, pages: int) -> str:
    path = Path(directory) / f"contract-{pages}.json"
    path.write_bytes(one_field_contract(num_pages=pages, page_bytes=PAGE).to_json())
    return str(path)


async def _demo(
    workload: Workload,
    *,
    in_flight: int,
    scatter: bool = False,
    secure: bool = False,
    staging_mib: int = 0,
    driver_args: tuple[str, ...] = (),
) -> DemoSummary:
    summary = await run_demo(
        DemoOptions(
            workload=workload,
            prefill_tp=1,
            decode_tp=1,
            in_flight=in_flight,
            scatter=scatter,
            staging_mib=staging_mib,
            timeout=600,
            prefill_args=(*_HOLD, *driver_args),
            decode_args=(*_HOLD, *driver_args),
            secure=secure,
        )
    )
    if summary.errors:
        raise click.ClickException("benchmark run failed: " + "; ".join(summary.errors))
    return summary


async def run_pd_bench(
    *,
    quick: bool = False,
    secure: bool = False,
    large_only: bool = False,
    large_rooms: int | None = None,
) -> PdFigures:
    """Run every measurement (``quick``: far fewer rooms, for smoke tests; ``secure``:
    the rooms/s and hand-over runs in secure mode too; ``large_only``: only the
    64 MiB rows and their raw limits; ``large_rooms``: 64 MiB rooms per layout,
    default 3, 1 with ``quick``)."""
    small_rooms = 300 if quick else 4000
    latency_rooms = 40 if quick else 400
    big_rooms = large_rooms if large_rooms is not None else (1 if quick else 3)
    if big_rooms < 1:
        raise ValueError(f"large_rooms must be at least 1, got {big_rooms}")
    in_flight = 64 if quick else 256
    throughput = latency = secure_throughput = secure_latency = thread_latency = None
    with tempfile.TemporaryDirectory(prefix="tspd-bench-pd-") as directory:
        small = _contract_file(directory, in_flight + 8)
        big = _contract_file(directory, BIG_PAGES + 8)
        if not large_only:
            throughput = await _demo(
                Workload(
                    rooms=range(1, 1 + small_rooms), contract_file=small, fixed_prompt_pages=1
                ),
                in_flight=in_flight,
            )
            latency = await _demo(
                Workload(
                    rooms=range(1, 1 + latency_rooms), contract_file=small, fixed_prompt_pages=1
                ),
                in_flight=1,
            )
            thread_latency = await _demo(
                Workload(
                    rooms=range(1, 1 + latency_rooms), contract_file=small, fixed_prompt_pages=1
                ),
                in_flight=1,
                driver_args=("--driver", "thread"),
            )
        if secure and not large_only:
            secure_throughput = await _demo(
                Workload(
                    rooms=range(1, 1 + small_rooms), contract_file=small, fixed_prompt_pages=1
                ),
                in_flight=in_flight,
                secure=True,
            )
            secure_latency = await _demo(
                Workload(
                    rooms=range(1, 1 + latency_rooms), contract_file=small, fixed_prompt_pages=1
                ),
                in_flight=1,
                secure=True,
            )
        contiguous = await _demo(
            Workload(
                rooms=range(1, 1 + big_rooms), contract_file=big, fixed_prompt_pages=BIG_PAGES
            ),
            in_flight=1,
        )
        scattered = await _demo(
            Workload(
                rooms=range(1, 1 + big_rooms), contract_file=big, fixed_prompt_pages=BIG_PAGES
            ),
            in_flight=1,
            scatter=True,
        )
        staged = await _demo(
            Workload(
                rooms=range(1, 1 + big_rooms), contract_file=big, fixed_prompt_pages=BIG_PAGES
            ),
            in_flight=1,
            scatter=True,
            staging_mib=STAGING_MIB,
        )
    small_write = zmq_rtt = thread_wake = None
    if not large_only:
        small_write = await trio.to_thread.run_sync(
            lambda: measure_mooncake(PAGE, repeats=200 if quick else 2000)
        )
    big_write = await trio.to_thread.run_sync(
        lambda: measure_mooncake(BIG_PAGES * PAGE, repeats=3 if quick else 9)
    )
    big_scattered_write = await trio.to_thread.run_sync(
        lambda: measure_mooncake(BIG_PAGES * PAGE, descriptors=BIG_PAGES, repeats=2 if quick else 5)
    )
    big_write_pipelined = await trio.to_thread.run_sync(
        lambda: measure_mooncake(BIG_PAGES * PAGE, repeats=3 if quick else 9, mode="pipelined")
    )
    big_scattered_pipelined = await trio.to_thread.run_sync(
        lambda: measure_mooncake(
            BIG_PAGES * PAGE, descriptors=BIG_PAGES, repeats=2 if quick else 5, mode="pipelined"
        )
    )
    if not large_only:
        zmq_rtt = await trio.to_thread.run_sync(
            lambda: measure_zmq_rtt(repeats=300 if quick else 3000)
        )
        thread_wake = await trio.to_thread.run_sync(
            lambda: measure_thread_wake(repeats=300 if quick else 3000)
        )
    return PdFigures(
        throughput=throughput,
        latency=latency,
        contiguous=contiguous,
        scattered=scattered,
        in_flight=in_flight,
        small_write=small_write,
        big_write=big_write,
        big_scattered_write=big_scattered_write,
        big_write_pipelined=big_write_pipelined,
        big_scattered_pipelined=big_scattered_pipelined,
        zmq=zmq_rtt,
        secure_throughput=secure_throughput,
        secure_latency=secure_latency,
        staged=staged,
        thread_latency=thread_latency,
        thread_wake=thread_wake,
        tcp_congestion_control=tcp_congestion_control(),
    )


def _us(seconds: float) -> str:
    if math.isnan(seconds):
        return "n/a"
    return f"{seconds * 1e6:,.0f} µs" if seconds < 1e-2 else f"{seconds * 1e3:,.1f} ms"


def _room_gbps(summary: DemoSummary) -> float:
    if not summary.handover_latencies:
        return math.nan
    return BIG_PAGES * PAGE / percentile(summary.handover_latencies, 0.5) / 1e9


def _ok(summary: DemoSummary) -> str:
    """Nothing when every room passed; else the count of failed rooms, with the
    first one's reason (or the run's first error) and the last lines of each rank's
    log, so a failed row says why."""
    if summary.ok:
        return ""
    if summary.reasons:
        room, reason = min(summary.reasons.items())
        why = f": room {room}: {reason}"[:_WHY_CHARS]
    elif summary.errors:
        why = f": {summary.errors[0]}"[:_WHY_CHARS]
    else:
        why = ""
    logs = "".join(
        f"; {name} log: ...{tail[-_LOG_CHARS:]}"
        if len(tail) > _LOG_CHARS
        else f"; {name} log: {tail}"
        for name, tail in sorted(summary.role_logs.items())
    )
    return f" ({summary.failed} rooms FAILED{why}{logs})"


#: How much of a failed row's first reason, and of each rank's log tail, it shows.
_WHY_CHARS = 300
_LOG_CHARS = 1000


def rows(figures: PdFigures) -> list[tuple[str, str, str]]:
    """``(figure, tspd, raw limit)`` rows of the report."""
    f = figures
    return [*_small_rows(f), *_large_rows(f)]


def _small_rows(f: PdFigures) -> list[tuple[str, str, str]]:
    """The rooms/s, CPU and hand-over rows (absent with ``--large-only``)."""
    if f.throughput is None or f.latency is None or f.small_write is None or f.zmq is None:
        return []
    rtt = f"ZMQ round trip p50 {_us(f.zmq.p50)}"
    write = f"bare 4 KiB write p50 {_us(f.small_write.p50)} / p99 {_us(f.small_write.p99)}"
    return [
        *_secure_rows(f),
        (
            f"rooms/s, 1 × 4 KiB page, {f.in_flight} in flight",
            f"{f.throughput.rooms_per_s:,.0f}{_ok(f.throughput)}",
            f"{write}; {rtt}",
        ),
        (
            "CPU per room, Prefill / Decode",
            f"{_us(f.throughput.cpu_per_room('prefill'))} / "
            f"{_us(f.throughput.cpu_per_room('decode'))}",
            "—",
        ),
        (
            "hand-over → Decode done, 1 in flight, p50 / p99",
            f"{_us(percentile(f.latency.handover_latencies, 0.5))} / "
            f"{_us(percentile(f.latency.handover_latencies, 0.99))}{_ok(f.latency)}",
            f"{write}; ZMQ round trip p50 {_us(f.zmq.p50)} / p99 {_us(f.zmq.p99)}",
        ),
        *_thread_rows(f, write),
    ]


def _thread_rows(f: PdFigures, write: str) -> list[tuple[str, str, str]]:
    """The schedulers as plain threads (tspd.hosts.threads) beside Trio tasks: the
    hand-over latency, and how long after a room ended on the Decode peer each kind
    of scheduler saw it, beside a bare thread wake-up. The names start with neither
    "hand-over" nor "rooms/s": readers of ``--json`` find those rows by that."""
    t, latency, wake = f.thread_latency, f.latency, f.thread_wake
    if t is None or latency is None or wake is None or f.zmq is None:
        return []

    def lag(summary: DemoSummary) -> str:
        lags = summary.scheduler_lags
        return f"{_us(percentile(lags, 0.5))} / {_us(percentile(lags, 0.99))}"

    return [
        (
            "thread schedulers: hand-over → Decode done, 1 in flight, p50 / p99",
            f"{_us(percentile(t.handover_latencies, 0.5))} / "
            f"{_us(percentile(t.handover_latencies, 0.99))}{_ok(t)}",
            f"{write}; ZMQ round trip p50 {_us(f.zmq.p50)} / p99 {_us(f.zmq.p99)}",
        ),
        (
            "room ended → Decode scheduler has it, p50 / p99: Trio task; plain thread",
            f"{lag(latency)}; {lag(t)}",
            f"bare thread wake-up p50 {_us(wake.p50)} / p99 {_us(wake.p99)}",
        ),
    ]


def _large_rows(f: PdFigures) -> list[tuple[str, str, str]]:
    """The 64 MiB rows."""
    host = _host_tcp(f)
    return [
        (
            "64 MiB room, 16,384 × 4 KiB pages, contiguous",
            f"{_room_gbps(f.contiguous):.3f} GB/s{_ok(f.contiguous)}",
            f"one 64 MiB write {f.big_write.gbps:.3f} GB/s"
            f"{_pipelined(f.big_write_pipelined)}{host}",
        ),
        (
            "64 MiB room, 16,384 × 4 KiB pages, scattered",
            f"{_room_gbps(f.scattered):.3f} GB/s{_ok(f.scattered)}",
            f"16,384 × 4 KiB descriptors {f.big_scattered_write.gbps:.3f} GB/s"
            f"{_pipelined(f.big_scattered_pipelined)}; "
            f"one 64 MiB write {f.big_write.gbps:.3f} GB/s{host}",
        ),
        *_staged_rows(f),
    ]


def _host_tcp(f: PdFigures) -> str:
    """What the 64 MiB rows' raw column says of the host (after the figures, which
    readers of ``--json`` take as the first numbers after "one 64 MiB write" and
    "descriptors"): its TCP congestion control, which decides how fast a room's
    write starts after the pause before it (see the module docstring)."""
    return f"; host TCP congestion control {f.tcp_congestion_control}"


#: The staged row's name. It says neither "scattered" nor "contiguous": readers of
#: ``--json`` (the side-by-side report) find the in-place rows by those words.
STAGED_ROW = "64 MiB room, 16,384 × 4 KiB pages apart, staged (tspd ↔ tspd)"


def _staged_rows(f: PdFigures) -> list[tuple[str, str, str]]:
    """The staged 64 MiB row, beside one contiguous write of the same bytes."""
    if f.staged is None:
        return []
    share = _room_gbps(f.staged) / f.big_write.gbps * 100 if f.big_write.gbps else math.nan
    staged = sum(s.get("staged_writes", 0) for s in f.staged.stats.values())
    return [
        (
            STAGED_ROW,
            f"{_room_gbps(f.staged):.3f} GB/s = {share:.0f} % of one write, "
            f"{staged} of {f.staged.rooms} rooms staged{_ok(f.staged)}",
            f"one 64 MiB write {f.big_write.gbps:.3f} GB/s"
            f"{_pipelined(f.big_write_pipelined)}{_host_tcp(f)}",
        ),
    ]


def _pipelined(limit: MooncakeLimit | None) -> str:
    """The pipelined limit after a sync one: `` sync / 2.301 GB/s pipelined``."""
    return "" if limit is None else f" sync / {limit.gbps:.3f} GB/s pipelined"


def _change(secure: float, plain: float) -> str:
    if not plain or math.isnan(plain) or math.isnan(secure):
        return "n/a"
    return f"{(secure - plain) / plain * 100:+.1f} %"


def _secure_rows(f: PdFigures) -> list[tuple[str, str, str]]:
    """The secure-mode rows (first, when measured): secure figure, plain beside it."""
    if (
        f.secure_throughput is None
        or f.secure_latency is None
        or f.throughput is None
        or f.latency is None
    ):
        return []
    plain_rate, secure_rate = f.throughput.rooms_per_s, f.secure_throughput.rooms_per_s
    plain_p50 = percentile(f.latency.handover_latencies, 0.5)
    secure_p50 = percentile(f.secure_latency.handover_latencies, 0.5)
    secure_p99 = percentile(f.secure_latency.handover_latencies, 0.99)
    return [
        (
            f"secure mode: rooms/s, 1 × 4 KiB page, {f.in_flight} in flight",
            f"{secure_rate:,.0f}{_ok(f.secure_throughput)}",
            f"plain {plain_rate:,.0f} ({_change(secure_rate, plain_rate)})",
        ),
        (
            "secure mode: hand-over → Decode done, 1 in flight, p50 / p99",
            f"{_us(secure_p50)} / {_us(secure_p99)}{_ok(f.secure_latency)}",
            f"plain {_us(plain_p50)} / {_us(percentile(f.latency.handover_latencies, 0.99))} "
            f"(p50 {_change(secure_p50, plain_p50)})",
        ),
    ]


@click.command()
@click.option("--quick", is_flag=True, help="Far fewer rooms (a smoke run, noisy figures).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
@click.option(
    "--secure",
    is_flag=True,
    help="Also run rooms/s and hand-over latency in secure mode (CURVE, TLS, token), "
    "beside plain mode.",
)
@click.option(
    "--large-only",
    is_flag=True,
    help="Only the 64 MiB rows (contiguous and scattered) and their raw limits.",
)
@click.option(
    "--large-rooms",
    type=click.IntRange(min=1),
    default=None,
    help="64 MiB rooms per layout (default 3, 1 with --quick); the row is their median.",
)
def pd(quick: bool, as_json: bool, secure: bool, large_only: bool, large_rooms: int | None) -> None:
    """PD rooms/s, latency and GB/s on real processes, beside bare Mooncake and ZMQ."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    figures = trio.run(
        partial(
            run_pd_bench,
            quick=quick,
            secure=secure,
            large_only=large_only,
            large_rooms=large_rooms,
        )
    )
    table_rows = rows(figures)
    if as_json:
        out: dict[str, Any] = {name: {"tspd": value, "raw": raw} for name, value, raw in table_rows}
        click.echo(json.dumps(out, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="tspd bench pd — Prefill TP1 → Decode TP1, Mooncake TCP on 127.0.0.1")
    table.add_column("figure")
    table.add_column("tspd", justify="right")
    table.add_column("raw limit, same run")
    for row in table_rows:
        table.add_row(*row)
    Console().print(table)
