"""Fuzz target for the KV-event decoders and the subscriber's sequence tracker.

The first input byte picks the target, the rest is its input:

* ``0``: a batch payload for :func:`decode_batch`. Only ``WireError`` may escape;
  a payload that decodes re-encodes in TokenSpeed's form and decodes back to the
  same batch (less the vLLM-only fields tspd never writes).
* ``1``, ``2``, ``3``: the rest split at ``b"|"`` into frames, for the live-frame,
  replay-request and replay-reply decoders (same rule: ``WireError`` or a value).
* ``4``: the rest as a program for a :class:`SeqTracker` (each 3-byte step: an
  operation and a 16-bit sequence number); whatever it is fed, it delivers in
  order, never twice, and reports every hole it skips.

Short runs are part of the test suite (``tests/core/test_fuzz_targets_events.py``).
Long runs by hand::

    pip install atheris
    python fuzz/fuzz_kv_events.py [libFuzzer flags]

Without atheris the same command runs a hypothesis loop over random bytes.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys

from tspd.core.errors import WireError
from tspd.core.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    decode_pub_frames,
    encode_batch,
)
from tspd.core.replay import decode_replay_reply, decode_replay_request
from tspd.core.seqtrack import Deliver, GapUnhealable, PublisherRestarted, SeqTracker

__all__ = ["check_tracker_program", "test_one_input"]


def _tokenspeed_form(event: KVEvent) -> KVEvent:
    """The event as tspd encodes it (vLLM's map-only fields dropped)."""
    if isinstance(event, BlockStored):
        return dataclasses.replace(event, medium=None, group_idx=None, lora_name=None)
    if isinstance(event, BlockRemoved):
        return dataclasses.replace(event, medium=None, group_idx=None)
    return event


def _check_batch(payload: bytes) -> None:
    try:
        batch = decode_batch(payload)
    except WireError:
        return
    # Everything msgpack decodes fits 64 bits, so whatever decodes must re-encode.
    again = decode_batch(encode_batch(batch))
    expected = KVEventBatch(
        batch.ts, tuple(_tokenspeed_form(e) for e in batch.events), batch.dp_rank
    )
    assert again == expected or batch.ts != batch.ts, (again, expected)  # NaN != NaN


def _check_frames(kind: int, data: bytes) -> None:
    frames = data.split(b"|")
    try:
        if kind == 1:
            message = decode_pub_frames(frames)
            assert 0 <= message.seq < 1 << 64
        elif kind == 2:
            request = decode_replay_request(frames)
            assert 0 <= request.start_seq < 1 << 64
        else:
            reply = decode_replay_reply(frames)
            assert -1 <= reply.seq < 1 << 64
    except WireError:
        return


def check_tracker_program(program: bytes) -> None:
    """Drive a tracker with ``program`` and check its output's invariants."""
    tracker = SeqTracker(replay=bool(program[:1]) and program[0] & 1 == 1, max_pending=64)
    now = 0.0
    expected: int | None = None
    for i in range(1, len(program) - 2, 3):
        op = program[i] % 5
        seq = int.from_bytes(program[i + 1 : i + 3], "big")
        if op == 0:
            tracker.live(seq, seq.to_bytes(2, "big"), now)
        elif op == 1:
            tracker.replayed(seq, seq.to_bytes(2, "big"), now)
        elif op == 2:
            tracker.replay_end(now)
        elif op == 3:
            now += seq / 1000
            tracker.handle_timeout(now)
        else:
            now += 0.001
        for command in tracker.drain_commands():
            if isinstance(command, PublisherRestarted):
                expected = 0
            elif isinstance(command, GapUnhealable):
                assert expected is None or command.first_missing == expected, command
                assert command.resumed_at > command.first_missing
                expected = command.resumed_at
            elif isinstance(command, Deliver):
                assert expected is None or command.seq == expected, (command, expected)
                assert command.payload == command.seq.to_bytes(2, "big")
                expected = command.seq + 1
        assert tracker.statistics().pending <= 65


def test_one_input(data: bytes) -> None:
    """Dispatch on ``data[0]``."""
    if not data:
        return
    kind, rest = data[0] % 5, data[1:]
    if kind == 0:
        _check_batch(rest)
    elif kind in (1, 2, 3):
        _check_frames(kind, rest)
    else:
        check_tracker_program(rest)


def main(argv: list[str]) -> None:
    """Fuzz with atheris when it is installed, else with hypothesis over random bytes."""
    if importlib.util.find_spec("atheris") is not None:
        atheris = importlib.import_module("atheris")
        atheris.Setup(argv, test_one_input)
        atheris.Fuzz()
        return
    from hypothesis import given, settings
    from hypothesis import strategies as st

    settings(max_examples=100_000, deadline=None)(given(st.binary())(test_one_input))()


if __name__ == "__main__":
    main(sys.argv)
