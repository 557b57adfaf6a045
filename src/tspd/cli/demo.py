"""``tspd demo`` and ``tspd bootstrap-server``: the PD control plane, for real, on loopback.

``tspd demo`` starts a bootstrap server, a Prefill instance (TP 2 by default) and
Decode ranks of another TP size, each its own process on 127.0.0.1, serves a
stream of rooms with real KV bytes moved by Mooncake over TCP, verifies every
byte on the Decode side and prints a summary. It exits non-zero if any room
failed or any byte differed.

Each role also runs alone, so either side can face a peer of another
implementation (the bytes follow the interop pattern of docs/protocol.md#proto-interop):

    tspd bootstrap-server --port 8998
    tspd demo prefill --rank 0 --tp 1 --bootstrap 127.0.0.1:8998 --rooms 1000:1100
    tspd demo decode  --rank 0 --tp 1 --bootstrap 127.0.0.1:8998 --rooms 1000:1100

Roles print their endpoints and progress as JSON lines on stdout.

``tspd demo --secure`` runs every process in tspd's secure mode (docs/security.md)
with throwaway keys and certificates; the roles and the bootstrap server read the
``TSPD_*`` secure-mode variables, so each can run secured alone too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click
import trio

from tspd.core.config import (
    ENV_BOOTSTRAP_TIMEOUT,
    ENV_HEARTBEAT_INTERVAL,
    ENV_QUEUE_SIZE,
    ENV_WAITING_TIMEOUT,
)
from tspd.core.errors import TspdError
from tspd.demo.orchestrate import DemoOptions, DemoSummary, percentile, run_demo
from tspd.demo.report import Reporter
from tspd.demo.roles import (
    DemoTunables,
    RoleOptions,
    run_decode_rank,
    run_decode_rank_in_thread,
    run_prefill_rank,
    run_prefill_rank_in_thread,
)
from tspd.demo.workload import (
    DEFAULT_SPEC_CANDIDATES,
    MAX_SPEC_CANDIDATES,
    Workload,
    check_spec_candidates,
    parse_rooms,
)
from tspd.log import configure_logging
from tspd.shell.security import SecurityConfig

__all__ = ["bootstrap_server", "demo"]

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_ROOMS = "1000000:1000300"


def _rooms(ctx: click.Context, param: click.Parameter, value: str) -> range:
    try:
        return parse_rooms(value)
    except TspdError as err:
        raise click.BadParameter(str(err)) from None


def _spec_candidates(ctx: click.Context, param: click.Parameter, value: int) -> int:
    try:
        return check_spec_candidates(value)
    except TspdError as err:
        raise click.BadParameter(str(err)) from None


def _workload_options(fn: F) -> F:
    options = [
        click.option(
            "--rooms",
            default=DEFAULT_ROOMS,
            show_default=True,
            callback=_rooms,
            help="Rooms A:B (A..B-1), served in order.",
        ),
        click.option(
            "--seed",
            default=0,
            show_default=True,
            help="Interop pattern seed (docs/protocol.md#proto-interop).",
        ),
        click.option(
            "--spec-candidates",
            type=int,
            default=DEFAULT_SPEC_CANDIDATES,
            show_default=True,
            callback=_spec_candidates,
            help="Speculative candidate ids a Prefill sends and a Decode expects with each "
            f"bootstrap token (0-{MAX_SPEC_CANDIDATES}; 0: none). Match the peer you face.",
        ),
        click.option(
            "--host",
            default="127.0.0.1",
            show_default=True,
            help="Address every socket binds to and advertises.",
        ),
        click.option(
            "--contract",
            "contract_file",
            type=click.Path(exists=True, dir_okay=False),
            default=None,
            help="A cache transfer contract JSON file for this rank.",
        ),
        click.option("--layers", default=2, show_default=True),
        click.option("--heads", default=4, show_default=True, help="Global KV heads."),
        click.option("--head-dim", default=64, show_default=True),
        click.option("--page-tokens", default=16, show_default=True),
        click.option("--pages", default=2048, show_default=True, help="Pages in each arena."),
        click.option("--max-prompt-pages", default=8, show_default=True),
        click.option(
            "--fixed-prompt-pages",
            default=None,
            type=int,
            help="Give every room exactly this many pages.",
        ),
        click.option("--in-flight", default=16, show_default=True),
        click.option("--layerwise", is_flag=True, help="Stream KV layer by layer."),
        click.option("--scatter", is_flag=True, help="Allocate pages scattered, not contiguous."),
        click.option(
            "--staging-mib",
            default=0,
            show_default=True,
            type=click.IntRange(min=0, max=1 << 20),
            help="Each rank's staging region for staged transfers between tspd peers "
            "(docs/wire.md#staged-transfers); 0: off.",
        ),
        click.option(
            "--bootstrap-timeout",
            type=float,
            default=None,
            help=f"Seconds (default: ${ENV_BOOTSTRAP_TIMEOUT}, else 30).",
        ),
        click.option(
            "--waiting-timeout",
            type=float,
            default=None,
            help=f"Seconds (default: ${ENV_WAITING_TIMEOUT}, else 60).",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _workload(kw: dict[str, Any]) -> Workload:
    return Workload(
        rooms=kw["rooms"],
        seed=kw["seed"],
        candidates=kw["spec_candidates"],
        layers=kw["layers"],
        global_heads=kw["heads"],
        head_dim=kw["head_dim"],
        page_tokens=kw["page_tokens"],
        num_pages=kw["pages"],
        max_prompt_pages=kw["max_prompt_pages"],
        fixed_prompt_pages=kw["fixed_prompt_pages"],
        contract_file=kw["contract_file"],
    )


def _tunables(kw: dict[str, Any], **explicit: Any) -> DemoTunables:
    """The demo's timeouts and sizes: an explicit option wins, then TokenSpeed's
    variable when set, then the demo's own default (an invalid variable is a usage
    error that names it)."""
    try:
        return DemoTunables.resolve(
            os.environ,
            bootstrap_timeout=kw["bootstrap_timeout"],
            waiting_timeout=kw["waiting_timeout"],
            **explicit,
        )
    except TspdError as err:
        raise click.UsageError(str(err)) from None


def _security() -> SecurityConfig | None:
    """Secure mode from tspd's variables (``None`` when none is set); a bad value is a
    usage error that names it."""
    try:
        security = SecurityConfig.from_env(os.environ)
    except TspdError as err:
        raise click.UsageError(str(err)) from None
    return security if security.enabled else None


def _logging(verbose: bool) -> None:
    configure_logging(logging.INFO if verbose else logging.WARNING, stream=sys.stderr)


@click.group(invoke_without_command=True)
@_workload_options
@click.option("--prefill-tp", default=2, show_default=True)
@click.option("--decode-tp", default=1, show_default=True)
@click.option("--timeout", default=180.0, show_default=True, help="Give up after this long (s).")
@click.option(
    "--metrics-port",
    type=int,
    default=None,
    help="Serve every rank's /metrics and /traces: Prefill rank r on PORT+r, Decode ranks "
    "after them (0: free ports). The addresses are printed as the ranks start.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@click.option(
    "--secure",
    is_flag=True,
    help="Secure mode: CURVE on every socket, the bootstrap server over TLS with a token "
    "(throwaway keys and certificates in a temporary directory; docs/security.md).",
)
@click.pass_context
def demo(
    ctx: click.Context,
    /,
    prefill_tp: int,
    decode_tp: int,
    timeout: float,
    metrics_port: int | None,
    as_json: bool,
    secure: bool,
    **kw: Any,
) -> None:
    """Run a bootstrap server, a Prefill group and a Decode group on this host and
    serve a stream of rooms with verified KV bytes (see ``tspd demo --help``)."""
    if ctx.invoked_subcommand is not None:
        return
    _logging(False)
    tuned = _tunables(kw)
    options = DemoOptions(
        workload=_workload(kw),
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        host=kw["host"],
        in_flight=kw["in_flight"],
        layerwise=kw["layerwise"],
        scatter=kw["scatter"],
        staging_mib=kw["staging_mib"],
        timeout=timeout,
        bootstrap_timeout=tuned.bootstrap_timeout,
        waiting_timeout=tuned.waiting_timeout,
        metrics_port=metrics_port,
        secure=secure,
    )
    summary = _run_with_progress(options, quiet=as_json)
    if as_json:
        click.echo(json.dumps(summary.as_dict(), indent=2))
    else:
        _print_summary(options, summary)
    ctx.exit(0 if summary.ok else 1)


def _run_with_progress(options: DemoOptions, *, quiet: bool) -> DemoSummary:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True, quiet=quiet)
    with Progress(
        TextColumn("[bold]rooms"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("[green]{task.fields[ok]} ok [red]{task.fields[bad]} failed"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        task = progress.add_task("rooms", total=len(options.workload.rooms), ok=0, bad=0)
        counts = {"ok": 0, "bad": 0}

        def on_room(room: int, ok: bool) -> None:
            counts["ok" if ok else "bad"] += 1
            progress.update(task, advance=1, ok=counts["ok"], bad=counts["bad"])

        def on_metrics(name: str, url: str) -> None:
            traces = url.removesuffix("/metrics") + "/traces"
            progress.console.print(f"{name}: metrics {url}, traces {traces}", markup=False)

        return trio.run(lambda: run_demo(options, on_room=on_room, on_metrics=on_metrics))


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:.2f} ms"


def _trace_line(entry: dict[str, Any]) -> str:
    """One rank's trace of a failed room: where it failed and its phases."""
    phases = ", ".join(f"{name} {_ms(seconds)}" for name, seconds in entry["phases"].items())
    return (
        f"{entry['side']} rank {entry['rank']}: [{entry['reason_class']}] after "
        f"{_ms(entry['duration'])}" + (f"; {phases}" if phases else "")
    )


