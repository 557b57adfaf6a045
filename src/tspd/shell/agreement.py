"""Replica agreement: the element-wise MIN of poll values over one TP group
(docs/protocol.md#proto-replica-agreement).

Every rank of a Prefill (or Decode) attention-TP group registers the same
requests in the same order and polls once per scheduler iteration; the poll's
per-request values are agreed by MIN so that any rank's ``Failed`` fails the
request everywhere and every rank must reach ``Bootstrapped``/``Success`` before
the scheduler moves on.

Implementations:

* :class:`SingleRank` — a group of one: the values are the agreement.
* :class:`ZmqAgreement` — several ranks as separate processes. Each rank binds a
  PULL socket and connects a PUSH to every other rank; a round sends this rank's
  values to all the others and waits for theirs (one hop, no leader). Messages
  carry the round number, so a fast rank's next round waits in a buffer instead of
  mixing with the current one. In secure mode (``curve`` keys and ``peer_keys``,
  docs/security.md) the PULL is a CURVE server behind the ZAP handler's allow-list,
  each PUSH a CURVE client of its rank's key, and a round's values count only from
  the identity of the rank they name.

An adapter for a host's ``torch.distributed`` group fits the same
:class:`ReplicaAgreement` protocol.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Final, Protocol, Self, final

import numpy as np
import trio
import zmq

from tspd.core.errors import ConfigError, ProtocolError, TspdError, WireError
from tspd.shell.zmq import TrioSocket, open_socket

if TYPE_CHECKING:
    from tspd.shell.security import CurveGuard, CurveKeys

__all__ = ["AgreementError", "ReplicaAgreement", "SingleRank", "ZmqAgreement"]

_MAGIC: Final = b"tspd-agree-v1"
_HEADER: Final = struct.Struct("<QI")  # round, rank
_CLOSE_LINGER_MS: Final = 500


class AgreementError(TspdError):
    """A replica agreement round could not complete (a rank is gone or out of step)."""


class ReplicaAgreement(Protocol):
    """Agree on a list of poll values with the other ranks of a TP group."""

    @property
    def group_size(self) -> int:
        """How many ranks take part."""
        ...

    async def agree(self, values: Sequence[int]) -> list[int]:
        """The element-wise MIN of ``values`` over every rank of the group.

        Every rank calls this once per poll with a list of the same length (the
        same tracked requests, in the same order).
        """
        ...


@final
class SingleRank:
    """The agreement of a group of one rank: the values themselves."""

    group_size = 1

    async def agree(self, values: Sequence[int]) -> list[int]:
        """Return ``values`` unchanged (after a checkpoint, like any async call)."""
        await trio.lowlevel.checkpoint()
        return list(values)


def _encode(round_no: int, rank: int, values: Sequence[int]) -> list[bytes]:
    return [
        _MAGIC,
        _HEADER.pack(round_no, rank),
        np.asarray(values, dtype="<i8").tobytes(),
    ]


def _decode(frames: Sequence[bytes]) -> tuple[int, int, list[int]]:
    if len(frames) != 3 or frames[0] != _MAGIC or len(frames[1]) != _HEADER.size:
        raise WireError("replica agreement message is malformed")
    if len(frames[2]) % 8:
        raise WireError("replica agreement values frame is not a whole number of int64")
    round_no, rank = _HEADER.unpack(frames[1])
    return round_no, rank, np.frombuffer(frames[2], dtype="<i8").tolist()


@final
class ZmqAgreement:
    """MIN agreement among ``len(endpoints)`` ranks over ZMQ PUSH/PULL.

    ``endpoints[i]`` is the ``tcp://host:port`` rank ``i`` binds its PULL socket
    to; every rank gets the same list. Use it as an async context manager (it
    owns its sockets); ``timeout`` bounds one round, so a dead rank turns into an
    :class:`AgreementError` instead of a hang. Secure mode: ``curve`` (this process's
    keys and allow-list) and ``peer_keys[i]``, rank ``i``'s public key (Z85).
    """

    def __init__(
        self,
        rank: int,
        endpoints: Sequence[str],
        *,
        timeout: float = 30.0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        curve: CurveKeys | None = None,
        peer_keys: Sequence[str] | None = None,
    ) -> None:
        if not endpoints:
            raise ConfigError("a ZMQ replica agreement needs at least one rank endpoint")
        if not 0 <= rank < len(endpoints):
            raise ConfigError(
                f"replica agreement rank {rank} is outside [0, {len(endpoints)}) endpoints"
            )
        if curve is not None:
            if peer_keys is None or len(peer_keys) != len(endpoints):
                raise ConfigError(
                    "a secure replica agreement needs every rank's CURVE public key "
                    f"(peer_keys), one per endpoint: {len(endpoints)}"
                )
            if peer_keys[rank] != curve.public_key:
                raise ConfigError(
                    f"peer_keys[{rank}] is not this process's public key {curve.public_key}"
                )
            strangers = [k for k in peer_keys if k not in curve.allowed]
            if strangers:
                raise ConfigError(
                    f"replica agreement ranks' keys {strangers} are not in the allow-list "
                    f"{curve.allow_dir}"
                )
        self._keys = curve
        self._peer_keys = tuple(peer_keys) if curve is not None and peer_keys else ()
        self._guard: CurveGuard | None = None
        self.rank = rank
        self.endpoints = tuple(endpoints)
        self.timeout = timeout
        self._context = context or zmq.Context.instance()
        self._pull: TrioSocket | None = None
        self._pushes: dict[int, TrioSocket] = {}
        self._round = 0
        self._pending: dict[int, dict[int, list[int]]] = {}
        self._lock = trio.Lock()

    @property
    def group_size(self) -> int:
        """How many ranks take part."""
        return len(self.endpoints)

    async def __aenter__(self) -> Self:
        guard: CurveGuard | None = None
        if self._keys is not None:
            from tspd.shell.security import CurveGuard

            guard = CurveGuard(self._context, self._keys, f"replica agreement rank {self.rank}")
        self._guard = guard
        pull = open_socket(self._context, zmq.PULL)
        try:
            if guard is not None:
                guard.server(pull, "the replica agreement PULL")
            pull.sock.bind(self.endpoints[self.rank])
            for other, endpoint in enumerate(self.endpoints):
                if other != self.rank:
                    push = open_socket(self._context, zmq.PUSH)
                    self._pushes[other] = push
                    if guard is not None:
                        guard.client(push, self._peer_keys[other])
                    push.sock.connect(endpoint)
        except BaseException:
            pull.close()
            for push in self._pushes.values():
                push.close()
            self._pushes.clear()
            if guard is not None:
                guard.close()
                self._guard = None
            raise
        self._pull = pull
        await trio.lowlevel.checkpoint()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close every socket; idempotent."""
        if self._pull is not None:
            self._pull.close()
            self._pull = None
        for push in self._pushes.values():
            # Linger briefly: this rank's last round may still be on its way to a
            # rank that has not finished that round yet.
            push.close(linger=_CLOSE_LINGER_MS)
        self._pushes.clear()
        if self._guard is not None:
            self._guard.close()
            self._guard = None

    async def agree(self, values: Sequence[int]) -> list[int]:
        """The element-wise MIN over every rank (see :class:`ReplicaAgreement`)."""
        async with self._lock:
            if self._pull is None:
                raise AgreementError(
                    "the replica agreement is not open; use it as `async with ZmqAgreement(...)`"
                )
            round_no = self._round
            self._round += 1
            frames = _encode(round_no, self.rank, values)
            for push in self._pushes.values():
                await push.send_multipart(frames)
            result = list(values)
            with trio.move_on_after(self.timeout) as scope:
                while len(self._pending.get(round_no, {})) < len(self._pushes):
                    if self._peer_keys:
                        for message, sender in await self._pull.recv_batch_from(64):
                            self._accept(message, sender)
                        continue
                    for message in await self._pull.recv_batch(64):
                        self._accept(message)
            got = self._pending.pop(round_no, {})
            if scope.cancelled_caught:
                missing = sorted(set(self._pushes) - set(got))
                raise AgreementError(
                    f"replica agreement round {round_no} on rank {self.rank} timed out "
                    f"after {self.timeout:.1f}s waiting for ranks {missing}; check that every "
                    "rank of the TP group is alive and polling"
                )
            for other, theirs in got.items():
                if len(theirs) != len(result):
                    raise ProtocolError(
                        f"replica agreement round {round_no}: rank {other} polled "
                        f"{len(theirs)} requests, rank {self.rank} polled {len(result)}; "
                        "every rank must register the same requests in the same order"
                    )
                result = [min(a, b) for a, b in zip(result, theirs, strict=True)]
            return result

    def _accept(self, frames: Sequence[bytes], sender: str | None = None) -> None:
        try:
            round_no, rank, values = _decode(frames)
        except WireError:
            return
        if round_no < self._round - 1 or rank == self.rank or rank not in self._pushes:
            return
        if sender is not None and self._peer_keys[rank] != sender:
            return  # secure mode: only rank ``rank``'s identity speaks for it
        self._pending.setdefault(round_no, {})[rank] = values
