"""The demo's Prefill and Decode ranks: a peer plus a small stand-in scheduler each.

:func:`run_prefill_rank` and :func:`run_decode_rank` each run one rank in the
current process on the real Mooncake engine (TCP on the given host, P2P
handshake), with a host-memory arena, and serve the workload's rooms the way an
inference engine would drive the peer:

* **Prefill**: register each room's request (up to ``in_flight`` at a time), poll;
  on ``Bootstrapped`` allocate pages, "run the forward" — write the interop pattern
  into them (layerwise: one producer step at a time, advancing the step counter,
  with chunks armed before) — and hand the remote decode over with the room's
  bootstrap token; on ``Succeeded``/``Failed`` free the pages and report.
* **Decode**: register each request with its bootstrap address, poll; on
  ``Bootstrapped`` allocate and zero pages and pre-allocate them; on
  ``RemotePrefillDone`` verify every byte and the token and candidates against the
  pattern, free the pages and report, with when the room ended on the peer and
  when the scheduler saw it.

Each rank's scheduler is a Trio task beside the peer (:func:`run_prefill_rank`,
:func:`run_decode_rank`) or, as in thread-hosted engines, a loop in a plain thread
that reaches a peer in a background Trio thread through :mod:`tspd.hosts.threads`
(:func:`run_prefill_rank_in_thread`, :func:`run_decode_rank_in_thread`;
``tspd demo prefill|decode --driver thread``); both share the scheduler's logic.

Progress goes out as JSON lines (:class:`~tspd.demo.report.Reporter`); a failed
room's line carries the rank's trace of it (:mod:`tspd.core.trace`). With
``metrics_port`` set, a rank serves its metrics and traces over HTTP
(:func:`~tspd.shell.metrics.open_metrics_server`) and reports the URL. A rank of a
TP group larger than one agrees with the others over ZMQ
(:class:`~tspd.shell.agreement.ZmqAgreement`; ``agree`` lists every rank's
endpoint). With ``security`` a rank runs tspd's secure mode (docs/security.md):
CURVE on its sockets (``agree_keys``: every agreeing rank's public key), TLS and the
token towards the bootstrap server.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import trio

from tspd.core.commands import (
    Bootstrapped,
    Event,
    Failed,
    PagesReleased,
    RemotePrefillDone,
    Succeeded,
)
from tspd.core.config import (
    ENV_BOOTSTRAP_TIMEOUT,
    ENV_FAILED_SESSION_TTL,
    ENV_HEARTBEAT_INTERVAL,
    ENV_HEARTBEAT_MAX_FAILURE,
    ENV_QUEUE_SIZE,
    ENV_WAITING_TIMEOUT,
    parse_pd_env,
)
from tspd.core.contract import CacheContract
from tspd.core.decode import DecodeConfig
from tspd.core.errors import ConfigError, TspdError
from tspd.core.interop import bootstrap_token_and_candidates
from tspd.core.machines import RoomState
from tspd.core.manifest import BlockManifest, build_manifest
from tspd.core.prefill import ExtendRow, PrefillConfig
from tspd.core.schedule import ProducerSchedule
from tspd.core.trace import RoomTrace
from tspd.demo.failures import SessionFailures
from tspd.demo.report import Reporter
from tspd.demo.workload import Workload
from tspd.layouts import PageAllocator
from tspd.log import component_logger
from tspd.shell.agreement import ReplicaAgreement, SingleRank, ZmqAgreement
from tspd.shell.arena import HostArena, clear_room, fill_room, verify_room
from tspd.shell.bootstrap import BootstrapClient
from tspd.shell.decode import DecodePeer, DecodeSettings, open_decode_peer
from tspd.shell.engine_setup import open_mooncake_engine
from tspd.shell.metrics import TspdMetrics, open_metrics_server
from tspd.shell.offload import EngineRunner
from tspd.shell.prefill import PrefillPeer, PrefillSettings, RemoteDecodeRow, open_prefill_peer
from tspd.shell.security import SecurityConfig
from tspd.shell.steps import StepCounter

__all__ = [
    "DemoTunables",
    "RoleOptions",
    "run_decode_rank",
    "run_decode_rank_in_thread",
    "run_prefill_rank",
    "run_prefill_rank_in_thread",
]

log = component_logger("demo")

#: A scheduler loop whose poll brought nothing waits for the peer's next activity,
#: at most this long (an engine polls once per iteration, every few ms).
_IDLE_MAX = 0.002
#: Polls cost time in proportion to the requests tracked; like an engine's
#: iteration, the loop polls at most once per this many seconds per tracked request
#: (capped at _IDLE_MAX), so a busy peer batches its events.
_POLL_SPACING_PER_REQUEST = 0.00001


#: A TP group's poll is a replica-agreement round trip between processes: at least
#: this far apart.
_GROUP_POLL_SPACING = 0.0005

#: Room states in which a handed-over room has nothing left in flight (it ended in
#: the hand-over call: nothing to send, a failed plan, a layerwise room already
#: written), so the next poll reports it without any activity.
_ENDED: Final = frozenset({RoomState.SUCCESS, RoomState.FAILED, RoomState.ABSENT})


async def _pace(last_poll: float, tracked: int, tp: int) -> None:
    """Sleep until the next poll is due (see _POLL_SPACING_PER_REQUEST)."""
    spacing = min(_IDLE_MAX, tracked * _POLL_SPACING_PER_REQUEST)
    if tp > 1:
        spacing = max(spacing, _GROUP_POLL_SPACING)
    due = last_poll + spacing
    if due > trio.current_time():
        await trio.sleep_until(due)


@dataclass(frozen=True, slots=True)
class RoleOptions:
    """One demo rank's settings (both roles; each ignores what is not its own)."""

    workload: Workload
    rank: int = 0
    tp: int = 1
    host: str = "127.0.0.1"
    bootstrap: str = "127.0.0.1:8998"
    agree: tuple[str, ...] = ()
    in_flight: int = 32
    layerwise: bool = False
    scatter: bool = False
    #: This rank's staging region in MiB (0: staged transfers off).
    staging_mib: int = 0
    workers: int = 2
    bootstrap_timeout: float = 30.0
    waiting_timeout: float = 60.0
    failed_session_ttl: float = 30.0
    heartbeat_interval: float = 1.0
    heartbeat_max_failures: int = 2
    never_preallocate: bool = False
    #: Serve /metrics and /traces on this port (0: any free port); ``None``: no endpoint.
    metrics_port: int | None = None
    extra: dict[str, object] = field(default_factory=dict)
    #: Secure mode (``None``: plain) and, with CURVE, every agreeing rank's public key.
    security: SecurityConfig | None = None
    agree_keys: tuple[str, ...] = ()


