"""Trio adapter over pyzmq sockets: every tspd socket goes through :class:`TrioSocket`.

pyzmq's socket FD cannot simply be awaited like a TCP socket, and the naive pattern
("try NOBLOCK, else ``wait_readable(fd)``") hangs. The rules this module enforces:

1. **The FD is edge-triggered and signals readability only.** It fires when the
   socket's ``EVENTS`` change (for POLLIN *and* POLLOUT), and *any* call on the
   socket -- send, recv, even ``getsockopt(EVENTS)`` -- can consume the edge.
2. **One FD waiter per socket.** Trio allows one task in ``wait_readable`` per fd
   (a second raises ``BusyResourceError``). The first task that must wait owns the
   FD wait; every other waiting task parks on a :class:`trio.lowlevel.ParkingLot`
   and retries its operation when the FD waiter wakes. A socket opened
   ``owner_only`` (one task makes every call: a peer's PULL socket) skips that
   bookkeeping, whose cancel scope costs about as much as the rest of a wait, and
   after a drain that emptied it asks ``EVENTS`` before receiving again rather than
   failing a receive: re-arming an idle peer's receive task went from ~17 to ~7 µs
   (p50, 2-core host), and the scheduler task its batch woke resumes ~8 µs sooner.
3. **The kick.** After *every* successful send or receive we re-read ``EVENTS``; if
   what some waiter wants (POLLIN or POLLOUT) is ready, we cancel the FD wait so the
   waiter and the parked tasks retry. Without it a sender task consumes the edge of
   a message that already arrived and a receiver task sleeps forever (measured:
   DEALER with one sender and one receiver task hangs in 5 runs of 5).
4. **Never lose a received message to cancellation.** A receive checks for
   cancellation *before* touching the socket; once a message is taken off the
   socket it is returned without a cancel point: at once when the call already
   waited for it (that wait was the call's checkpoint, as in Trio's own sockets,
   and it saves the receiving task a pass through the scheduler when a message
   wakes an idle peer), else through a cancel-shielded checkpoint. A cancel that
   arrives then is delivered at the caller's next checkpoint instead.
5. **Batch drain.** :meth:`TrioSocket.recv_batch` takes every queued message (up to
   ``max_msgs``) with one yield to the scheduler; on this machine that reaches the
   throughput of a plain sync loop, against about half of it one message at a time.
   Cap ``max_msgs`` where other tasks need to run often.
6. **Plain frames take the short way.** A message of ``bytes`` frames is sent and
   received with the backend's per-frame calls (pyzmq's ``send_multipart`` and
   ``recv_multipart`` wrappers cost several times as much: ~7 against ~1.5 µs to
   send three frames here). Frames are type-checked before the first is sent, so a
   bad frame never leaves half a message queued; anything else (buffers, ``Frame``
   objects) goes through pyzmq's own ``send_multipart``.
7. **Closing** notifies Trio (``notify_closing``, so a task blocked on the FD gets
   ``ClosedResourceError`` instead of waiting on a recycled descriptor) and closes
   with ``linger=0`` by default: a closed tspd socket never keeps the process alive.
8. **Bounded input.** A socket that receives from peers is opened with
   ``max_frame_bytes`` (libzmq's ``ZMQ_MAXMSGSIZE``: it applies to *each frame*,
   and a peer that announces a larger one is disconnected before a byte of it is
   stored) and ``max_frames``: a message with more frames is taken off the socket
   and dropped frame by frame, never turned into a list of Python objects.

Every socket is owned by one Trio run; its methods are not thread-safe. Use
:func:`bind_free_port` to bind to ``127.0.0.1`` on a port the OS chooses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Final, Self, TypeVar, final

import trio
import zmq
from zmq.backend import Socket as _BackendSocket

from tspd.log import component_logger

__all__ = ["MAX_MESSAGE_FRAMES", "MIN_FRAME_LIMIT", "TrioSocket", "bind_free_port", "open_socket"]

#: One received item of a batch: a message, or a message with its sender.
_M = TypeVar("_M")


def _frames_of_message(message: list[bytes]) -> list[bytes]:
    return message


def _frames_of_sent(item: tuple[list[bytes], str]) -> list[bytes]:
    return item[0]


log = component_logger("zmq")

#: The smallest ``max_frame_bytes`` :func:`open_socket` sets. libzmq checks
#: ``ZMQ_MAXMSGSIZE`` on every frame it decodes, the ZMTP handshake's READY command
#: included, and that command carries the peer's routing id (up to 255 bytes) and
#: socket type: below this bound a legal peer could not even connect.
MIN_FRAME_LIMIT: Final = 1024
#: ``max_frames`` of every socket that receives tspd protocol messages. The largest
#: message of these protocols has 8 frames (a registration); twice that still hands
#: a slightly malformed message to its decoder, which rejects it in the
#: specification's words, while a message of thousands of frames is dropped unread.
MAX_MESSAGE_FRAMES: Final = 16
#: Seconds between two warnings about dropped many-frame messages on one socket.
_DROP_WARN_EVERY_S: Final = 10.0

# Plain ints: pyzmq's flag enums make every ``&`` and dict lookup a Python-level
# call, and _kick runs after every operation.
_POLLIN: Final = int(zmq.POLLIN)
_POLLOUT: Final = int(zmq.POLLOUT)
_EVENTS: Final = int(zmq.EVENTS)
_NOBLOCK: Final = zmq.NOBLOCK
_MORE_NOBLOCK: Final = zmq.SNDMORE | zmq.NOBLOCK
# The backend's send, without the sugar layer's keyword re-dispatch.
_raw_send = _BackendSocket.send

Frames = Sequence[bytes | bytearray | memoryview | zmq.Frame]


@final
class TrioSocket:
    """A pyzmq socket driven from Trio without a thread.

    Several tasks may send and receive on one socket concurrently (for example a
    ROUTER with one receiving task and several replying tasks); the adapter keeps a
    single FD waiter and wakes the others as described in the module docstring.
    """

    __slots__ = (
        "_closed",
        "_emptied",
        "_fd",
        "_fd_waiter",
        "_lot",
        "_max_frames",
        "_more_frames",
        "_name",
        "_owner_only",
        "_want",
        "_warned_at",
        "dropped_messages",
        "sock",
    )

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        *,
        max_frames: int | None = None,
        name: str = "",
        owner_only: bool = False,
    ) -> None:
        if max_frames is not None and max_frames < 1:
            raise ValueError(f"max_frames must be at least 1, got {max_frames}")
        self.sock: zmq.Socket[bytes] = sock
        # More frames than this and a received message is dropped (see _recv_now).
        self._max_frames = max_frames if max_frames is not None else 1 << 62
        self._more_frames = range(self._max_frames - 1)
        self._name = name or "a ZMQ socket"
        #: Messages dropped on receipt for having more than ``max_frames`` frames.
        self.dropped_messages = 0
        self._warned_at = -_DROP_WARN_EVERY_S
        fd = sock.getsockopt(zmq.FD)
        assert isinstance(fd, int)
        self._fd: int = fd
        # CancelScope of the one task inside wait_readable(fd), if any.
        self._fd_waiter: trio.CancelScope | None = None
        # Tasks waiting while another task holds the FD wait.
        self._lot = trio.lowlevel.ParkingLot()
        # How many tasks currently wait for each direction.
        self._want: dict[int, int] = {_POLLIN: 0, _POLLOUT: 0}
        self._closed = False
        # One task makes every call (see _wait_owner); then whether the last drain
        # left the socket empty, so the next one asks EVENTS instead of failing a recv.
        self._owner_only = owner_only
        self._emptied = False

    # -- waiting -----------------------------------------------------------------

    async def _wait(self, event: int) -> None:
        """Wait until the socket may have become ready for ``event``; the caller retries."""
        if self._closed:
            raise trio.ClosedResourceError("the ZMQ socket was closed")
        if self._owner_only:
            await self._wait_owner(self._ready_for(event))
            return
        self._want[event] += 1
        try:
            if self._fd_waiter is not None:
                await self._lot.park()
                return
            with trio.CancelScope() as scope:
                self._fd_waiter = scope
                try:
                    # Re-check after taking the waiter role: an earlier call may have
                    # consumed the edge of the very event we want.
                    if not self._ready_for(event):
                        await trio.lowlevel.wait_readable(self._fd)
                    else:
                        # Ready already: still yield, so a caller whose retry keeps
                        # failing (a ROUTER at one peer's high-water mark reports
                        # POLLOUT for its other peers) cannot starve the loop.
                        await trio.lowlevel.checkpoint()
                finally:
                    self._fd_waiter = None
                    self._lot.unpark_all()
        finally:
            self._want[event] -= 1
        if self._closed:
            raise trio.ClosedResourceError("the ZMQ socket was closed")

    async def _wait_owner(self, ready: bool) -> None:
        """:meth:`_wait` of a socket only its owner task calls (``owner_only``): no other
        task's operation can consume the FD edge it waits for, so it needs neither the
        waiter's cancel scope that :meth:`_kick` would cancel (entering one costs about
        as much as the rest of the wait) nor the parking lot. ``ready``: what EVENTS
        said just now. A second task waiting on the socket raises Trio's
        ``BusyResourceError`` instead of parking."""
        if not ready:
            await trio.lowlevel.wait_readable(self._fd)
        else:
            await trio.lowlevel.checkpoint()
        if self._closed:
            raise trio.ClosedResourceError("the ZMQ socket was closed")

    def _ready_for(self, event: int) -> bool:
        if self._closed:
            return True
        return bool(self._events() & event)

    def _events(self) -> int:
        events = self.sock.get(_EVENTS)
        assert isinstance(events, int)
        return events

    def _kick(self) -> None:
        """After a successful op: wake the FD waiter if what any waiter wants is ready."""
        if self._fd_waiter is None:
            return
        events = self._events()
        if (events & _POLLIN and self._want[_POLLIN]) or (
            events & _POLLOUT and self._want[_POLLOUT]
        ):
            self._fd_waiter.cancel()

    # -- receiving ---------------------------------------------------------------

    async def recv_multipart(self) -> list[bytes]:
        """Receive one multipart message; a message taken off the socket is never lost."""
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            self._check_open()
            try:
                msg = self._recv_now()
            except zmq.Again:
                await self._wait(_POLLIN)
                waited = True
                continue
            self._kick()
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return msg

    async def recv_batch(
        self, max_msgs: int = 256, max_bytes: int | None = None
    ) -> list[list[bytes]]:
        """Receive every queued message, at least one and at most ``max_msgs``.

        With ``max_bytes``, stop once the messages taken reach that many bytes (all
        frames counted; the message that crosses the bound is kept).
        """
        return await self._drain(self._recv_now, _frames_of_message, max_msgs, max_bytes)

    async def recv_batch_from(
        self, max_msgs: int = 256, max_bytes: int | None = None
    ) -> list[tuple[list[bytes], str]]:
        """:meth:`recv_batch` for a CURVE server socket: every message with its
        sender's ``User-Id`` (what the ZAP handler set: the client's Z85 public key;
        ``""`` when the message has none, e.g. on a socket without a ZAP handler)."""
        return await self._drain(self._recv_from_now, _frames_of_sent, max_msgs, max_bytes)

    async def _drain(
        self,
        receive: Callable[[], _M],
        frames_of: Callable[[_M], list[bytes]],
        max_msgs: int,
        max_bytes: int | None,
    ) -> list[_M]:
        """Take what ``receive`` returns until the socket is empty (at least one) or
        ``max_msgs`` / ``max_bytes`` is reached; ``frames_of`` gives a taken item's
        frames for the byte count."""
        if max_msgs < 1:
            raise ValueError(f"max_msgs must be at least 1, got {max_msgs}")
        await trio.lowlevel.checkpoint_if_cancelled()
        out: list[_M] = []
        budget = max_bytes if max_bytes is not None else -1
        waited = False
        if self._emptied:
            # The owner's last drain emptied the socket: most likely it still is,
            # and reading EVENTS costs less than a receive that fails.
            self._check_open()
            if not self._events() & _POLLIN:
                await self._wait_owner(False)
                waited = True
        while True:
            self._check_open()
            try:
                while len(out) < max_msgs:
                    item = receive()
                    out.append(item)
                    if budget >= 0:
                        budget -= sum(map(len, frames_of(item)))
                        if budget <= 0:
                            break
                self._emptied = False
            except zmq.Again:
                self._emptied = self._owner_only
                if not out:
                    await self._wait(_POLLIN)
                    waited = True
                    continue
            self._kick()
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return out

    def _recv_from_now(self) -> tuple[list[bytes], str]:
        """:meth:`_recv_now` that also reads the first frame's ``User-Id``."""
        frame = self.sock.recv(_NOBLOCK, False)
        try:
            user = frame.get("User-Id")
        except zmq.ZMQError:
            user = ""
        parts = [frame.bytes]
        recv = self.sock.recv
        for _ in self._more_frames:
            if not frame.more:
                return parts, user if isinstance(user, str) else ""
            frame = recv(_NOBLOCK, False)
            parts.append(frame.bytes)
        if frame.more:
            self._drop_rest(frame, len(parts))
            raise zmq.Again()
        return parts, user if isinstance(user, str) else ""

    def recv_multipart_nowait(self) -> list[bytes] | None:
        """Receive one message if one is queued, else return ``None`` (never blocks)."""
        self._check_open()
        try:
            msg = self._recv_now()
        except zmq.Again:
            return None
        self._kick()
        return msg

    def _recv_now(self) -> list[bytes]:
        """Take one whole message off the socket; :class:`zmq.Again` if none is queued.

        The parts of a multipart message arrive together, so only the first can fail.
        A message of more than ``max_frames`` frames is dropped (see
        :meth:`_drop_rest`) and reported as :class:`zmq.Again`; the caller's wait
        sees the socket still readable when more is queued.
        """
        recv = self.sock.recv
        # A Frame says itself whether more parts follow; asking the socket
        # (``RCVMORE``) costs more than taking the frame and copying its bytes.
        frame = recv(_NOBLOCK, False)
        parts = [frame.bytes]
        # Iterating a range bounds the frames for less than counting them.
        for _ in self._more_frames:
            if not frame.more:
                return parts
            frame = recv(_NOBLOCK, False)
            parts.append(frame.bytes)
        if frame.more:
            self._drop_rest(frame, len(parts))
            raise zmq.Again()
        return parts

    def _drop_rest(self, frame: zmq.Frame, taken: int) -> None:
        """Take the rest of an over-long message off the socket without keeping it."""
        recv = self.sock.recv
        count = taken
        while frame.more:
            frame = recv(_NOBLOCK, False)
            count += 1
        self._kick()  # these receives may have consumed another waiter's edge
        self.dropped_messages += 1
        now = time.monotonic()
        if now - self._warned_at >= _DROP_WARN_EVERY_S:
            self._warned_at = now
            log.warning(
                "%s: dropped a message of %d frames (at most %d expected); %d such "
                "messages so far. A peer speaks another protocol or sends garbage",
                self._name,
                count,
                self._max_frames,
                self.dropped_messages,
            )

    # -- sending -----------------------------------------------------------------

    async def send_multipart(self, frames: Frames) -> None:
        """Send one multipart message, waiting while the socket is at its high-water mark.

        Cancellation is honoured only before the message is queued: once sent, the
        call returns through a shielded checkpoint, so "cancelled" means "not sent".
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            self._check_open()
            try:
                self._send_now(frames)
            except zmq.Again:
                await self._wait(_POLLOUT)
                continue
            self._kick()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return

    def send_multipart_nowait(self, frames: Frames) -> bool:
        """Send one message without waiting; return ``False`` if the socket is full.

        A ROUTER with ``ROUTER_MANDATORY`` unset silently drops messages to unknown
        peers and returns ``True``; a PUB drops at its high-water mark and returns
        ``True`` as well (that is libzmq's contract for those socket types).
        """
        self._check_open()
        try:
            self._send_now(frames)
        except zmq.Again:
            return False
        self._kick()
        return True

    def _send_now(self, frames: Frames) -> None:
        """Queue one whole message; :class:`zmq.Again` (nothing queued) if it is full.

        Only the first part can be refused: libzmq accepts the rest of a message
        whose first part it took.
        """
        sock = self.sock
        for frame in frames:
            if type(frame) is not bytes:
                sock.send_multipart(frames, _NOBLOCK)
                return
        last = len(frames) - 1
        if last < 0:
            raise ValueError("a ZMQ message needs at least one frame")
        for index in range(last):
            _raw_send(sock, frames[index], _MORE_NOBLOCK)
        _raw_send(sock, frames[last], _NOBLOCK)

    # -- lifecycle ---------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the ZMQ socket was closed")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def close(self, linger: int = 0) -> None:
        """Close now; queued outgoing messages are dropped unless ``linger`` (ms) > 0.

        Tasks blocked in this socket's operations wake with ``ClosedResourceError``.
        Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        self._lot.unpark_all()
        self.sock.close(linger=linger)

    async def aclose(self) -> None:
        """Close with ``linger=0`` and checkpoint (Trio's ``AsyncResource`` protocol)."""
        self.close()
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "closed" if self._closed else f"fd={self._fd}"
        return f"<TrioSocket {self.sock.socket_type} {kind}>"


def open_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    socket_type: int,
    *,
    max_frame_bytes: int | None = None,
    max_frames: int | None = None,
    name: str = "",
    owner_only: bool = False,
) -> TrioSocket:
    """Create a socket of ``socket_type`` on ``ctx`` with ``linger=0`` and wrap it.

    For a socket that receives from peers: ``max_frame_bytes`` sets
    ``ZMQ_MAXMSGSIZE`` (per frame; raised to :data:`MIN_FRAME_LIMIT` so handshakes
    pass) before any bind or connect, so a peer announcing a larger frame is
    disconnected unread; ``max_frames`` drops messages with more frames on receipt
    (counted in :attr:`TrioSocket.dropped_messages`). ``name`` says in warnings
    which socket it is. ``owner_only``: one task makes every call on the socket
    (a peer's PULL socket and its receive task), which makes its waits cheaper
    (see the module docstring, rule 2).
    """
    sock = ctx.socket(socket_type)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if max_frame_bytes is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max(max_frame_bytes, MIN_FRAME_LIMIT))
        return TrioSocket(sock, max_frames=max_frames, name=name, owner_only=owner_only)
    except BaseException:
        sock.close(linger=0)
        raise


def bind_free_port(sock: TrioSocket | zmq.Socket[bytes], host: str = "127.0.0.1") -> int:
    """Bind ``sock`` to ``tcp://host:<free port>`` and return the port the OS chose.

    ``host`` is explicit and defaults to loopback: tspd never binds a wildcard address
    unless the caller asks for one.
    """
    raw = sock.sock if isinstance(sock, TrioSocket) else sock
    raw.bind(f"tcp://{host}:0")
    endpoint = raw.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    port = int(endpoint.rsplit(b":", 1)[1])
    if not 0 < port < 65536:
        raise OSError(f"ZMQ reported an unusable bound endpoint {endpoint!r}")
    return port
