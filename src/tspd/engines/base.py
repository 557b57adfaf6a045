"""The transfer-engine protocol every data plane implements, and its errors.

A transfer engine moves bytes from this rank's registered memory into a peer's
registered memory (the push model of spec §8: only Prefill writes). Engines are
**synchronous** and may block or busy-spin for as long as a transfer takes
(Mooncake's sync calls spin until done or ``MC_TRANSFER_TIMEOUT``), so they are
never called from the Trio thread: the shell offloads every call through
:class:`tspd.shell.offload.EngineRunner`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeAlias, runtime_checkable

import numpy as np
import numpy.typing as npt

from tspd.core.errors import TspdError

__all__ = [
    "AddressList",
    "AsyncTransferEngine",
    "EngineUnavailable",
    "TransferEngine",
    "TransferError",
    "as_address_list",
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
    """A synchronous transfer engine (spec §8).

    ``session_id`` is this engine's identity, ``"{host}:{rpc_port}"``, which peers
    use as the target of their writes. Every method may block; callers on a Trio
    loop go through :class:`tspd.shell.offload.EngineRunner`.
    """

    @property
    def session_id(self) -> str:
        """This engine's session id, ``"{host}:{rpc_port}"``."""
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


@runtime_checkable
class AsyncTransferEngine(Protocol):
    """What the Trio shell writes through: the same operations as
    :class:`TransferEngine` with an awaitable ``batch_write``.

    :class:`tspd.shell.offload.EngineRunner` provides it around any synchronous
    engine (a thread per write); :class:`tspd.testing.fake_engine.AsyncFakeEngine`
    provides it natively with ``trio.sleep`` latency for ``MockClock`` tests.
    Registration stays synchronous: it is a bookkeeping call of tens of µs.
    """

    @property
    def session_id(self) -> str:
        """This engine's session id, ``"{host}:{rpc_port}"``."""
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


def as_address_list(values: AddressList, *, what: str) -> list[int]:
    """Normalise a batch column to a list of Python ints (what Mooncake's binding
    accepts), refusing anything that is not one-dimensional or not integral."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or not np.issubdtype(values.dtype, np.integer):
            raise TypeError(
                f"{what} must be a 1-D integer array, got shape {values.shape} "
                f"of dtype {values.dtype}"
            )
        return [int(v) for v in values.tolist()]
    out: list[int] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise TypeError(f"{what} must hold integers, got {type(v).__name__}")
        out.append(int(v))
    return out