#: Each demo tunable -> (TokenSpeed's variable, its :class:`PDEnv` field).
_TUNABLE_VARIABLES: Final = {
    "bootstrap_timeout": (ENV_BOOTSTRAP_TIMEOUT, "bootstrap_timeout"),
    "waiting_timeout": (ENV_WAITING_TIMEOUT, "waiting_timeout"),
    "workers": (ENV_QUEUE_SIZE, "queue_size"),
    "failed_session_ttl": (ENV_FAILED_SESSION_TTL, "failed_session_ttl"),
    "heartbeat_interval": (ENV_HEARTBEAT_INTERVAL, "heartbeat_interval"),
    "heartbeat_max_failures": (ENV_HEARTBEAT_MAX_FAILURE, "heartbeat_max_failures"),
}


@dataclass(frozen=True, slots=True)
class DemoTunables:
    """The demo's timeouts and sizes. Its own defaults are shorter than TokenSpeed's
    so a stuck demo ends in a minute; :meth:`resolve` lets TokenSpeed's variables
    replace them, as an operator tunes a TokenSpeed deployment."""

    bootstrap_timeout: float = 30.0
    waiting_timeout: float = 60.0
    workers: int = 2
    failed_session_ttl: float = 30.0
    heartbeat_interval: float = 1.0
    heartbeat_max_failures: int = 2

    @classmethod
    def resolve(cls, environ: Mapping[str, str], **explicit: float | int | None) -> DemoTunables:
        """An explicit value (not ``None``) wins, then the variable when it is set in
        ``environ``, then the demo default. Raises ``ConfigError`` naming a variable
        whose value is invalid."""
        env = parse_pd_env(environ, prefill=False)
        values: dict[str, Any] = {}
        for name, (variable, env_field) in _TUNABLE_VARIABLES.items():
            given = explicit.get(name)
            if given is not None:
                values[name] = given
            elif environ.get(variable, "").strip():
                values[name] = getattr(env, env_field)
        return cls(**values)