def _failed_session_line(name: str, session: str, entry: dict[str, Any]) -> str:
    """One Decode rank's failures from one Prefill session, counted."""
    line = f"{name}: {entry.get('rooms', 0)} rooms from Prefill {session} failed"
    if entry.get("first_reason"):
        line += f", first room {entry.get('first_room')}: {entry['first_reason']}"
    return line


def _print_summary(options: DemoOptions, summary: DemoSummary) -> None:
    """The summary table and what failed. Reasons, errors and addresses are printed
    as they are: rich must not read them as markup (``pip install
    'tspd[mooncake-cpu]'`` would lose ``[mooncake-cpu]``)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title=(
            f"tspd demo: Prefill TP{options.prefill_tp} → Decode TP{options.decode_tp}, "
            f"{'layerwise' if options.layerwise else 'full'} transfers, "
            f"Mooncake TCP on {escape(options.host)}"
            + (", secure mode (CURVE, TLS, token)" if options.secure else "")
        )
    )
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("rooms succeeded", f"{summary.succeeded} / {summary.rooms}")
    table.add_row("rooms failed", str(summary.failed))
    table.add_row("rooms/s", f"{summary.rooms_per_s:.1f}")
    table.add_row("room latency p50 (register → done)", _ms(percentile(summary.latencies, 0.5)))
    table.add_row("room latency p99", _ms(percentile(summary.latencies, 0.99)))
    table.add_row("hand-over → Decode done p50", _ms(percentile(summary.handover_latencies, 0.5)))
    table.add_row("hand-over → Decode done p99", _ms(percentile(summary.handover_latencies, 0.99)))
    table.add_row("KV verified", f"{summary.bytes_verified / 1e6:.1f} MB")
    table.add_row("GB/s (verified bytes / serving time)", f"{summary.gbps:.3f}")
    for role in sorted(summary.cpu):
        table.add_row(f"CPU per room, {escape(role)}", _ms(summary.cpu_per_room(role)))
    table.caption = (
        "The demo's ranks also generate (Prefill) and check (Decode) every KV byte with "
        "the SHAKE-256 interop pattern; its CPU and latency figures include that. "
        "CPU per room is the process CPU of all of a side's ranks (engine threads "
        "included) over the rooms. Hand-over → done also counts the Decode rank "
        "checking the rooms that finished ahead of it in the same poll, and all ranks "
        "and this driver share this host's cores. "
        "`tspd bench pd` measures the control plane alone."
    )
    console = Console()
    console.print(table)
    # A failed Prefill session is one line with its count, however many rooms it took.
    for name, sessions in sorted(summary.failed_sessions.items()):
        for session, entry in sessions.items():
            if not entry.get("rooms"):
                continue
            console.print(
                f"[red]failed session:[/red] {escape(_failed_session_line(name, session, entry))}"
            )
    for room, reason in list(summary.reasons.items())[:10]:
        console.print(f"[red]room {room} failed:[/red] {escape(reason)}")
    for room, traces in list(summary.traces.items())[:3]:
        for entry in traces:
            console.print(f"  room {room} on {_trace_line(entry)}", markup=False)
    for error in summary.errors:
        console.print(f"[red]error:[/red] {escape(error)}")
    console.print("[green]all rooms verified[/green]" if summary.ok else "[red]demo FAILED[/red]")


def _role_command(role: str) -> click.Command:
    runner = run_prefill_rank if role == "prefill" else run_decode_rank
    in_thread = run_prefill_rank_in_thread if role == "prefill" else run_decode_rank_in_thread

    @click.command(name=role)
    @_workload_options
    @click.option("--rank", default=0, show_default=True, help="This rank's TP rank.")
    @click.option("--tp", default=1, show_default=True, help="This side's TP size.")
    @click.option(
        "--bootstrap",
        default="8998",
        show_default=True,
        help="The Prefill instance's bootstrap server: host:port, or a port on --host.",
    )
    @click.option("--agree", default="", help="Comma-separated agreement endpoints of every rank.")
    @click.option(
        "--workers",
        type=int,
        default=None,
        help=f"Transfer workers, Prefill (default: ${ENV_QUEUE_SIZE}, else 2).",
    )
    @click.option(
        "--heartbeat-interval",
        type=float,
        default=None,
        help=f"Seconds, Decode (default: ${ENV_HEARTBEAT_INTERVAL}, else 1).",
    )
    @click.option(
        "--never-preallocate",
        is_flag=True,
        hidden=True,
        help="Decode: register but never pre-allocate (failure-path tests).",
    )
    @click.option(
        "--metrics-port",
        type=int,
        default=None,
        help="Serve this rank's /metrics and /traces on this port (0: any free port).",
    )
    @click.option(
        "--hold-reports",
        is_flag=True,
        help="Write the per-room report lines at the end, not as rooms go (benchmarks).",
    )
    @click.option(
        "--agree-keys",
        default="",
        help="Secure mode: comma-separated CURVE public keys (Z85) of every rank in --agree.",
    )
    @click.option("-v", "--verbose", is_flag=True, help="Log at INFO on stderr.")
    def command(
        rank: int,
        tp: int,
        bootstrap: str,
        agree: str,
        agree_keys: str,
        workers: int | None,
        heartbeat_interval: float | None,
        never_preallocate: bool,
        metrics_port: int | None,
        hold_reports: bool,
        verbose: bool,
        **kw: Any,
    ) -> None:
        _logging(verbose)
        driver = kw.pop("driver", "trio")
        tuned = _tunables(kw, workers=workers, heartbeat_interval=heartbeat_interval)
        options = RoleOptions(
            workload=_workload(kw),
            rank=rank,
            tp=tp,
            host=kw["host"],
            bootstrap=bootstrap if ":" in bootstrap else f"{kw['host']}:{bootstrap}",
            agree=tuple(a for a in agree.split(",") if a),
            in_flight=kw["in_flight"],
            layerwise=kw["layerwise"],
            scatter=kw["scatter"],
            staging_mib=kw["staging_mib"],
            workers=tuned.workers,
            bootstrap_timeout=tuned.bootstrap_timeout,
            waiting_timeout=tuned.waiting_timeout,
            failed_session_ttl=tuned.failed_session_ttl,
            heartbeat_interval=tuned.heartbeat_interval,
            heartbeat_max_failures=tuned.heartbeat_max_failures,
            never_preallocate=never_preallocate,
            metrics_port=metrics_port,
            security=_security(),
            agree_keys=tuple(k for k in agree_keys.split(",") if k),
        )
        reporter = Reporter(role, rank, hold=hold_reports)
        try:
            if driver == "thread":
                failed = in_thread(options, reporter)
            else:
                failed = trio.run(runner, options, reporter)
        except TspdError as err:
            raise click.ClickException(str(err)) from None
        finally:
            reporter.flush()
        sys.exit(1 if failed else 0)

    command.help = f"Run one {role.capitalize()} rank of the demo in this process."
    click.option(
        "--driver",
        type=click.Choice(["trio", "thread"]),
        default="trio",
        show_default=True,
        help=(
            "Where the scheduler loop runs: a Trio task beside the peer, or a plain "
            "thread that reaches the peer in a background Trio thread through "
            "tspd.hosts.threads (as a thread-hosted engine does)."
        ),
    )(command)
    return command


demo.add_command(_role_command("prefill"))
demo.add_command(_role_command("decode"))


@click.command(name="bootstrap-server")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8998, show_default=True)
def bootstrap_server(host: str, port: int) -> None:
    """Serve the bootstrap rendezvous (docs/protocol.md#proto-bootstrap) until interrupted.

    Secure mode from ``TSPD_TLS_CERT_FILE``/``TSPD_TLS_KEY_FILE`` (HTTPS only),
    ``TSPD_BOOTSTRAP_TOKEN_FILE`` and ``TSPD_BOOTSTRAP_PROTECT_GET``
    (docs/security.md)."""
    from tspd.shell.bootstrap import open_bootstrap_server

    security = _security()

    async def serve() -> None:
        async with open_bootstrap_server(host, port, security=security) as server:
            Reporter("bootstrap", 0).emit("ready", address=server.address, url=server.url)
            click.echo(f"bootstrap server listening on {server.url}", err=True)
            await trio.sleep_forever()

    _logging(False)
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(serve)
