"""``tspd demo``: a bootstrap server, a Prefill group and a Decode group as processes.

:func:`run_demo` starts, on 127.0.0.1 unless told otherwise:

1. ``tspd bootstrap-server`` and waits for its address;
2. one ``tspd demo prefill`` process per Prefill TP rank (they agree over ZMQ);
3. one ``tspd demo decode`` process per Decode TP rank, at once (each waits until
   the bootstrap server knows every Prefill rank: a Prefill rank registers its
   requests as soon as it is ready, and their bootstrap timeout should not also
   cover a Decode process's start), and waits until each Prefill rank has
   registered with the bootstrap server;

then follows their JSON-line reports (:mod:`tspd.demo.report`) with a progress
display and returns a :class:`DemoSummary`: rooms succeeded and failed, rooms/s,
room latency p50/p99 (Decode registration → completion event), hand-over →
Decode completion event p50/p99, GB/s verified, CPU seconds per room per side, and
the traces both sides kept of the first failed rooms. With ``metrics_port`` set,
each rank serves /metrics and /traces (Prefill rank ``r`` on ``metrics_port + r``,
Decode rank ``r`` after the Prefill ranks; 0: free ports) and ``on_metrics`` hears
each URL as the rank comes up. Every
process is stopped before it returns, whatever happened; a role that exits
early, or a run past ``timeout``, fails the demo with the reason.

With ``secure`` every process runs tspd's secure mode (docs/security.md): a CURVE key
pair per rank, an allow-list of them all, a TLS CA and server certificate for the
bootstrap server and a bearer token, all throwaway (:func:`tspd.keys.generate_keys`
in the run's temporary directory), handed to each process in its ``TSPD_*``
variables.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import trio

from tspd.demo.workload import Workload
from tspd.keys import KeyFiles
from tspd.shell.ports import free_port

__all__ = ["DemoOptions", "DemoSummary", "RoleProcess", "percentile", "run_demo", "tspd_argv"]


def tspd_argv(*args: str) -> list[str]:
    """The command line that runs ``tspd *args`` with this interpreter."""
    return [sys.executable, "-c", "from tspd.cli import main; main()", *args]


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; NaN for no samples."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What ``tspd demo`` runs."""

    workload: Workload
    prefill_tp: int = 2
    decode_tp: int = 1
    host: str = "127.0.0.1"
    in_flight: int = 16
    layerwise: bool = False
    scatter: bool = False
    #: Each rank's staging region in MiB (0: staged transfers off).
    staging_mib: int = 0
    timeout: float = 180.0
    bootstrap_timeout: float = 30.0
    waiting_timeout: float = 60.0
    metrics_port: int | None = None
    #: Extra command-line arguments for every Prefill / Decode role process (they
    #: come last, so they override the demo's own).
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    #: Secure mode for every process (see the module doc).
    secure: bool = False

    def role_metrics_port(self, role: str, rank: int) -> int | None:
        """The metrics port of one rank: the base plus its index (Prefill ranks
        first), 0 for every rank when the base is 0, ``None`` without metrics."""
        if not self.metrics_port:
            return self.metrics_port
        return self.metrics_port + rank + (self.prefill_tp if role == "decode" else 0)


