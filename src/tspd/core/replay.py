"""The replay side of the KV-event stream: the bounded buffer and the ROUTER frames.

Protocol (docs/protocol.md#proto-kv-replay, byte-for-byte TokenSpeed S1): a client's
DEALER sends ``[b"", start_seq]``, which the publisher's ROUTER sees as
``[client, b"", start_seq]``; the publisher answers with one
``[client, b"", seq, payload]`` per buffered batch with ``seq >= start_seq``, in
ascending order, then the end marker ``[client, b"", 0xFF * 8, b""]`` (sequence -1). The
end marker is always sent, also when nothing matched.

How a client learns that a replay was cut short: the batches of one replay are a
contiguous ascending run, and the end marker follows the last batch actually sent.
A client compares where the run ended with what it still misses and asks again
(the tracker in :mod:`tspd.core.seqtrack` does this); when the buffer no longer
holds the first missing batch, the run starts *after* it, which is the explicit
"this gap cannot be filled" signal.

``start_seq`` is decoded as R-ev does (whose behaviour the spec ranks first): the
last 8 bytes of the frame, left-padded with zeros when shorter. For the 8-byte
frames every client sends this is the same as S1's reading.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, final

from tspd.core.errors import WireError

__all__ = [
    "END_SEQ",
    "END_SEQ_FRAME",
    "ReplayBuffer",
    "ReplayReply",
    "ReplayRequest",
    "decode_replay_reply",
    "decode_replay_request",
    "encode_replay_request",
    "end_marker_frames",
    "parse_start_seq",
    "replay_reply_frames",
]

#: The end marker's sequence number and its frame.
END_SEQ: Final = -1
END_SEQ_FRAME: Final = b"\xff" * 8

_U64_MAX: Final = (1 << 64) - 1


@final
class ReplayBuffer:
    """The last ``capacity`` published ``(seq, payload)`` pairs, oldest evicted first.

    Sequence numbers must be appended in increasing order; a publisher starts at 0
    and never skips, but the buffer only requires them to increase.
    """

    __slots__ = ("_capacity", "_items")

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"replay buffer capacity must be non-negative, got {capacity}")
        self._capacity = capacity
        self._items: deque[tuple[int, bytes]] = deque(maxlen=capacity)

    @property
    def capacity(self) -> int:
        """How many batches the buffer keeps."""
        return self._capacity

    def append(self, seq: int, payload: bytes) -> None:
        """Keep one batch, evicting the oldest when full."""
        if self._items and seq <= self._items[-1][0]:
            raise ValueError(
                f"replay buffer sequence numbers must increase: {seq} after {self._items[-1][0]}"
            )
        if self._capacity:
            self._items.append((seq, payload))

    def since(self, start_seq: int) -> list[tuple[int, bytes]]:
        """Every kept batch with ``seq >= start_seq``, ascending (a snapshot).

        The result is a copy, so a replay can be sent while new batches arrive.
        """
        items = self._items
        if not items or start_seq > items[-1][0]:
            return []
        first = items[0][0]
        if start_seq <= first:
            return list(items)
        # Sequence numbers are contiguous when the publisher never skips; fall back
        # to a scan otherwise.
        offset = start_seq - first
        if offset < len(items) and items[offset][0] == start_seq:
            return [items[i] for i in range(offset, len(items))]
        return [item for item in items if item[0] >= start_seq]

    @property
    def oldest_seq(self) -> int | None:
        """The oldest kept sequence number, ``None`` when empty."""
        return self._items[0][0] if self._items else None

    @property
    def newest_seq(self) -> int | None:
        """The newest kept sequence number, ``None`` when empty."""
        return self._items[-1][0] if self._items else None

    def clear(self) -> None:
        """Forget every batch."""
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """A replay request as the ROUTER received it."""

    client: bytes
    start_seq: int


def parse_start_seq(frame: bytes) -> int:
    """``start_seq`` from its frame: the last 8 bytes, big-endian, left-padded."""
    return int.from_bytes(frame[-8:], "big")


def decode_replay_request(frames: Sequence[bytes]) -> ReplayRequest:
    """Decode ``[client, b"", start_seq]``; raises :class:`WireError` for any other shape.

    The delimiter frame is not checked (TokenSpeed does not check it either).
    """
    if len(frames) != 3:
        raise WireError(
            f"Invalid replay request: expected 3 frames [client, empty, start_seq], "
            f"got {len(frames)}"
        )
    client, _delimiter, start = frames
    return ReplayRequest(bytes(client), parse_start_seq(start))


def replay_reply_frames(client: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One replayed batch, as the ROUTER sends it."""
    return [client, b"", seq.to_bytes(8, "big"), payload]


def end_marker_frames(client: bytes) -> list[bytes]:
    """The end of a replay (sequence -1, empty payload), as the ROUTER sends it."""
    return [client, b"", END_SEQ_FRAME, b""]


def encode_replay_request(start_seq: int) -> list[bytes]:
    """A client's request, as its DEALER sends it: ``[b"", start_seq (8 B BE)]``."""
    if not 0 <= start_seq <= _U64_MAX:
        raise ValueError(f"start_seq {start_seq} is outside the unsigned 64-bit range")
    return [b"", start_seq.to_bytes(8, "big")]


@dataclass(frozen=True, slots=True)
class ReplayReply:
    """One message of a replay stream as a DEALER receives it; ``seq == END_SEQ`` ends it."""

    seq: int
    payload: bytes

    @property
    def is_end(self) -> bool:
        """Whether this is the end marker."""
        return self.seq == END_SEQ


def decode_replay_reply(frames: Sequence[bytes]) -> ReplayReply:
    """Decode ``[b"", seq, payload]`` received on a DEALER.

    Frame 0 is ignored: TokenSpeed sends an empty delimiter there, vLLM since its
    fix #45177 sends the topic, and both are three frames.
    """
    if len(frames) != 3:
        raise WireError(
            f"KV event replay reply must have 3 frames [empty, seq, payload], got {len(frames)}"
        )
    _first, seq_frame, payload = frames
    if len(seq_frame) != 8:
        raise WireError(f"KV event replay sequence number must be 8 bytes, got {len(seq_frame)}")
    if seq_frame == END_SEQ_FRAME:
        return ReplayReply(END_SEQ, bytes(payload))
    return ReplayReply(int.from_bytes(seq_frame, "big"), bytes(payload))
