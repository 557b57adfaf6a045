"""The transfer-engine protocol every data plane implements, and its errors.

A transfer engine moves bytes from this rank's registered memory into a peer's
registered memory (the push model of docs/protocol.md#proto-transfer-engine: only
Prefill writes). Engines are
**synchronous** and may block or busy-spin for as long as a transfer takes
(Mooncake's sync calls spin until done or ``MC_TRANSFER_TIMEOUT``), so writes are
never called from the Trio thread: the shell offloads every write through
:class:`tspd.shell.offload.EngineRunner`.

The other calls — building the engine, :meth:`~TransferEngine.register_memory`,
:meth:`~TransferEngine.unregister_memory` and :meth:`~TransferEngine.close` — are
the engine's *setup* calls, and each engine says whether they may block with
:attr:`~TransferEngine.blocking_setup`: ``True`` for Mooncake (registering pins the
memory, which on RDMA takes seconds for gigabytes), ``False`` for the in-process
engines of :mod:`tspd.engines.memory` (a dict update under a lock). The shell makes
blocking setup calls in a worker thread and the others inline
(:mod:`tspd.shell.engine_setup`); :func:`setup_blocks` reads the flag, taking an
engine that does not declare it to block.

An engine may also offer :class:`PollingEngine`, a non-blocking pair — submit one
write, then check on it — that the shell drives from the Trio thread for small
writes: a thread hop costs ~200 µs on a small host, four times a 4 KiB write.

And it may offer :class:`PipelinedEngine`: a whole batch submitted in one
non-blocking call, and a blocking wait for it that does not busy-spin. The shell
keeps several batches to one peer in flight with it (within the engine's per-peer
queue, :attr:`PipelinedEngine.max_in_flight_descriptors`), so a room of thousands
of descriptors pays neither a Python call per descriptor nor a pause between
batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

import numpy as np
import numpy.typing as npt

from tspd.core.errors import TspdError

__all__ = [
    "AddressList",
    "AsyncTransferEngine",
    "BatchTicket",
    "EngineUnavailable",
    "PipelinedEngine",
    "PollingEngine",
    "TransferEngine",
    "TransferError",
    "WriteTicket",
    "as_address_list",
    "setup_blocks",
]

#: Addresses or lengths of one batch: a sequence of ints or a 1-D integer array.
AddressList: TypeAlias = Sequence[int] | npt.NDArray[np.integer]


class TransferError(TspdError):
    """A write to a peer failed.

    ``peer`` is the peer's session id (``"host:rpc_port"``), ``code`` the engine's
    return code (Mooncake: negative; ``-1`` for an exception) and ``detail`` what
    the engine or the local validation reported.
    """

    def __init__(self, peer: str, code: int, detail: str) -> None:
        self.peer = peer
        self.code = code
        self.detail = detail
        super().__init__(f"transfer to {peer} failed (code {code}): {detail}")

    def __reduce__(self) -> tuple[type[TransferError], tuple[str, int, str]]:
        return (type(self), (self.peer, self.code, self.detail))


class EngineUnavailable(TspdError):
    """A transfer engine cannot be created on this host (a missing package or
    system library, or an initialisation failure); the message says what to do."""


@runtime_checkable
class TransferEngine(Protocol):
    """A synchronous transfer engine (docs/protocol.md#proto-transfer-engine).

    ``session_id`` is this engine's identity, ``"{host}:{rpc_port}"``, which peers
    use as the target of their writes. Writes may block; callers on a Trio loop go
    through :class:`tspd.shell.offload.EngineRunner`. The setup calls
    (registration, unregistration, :meth:`close`) block only if
    :attr:`blocking_setup` says so; callers on a Trio loop go through
    :mod:`tspd.shell.engine_setup`.
    """

    @property
    def session_id(self) -> str:
        """This engine's session id, ``"{host}:{rpc_port}"``."""
        ...

    @property
    def blocking_setup(self) -> bool:
        """Whether building this engine, :meth:`register_memory`,
        :meth:`unregister_memory` and :meth:`close` may block the calling thread for
        longer than a Trio loop may stall (more than about a millisecond). ``True``
        makes the shell run them in a worker thread; ``False`` promises they are
        bookkeeping that returns at once, and the shell calls them inline. An
        implementation usually declares it as a class attribute."""
        ...

    def register_memory(self, addr: int, length: int) -> None:
        """Make ``[addr, addr + length)`` a valid source and a valid destination
        for peers' writes. Raises :class:`TransferError` when the engine refuses
        (for example an overlap with a registered region)."""
        ...

    def unregister_memory(self, addr: int) -> None:
        """Withdraw the region registered at ``addr``; later writes into it fail.
        Raises :class:`TransferError` for an unknown address."""
        ...

    def batch_write(
        self,
        peer_session: str,
        src: AddressList,
        dst: AddressList,
        lengths: AddressList,
    ) -> None:
        """Write ``lengths[i]`` bytes from local ``src[i]`` to the peer's ``dst[i]``
        for every ``i``; return when all are done. Raises :class:`TransferError`
        if any write fails (bytes of the batch may then be partially written)."""
        ...

    def close(self) -> None:
        """Release the engine; idempotent."""
        ...


@dataclass(frozen=True, slots=True)
class WriteTicket:
    """One write handed to a :class:`PollingEngine` and not yet known to be done.

    ``token`` is the engine's own id for it (Mooncake: the batch id);
    ``submitted_at`` is ``time.monotonic()`` at submission, from which the engine
    times the write out. Pass the ticket back to
    :meth:`PollingEngine.check_write` until it reports done or raises.
    """

    peer_session: str
    token: int
    length: int
    submitted_at: float


@runtime_checkable
class PollingEngine(Protocol):
    """The optional non-blocking half of a :class:`TransferEngine`.

    Neither call waits for a transfer, so the shell may make them on the Trio
    thread. A write that was submitted references this rank's registered memory
    until :meth:`check_write` reports it done or failed: keep checking it, even
    when the caller is cancelled. Submission may still block once per peer while
    the engine opens its connection to it; the shell therefore submits only to
    peers a write has already reached.
    """

    def submit_write(self, peer_session: str, src: int, dst: int, length: int) -> WriteTicket:
        """Start writing ``length`` bytes from local ``src`` to the peer's ``dst``.
        Raises :class:`TransferError` when the write cannot start (nothing is then
        in flight)."""
        ...

    def check_write(self, ticket: WriteTicket) -> bool:
        """``True`` once the write is done, ``False`` while it is in flight. Raises
        :class:`TransferError` when it failed, or when it has been in flight longer
        than the engine's transfer timeout (Mooncake: ``MC_TRANSFER_TIMEOUT``); the
        ticket is spent after either outcome."""
        ...


@dataclass(frozen=True, slots=True)
class BatchTicket:
    """A batch handed to a :class:`PipelinedEngine` and not yet waited for.

    ``descriptors`` and ``length`` (bytes) describe the batch; ``submitted_at`` is
    ``time.monotonic()`` at submission; ``handle`` is the engine's own record of it.
    Pass the ticket to :meth:`PipelinedEngine.wait_batch` exactly once.
    """

    peer_session: str
    descriptors: int
    length: int
    submitted_at: float
    handle: object


@runtime_checkable
class PipelinedEngine(Protocol):
    """The optional batch half of a :class:`TransferEngine`: submit a whole batch
    without waiting, wait for it later.

    :meth:`submit_batch` never waits for a transfer, so the shell makes it on the
    Trio thread (only to a peer a write already reached: the first write to a peer
    may block while the engine opens its connection). :meth:`wait_batch` blocks
    until the batch is done — the shell calls it in a worker thread — without
    busy-spinning a core for the batch's duration. A submitted batch references this
    rank's registered memory until :meth:`wait_batch` returns or raises: every
    ticket is waited for, even when the caller is cancelled.
    """

    @property
    def max_in_flight_descriptors(self) -> int:
        """Descriptors the shell keeps in flight to one peer at most (Mooncake: the
        TCP transport's per-peer queue, ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``)."""
        ...

    def submit_batch(
        self, peer_session: str, src: AddressList, dst: AddressList, lengths: AddressList
    ) -> BatchTicket:
        """Start writing every descriptor of the batch to ``peer_session``. Raises
        :class:`TransferError` when the batch cannot start (nothing is then in
        flight); a failure after part of it started is raised by :meth:`wait_batch`."""
        ...

    def wait_batch(self, ticket: BatchTicket) -> None:
        """Block until every descriptor of the batch is done; raise
        :class:`TransferError` if any failed, or stayed in flight longer than the
        engine's transfer timeout. The ticket is spent afterwards."""
        ...


@runtime_checkable
class AsyncTransferEngine(Protocol):
    """What the Trio shell writes through: the same operations as
    :class:`TransferEngine` with an awaitable ``batch_write``.

    :class:`tspd.shell.offload.EngineRunner` provides it around any synchronous
    engine (a thread per write); :class:`tspd.testing.fake_engine.AsyncFakeEngine`
    provides it natively with ``trio.sleep`` latency for ``MockClock`` tests.
    The setup calls stay synchronous, with :attr:`blocking_setup` saying whether
    they may block: :mod:`tspd.shell.engine_setup` makes them from Trio.
    """

    @property
    def session_id(self) -> str:
        """This engine's session id, ``"{host}:{rpc_port}"``."""
        ...

    @property
    def blocking_setup(self) -> bool:
        """As :attr:`TransferEngine.blocking_setup` (a runner reports its engine's)."""
        ...

    def register_memory(self, addr: int, length: int) -> None:
        """As :meth:`TransferEngine.register_memory`."""
        ...

    def unregister_memory(self, addr: int) -> None:
        """As :meth:`TransferEngine.unregister_memory`."""
        ...

    async def batch_write(
        self,
        peer_session: str,
        src: AddressList,
        dst: AddressList,
        lengths: AddressList,
    ) -> None:
        """As :meth:`TransferEngine.batch_write`, awaited; a write that started is
        finished (or failed) before this returns, even when cancelled."""
        ...

    def close(self) -> None:
        """Release the engine; idempotent."""
        ...


def setup_blocks(engine: TransferEngine | AsyncTransferEngine) -> bool:
    """Whether ``engine``'s setup calls may block (its
    :attr:`~TransferEngine.blocking_setup`); an engine written before the flag
    existed, which does not declare it, is taken to block."""
    return bool(getattr(engine, "blocking_setup", True))


def as_address_list(values: AddressList, *, what: str) -> list[int]:
    """Normalise a batch column to a list of Python ints (what Mooncake's binding
    accepts), refusing anything that is not one-dimensional or not integral."""
    if isinstance(values, np.ndarray):
        # dtype.kind "i"/"u" is np.integer; tolist() of those yields Python ints.
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise TypeError(
                f"{what} must be a 1-D integer array, got shape {values.shape} "
                f"of dtype {values.dtype}"
            )
        out: list[int] = values.tolist()
        return out
    items: list[int] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise TypeError(f"{what} must hold integers, got {type(v).__name__}")
        items.append(int(v))
    return items