@dataclass(slots=True)
class DemoSummary:
    """The demo's outcome."""

    rooms: int = 0
    succeeded: int = 0
    failed: int = 0
    wall: float = 0.0
    bytes_verified: int = 0
    latencies: list[float] = field(default_factory=list)
    handover_latencies: list[float] = field(default_factory=list)
    #: Per succeeded room and Decode rank: the room's end on the peer (its event's
    #: time) to the Decode scheduler seeing the event.
    scheduler_lags: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    stats: dict[str, dict[str, int]] = field(default_factory=dict)
    #: Metrics URL per role process (``prefill-0``...), when served.
    metrics: dict[str, str] = field(default_factory=dict)
    #: The first failed rooms' traces, from every rank that kept one.
    traces: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    #: Per Decode rank (``decode-0``...): the Prefill sessions its rooms failed from,
    #: each with its count of failed rooms and first failure (the ranks' ``done``
    #: reports, :class:`~tspd.demo.failures.SessionFailures`).
    failed_sessions: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    #: When rooms failed: the last lines each Prefill and Decode rank wrote to its
    #: log (tspd's warnings, the engine's errors), by rank name.
    role_logs: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every room succeeded, every byte matched, every process behaved."""
        return not self.failed and not self.errors and self.succeeded == self.rooms

    @property
    def rooms_per_s(self) -> float:
        """Rooms completed per second of the serving phase."""
        return self.succeeded / self.wall if self.wall > 0 else 0.0

    @property
    def gbps(self) -> float:
        """Verified KV bytes per second of the serving phase, in GB/s."""
        return self.bytes_verified / self.wall / 1e9 if self.wall > 0 else 0.0

    def cpu_per_room(self, role: str) -> float:
        """CPU seconds per room of one side (all its ranks together)."""
        return self.cpu.get(role, 0.0) / self.rooms if self.rooms else 0.0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly form (``tspd demo --json``)."""
        return {
            "ok": self.ok,
            "rooms": self.rooms,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "wall_s": self.wall,
            "rooms_per_s": self.rooms_per_s,
            "latency_p50_s": percentile(self.latencies, 0.5),
            "latency_p99_s": percentile(self.latencies, 0.99),
            "handover_p50_s": percentile(self.handover_latencies, 0.5),
            "handover_p99_s": percentile(self.handover_latencies, 0.99),
            "scheduler_lag_p50_s": percentile(self.scheduler_lags, 0.5),
            "scheduler_lag_p99_s": percentile(self.scheduler_lags, 0.99),
            "gb_per_s": self.gbps,
            "bytes_verified": self.bytes_verified,
            "cpu_per_room_s": {role: self.cpu_per_room(role) for role in self.cpu},
            "failures": {str(room): reason for room, reason in sorted(self.reasons.items())[:20]},
            "failure_traces": {str(room): traces for room, traces in self.traces.items()},
            "failed_sessions": self.failed_sessions,
            "role_logs": self.role_logs,
            "metrics": self.metrics,
            "errors": self.errors,
        }


@dataclass(slots=True)
class RoleProcess:
    """One child process and what it reported."""

    name: str
    process: trio.Process
    log_path: str
    records: list[dict[str, Any]] = field(default_factory=list)
    ready: trio.Event = field(default_factory=trio.Event)
    finished: trio.Event = field(default_factory=trio.Event)

    def log_tail(self, lines: int = 15) -> str:
        """The last lines of the process's stderr."""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


async def _follow(
    role: RoleProcess, on_record: Callable[[RoleProcess, dict[str, Any]], None]
) -> None:
    stream = role.process.stdout
    assert stream is not None
    buffer = b""
    try:
        while True:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                role.records.append(record)
                if record.get("event") == "ready":
                    role.ready.set()
                on_record(role, record)
        await role.process.wait()
    finally:
        role.ready.set()
        role.finished.set()


def _open_log(path: str) -> Any:
    """The child's stderr file (opening a local temp file does not block meaningfully)."""
    return open(path, "wb")


async def spawn(
    nursery: trio.Nursery,
    name: str,
    argv: Sequence[str],
    on_record: Callable[[RoleProcess, dict[str, Any]], None],
    log_dir: str,
    extra_env: Mapping[str, str] | None = None,
) -> RoleProcess:
    """Start ``argv`` with stdout followed as JSON lines and stderr to a log file;
    ``extra_env`` is added to its environment."""
    log_path = os.path.join(log_dir, f"{name}.log")
    log_file = _open_log(log_path)
    env = dict(os.environ)
    env.setdefault("MC_LOG_LEVEL", "ERROR")
    env.update(extra_env or {})
    try:
        process = await trio.lowlevel.open_process(
            list(argv), stdout=subprocess.PIPE, stderr=log_file, env=env
        )
    finally:
        log_file.close()
    role = RoleProcess(name, process, log_path)
    nursery.start_soon(_follow, role, on_record)
    return role


def _stop(roles: Sequence[RoleProcess]) -> None:
    for role in roles:
        if role.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                role.process.send_signal(signal.SIGKILL)


def _role_args(
    opts: DemoOptions,
    role: str,
    rank: int,
    tp: int,
    bootstrap: str,
    agree: str,
    agree_keys: str = "",
) -> list[str]:
    w = opts.workload
    rooms = f"{w.rooms.start}:{w.rooms.stop}"
    args = [
        "demo",
        role,
        "--rank",
        str(rank),
        "--tp",
        str(tp),
        "--bootstrap",
        bootstrap,
        "--rooms",
        rooms,
        "--seed",
        str(w.seed),
        "--spec-candidates",
        str(w.candidates),
        "--host",
        opts.host,
        "--in-flight",
        str(opts.in_flight),
        "--pages",
        str(w.num_pages),
        "--layers",
        str(w.layers),
        "--heads",
        str(w.global_heads),
        "--head-dim",
        str(w.head_dim),
        "--page-tokens",
        str(w.page_tokens),
        "--max-prompt-pages",
        str(w.max_prompt_pages),
        "--bootstrap-timeout",
        str(opts.bootstrap_timeout),
        "--waiting-timeout",
        str(opts.waiting_timeout),
    ]
    if w.fixed_prompt_pages is not None:
        args += ["--fixed-prompt-pages", str(w.fixed_prompt_pages)]
    if w.contract_file is not None:
        args += ["--contract", w.contract_file]
    if agree:
        args += ["--agree", agree]
    if agree and agree_keys:
        args += ["--agree-keys", agree_keys]
    metrics_port = opts.role_metrics_port(role, rank)
    if metrics_port is not None:
        args += ["--metrics-port", str(metrics_port)]
    if opts.layerwise:
        args.append("--layerwise")
    if opts.scatter:
        args.append("--scatter")
    if opts.staging_mib:
        args += ["--staging-mib", str(opts.staging_mib)]
    args += list(opts.prefill_args if role == "prefill" else opts.decode_args)
    return args


