"""``tspd bench churn``: one Prefill rank outliving many Decode restarts.

A real Prefill peer runs in a child process (:mod:`tspd.bench.victims`). A Decode
*restart* is what a restarted Decode rank looks like to it: a new Decode session — a
new status port and a new session id — that registers, pre-allocates one room,
receives that room's status, and goes away. This process plays each one with raw
ZMQ sockets and :mod:`tspd.core.wire`'s encoders: a new PULL bound on a new port, a
new PUSH to the Prefill's control socket, the 8-frame registration, one
pre-allocation, the status awaited (10 s at most), both sockets closed. The Prefill
side's scheduler claims the room, writes the interop pattern (docs/protocol.md#proto-interop) and
hands it over, as an
engine would.

The data plane is tspd's :class:`~tspd.testing.fake_engine.FakeEngine`, inside the
Prefill's process: each restart's Decode session is a new fake engine (a new session
id) with the Decode arena registered, closed when the restart goes away (a dead
peer, as a stopped Decode is to Mooncake). The bytes are real copies, checked after
each room. Mooncake cannot play this part: a Mooncake engine takes about a second to
start and stop, and a fresh one per restart would measure Mooncake (in one process,
100 engines created and closed left ~50 more descriptors behind).

Printed, sampled through the run: the Prefill's RSS, descriptors (of them sockets),
threads, open push sockets and registrations, restarts per second, and the rooms
that failed (a ``Failed`` status, none within 10 s, wrong bytes or token) per
restart. Figures only.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import click
import zmq

from tspd.bench.victims import GOOD_ROOMS, Victim, workload
from tspd.core import wire
from tspd.core.errors import WireError
from tspd.core.interop import bootstrap_token_and_candidates
from tspd.core.poll import TransferPoll

__all__ = ["ChurnFigures", "Sample", "churn", "render", "report", "run_churn_bench"]

#: Seconds an emulated Decode waits for its room's status.
STATUS_WAIT: Final = 10.0


@dataclass(frozen=True, slots=True)
class Sample:
    """The Prefill process after ``restarts`` Decode restarts."""

    restarts: int
    seconds: float
    rss: float
    fds: float
    sockets: float
    threads: float
    push_sockets: int
    registrations: int
    rooms: int
    failed: int


@dataclass(slots=True)
class ChurnFigures:
    """Everything ``tspd bench churn`` measured."""

    restarts: int
    seconds: float
    samples: list[Sample] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    reasons: list[str] = field(default_factory=list)
    alive: bool = True
    final_stats: dict[str, Any] = field(default_factory=dict)
    log: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> int:
        """Rooms that did not end with a ``Success`` status carrying the right token."""
        return self.restarts - self.outcomes["ok"]


def _sample(prefill: Victim, restarts: int, started: float, failed: int) -> Sample:
    stats = prefill.stats()
    process = stats["process"]
    table = stats["stats"]
    return Sample(
        restarts=restarts,
        seconds=time.monotonic() - started,
        rss=process["rss"],
        fds=process["fds"],
        sockets=process["sockets"],
        threads=process["threads"],
        push_sockets=int(table["push_sockets"]),
        registrations=int(table["registrations"]),
        rooms=int(table["rooms"]),
        failed=failed,
    )


def _restart(
    ctx: zmq.Context[zmq.Socket[bytes]],
    prefill: Victim,
    control: str,
    contract: bytes,
    room: int,
) -> tuple[str, str | None]:
    """One Decode restart; returns the outcome (``ok``, ``failed``, ``no status``,
    ``wrong token``, ``bytes differ``...) and a reason for anything but ``ok``."""
    opened = prefill.call("session", op="session", room=room)
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    try:
        pull.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.LINGER, 0)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        session = str(opened["session"])
        push.connect(control)
        push.send_multipart(
            [
                wire.REGISTRATION_MARKER,
                b"127.0.0.1",
                b"%d" % port,
                session.encode(),
                struct.pack("<Q", int(opened["arena"])),
                contract,
                b"1",
                b"0",
            ]
        )
        push.send_multipart([b"%d" % room, session.encode(), str(opened["manifest"]).encode()])
        outcome, reason = _await_status(pull, room)
    finally:
        pull.close(linger=0)
        push.close(linger=0)
    dropped = prefill.call("drop", op="drop", room=room)
    if outcome == "ok" and not dropped["verified"]:
        return "bytes differ", f"room {room}: {dropped['mismatches']} blocks differ"
    if outcome == "ok" and not dropped["prefill_ok"]:
        return "prefill failed", f"room {room}: {dropped['reasons']}"
    return outcome, reason


def _await_status(pull: zmq.Socket[bytes], room: int) -> tuple[str, str | None]:
    deadline = time.monotonic() + STATUS_WAIT
    while (left := deadline - time.monotonic()) > 0:
        if not pull.poll(int(left * 1000) + 1):
            break
        try:
            status = wire.decode_status(pull.recv_multipart())
        except WireError as err:
            return "malformed status", str(err)
        if status.room != room:
            continue
        if status.status is TransferPoll.FAILED:
            return "failed", f"room {room}: Failed status"
        if status.status is not TransferPoll.SUCCESS:
            continue
        token, _ = bootstrap_token_and_candidates(workload().seed, room, 2)
        if status.bootstrap_token != token:
            return "wrong token", f"room {room}: token {status.bootstrap_token} != {token}"
        return "ok", None
    return "no status", f"room {room}: no status within {STATUS_WAIT:g} s"


def run_churn_bench(
    restarts: int,
    *,
    samples: int = 10,
    log: Callable[[str], None] = lambda line: None,
) -> ChurnFigures:
    """Start the Prefill victim and run ``restarts`` Decode restarts against it."""
    contract = workload().contract(1).to_json()
    every = max(1, restarts // max(1, samples))
    with tempfile.TemporaryDirectory(prefix="tspd-bench-churn-") as logs:
        prefill = Victim("prefill", os.path.join(logs, "prefill.log"), engine="fake")
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            control = f"tcp://127.0.0.1:{prefill.ready['control_port']}"
            started = time.monotonic()
            figures = ChurnFigures(restarts=restarts, seconds=0.0)
            figures.samples.append(_sample(prefill, 0, started, 0))
            log(f"{restarts:,} Decode restarts against a Prefill rank (pid {prefill.pid})")
            for index in range(restarts):
                room = GOOD_ROOMS + index
                outcome, reason = _restart(ctx, prefill, control, contract, room)
                figures.outcomes[outcome] += 1
                if reason is not None and len(figures.reasons) < 5:
                    figures.reasons.append(reason)
                if (index + 1) % every == 0 or index + 1 == restarts:
                    failed = index + 1 - figures.outcomes["ok"]
                    figures.samples.append(_sample(prefill, index + 1, started, failed))
                    if not prefill.alive:
                        break
            figures.seconds = time.monotonic() - started
            time.sleep(1.0)
            final = prefill.stats()
            figures.final_stats = final["stats"]
            figures.log = final["log"]
            figures.alive = prefill.alive
            return figures
        finally:
            ctx.destroy(linger=0)
            prefill.close()


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def report(f: ChurnFigures) -> dict[str, Any]:
    """JSON-friendly figures."""
    return {
        "restarts": f.restarts,
        "seconds": f.seconds,
        "restarts_per_s": f.restarts / f.seconds if f.seconds else 0.0,
        "rooms_failed": f.failed,
        "rooms_failed_per_restart": f.failed / f.restarts if f.restarts else 0.0,
        "outcomes": dict(f.outcomes),
        "first_reasons": f.reasons,
        "prefill_alive": f.alive,
        "samples": [
            {
                "restarts": s.restarts,
                "seconds": round(s.seconds, 2),
                "rss": s.rss,
                "fds": s.fds,
                "sockets": s.sockets,
                "threads": s.threads,
                "push_sockets": s.push_sockets,
                "registrations": s.registrations,
                "rooms": s.rooms,
                "failed": s.failed,
            }
            for s in f.samples
        ],
        "final_stats": f.final_stats,
        "log_lines_warning": f.log.get("warning_lines", 0),
        "log_lines_info": f.log.get("by_level", {}).get("INFO", 0),
        "log_top": f.log.get("top", []),
    }


def render(out: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(
        title=f"tspd bench churn — one Prefill rank, {out['restarts']:,} Decode restarts "
        "(fake data plane, bytes checked; figures, not checks)"
    )
    for column in (
        "restarts",
        "s",
        "RSS",
        "FDs",
        "of them sockets",
        "threads",
        "push sockets",
        "registrations",
        "rooms open",
        "rooms failed",
    ):
        table.add_column(column, justify="right")
    for s in out["samples"]:
        table.add_row(
            f"{s['restarts']:,}",
            f"{s['seconds']:.1f}",
            _mb(s["rss"]),
            f"{s['fds']:.0f}",
            f"{s['sockets']:.0f}",
            f"{s['threads']:.0f}",
            f"{s['push_sockets']}",
            f"{s['registrations']:,}",
            f"{s['rooms']}",
            f"{s['failed']:,}",
        )
    console.print(table)
    console.print(
        f"{out['restarts_per_s']:,.0f} restarts/s; rooms failed per restart "
        f"{out['rooms_failed_per_restart']:.4f} ({out['outcomes']}); Prefill alive: "
        f"{'yes' if out['prefill_alive'] else 'NO'}; its log: {out['log_lines_warning']:,} "
        f"lines at WARNING, {out['log_lines_info']:,} at INFO"
    )
    for reason in out["first_reasons"]:
        console.print(f"  {reason}")


@click.command()
@click.option(
    "--restarts",
    type=click.IntRange(min=1),
    default=10_000,
    show_default=True,
    help="Decode restarts (each a new session that registers and runs one room).",
)
@click.option(
    "--samples", type=click.IntRange(min=1), default=10, show_default=True, help="Rows printed."
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def churn(restarts: int, samples: int, as_json: bool) -> None:
    """A Prefill rank outliving many Decode restarts: FDs, sockets, RSS, failed rooms."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    figures = run_churn_bench(
        restarts, samples=samples, log=lambda line: click.echo(line, err=True)
    )
    out = report(figures)
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    render(out)
