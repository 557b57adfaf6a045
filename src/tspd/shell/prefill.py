"""The Prefill rank's peer on Trio: sockets, workers, timers and the scheduler's API.

:func:`open_prefill_peer` runs one Prefill rank's PD transfer peer for the
duration of an ``async with`` block. The protocol decisions are the sans-IO
:class:`tspd.core.prefill.PrefillCore`'s; this module moves data between it and
the world. The peer's nursery owns:

* the **control task** — the only owner of the PULL control socket (bound on the
  configured host, frames and frame counts bounded by the protocol's largest
  message); it drains registrations and pre-allocations in batches into
  ``core.receive_control`` (docs/protocol.md#proto-registration-handling,
  docs/protocol.md#proto-preallocation-checks);
* the **push pool** — a bounded pool of PUSH sockets, one per Decode endpoint, one
  owner task, for status messages and failure notices (docs/protocol.md#proto-zmq). A route libzmq
  cannot use fails only the rooms of the sessions replying there
  (``core.send_failed``); a route the core releases is closed;
* the **transfer workers** — sharded as the core says, so one room's chunks stay
  ordered; engine calls go through an :class:`AsyncTransferEngine`;
* the **timer task** — sleeps until ``core.next_deadline()`` and hands the core
  ``now`` (bootstrap timeouts, the unclaimed-room sweep, session TTLs);
* the **bootstrap registration** — one ``PUT /route`` to the instance's bootstrap
  server (failure is logged, not fatal, as in TokenSpeed).

In secure mode (``PrefillSettings.security`` with CURVE keys, docs/security.md) the
control socket is a CURVE server behind the ZAP handler's allow-list, the ``PUT``
carries its public key (:data:`~tspd.core.bootstrap.CURVE_KEY_FIELD`), every control
message reaches the core with its sender's identity, and each status goes out as a
CURVE client of the identity that registered the Decode session replying there.

Every core call is followed by a pump (:meth:`~tspd.shell.peer.RankPeer._pump`,
shared with Decode in :mod:`tspd.shell.peer`), which executes the commands it
queued, in order: :meth:`PrefillPeer._execute` matches every
:data:`~tspd.core.commands.PrefillCommand` exhaustively. The scheduler-side API
(``register_request``, ``poll``, ``abort``, ``record_usage``, ``has_in_flight``)
runs in the Trio thread; the forward-side API (:class:`PrefillOutbox`) is callable
from any thread and never waits for a transfer. Leaving the block cancels every
task, closes every socket and deregisters the arena; no thread or socket outlives
it.
Registering and deregistering the arena (on entry and exit, and for sleep/wake) go
through :mod:`tspd.shell.engine_setup`: in a worker thread for an engine whose setup
blocks (Mooncake pins the arena), inline for the in-process engines.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, assert_never, final

import trio
import zmq

from tspd.core.bootstrap import CURVE_KEY_FIELD, STAGING_FIELD, build_route_payload
from tspd.core.commands import (
    CloseRoute,
    Event,
    Failed,
    Log,
    PrefillCommand,
    Rejected,
    RoomFailed,
    SendFrames,
    StartTransfer,
    Succeeded,
)
from tspd.core.errors import ProtocolError, TspdError
from tspd.core.prefill import ExtendRow, PrefillConfig, PrefillCore
from tspd.core.trace import Side
from tspd.core.wire import MAX_CONTROL_FRAME_BYTES
from tspd.engines.base import AsyncTransferEngine
from tspd.log import component_logger
from tspd.shell.agreement import ReplicaAgreement, SingleRank
from tspd.shell.arena import HostArena
from tspd.shell.bootstrap import BootstrapClient
from tspd.shell.engine_setup import register_memory, unregister_memory, unregister_on_exit
from tspd.shell.metrics import TspdMetrics
from tspd.shell.observe import PeerObserver
from tspd.shell.peer import RankPeer, Receiver, open_peer_nursery, open_rank_sockets
from tspd.shell.pushes import DEFAULT_IDLE_TTL, DEFAULT_MAX_SOCKETS, PushPool
from tspd.shell.security import CurveGuard, SecurityConfig
from tspd.shell.steps import StepCounter
from tspd.shell.threadsafe import LoopPortal
from tspd.shell.transfers import Staging, TransferWorkers

__all__ = [
    "ExtendRow",
    "PrefillOutbox",
    "PrefillPeer",
    "PrefillSettings",
    "ReleaseRefused",
    "RemoteDecodeRow",
    "open_prefill_peer",
]

log = component_logger("prefill")


class ReleaseRefused(TspdError):
    """Sleep may not release the registered cache while a tracked request may still
    send (docs/protocol.md#proto-sleep-wake); the message lists the rooms."""


@dataclass(frozen=True, slots=True)
class PrefillSettings:
    """What a Prefill rank's peer needs besides its core's configuration.

    ``host`` is where the control socket binds and what the rank advertises as its
    ``rank_ip``; ``bootstrap_addr`` is its instance's bootstrap server
    (``host:port``; ``None`` skips the registration, for tests that wire peers by
    hand). ``world_size``, ``dp_size`` and ``engine_rank`` go into the ``PUT
    /route`` body, with ``extra_payload`` merged over it. ``control_batch`` caps
    how many control messages one drain takes before other tasks run.
    ``push_sockets``/``push_idle_ttl``: the push pool's bound and idle TTL
    (:class:`~tspd.shell.pushes.PushPool`). ``security``: secure mode (CURVE keys
    for the sockets, TLS and token for the bootstrap client; docs/security.md);
    ``None`` is plain mode.
    """

    host: str = "127.0.0.1"
    bootstrap_addr: str | None = None
    world_size: int = 1
    dp_size: int = 1
    engine_rank: int = 0
    extra_payload: Mapping[str, Any] = field(default_factory=dict)
    control_batch: int = 256
    push_sockets: int = DEFAULT_MAX_SOCKETS
    push_idle_ttl: float = DEFAULT_IDLE_TTL
    security: SecurityConfig | None = None


@dataclass(frozen=True, slots=True)
class RemoteDecodeRow:
    """One request of a remote-decode hand-over: this rank's block tables for it (per
    group, block ids indexed by logical slot), its first generated token and its
    speculative candidates."""

    rid: str
    tables: Mapping[str, Sequence[int]]
    bootstrap_token: int
    spec_candidate_ids: tuple[int, ...] = ()


@final
class PrefillPeer(RankPeer[PrefillCommand]):
    """One Prefill rank's running peer; get one from :func:`open_prefill_peer`.

    Methods run in the peer's Trio thread unless stated otherwise; use
    :attr:`outbox` from an engine's own threads. What it shares with the Decode
    peer (the pump, the poll, the receive task, the queries) is
    :class:`~tspd.shell.peer.RankPeer`'s.
    """

    core: PrefillCore
    _side = Side.PREFILL

    def __init__(
        self,
        core: PrefillCore,
        *,
        engine: AsyncTransferEngine,
        arena: HostArena,
        agreement: ReplicaAgreement,
        pushes: PushPool,
        step_counter: StepCounter | None,
        control_port: int,
        host: str,
        observer: PeerObserver | None = None,
        curve: CurveGuard | None = None,
        staging: Staging | None = None,
    ) -> None:
        super().__init__(core, observer, agreement=agreement, pushes=pushes, curve=curve)
        self.engine = engine
        self.arena = arena
        self.staging = staging
        self.control_port = control_port
        self.host = host
        self.step_counter = step_counter
        self.registered_with_bootstrap = False
        self._workers = TransferWorkers(
            engine,
            self,
            count=core.config.transfer_workers,
            read_step=step_counter.read if step_counter is not None else None,
            on_write=self.observer.write,
            staging=staging,
        )
        self._rooms_by_rid: dict[str, int] = {}
        self._memory_registered = False
        #: Held while the arena's registration changes (sleep/wake).
        self._registration_lock = trio.Lock()
        self._portal: LoopPortal | None = None
        self._outbox: PrefillOutbox | None = None
        # Routes the push pool could not send to, for the core (see _execute_queued).
        self._unreachable: list[tuple[str, int, str]] = []

    @property
    def session_id(self) -> str:
        """This rank's transfer-engine session id."""
        return self.engine.session_id

    # -- command execution -------------------------------------------------------

    def _execute_queued(self) -> None:
        """Execute the queued commands; then tell the core of every route the push
        pool could not send to."""
        super()._execute_queued()
        while self._unreachable:
            # The core fails those routes' rooms; their notices to other routes
            # may fail in turn (each route at most once: its sessions are gone).
            unreachable, self._unreachable = self._unreachable, []
            now = trio.current_time()
            for endpoint, port, error in unreachable:
                self.core.send_failed(endpoint, port, error, now)
            super()._execute_queued()

    def _execute(self, command: PrefillCommand) -> None:
        match command:
            case SendFrames():
                error = self._pushes.send_nowait(
                    command.endpoint, command.port, command.frames, command.room
                )
                if error is not None:
                    self._unreachable.append((command.endpoint, command.port, error))
            case StartTransfer():
                self._workers.submit(command)
            case CloseRoute():
                self._pushes.release(command.endpoint, command.port)
            case RoomFailed() | Log() | Rejected():
                self._observed(command)
            case _:
                assert_never(command)

    # -- transfer feedback (tspd.shell.transfers.TransferFeedback) ----------------

    def chunk_succeeded(self, chunk: StartTransfer) -> None:
        """A worker wrote every interval of ``chunk`` (only a final chunk reports)."""
        now = trio.current_time()
        if chunk.final:
            self.core.transfer_succeeded(chunk.room, now)
        self.core.transfer_done(chunk.room, now)
        self._pump(activity=chunk.final)

    def chunk_failed(self, chunk: StartTransfer, session_id: str | None, reason: str) -> None:
        """A worker stopped ``chunk``; the core fails the room (first failure wins)."""
        now = trio.current_time()
        self.core.transfer_failed(chunk.room, session_id, reason, now)
        self.core.transfer_done(chunk.room, now)
        self._pump(activity=True)

    def wait_should_stop(self, chunk: StartTransfer) -> str | None:
        """A layerwise wait re-checks its room and destinations every ~100 ms."""
        if not self.core.room_active(chunk.room):
            return f"Cache-transfer layerwise wait aborted for room {chunk.room}"
        now = trio.current_time()
        if any(not self.core.session_alive(sid, now) for sid in chunk.sessions):
            return f"Cache-transfer layerwise peer failed for room {chunk.room}"
        return None

    def room_active(self, chunk: StartTransfer) -> bool:
        """Whether ``chunk``'s room may still be written."""
        return self.core.room_active(chunk.room)

    # -- scheduler-side API -------------------------------------------------------

    def register_request(self, rid: str, room: int) -> None:
        """Track request ``rid`` on ``room``; every rank of the TP group registers the
        same requests in the same order."""
        self.core.register_request(rid, room, trio.current_time())
        self._rooms_by_rid[rid] = room
        self._pump(due=self.core.event_pending(rid))

    def _concluded(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Succeeded | Failed):
                self._rooms_by_rid.pop(event.rid, None)

    def abort(self, room: int, reason: str) -> None:
        """Fail ``room`` with ``reason``, notifying every destination
        (docs/protocol.md#proto-failure-epd-abort)."""
        self.core.abort(room, reason, trio.current_time())
        self._pump(due=True)

    def record_usage(self, room: int, cached_tokens: int, logprob: float | None = None) -> None:
        """Record the request's prefix-cache hit and bootstrap-token logprob for its
        status messages (ignored once the room ended)."""
        self.core.record_usage(room, cached_tokens, logprob)

    def statistics(self) -> dict[str, int]:
        """The core's table sizes, plus worker and message counters."""
        stats = dict(self.core.statistics())
        stats["chunks_in_flight"] = self._workers.in_flight()
        stats["messages_sent"] = self._pushes.stats.sent
        stats["messages_dropped"] = self._pushes.stats.dropped
        stats["bytes_written"] = self._workers.stats.bytes_written
        stats["descriptors"] = self._workers.stats.descriptors
        stats["engine_calls"] = self._workers.stats.engine_calls
        stats["staged_writes"] = self._workers.stats.staged_writes
        return stats

    # -- forward-side API (Trio thread; PrefillOutbox posts here from other threads)

    def hand_over(self, rows: Sequence[RemoteDecodeRow]) -> None:
        """The prompts' KV is written: queue each request's transfer (for a room that
        streams layerwise, hand its final chunk the bootstrap token). Rows of
        requests this rank does not track are skipped. Raises what the core raises
        for a caller error (a negative token, a room still waiting for its
        pre-allocations); the other rows are still handed over."""
        errors: list[TspdError] = []
        now = trio.current_time()
        try:
            for row in rows:
                room = self._rooms_by_rid.get(row.rid)
                if room is None:
                    continue
                try:
                    self.core.hand_over(
                        room, row.tables, row.bootstrap_token, row.spec_candidate_ids, now
                    )
                except TspdError as err:
                    errors.append(err)
        finally:
            # A room ends here only when it had nothing to send or could not be planned.
            self._pump(due=any(self.core.event_pending(row.rid) for row in rows))
        if errors:
            raise errors[0]

    def arm_layerwise(self, rows: Sequence[ExtendRow]) -> int | None:
        """Arm one layerwise chunk per extend row ahead of the forward that writes
        them; returns the forward's first producer step (``None`` when nothing was
        armed). Any row's error refuses the whole forward (raised)."""
        try:
            return self.core.arm_layerwise(rows, trio.current_time())
        finally:
            self._pump(due=True)

    @property
    def outbox(self) -> PrefillOutbox:
        """The forward-side API for an engine's own threads."""
        if self._outbox is None:
            raise TspdError("the Prefill peer is not running; use it inside open_prefill_peer")
        return self._outbox

    # -- sleep / wake --------------------------------------------------------------

    async def release_registration(self) -> None:
        """Deregister the arena from the transfer engine for a sleep
        (docs/protocol.md#proto-sleep-wake).
        Refused while a tracked request may still send; unclaimed rooms do not
        hold it. A blocking engine deregisters in a worker thread (never abandoned:
        a cancel lands once it is done)."""
        async with self._registration_lock:
            try:
                self.core.check_release()
            except ProtocolError as err:
                raise ReleaseRefused(str(err)) from None
            if self._memory_registered:
                await unregister_memory(self.engine, self.arena.base)
                self._memory_registered = False

    async def restore_registration(self) -> None:
        """Register the arena again after a wake, at the same address and on the same
        session (no peer needs telling); in a worker thread for a blocking engine."""
        async with self._registration_lock:
            if not self._memory_registered:
                await register_memory(self.engine, self.arena.base, self.arena.size)
                self._memory_registered = True

    # -- tasks -------------------------------------------------------------------

    _received = "a control message"

    def _receiver(self) -> Receiver:
        return self.core.receive_control

    async def _register_with_bootstrap(
        self, client: BootstrapClient, settings: PrefillSettings
    ) -> None:
        assert settings.bootstrap_addr is not None
        payload = build_route_payload(
            rank_ip=self.host,
            rank_port=self.control_port,
            engine_rank=settings.engine_rank,
            world_size=settings.world_size,
            dp_size=settings.dp_size,
            cache_layout=self.core.config.contract.to_json(),
        )
        payload.update(settings.extra_payload)
        payload["rank_port"] = self.control_port
        if self.curve is not None:
            payload[CURVE_KEY_FIELD] = self.curve.public_key
        if self.staging is not None:
            payload[STAGING_FIELD] = True
        try:
            await client.put_route(settings.bootstrap_addr, payload)
        except TspdError as err:
            log.error(
                "the Prefill rank failed to register with the bootstrap server at %s: %s; "
                "Decode ranks cannot reach rank %s until it is restarted",
                settings.bootstrap_addr,
                err,
                settings.engine_rank,
            )
            return
        self.registered_with_bootstrap = True


@final
class PrefillOutbox:
    """The forward-side API for an engine's own threads; never waits for a transfer.

    Each call is posted into the peer's Trio loop and returns a
    ``concurrent.futures.Future`` at once: ignore it, or call ``result()`` for the
    error the call raised. Calls run in the order they were made. A remote decode
    is staged when its plan goes to the data plane and handed over once the
    drafter's pending round finished (docs/protocol.md#proto-prefill-forward), so the KV it sends
    includes what that round wrote.
    """

    def __init__(self, peer: PrefillPeer, portal: LoopPortal) -> None:
        self._peer = peer
        self._portal = portal
        self._staged: list[RemoteDecodeRow] | None = None

    def stage_remote_decode(self, rows: Sequence[RemoteDecodeRow]) -> None:
        """Stage a plan's remote decode (the prompts whose KV goes out next)."""
        self._staged = list(rows)

    def remote_decode_pending(self) -> bool:
        """Whether a staged remote decode still waits to be handed over."""
        return self._staged is not None

    def hand_over_remote_decode(self) -> concurrent.futures.Future[None]:
        """The staged rows' device prerequisites are met: send their KV."""
        rows, self._staged = self._staged or [], None
        return self._portal.post(lambda: self._peer.hand_over(rows))

    def hand_over(self, rows: Sequence[RemoteDecodeRow]) -> concurrent.futures.Future[None]:
        """Stage and hand over in one step."""
        rows = list(rows)
        return self._portal.post(lambda: self._peer.hand_over(rows))

    def arm_layerwise(self, rows: Sequence[ExtendRow]) -> concurrent.futures.Future[int | None]:
        """Arm layerwise chunks for the coming forward's extend rows."""
        rows = list(rows)
        return self._portal.post(lambda: self._peer.arm_layerwise(rows))


@asynccontextmanager
async def open_prefill_peer(
    config: PrefillConfig,
    engine: AsyncTransferEngine,
    arena: HostArena,
    *,
    settings: PrefillSettings | None = None,
    agreement: ReplicaAgreement | None = None,
    step_counter: StepCounter | None = None,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    metrics: TspdMetrics | None = None,
) -> AsyncIterator[PrefillPeer]:
    """Run one Prefill rank's peer for the duration of the block (see the module doc).

    ``config`` is the core's configuration; its ``arena_base``, ``arena_len`` and
    ``session_id`` are taken from ``arena`` and ``engine``. ``agreement`` is the
    TP group's replica agreement (:class:`SingleRank` by default).
    ``step_counter`` is the producer step counter layerwise chunks wait on (needed
    when ``config.layerwise`` is set). The arena is registered with ``engine`` on
    entry and deregistered on exit. ``metrics``: where this rank's metrics go
    (serve them with :func:`tspd.shell.metrics.serve_metrics`); logs and traces
    are kept either way.
    """
    settings = settings or PrefillSettings()
    if config.layerwise is not None and step_counter is None:
        raise TspdError("a layerwise Prefill peer needs the producer step counter it waits on")
    ctx = context or zmq.Context.instance()
    # Staged transfers (docs/wire.md#staged-transfers): a staging region of its own,
    # registered with the engine beside the arena.
    region = HostArena(config.staging_bytes) if config.staging_bytes > 0 else None
    core = PrefillCore(
        dataclasses.replace(
            config,
            arena_base=arena.base,
            arena_len=arena.size,
            session_id=engine.session_id,
            staging_base=region.base if region is not None else 0,
        )
    )
    curve, pushes, control, port = open_rank_sockets(
        ctx,
        settings,
        f"Prefill rank {config.tp_rank}",
        server_key=core.route_identity,
        socket_name="Prefill control socket",
        max_frame_bytes=MAX_CONTROL_FRAME_BYTES,
    )
    peer = PrefillPeer(
        core,
        engine=engine,
        arena=arena,
        agreement=agreement or SingleRank(),
        pushes=pushes,
        step_counter=step_counter,
        control_port=port,
        host=settings.host,
        observer=PeerObserver(
            "prefill", config.tp_rank, metrics=metrics, slow_after=config.trace.slow_after
        ),
        curve=curve,
        staging=Staging(arena, region) if region is not None else None,
    )
    peer.observer.watch(core, peer.statistics)
    region_registered = False
    try:
        await register_memory(engine, arena.base, arena.size)
        peer._memory_registered = True
        if region is not None:
            # Its pages are backed before the first blob lands (no faults then).
            await trio.to_thread.run_sync(region.prefault)
            await register_memory(engine, region.base, region.size)
            region_registered = True
        async with open_peer_nursery(settings.security) as (client, nursery):
            await peer._start_tasks(nursery)
            await nursery.start(peer._workers.run)
            await nursery.start(peer._receive, control, settings.control_batch)
            portal = LoopPortal(trio.lowlevel.current_trio_token(), name="the Prefill peer")
            peer._portal = portal
            peer._outbox = PrefillOutbox(peer, portal)
            if settings.bootstrap_addr is not None:
                await peer._register_with_bootstrap(client, settings)
            try:
                yield peer
            finally:
                portal.close()
    finally:
        peer.observer.close()
        control.close()
        if curve is not None:
            curve.close()
        if peer._memory_registered:
            await unregister_on_exit(engine, arena.base, what="the Prefill arena", logger=log)
            peer._memory_registered = False
        if region is not None:
            if region_registered:
                await unregister_on_exit(
                    engine, region.base, what="the Prefill staging region", logger=log
                )
            region.close()