async def run_demo(
    opts: DemoOptions,
    *,
    on_room: Callable[[int, bool], None] | None = None,
    on_metrics: Callable[[str, str], None] | None = None,
    console: TextIO | None = None,
) -> DemoSummary:
    """Run the demo's processes to the end (see the module doc)."""
    summary = DemoSummary(rooms=len(opts.workload.rooms))
    decode_rooms: dict[int, list[dict[str, Any]]] = defaultdict(list)
    prefill_rooms: dict[int, list[dict[str, Any]]] = defaultdict(list)
    handovers: dict[int, float] = {}
    done_rooms: set[int] = set()

    def on_record(role: RoleProcess, record: dict[str, Any]) -> None:
        kind = record.get("event")
        if kind == "ready" and record.get("metrics"):
            summary.metrics[role.name] = str(record["metrics"])
            if on_metrics is not None:
                on_metrics(role.name, str(record["metrics"]))
        elif kind == "handover":
            room = int(record["room"])
            handovers[room] = max(handovers.get(room, 0.0), float(record["t"]))
        elif kind == "room":
            room = int(record["room"])
            side = decode_rooms if record["role"] == "decode" else prefill_rooms
            side[room].append(record)
            if (
                len(decode_rooms[room]) == opts.decode_tp
                and len(prefill_rooms[room]) == opts.prefill_tp
                and room not in done_rooms
            ):
                done_rooms.add(room)
                if on_room is not None:
                    ok = all(r["ok"] for r in decode_rooms[room] + prefill_rooms[room])
                    on_room(room, ok)

    roles: list[RoleProcess] = []
    with tempfile.TemporaryDirectory(prefix="tspd-demo-") as log_dir:
        keys = _demo_keys(opts, log_dir) if opts.secure else None

        def env(name: str | None, *, server: bool = False) -> dict[str, str]:
            return keys.env(name, server=server) if keys is not None else {}

        def agree_keys(role: str, tp: int) -> str:
            if keys is None:
                return ""
            return ",".join(keys.public_key(f"{role}-{rank}") for rank in range(tp))

        async with trio.open_nursery() as nursery:
            try:
                with trio.move_on_after(opts.timeout) as scope:
                    # Port 0: the server binds a port the OS picks and reports it (a
                    # port probed free here could be taken before the server binds it).
                    server = await spawn(
                        nursery,
                        "bootstrap",
                        tspd_argv("bootstrap-server", "--host", opts.host, "--port", "0"),
                        on_record,
                        log_dir,
                        env(None, server=True),
                    )
                    roles.append(server)
                    await server.ready.wait()
                    addresses = [
                        r.get("address") for r in server.records if r.get("event") == "ready"
                    ]
                    if server.process.returncode is not None or not addresses or not addresses[0]:
                        raise _Abort(f"the bootstrap server exited:\n{server.log_tail()}")
                    bootstrap = str(addresses[0])
                    prefill_agree = ",".join(
                        f"tcp://{opts.host}:{free_port(opts.host)}" for _ in range(opts.prefill_tp)
                    )
                    prefill = []
                    for rank in range(opts.prefill_tp):
                        argv = tspd_argv(
                            *_role_args(
                                opts,
                                "prefill",
                                rank,
                                opts.prefill_tp,
                                bootstrap,
                                prefill_agree if opts.prefill_tp > 1 else "",
                                agree_keys("prefill", opts.prefill_tp),
                            )
                        )
                        name = f"prefill-{rank}"
                        prefill.append(
                            await spawn(nursery, name, argv, on_record, log_dir, env(name))
                        )
                    roles.extend(prefill)
                    # The Decode ranks start now, beside the Prefill ranks (each waits
                    # for the Prefill instance itself): the Prefill registers its
                    # requests as soon as it is ready, and their bootstrap timeout
                    # should not run through a whole Decode start on a busy host.
                    decode_agree = ",".join(
                        f"tcp://{opts.host}:{free_port(opts.host)}" for _ in range(opts.decode_tp)
                    )
                    decode = []
                    for rank in range(opts.decode_tp):
                        argv = tspd_argv(
                            *_role_args(
                                opts,
                                "decode",
                                rank,
                                opts.decode_tp,
                                bootstrap,
                                decode_agree if opts.decode_tp > 1 else "",
                                agree_keys("decode", opts.decode_tp),
                            )
                        )
                        name = f"decode-{rank}"
                        decode.append(
                            await spawn(nursery, name, argv, on_record, log_dir, env(name))
                        )
                    roles.extend(decode)
                    for role in prefill:
                        await role.ready.wait()
                        ready = [r for r in role.records if r.get("event") == "ready"]
                        if not ready or not ready[0].get("registered"):
                            raise _Abort(
                                f"{role.name} did not start or register:\n{role.log_tail()}"
                            )
                    for role in prefill + decode:
                        await role.finished.wait()
                        if role.process.returncode not in (0, 1):
                            summary.errors.append(
                                f"{role.name} exited with code {role.process.returncode}:\n"
                                f"{role.log_tail()}"
                            )
                if scope.cancelled_caught:
                    summary.errors.append(f"the demo did not finish within {opts.timeout:.0f}s")
            except _Abort as abort:
                summary.errors.append(str(abort))
            finally:
                _stop(roles)
        _summarise(summary, opts, roles, decode_rooms, prefill_rooms, handovers)
        if summary.failed:
            ranks = roles[1:]  # roles[0] is the bootstrap server
            tails = {r.name: r.log_tail(_FAILED_LOG_LINES).strip() for r in ranks}
            summary.role_logs = {name: tail for name, tail in tails.items() if tail}
    return summary