@asynccontextmanager
async def _agreement(opts: RoleOptions) -> AsyncIterator[ReplicaAgreement]:
    if opts.tp == 1:
        yield SingleRank()
        return
    if len(opts.agree) != opts.tp:
        raise ConfigError(
            f"a rank of a TP group of {opts.tp} needs {opts.tp} agreement endpoints "
            f"(--agree), got {len(opts.agree)}"
        )
    curve = opts.security.curve if opts.security is not None else None
    if curve is not None and len(opts.agree_keys) != opts.tp:
        raise ConfigError(
            f"a secure rank of a TP group of {opts.tp} needs {opts.tp} agreement keys "
            f"(--agree-keys), got {len(opts.agree_keys)}"
        )
    async with ZmqAgreement(
        opts.rank,
        opts.agree,
        timeout=max(30.0, opts.waiting_timeout),
        curve=curve,
        peer_keys=opts.agree_keys if curve is not None else None,
    ) as a:
        yield a


@asynccontextmanager
async def _metrics(opts: RoleOptions) -> AsyncIterator[tuple[TspdMetrics | None, str | None]]:
    """This rank's metrics and the URL they are served at, when ``metrics_port`` is set."""
    if opts.metrics_port is None:
        yield None, None
        return
    metrics = TspdMetrics()
    async with open_metrics_server(metrics, opts.host, opts.metrics_port) as server:
        yield metrics, server.url


def _failure_trace(
    read: Callable[[int], RoomTrace | None], room: int, ok: bool
) -> dict[str, object] | None:
    """A failed room's trace on this rank (``read``: the peer's ``trace``), for its
    report line."""
    trace = None if ok else read(room)
    return None if trace is None else trace.as_dict()


