"""The Decode rank's peer on Trio: status socket, bootstrap lookups, heartbeats, polls.

:func:`open_decode_peer` runs one Decode rank's PD transfer peer for the
duration of an ``async with`` block. The sans-IO
:class:`tspd.core.decode.DecodeCore` makes every protocol decision; the peer's
nursery owns:

* the **status task** — the only owner of the PULL status socket (bound on the
  configured host before the core exists, so its port goes into every
  registration; frames and frame counts bounded by the largest status message); it
  drains status messages in batches into ``core.receive_status``;
* the **push pool** — a bounded pool of PUSH sockets, one per Prefill rank, for
  registrations and pre-allocations (docs/protocol.md#proto-zmq);
* **bootstrap lookups** — one short task per ``FetchParallelInfo`` /
  ``FetchRankInfo`` command over HTTP (:class:`~tspd.shell.bootstrap.BootstrapClient`),
  answered with ``core.parallel_info`` / ``core.rank_info`` (an error becomes the
  error text: the waiting rooms fail with the spec's reason,
  docs/protocol.md#proto-decode-room-table);
* the **heartbeat task** — every interval, ``GET /health`` on each Prefill
  bootstrap address the core names, concurrently, reported to ``core.heartbeat``
  (docs/protocol.md#proto-failure-prefill-death);
* the **timer task** — the waiting timeout.

In secure mode (``DecodeSettings.security`` with CURVE keys, docs/security.md) the
status socket is a CURVE server behind the ZAP handler's allow-list (its server key is
this process's public key, which every Prefill rank learns as the identity of the
registration it receives), each status reaches the core with its sender's identity,
and registrations and pre-allocations go out as CURVE clients of the key each
Prefill rank's bootstrap route carries. A rank whose route has no key (a plain
Prefill), or a key not on the allow-list, fails its rooms with an explicit reason; a
plain Decode refuses a rank whose route carries a key the same way.

Nothing a peer sends and no route that cannot be planned raises into the caller:
the room fails with a reason, and the scheduler sees a ``Failed`` event. The
arena is registered with the engine so Prefill ranks can write into it, and
deregistered on exit, through :mod:`tspd.shell.engine_setup` (in a worker thread for
an engine whose setup blocks, inline for the in-process engines).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, final

import trio
import zmq

from tspd.core.bootstrap import RankInfo
from tspd.core.commands import (
    Command,
    Event,
    FetchParallelInfo,
    FetchRankInfo,
    RoomFailed,
    SendFrames,
)
from tspd.core.config import parse_pd_env
from tspd.core.decode import DecodeConfig, DecodeCore
from tspd.core.errors import TspdError
from tspd.core.machines import RoomState
from tspd.core.manifest import BlockManifest
from tspd.core.trace import RoomTrace
from tspd.core.wire import MAX_STATUS_FRAME_BYTES
from tspd.engines.base import AsyncTransferEngine, TransferEngine
from tspd.log import component_logger
from tspd.shell.agreement import ReplicaAgreement, SingleRank
from tspd.shell.arena import HostArena
from tspd.shell.bootstrap import BootstrapClient
from tspd.shell.engine_setup import register_memory, unregister_on_exit
from tspd.shell.metrics import TspdMetrics
from tspd.shell.nursery import single_error
from tspd.shell.observe import PeerObserver
from tspd.shell.pushes import DEFAULT_IDLE_TTL, DEFAULT_MAX_SOCKETS, PushPool
from tspd.shell.security import CurveGuard, SecurityConfig
from tspd.shell.timer import DeadlineTimer
from tspd.shell.zmq import MAX_MESSAGE_FRAMES, TrioSocket, bind_free_port, open_socket

__all__ = ["DecodePeer", "DecodeSettings", "open_decode_peer"]

log = component_logger("decode")

#: How many recent room failures a peer keeps in ``failures``.
RECENT_FAILURES = 1024


@dataclass(frozen=True, slots=True)
class DecodeSettings:
    """What a Decode rank's peer needs besides its core's configuration.

    ``host``: where the status socket binds and what registrations advertise.
    ``heartbeat_interval``: seconds between heartbeat rounds
    (``TOKENSPEED_DISAGGREGATION_HEARTBEAT_INTERVAL``, 5.0 by default).
    ``status_batch`` caps how many status messages one drain takes.
    ``push_sockets``/``push_idle_ttl``: the push pool's bound and idle TTL
    (:class:`~tspd.shell.pushes.PushPool`). ``security``: secure mode (CURVE keys
    for the sockets, TLS and token for the bootstrap client; docs/security.md);
    ``None`` is plain mode.
    """

    host: str = "127.0.0.1"
    heartbeat_interval: float = 5.0
    status_batch: int = 256
    push_sockets: int = DEFAULT_MAX_SOCKETS
    push_idle_ttl: float = DEFAULT_IDLE_TTL
    security: SecurityConfig | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **fields: Any) -> DecodeSettings:
        """Settings whose heartbeat interval defaults to
        ``TOKENSPEED_DISAGGREGATION_HEARTBEAT_INTERVAL`` in ``environ`` (pass
        ``os.environ``); explicit ``fields`` win. Raises ``ConfigError`` naming the
        variable for an invalid value."""
        values: dict[str, Any] = {
            "heartbeat_interval": parse_pd_env(environ, prefill=False).heartbeat_interval
        }
        values.update(fields)
        return cls(**values)


@final
class DecodePeer:
    """One Decode rank's running peer; get one from :func:`open_decode_peer`.

    Every method runs in the peer's Trio thread.
    """

    def __init__(
        self,
        core: DecodeCore,
        *,
        engine: AsyncTransferEngine | TransferEngine,
        arena: HostArena,
        agreement: ReplicaAgreement,
        pushes: PushPool,
        client: BootstrapClient,
        status_port: int,
        observer: PeerObserver | None = None,
        curve: CurveGuard | None = None,
        server_keys: dict[tuple[str, int], str] | None = None,
    ) -> None:
        self.core = core
        #: Secure mode's CURVE keys and ZAP domain (``None`` in plain mode).
        self.curve = curve
        #: Secure mode: the CURVE server key of each Prefill control endpoint (the
        #: push pool reads it when it opens a socket).
        self._server_keys = server_keys if server_keys is not None else {}
        #: Logs, metrics and traces of this rank (:mod:`tspd.shell.observe`).
        self.observer = observer or PeerObserver("decode", core.config.tp_rank)
        self.engine = engine
        self.arena = arena
        self.agreement = agreement
        self.status_port = status_port
        #: The most recent room failures (bounded; metrics and traces keep the rest).
        self.failures: deque[RoomFailed] = deque(maxlen=RECENT_FAILURES)
        self._pushes = pushes
        self._client = client
        self._timer = DeadlineTimer(core.next_deadline, self._on_timeout)
        self._nursery: trio.Nursery | None = None
        self._activity = trio.Event()
        #: Called (in the Trio thread) whenever :meth:`wait_for_activity` would wake;
        #: a thread host sets it to wake its scheduler thread without polling.
        self.on_activity: Callable[[], None] | None = None
        self.heartbeats = 0

    @property
    def session_id(self) -> str:
        """This rank's transfer-engine session id."""
        return self.core.config.session_id

    # -- command execution -------------------------------------------------------

    def _pump(self, *, activity: bool = False) -> None:
        if activity:
            self._activity.set()
            if self.on_activity is not None:
                self.on_activity()
        for command in self.core.drain_commands():
            self._execute(command)
        self.observer.finished(self.core.drain_finished())
        self._timer.poke()

    def _execute(self, command: Command) -> None:
        if self.observer.command(command):  # a Log or RoomFailed: logged and counted
            if isinstance(command, RoomFailed):
                self.failures.append(command)
        elif isinstance(command, SendFrames):
            self._pushes.send_nowait(command.endpoint, command.port, command.frames, command.room)
        elif isinstance(command, FetchParallelInfo):
            self._spawn(self._fetch_parallel_info, command)
        elif isinstance(command, FetchRankInfo):
            self._spawn(self._fetch_rank_info, command)
        else:
            log.error("the Decode core asked for a Prefill-only command: %r", command)

    def _spawn(self, fn: object, command: FetchParallelInfo | FetchRankInfo) -> None:
        if self._nursery is None:
            log.error("Decode peer is not running; dropped %r", command)
            return
        self._nursery.start_soon(fn, command)  # type: ignore[arg-type]

    async def _fetch_parallel_info(self, command: FetchParallelInfo) -> None:
        addr = command.bootstrap_addr
        try:
            info = await self._client.get_parallel_info(addr)
        except TspdError as err:
            self.core.parallel_info(addr, str(err), trio.current_time())
        else:
            self.core.parallel_info(addr, info, trio.current_time())
        self._pump(activity=True)

    async def _fetch_rank_info(self, command: FetchRankInfo) -> None:
        addr, rank, dp = command.bootstrap_addr, command.engine_rank, command.dp_group
        try:
            info = await self._client.get_rank_info(addr, rank, dp)
        except TspdError as err:
            self.core.rank_info(addr, dp, rank, str(err), trio.current_time())
        else:
            refused = self._check_mode(addr, rank, dp, info)
            self.core.rank_info(addr, dp, rank, refused or info, trio.current_time())
        self._pump(activity=True)

    def server_key(self, endpoint: str, port: int) -> str | None:
        """Secure mode: the CURVE server key of the Prefill control socket at
        ``endpoint:port`` (from its bootstrap route), or ``None``."""
        return self._server_keys.get((endpoint, port))

    def _check_mode(self, addr: str, rank: int, dp: int, info: RankInfo) -> str | None:
        """Why this rank must not use ``info`` (a plain rank in secure mode, a secure
        one in plain mode, a key off the allow-list), or ``None``; a usable key is
        kept for the push pool."""
        where = f"Prefill rank {rank} (DP group {dp}) of {addr} at {info.rank_ip}:{info.rank_port}"
        if self.curve is None:
            if info.curve_key is None:
                return None
            return (
                f"{where} runs tspd secure mode (its bootstrap route carries a CURVE key) and "
                "this Decode runs plain mode: a plain peer cannot reach it; configure "
                "TSPD_CURVE_SECRET_KEY_FILE and TSPD_CURVE_ALLOW_DIR (docs/security.md)"
            )
        if info.curve_key is None:
            return (
                f"{where} runs plain mode (its bootstrap route has no CURVE key) and this "
                "Decode runs tspd secure mode, which refuses plain peers (docs/security.md)"
            )
        if info.curve_key not in self.curve.keys.allowed:
            return (
                f"{where} presents CURVE key {info.curve_key}, which is not in this Decode's "
                f"allow-list {self.curve.keys.allow_dir}: refused (docs/security.md)"
            )
        route = (info.rank_ip, info.rank_port)
        if self._server_keys.get(route, info.curve_key) != info.curve_key:
            self._pushes.release(*route)  # the rank's key changed: reconnect with the new one
        self._server_keys[route] = info.curve_key
        return None

    def _on_timeout(self, now: float) -> None:
        self.core.handle_timeout(now)
        self._pump(activity=True)

    # -- scheduler-side API -------------------------------------------------------

    def register_request(self, rid: str, room: int, bootstrap_addr: str) -> None:
        """Track request ``rid`` for ``room`` at the Prefill instance whose bootstrap
        server is ``bootstrap_addr`` (``host:port``); routing starts at once."""
        self.core.register_request(rid, room, bootstrap_addr, trio.current_time())
        self._pump()

    def send_preallocation(
        self,
        room: int,
        manifest: BlockManifest | Mapping[str, Sequence[int]],
        *,
        prefix_len: int = 0,
        prompt_len: int | None = None,
    ) -> None:
        """Pre-allocate ``room`` with its Prefill ranks once its pages are allocated
        and zeroed: a manifest, or block tables with the window (``prompt_len``). An
        invalid manifest fails the room with the reason."""
        try:
            self.core.send_preallocation(
                room, manifest, trio.current_time(), prefix_len=prefix_len, prompt_len=prompt_len
            )
        finally:
            self._pump()

    async def poll(self) -> list[Event]:
        """One poll (docs/protocol.md#proto-decode-poll): local values, the replica agreement's
        MIN, then the
        events in registration order — ``Bootstrapped``,
        :class:`~tspd.core.commands.RemotePrefillDone` or ``Failed``."""
        values = self.core.poll_values(trio.current_time())
        agreed = await self.agreement.agree(values)
        events = self.core.conclude(agreed, trio.current_time())
        self.observer.events(events)
        self._pump()
        return events

    async def wait_for_activity(self) -> None:
        """Return once something arrived from outside the scheduler since the last
        call — a peer's message, a transfer outcome, a lookup, a timer — so a
        scheduler loop can sleep between polls instead of spinning. Bound the wait
        (``trio.move_on_after``): polls also see time passing."""
        await self._activity.wait()
        self._activity = trio.Event()

    def has_in_flight(self) -> bool:
        """Whether any request is tracked."""
        return self.core.has_in_flight()

    def room_state(self, room: int) -> RoomState:
        """``room``'s state on this rank (``ABSENT`` when it has no entry)."""
        return self.core.room_state(room)

    def trace(self, room: int) -> RoomTrace | None:
        """``room``'s milestones on this rank: live, or kept after it failed or ran
        slow (:mod:`tspd.core.trace`); ``None`` when neither."""
        return self.core.trace(room)

    def recent_traces(self) -> list[RoomTrace]:
        """Kept traces of recent rooms that failed or ran slow."""
        return self.core.recent_traces()

    def statistics(self) -> dict[str, int]:
        """The core's table sizes plus message counters."""
        stats = dict(self.core.statistics())
        stats["messages_sent"] = self._pushes.stats.sent
        stats["messages_dropped"] = self._pushes.stats.dropped
        stats["heartbeats"] = self.heartbeats
        return stats

    # -- tasks -------------------------------------------------------------------

    async def _status(
        self,
        sock: TrioSocket,
        batch: int,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        if self.curve is not None:
            await self._status_secure(sock, batch)
        while True:
            messages = await sock.recv_batch(batch)
            now = trio.current_time()
            for frames in messages:
                try:
                    self.core.receive_status(frames, now)
                except Exception:  # the status loop never dies
                    self.observer.internal_error("a Prefill status message")
            self._pump(activity=True)

    async def _status_secure(self, sock: TrioSocket, batch: int) -> None:
        """The status loop of secure mode: each message with its CURVE identity."""
        while True:
            messages = await sock.recv_batch_from(batch)
            now = trio.current_time()
            for frames, sender in messages:
                try:
                    self.core.receive_status(frames, now, sender)
                except Exception:  # the status loop never dies
                    self.observer.internal_error("a Prefill status message")
            self._pump(activity=True)

    async def _heartbeat(
        self, interval: float, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            await trio.sleep(interval)
            addrs = self.core.bootstrap_addrs()
            if not addrs:
                continue
            results: dict[str, bool] = {}
            async with trio.open_nursery() as nursery:
                for addr in addrs:
                    nursery.start_soon(self._beat, addr, results)
            now = trio.current_time()
            for addr in addrs:
                self.core.heartbeat(addr, results.get(addr, False), now)
            self.heartbeats += 1
            self._pump(activity=True)

    async def _beat(self, addr: str, results: dict[str, bool]) -> None:
        results[addr] = await self._client.health(addr)


def _bind_status(
    host: str, context: zmq.Context[zmq.Socket[bytes]], curve: CurveGuard | None = None
) -> tuple[TrioSocket, int]:
    sock = open_socket(
        context,
        zmq.PULL,
        max_frame_bytes=MAX_STATUS_FRAME_BYTES,
        max_frames=MAX_MESSAGE_FRAMES,
        name="Decode status socket",
    )
    try:
        if curve is not None:
            curve.server(sock, "the Decode status socket")
        port = bind_free_port(sock, host)
    except BaseException:
        sock.close()
        raise
    return sock, port


@asynccontextmanager
async def open_decode_peer(
    config: DecodeConfig,
    engine: AsyncTransferEngine | TransferEngine,
    arena: HostArena,
    *,
    settings: DecodeSettings | None = None,
    agreement: ReplicaAgreement | None = None,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    metrics: TspdMetrics | None = None,
) -> AsyncIterator[DecodePeer]:
    """Run one Decode rank's peer for the duration of the block (see the module doc).

    ``config`` is the core's configuration; its ``arena_base``, ``session_id``,
    ``endpoint`` and ``port`` are taken from ``arena``, ``engine`` and the status
    socket this function binds on ``settings.host``. Decode never writes, so a
    synchronous engine is fine here: only its registration calls are used.
    ``metrics``: where this rank's metrics go (serve them with
    :func:`tspd.shell.metrics.serve_metrics`); logs and traces are kept either way.
    """
    settings = settings or DecodeSettings()
    ctx = context or zmq.Context.instance()
    security = settings.security
    curve = (
        CurveGuard(ctx, security.curve, f"Decode rank {config.tp_rank}")
        if security is not None and security.curve is not None
        else None
    )
    server_keys: dict[tuple[str, int], str] = {}
    pushes = PushPool(
        ctx,
        name=f"Decode rank {config.tp_rank}",
        max_sockets=settings.push_sockets,
        idle_ttl=settings.push_idle_ttl,
        curve=curve,
        server_key=(lambda e, p: server_keys.get((e, p))) if curve is not None else None,
    )
    try:
        status, port = _bind_status(settings.host, ctx, curve)
    except BaseException:
        if curve is not None:
            curve.close()
        raise
    try:
        core = DecodeCore(
            dataclasses.replace(
                config,
                arena_base=arena.base,
                session_id=engine.session_id,
                endpoint=settings.host,
                port=port,
            )
        )
        await register_memory(engine, arena.base, arena.size)
    except BaseException:
        status.close()
        if curve is not None:
            curve.close()
        raise
    try:
        with single_error():
            async with (
                BootstrapClient(security=security) as client,
                trio.open_nursery() as nursery,
            ):
                peer = DecodePeer(
                    core,
                    engine=engine,
                    arena=arena,
                    agreement=agreement or SingleRank(),
                    pushes=pushes,
                    client=client,
                    status_port=port,
                    observer=PeerObserver(
                        "decode",
                        config.tp_rank,
                        metrics=metrics,
                        slow_after=config.trace.slow_after,
                    ),
                    curve=curve,
                    server_keys=server_keys,
                )
                peer.observer.watch(core, peer.statistics)
                peer._nursery = nursery
                await nursery.start(pushes.run)
                await nursery.start(peer._timer.run)
                await nursery.start(peer._status, status, settings.status_batch)
                await nursery.start(peer._heartbeat, settings.heartbeat_interval)
                try:
                    yield peer
                finally:
                    peer._nursery = None
                    peer.observer.close()
                    nursery.cancel_scope.cancel()
    finally:
        status.close()
        if curve is not None:
            curve.close()
        await unregister_on_exit(engine, arena.base, what="the Decode arena", logger=log)