class _Abort(Exception):
    """A role failed to start; the demo stops."""


def _demo_keys(opts: DemoOptions, directory: str) -> KeyFiles:
    """Throwaway secure-mode material for every rank of the demo (see the module doc)."""
    from tspd.keys import generate_keys

    names = [f"prefill-{r}" for r in range(opts.prefill_tp)]
    names += [f"decode-{r}" for r in range(opts.decode_tp)]
    hosts = [opts.host] + (["localhost"] if opts.host != "localhost" else [])
    return generate_keys(os.path.join(directory, "keys"), names, hosts=hosts, days=2)


#: Failed rooms whose traces the summary keeps.
_TRACED_FAILURES = 5
#: Lines of each rank's log the summary keeps when rooms failed.
_FAILED_LOG_LINES = 8


def _summarise(
    summary: DemoSummary,
    opts: DemoOptions,
    roles: Sequence[RoleProcess],
    decode_rooms: dict[int, list[dict[str, Any]]],
    prefill_rooms: dict[int, list[dict[str, Any]]],
    handovers: dict[int, float],
) -> None:
    starts: list[float] = []
    ends: list[float] = []
    for role in roles:
        for record in role.records:
            if record.get("event") == "ready" and record.get("role") == "decode":
                starts.append(float(record["t"]))
            if record.get("event") == "done":
                side = str(record["role"])
                summary.cpu[side] = summary.cpu.get(side, 0.0) + float(record["cpu"])
                summary.stats[role.name] = record.get("stats", {})
                if record.get("failed_sessions"):
                    summary.failed_sessions[role.name] = record["failed_sessions"]
                if side == "decode":
                    ends.append(float(record["t"]))
    for room in opts.workload.rooms:
        reports = decode_rooms.get(room, []) + prefill_rooms.get(room, [])
        complete = len(decode_rooms.get(room, [])) == opts.decode_tp
        if complete and reports and all(r["ok"] for r in reports):
            summary.succeeded += 1
            summary.bytes_verified += sum(int(r.get("bytes") or 0) for r in decode_rooms[room])
            summary.latencies.append(max(float(r["latency"]) for r in decode_rooms[room]))
            summary.scheduler_lags += [
                float(r["seen"]) - float(r["ended"])
                for r in decode_rooms[room]
                if r.get("ended") is not None and r.get("seen") is not None
            ]
            if room in handovers:
                done_at = max(float(r.get("seen", r["t"])) for r in decode_rooms[room])
                summary.handover_latencies.append(done_at - handovers[room])
        else:
            summary.failed += 1
            reasons = [str(r.get("reason")) for r in reports if not r["ok"]]
            summary.reasons[room] = "; ".join(reasons) or "no report (a role stopped early)"
            traces = [r["trace"] for r in reports if r.get("trace")]
            if traces and len(summary.traces) < _TRACED_FAILURES:
                summary.traces[room] = traces
    if starts and ends:
        summary.wall = max(ends) - min(starts)