def _check_capacity(opts: RoleOptions, contract: CacheContract) -> None:
    grain = min(spec.block_granularity for spec in contract.group_specs)
    most = max(opts.workload.prompt_len(room, contract) for room in opts.workload.rooms[:4096])
    need = opts.in_flight * -(-most // grain)
    have = min(contract.page_count(gid) - 1 for gid in contract.group_ids)
    if need > have:
        raise ConfigError(
            f"{opts.in_flight} rooms in flight of up to {most} tokens need {need} pages; "
            f"the arena has {have}: lower --in-flight or raise --pages"
        )


@asynccontextmanager
async def _engine(host: str) -> AsyncIterator[EngineRunner]:
    """This rank's Mooncake engine for the block, built and closed in a worker thread
    (initialising and closing one must not stall the loop: tspd.shell.engine_setup)."""
    async with open_mooncake_engine(host) as mooncake:
        # The library's defaults are the settings measured fastest on small hosts
        # (tspd.shell.offload): one write at a time, every write to a reached peer
        # polled on the Trio thread.
        yield EngineRunner.from_env(mooncake, os.environ)


def _prefill_setup(
    opts: RoleOptions,
) -> tuple[CacheContract, ProducerSchedule | None, PrefillConfig, PrefillSettings]:
    """A Prefill rank's contract, layerwise schedule, core configuration and peer
    settings."""
    workload = opts.workload
    contract = workload.contract(opts.tp)
    _check_capacity(opts, contract)
    schedule = ProducerSchedule.from_contract(contract, workload.layers) if opts.layerwise else None
    config = PrefillConfig.from_env(
        os.environ,
        tp_size=opts.tp,
        tp_rank=opts.rank,
        contract=contract,
        arena_base=1,
        transfer_workers=opts.workers,
        bootstrap_timeout=opts.bootstrap_timeout,
        failed_session_ttl=opts.failed_session_ttl,
        layerwise=schedule,
        staging_bytes=opts.staging_mib << 20,
    )
    settings = PrefillSettings(
        host=opts.host,
        bootstrap_addr=opts.bootstrap,
        world_size=opts.tp,
        engine_rank=opts.rank,
        security=opts.security,
    )
    return contract, schedule, config, settings


class _RoleScheduler:
    """What the Prefill and Decode ranks' stand-in schedulers share: the rooms left
    to register, at most ``in_flight`` live, the rank's pages and its failed count.
    Each is the same for a scheduler that is a Trio task and one that is a plain
    thread; only how it calls the peer differs."""

    def __init__(
        self,
        opts: RoleOptions,
        reporter: Reporter,
        contract: CacheContract,
        arena: HostArena,
        trace: Callable[[int], RoomTrace | None],
    ) -> None:
        self._opts = opts
        self._reporter = reporter
        self._contract = contract
        self._arena = arena
        self._trace = trace
        self._pages = PageAllocator(contract, contiguous=not opts.scatter)
        self._pending = deque(opts.workload.rooms)
        #: Registered requests: rid -> room, and when each was registered.
        self.live: dict[str, int] = {}
        self._registered_at: dict[str, float] = {}
        self.failed = 0

    @property
    def busy(self) -> bool:
        """Whether rooms are left to register or to finish."""
        return bool(self._pending or self.live)

    def launch(self, register: Callable[[str, int], object]) -> bool:
        """Register requests (``register(rid, room)``) up to ``in_flight`` live ones;
        whether any was."""
        workload, launched = self._opts.workload, False
        while self._pending and len(self.live) < self._opts.in_flight:
            room = self._pending.popleft()
            rid = workload.rid(room)
            self.live[rid] = room
            self._registered_at[rid] = time.monotonic()
            register(rid, room)
            launched = True
        return launched

    def _ended(self, rid: str) -> tuple[int, float]:
        """Forget an ended request: its room and when it was registered."""
        return self.live.pop(rid), self._registered_at.pop(rid)


class _PrefillScheduler(_RoleScheduler):
    """The Prefill rank's stand-in scheduler and forward (:func:`run_prefill_rank`,
    :func:`run_prefill_rank_in_thread`): what to do with each event, and the
    forward of the requests that bootstrapped (pages, the pattern, hand-over
    rows)."""

    def __init__(
        self,
        opts: RoleOptions,
        reporter: Reporter,
        contract: CacheContract,
        arena: HostArena,
        trace: Callable[[int], RoomTrace | None],
    ) -> None:
        super().__init__(opts, reporter, contract, arena, trace)
        self._tables: dict[str, dict[str, list[int]]] = {}
        self._sources: dict[str, BlockManifest] = {}

    def handle(self, events: Sequence[Event]) -> list[str]:
        """One poll's events: report the rooms that ended and free their pages;
        the requests that bootstrapped, whose forward comes next."""
        ready: list[str] = []
        for event in events:
            if isinstance(event, Bootstrapped):
                ready.append(event.rid)
            elif isinstance(event, Succeeded | Failed):
                room, _ = self._ended(event.rid)
                if event.rid in self._tables:
                    self._pages.release(self._tables.pop(event.rid))
                self._sources.pop(event.rid, None)
                ok = isinstance(event, Succeeded)
                self.failed += not ok
                self._reporter.emit(
                    "room",
                    room=room,
                    ok=ok,
                    reason=None if ok else event.reason,  # type: ignore[union-attr]
                    trace=_failure_trace(self._trace, room, ok),
                )
        return ready

    def allocate(self, rids: Sequence[str]) -> list[ExtendRow]:
        """The forward's pages for ``rids``, as layerwise extend rows."""
        contract = self._contract
        rows = []
        for rid in rids:
            prompt = self._opts.workload.prompt_len(self.live[rid], contract)
            self._tables[rid] = self._pages.allocate(prompt)
            self._sources[rid] = build_manifest(contract, self._tables[rid], 0, prompt)
            rows.append(ExtendRow(rid, 0, prompt, self._tables[rid]))
        return rows

    def fill(self, rid: str, fields: frozenset[str] | None = None) -> None:
        """Write the pattern into ``rid``'s pages (``fields``: one producer step's)."""
        opts = self._opts
        fill_room(
            self._arena,
            self._contract,
            self._sources[rid],
            seed=opts.workload.seed,
            room=self.live[rid],
            tp_size=opts.tp,
            tp_rank=opts.rank,
            fields=fields,
        )

    def hand_over_rows(self, rids: Sequence[str]) -> list[RemoteDecodeRow]:
        """The hand-over rows of ``rids``, each reported as handed over."""
        workload, rows = self._opts.workload, []
        for rid in rids:
            room = self.live[rid]
            token, candidates = bootstrap_token_and_candidates(
                workload.seed, room, workload.candidates
            )
            rows.append(RemoteDecodeRow(rid, self._tables[rid], token, candidates))
            self._reporter.emit("handover", room=room)
        return rows


async def run_prefill_rank(opts: RoleOptions, reporter: Reporter) -> int:
    """Serve the workload as one Prefill rank, the scheduler a Trio task beside the
    peer; returns how many rooms failed."""
    contract, schedule, config, settings = _prefill_setup(opts)
    counter = StepCounter() if schedule is not None else None
    with HostArena.for_contract(contract) as arena:
        async with (
            _engine(opts.host) as engine,
            _metrics(opts) as (metrics, metrics_url),
            _agreement(opts) as agreement,
            open_prefill_peer(
                config,
                engine,
                arena,
                settings=settings,
                agreement=agreement,
                step_counter=counter,
                metrics=metrics,
            ) as peer,
        ):
            _prefill_ready(reporter, opts, peer, engine, metrics_url)
            scheduler = _PrefillScheduler(opts, reporter, contract, arena, peer.trace)
            cpu0, wall0 = time.process_time(), time.monotonic()
            last_poll = trio.current_time()
            while scheduler.busy:
                scheduler.launch(peer.register_request)
                await _pace(last_poll, len(scheduler.live), opts.tp)
                last_poll = trio.current_time()
                events = await peer.poll()
                ready = scheduler.handle(events)
                transferring = False
                if ready:
                    rows = scheduler.allocate(ready)
                    if schedule is not None and counter is not None:
                        peer.arm_layerwise(rows)
                        for step in schedule.steps:
                            for rid in ready:
                                scheduler.fill(rid, step)
                            counter.advance()
                            await trio.lowlevel.checkpoint()  # workers send meanwhile
                    else:
                        for rid in ready:
                            scheduler.fill(rid)
                    try:
                        peer.hand_over(scheduler.hand_over_rows(ready))
                    except TspdError as err:
                        log.error("hand-over refused: %s", err)
                    transferring = all(
                        peer.room_state(scheduler.live[rid]) not in _ENDED for rid in ready
                    )
                if not events or transferring:
                    # Nothing new, or only hand-overs whose outcome comes back as
                    # activity (the transfer's): polling at once would find nothing
                    # and take the CPU from the writes in flight.
                    with trio.move_on_after(_IDLE_MAX):
                        await peer.wait_for_activity()
            _role_done(reporter, scheduler.failed, cpu0, wall0, peer.statistics())
    return scheduler.failed


def run_prefill_rank_in_thread(opts: RoleOptions, reporter: Reporter) -> int:
    """:func:`run_prefill_rank` with the scheduler and the forward a loop in this
    plain thread: the peer runs in a background Trio thread and the loop reaches it
    only through :class:`~tspd.hosts.threads.ThreadedPrefill` -- posted calls, the
    forward side's outbox, and ``poll(wait=...)`` (docs/architecture.md#threads)."""
    from tspd.hosts.threads import ThreadedPrefill, open_trio_thread

    contract, schedule, config, settings = _prefill_setup(opts)
    counter = StepCounter() if schedule is not None else None
    with (
        HostArena.for_contract(contract) as arena,
        open_trio_thread(name="tspd-prefill") as host,
    ):
        engine = host.enter(_engine(opts.host), name="Mooncake engine")
        metrics, metrics_url = host.enter(_metrics(opts), name="metrics")
        agreement = host.enter(_agreement(opts), name="replica agreement")
        peer = host.enter(
            open_prefill_peer(
                config,
                engine,
                arena,
                settings=settings,
                agreement=agreement,
                step_counter=counter,
                metrics=metrics,
            ),
            name="Prefill peer",
        )
        prefill = ThreadedPrefill(host, peer)
        host.call_sync(_prefill_ready, reporter, opts, peer, engine, metrics_url)
        scheduler = _PrefillScheduler(opts, reporter, contract, arena, prefill.trace)
        calls: deque[_Call] = deque()
        cpu0, wall0 = time.process_time(), time.monotonic()
        while scheduler.busy:
            launched = scheduler.launch(
                lambda rid, room: calls.append((prefill.register_request(rid, room), False))
            )
            ready = scheduler.handle(prefill.poll(wait=0.0 if launched else _IDLE_MAX))
            if ready:
                rows = scheduler.allocate(ready)
                if schedule is not None and counter is not None:
                    calls.append((prefill.arm_layerwise(rows), False))
                    for step in schedule.steps:
                        for rid in ready:
                            scheduler.fill(rid, step)
                        counter.advance()
                else:
                    for rid in ready:
                        scheduler.fill(rid)
                calls.append((prefill.hand_over(scheduler.hand_over_rows(ready)), True))
            _raise_failed_calls(calls)
        _role_done(reporter, scheduler.failed, cpu0, wall0, prefill.statistics())
    return scheduler.failed


#: A posted call's future, and whether its error is only logged (a refused
#: hand-over, as the Trio scheduler logs it) rather than ending the rank.
_Call = tuple[concurrent.futures.Future[Any], bool]


def _raise_failed_calls(calls: deque[_Call]) -> None:
    """Collect the posted calls that finished (they finish in order); raise the
    first error that ends the rank, as it would in the Trio scheduler."""
    while calls and calls[0][0].done():
        future, logged = calls.popleft()
        error = future.exception()
        if error is None:
            continue
        if logged and isinstance(error, TspdError):
            log.error("hand-over refused: %s", error)
        else:
            raise error


def _prefill_ready(
    reporter: Reporter,
    opts: RoleOptions,
    peer: PrefillPeer,
    engine: EngineRunner,
    metrics_url: str | None,
) -> None:
    registered = peer.registered_with_bootstrap
    _ready(
        reporter,
        metrics_url,
        f"control socket tcp://{opts.host}:{peer.control_port}, Mooncake session "
        f"{engine.session_id}, bootstrap {opts.bootstrap} "
        f"({'registered' if registered else 'NOT registered'})",
        control=f"tcp://{opts.host}:{peer.control_port}",
        session=engine.session_id,
        registered=registered,
    )


def _ready(reporter: Reporter, metrics_url: str | None, text: str, **fields: Any) -> None:
    """A rank's ``ready`` report (``fields``, its pid, its metrics URL) and the same
    for a person on stderr (``text``)."""
    reporter.emit("ready", **fields, pid=os.getpid(), metrics=metrics_url)
    reporter.announce(text + (f", metrics {metrics_url}" if metrics_url else ""))


def _role_done(
    reporter: Reporter,
    failed: int,
    cpu0: float,
    wall0: float,
    stats: dict[str, Any],
    **more: Any,
) -> None:
    reporter.emit(
        "done",
        cpu=time.process_time() - cpu0,
        wall=time.monotonic() - wall0,
        failed=failed,
        stats=stats,
        **more,
    )


async def _wait_for_prefill(opts: RoleOptions, reporter: Reporter, limit: float = 120.0) -> None:
    """Wait until the Prefill instance's bootstrap server knows every rank (a Decode
    started first would otherwise fail its first rooms)."""
    async with BootstrapClient(security=opts.security) as client:
        with trio.move_on_after(limit):
            announced = False
            while True:
                try:
                    await client.get_parallel_info(opts.bootstrap)
                    return
                except TspdError as err:
                    if not announced:
                        reporter.announce(
                            f"waiting for the Prefill instance at {opts.bootstrap}: {err}"
                        )
                        announced = True
                await trio.sleep(0.05)
    raise ConfigError(
        f"the Prefill instance at {opts.bootstrap} did not become ready within {limit:.0f}s"
    )


def _decode_setup(opts: RoleOptions) -> tuple[CacheContract, DecodeConfig, DecodeSettings]:
    """A Decode rank's contract, core configuration and peer settings."""
    contract = opts.workload.contract(opts.tp)
    _check_capacity(opts, contract)
    config = DecodeConfig.from_env(
        os.environ,
        tp_size=opts.tp,
        tp_rank=opts.rank,
        contract=contract,
        arena_base=1,
        session_id="",
        endpoint=opts.host,
        port=1,
        waiting_timeout=opts.waiting_timeout,
        heartbeat_max_failures=opts.heartbeat_max_failures,
        staging_bytes=opts.staging_mib << 20,
    )
    settings = DecodeSettings(
        host=opts.host, heartbeat_interval=opts.heartbeat_interval, security=opts.security
    )
    return contract, config, settings


class _DecodeScheduler(_RoleScheduler):
    """The Decode rank's stand-in scheduler (:func:`run_decode_rank`,
    :func:`run_decode_rank_in_thread`): what to do with each event."""

    def __init__(
        self,
        opts: RoleOptions,
        reporter: Reporter,
        contract: CacheContract,
        arena: HostArena,
        failures: SessionFailures,
        trace: Callable[[int], RoomTrace | None],
    ) -> None:
        super().__init__(opts, reporter, contract, arena, trace)
        self._failures = failures
        self._held: dict[str, tuple[dict[str, list[int]], BlockManifest]] = {}
        #: Failed rooms whose pages a Prefill rank may still write: reused only
        #: after PagesReleased (docs/architecture.md#write-fencing).
        self._fenced: dict[str, dict[str, list[int]]] = {}

    def handle(
        self, events: Sequence[Event], preallocate: Callable[[int, BlockManifest], object]
    ) -> None:
        """One poll's events: pre-allocate (``preallocate(room, manifest)``) on
        ``Bootstrapped``, check and report a room that ended, free released pages."""
        opts, contract, arena = self._opts, self._contract, self._arena
        for event in events:
            if isinstance(event, Bootstrapped):
                if opts.never_preallocate:
                    continue
                room = self.live[event.rid]
                prompt = opts.workload.prompt_len(room, contract)
                row = self._pages.allocate(prompt)
                manifest = build_manifest(contract, row, 0, prompt)
                clear_room(arena, contract, manifest)
                self._held[event.rid] = (row, manifest)
                preallocate(room, manifest)
                self._reporter.emit("preallocated", room=room)
            elif isinstance(event, RemotePrefillDone | Failed):
                seen = time.monotonic()
                room, started = self._ended(event.rid)
                row_manifest = self._held.pop(event.rid, None)
                ok, reason, nbytes = _finish(event, room, row_manifest, arena, contract, opts)
                if row_manifest is not None:
                    if isinstance(event, Failed) and event.pages_held:
                        self._fenced[event.rid] = row_manifest[0]
                    else:
                        self._pages.release(row_manifest[0])
                if not ok:
                    self.failed += 1
                    self._failures.add(room, reason or "no reason given")
                self._reporter.emit(
                    "room",
                    room=room,
                    ok=ok,
                    reason=reason,
                    bytes=nbytes,
                    latency=seen - started,
                    seen=seen,
                    # When the peer saw the room end (the event's time, on the same
                    # clock): seen minus this is the scheduler's delay in learning it.
                    ended=event.at,
                    trace=_failure_trace(self._trace, room, ok),
                )
            elif isinstance(event, PagesReleased):
                released = self._fenced.pop(event.rid, None)
                if released is not None:
                    self._pages.release(released)


async def run_decode_rank(opts: RoleOptions, reporter: Reporter) -> int:
    """Serve the workload as one Decode rank, the scheduler a Trio task beside the
    peer; returns how many rooms failed (a byte or token mismatch counts as a
    failure)."""
    contract, config, settings = _decode_setup(opts)
    await _wait_for_prefill(opts, reporter)
    # Every room comes from the one Prefill instance at opts.bootstrap: its failures
    # are logged once for it, with their count, not once per room.
    failures = SessionFailures(lambda room: opts.bootstrap, [opts.bootstrap])
    with (
        HostArena.for_contract(contract) as arena,
        failures.collapse(component_logger("decode")),
    ):
        async with (
            _engine(opts.host) as engine,
            _metrics(opts) as (metrics, metrics_url),
            _agreement(opts) as agreement,
            open_decode_peer(
                config, engine, arena, settings=settings, agreement=agreement, metrics=metrics
            ) as peer,
        ):
            _decode_ready(reporter, opts, peer, engine, arena, metrics_url)
            scheduler = _DecodeScheduler(opts, reporter, contract, arena, failures, peer.trace)
            cpu0, wall0 = time.process_time(), time.monotonic()

            def register(rid: str, room: int) -> None:
                peer.register_request(rid, room, opts.bootstrap)

            last_poll = trio.current_time()
            while scheduler.busy:
                scheduler.launch(register)
                await _pace(last_poll, len(scheduler.live), opts.tp)
                last_poll = trio.current_time()
                events = await peer.poll()
                scheduler.handle(events, peer.send_preallocation)
                if not events:
                    with trio.move_on_after(_IDLE_MAX):
                        await peer.wait_for_activity()
            _decode_done(reporter, opts, failures, scheduler, cpu0, wall0, peer.statistics())
    return scheduler.failed


def run_decode_rank_in_thread(opts: RoleOptions, reporter: Reporter) -> int:
    """:func:`run_decode_rank` with the scheduler a loop in this plain thread, as
    TokenSpeed's, SGLang's and vLLM's are: the peer runs in a background Trio thread
    (:func:`~tspd.hosts.threads.open_trio_thread`) and the loop reaches it only
    through :class:`~tspd.hosts.threads.ThreadedDecode` -- posted calls, and
    ``poll(wait=...)``, which sleeps until the peer concluded events and takes them
    without a crossing (docs/architecture.md#threads)."""
    from tspd.hosts.threads import ThreadedDecode, open_trio_thread

    contract, config, settings = _decode_setup(opts)
    failures = SessionFailures(lambda room: opts.bootstrap, [opts.bootstrap])
    with (
        HostArena.for_contract(contract) as arena,
        failures.collapse(component_logger("decode")),
        open_trio_thread(name="tspd-decode") as host,
    ):
        host.call(_wait_for_prefill, opts, reporter)
        engine = host.enter(_engine(opts.host), name="Mooncake engine")
        metrics, metrics_url = host.enter(_metrics(opts), name="metrics")
        agreement = host.enter(_agreement(opts), name="replica agreement")
        peer = host.enter(
            open_decode_peer(
                config, engine, arena, settings=settings, agreement=agreement, metrics=metrics
            ),
            name="Decode peer",
        )
        decode = ThreadedDecode(host, peer)
        host.call_sync(_decode_ready, reporter, opts, peer, engine, arena, metrics_url)
        scheduler = _DecodeScheduler(opts, reporter, contract, arena, failures, decode.trace)
        # Posted calls' futures, oldest first: they finish in order; a call that
        # raised ends the rank as it would in the Trio scheduler.
        calls: deque[_Call] = deque()

        def register(rid: str, room: int) -> None:
            calls.append((decode.register_request(rid, room, opts.bootstrap), False))

        def preallocate(room: int, manifest: BlockManifest) -> None:
            calls.append((decode.send_preallocation(room, manifest), False))

        cpu0, wall0 = time.process_time(), time.monotonic()
        while scheduler.busy:
            launched = scheduler.launch(register)
            events = decode.poll(wait=0.0 if launched else _IDLE_MAX)
            scheduler.handle(events, preallocate)
            _raise_failed_calls(calls)
        _decode_done(reporter, opts, failures, scheduler, cpu0, wall0, decode.statistics())
    return scheduler.failed


def _decode_ready(
    reporter: Reporter,
    opts: RoleOptions,
    peer: DecodePeer,
    engine: EngineRunner,
    arena: HostArena,
    metrics_url: str | None,
) -> None:
    _ready(
        reporter,
        metrics_url,
        f"status socket tcp://{opts.host}:{peer.status_port}, Mooncake session "
        f"{engine.session_id}, arena at {arena.base:#x}, Prefill bootstrap {opts.bootstrap}",
        status=f"tcp://{opts.host}:{peer.status_port}",
        session=engine.session_id,
        arena_base=arena.base,
    )


def _decode_done(
    reporter: Reporter,
    opts: RoleOptions,
    failures: SessionFailures,
    scheduler: _DecodeScheduler,
    cpu0: float,
    wall0: float,
    stats: dict[str, Any],
) -> None:
    failures.log_summary(log, len(opts.workload.rooms))
    _role_done(
        reporter,
        scheduler.failed,
        cpu0,
        wall0,
        stats,
        failed_sessions=failures.as_dict(),
    )


def _finish(
    event: RemotePrefillDone | Failed,
    room: int,
    held: tuple[dict[str, list[int]], BlockManifest] | None,
    arena: HostArena,
    contract: CacheContract,
    opts: RoleOptions,
) -> tuple[bool, str | None, int]:
    """Check a finished room: (ok, reason, bytes verified)."""
    if isinstance(event, Failed):
        return False, event.reason, 0
    if held is None:
        return False, "RemotePrefillDone for a room this rank never pre-allocated", 0
    workload = opts.workload
    manifest = held[1]
    # The token and the bytes are both checked and both reported: a wrong token with
    # right bytes, right bytes with a wrong token and both wrong (another seed) are
    # three different problems for whoever runs the Prefill.
    problems: list[str] = []
    token, candidates = bootstrap_token_and_candidates(workload.seed, room, workload.candidates)
    if (event.bootstrap_token, event.spec_candidate_ids) != (token, candidates):
        problem = (
            f"bootstrap token/candidates {event.bootstrap_token}/{event.spec_candidate_ids} "
            f"differ from the pattern's {token}/{candidates}"
        )
        if event.bootstrap_token == token:
            problem += (
                f" (this rank expects {workload.candidates} speculative candidates: "
                "--spec-candidates must match the Prefill's)"
            )
        problems.append(problem)
    mismatches = verify_room(
        arena, contract, manifest, seed=workload.seed, room=room, tp_size=opts.tp, tp_rank=opts.rank
    )
    if mismatches:
        more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        problems.append(f"byte mismatch: {mismatches[0]}{more}")
        if event.bootstrap_token != token:
            problems.append(
                "the token and the bytes both differ: the Prefill probably writes another "
                f"seed's pattern (this rank checks seed {workload.seed}: --seed)"
            )
    if problems:
        return False, "; ".join(problems), 0
    return True, None, manifest.payload_bytes(contract)
