"""The replay buffer and the replay frames (ROUTER and DEALER side)."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tspd.core.errors import WireError
from tspd.core.replay import (
    END_SEQ,
    END_SEQ_FRAME,
    ReplayBuffer,
    decode_replay_reply,
    decode_replay_request,
    encode_replay_request,
    end_marker_frames,
    parse_start_seq,
    replay_reply_frames,
)


def test_buffer_keeps_the_last_capacity_batches() -> None:
    buf = ReplayBuffer(3)
    for seq in range(5):
        buf.append(seq, bytes([seq]))
    assert len(buf) == 3
    assert (buf.oldest_seq, buf.newest_seq) == (2, 4)
    assert buf.since(0) == [(2, b"\x02"), (3, b"\x03"), (4, b"\x04")]
    assert buf.since(3) == [(3, b"\x03"), (4, b"\x04")]
    assert buf.since(5) == []


def test_buffer_since_is_a_snapshot() -> None:
    buf = ReplayBuffer(2)
    buf.append(0, b"a")
    snapshot = buf.since(0)
    buf.append(1, b"b")
    buf.append(2, b"c")
    assert snapshot == [(0, b"a")]


def test_buffer_of_zero_keeps_nothing_and_sequences_must_increase() -> None:
    empty = ReplayBuffer(0)
    empty.append(0, b"x")
    assert len(empty) == 0
    assert empty.since(0) == []
    buf = ReplayBuffer(4)
    buf.append(5, b"x")
    with pytest.raises(ValueError, match="must increase"):
        buf.append(5, b"y")
    with pytest.raises(ValueError, match="non-negative"):
        ReplayBuffer(-1)


def test_buffer_handles_non_contiguous_sequences() -> None:
    buf = ReplayBuffer(5)
    for seq in (1, 4, 9):
        buf.append(seq, b"")
    assert [s for s, _ in buf.since(2)] == [4, 9]
    assert [s for s, _ in buf.since(9)] == [9]
    buf.clear()
    assert buf.oldest_seq is None
    assert buf.newest_seq is None


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        (b"", 0),
        (b"\x05", 5),
        (b"\x01\x00", 256),
        ((7).to_bytes(8, "big"), 7),
        (b"\xff" + (7).to_bytes(8, "big"), 7),  # longer: only the last 8 bytes count
        (b"\xff" * 8, (1 << 64) - 1),
    ],
)
def test_start_seq_uses_the_last_eight_bytes_left_padded(frame: bytes, expected: int) -> None:
    assert parse_start_seq(frame) == expected


def test_replay_request_must_have_three_frames() -> None:
    request = decode_replay_request([b"client", b"", (12).to_bytes(8, "big")])
    assert (request.client, request.start_seq) == (b"client", 12)
    for frames in ([b"c", b""], [b"c", b"", b"", b""], []):
        with pytest.raises(WireError, match=r"^Invalid replay request: expected 3 frames"):
            decode_replay_request(frames)


def test_reply_and_end_marker_frames_are_s1s() -> None:
    assert replay_reply_frames(b"id", 3, b"p") == [b"id", b"", b"\x00" * 7 + b"\x03", b"p"]
    assert end_marker_frames(b"id") == [b"id", b"", b"\xff" * 8, b""]
    assert encode_replay_request(258) == [b"", b"\x00" * 6 + b"\x01\x02"]
    with pytest.raises(ValueError, match="64-bit"):
        encode_replay_request(-1)


def test_dealer_side_reply_decoding() -> None:
    reply = decode_replay_reply([b"", (9).to_bytes(8, "big"), b"payload"])
    assert (reply.seq, reply.payload, reply.is_end) == (9, b"payload", False)
    end = decode_replay_reply([b"topic", END_SEQ_FRAME, b""])
    assert end.seq == END_SEQ
    assert end.is_end
    with pytest.raises(WireError, match="3 frames"):
        decode_replay_reply([END_SEQ_FRAME, b""])
    with pytest.raises(WireError, match="8 bytes"):
        decode_replay_reply([b"", b"\x01", b""])


class ReplayBufferMachine(RuleBasedStateMachine):
    """The buffer against a plain list model: the last `capacity` appended items."""

    @initialize(capacity=st.integers(0, 8))
    def start(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffer = ReplayBuffer(capacity)
        self.model: list[tuple[int, bytes]] = []
        self.next_seq = 0

    @rule(skip=st.integers(0, 2), payload=st.binary(max_size=3))
    def append(self, skip: int, payload: bytes) -> None:
        seq = self.next_seq + skip
        self.buffer.append(seq, payload)
        self.model.append((seq, payload))
        self.next_seq = seq + 1

    @rule(start=st.integers(0, 40))
    def since(self, start: int) -> None:
        kept = self.model[-self.capacity :] if self.capacity else []
        assert self.buffer.since(start) == [item for item in kept if item[0] >= start]

    @invariant()
    def bounded_and_newest_kept(self) -> None:
        assert len(self.buffer) == min(self.capacity, len(self.model))
        if self.capacity and self.model:
            assert self.buffer.newest_seq == self.model[-1][0]


TestReplayBufferMachine = ReplayBufferMachine.TestCase
