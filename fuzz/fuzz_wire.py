"""Fuzz targets for the control-message decoders of ``tspd.core.wire``.

Each target takes raw bytes, splits them into ZMQ frames at :data:`SEPARATOR`, and
feeds the frames to one decoder. The only exception allowed out of a decoder is
:class:`~tspd.core.errors.WireError`; anything else (an ``IndexError``, a
``struct.error``, a ``UnicodeDecodeError``...) propagates and is a finding. A
message that decodes must also survive re-encoding: encoding it and decoding the
result gives the same message back.

Short runs are part of the test suite (``tests/core/test_fuzz_targets_wire.py``,
hypothesis). Long runs, by hand, with atheris::

    pip install atheris
    python fuzz/fuzz_wire.py [registration|preallocation|status|embedding_status|staged_blob] \
        [libFuzzer flags]

The registration and pre-allocation targets decode as a rank with staged transfers
on, so the 9- and 4-frame forms (docs/wire.md#staged-transfers) are fuzzed too.

Without a target name every input picks one by its first byte.
"""

from __future__ import annotations

import contextlib
import importlib
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np

from tspd.core.errors import WireError
from tspd.core.staging import BLOB_ENTRY_BYTES, BLOB_HEADER_BYTES, read_blob_table
from tspd.core.wire import (
    decode_embedding_status,
    decode_preallocation,
    decode_registration,
    decode_registration_route,
    decode_status,
    encode_embedding_status,
    encode_preallocation,
    encode_registration,
    encode_status,
    is_registration,
)

__all__ = [
    "SEPARATOR",
    "TARGETS",
    "fuzz_embedding_status",
    "fuzz_preallocation",
    "fuzz_registration",
    "fuzz_staged_blob",
    "fuzz_status",
    "join_frames",
    "split_frames",
    "test_one_input",
]

#: Two bytes that end a frame. Rare in ASCII and JSON frames, so valid seeds stay
#: valid after a join and split; binary frames that contain it split, which is fine.
SEPARATOR: Final = b"\xfe\xff"


def split_frames(data: bytes) -> list[bytes]:
    """The frames encoded in ``data`` (no frames for empty input)."""
    return data.split(SEPARATOR) if data else []


def join_frames(frames: Sequence[bytes]) -> bytes:
    """The fuzz input of ``frames`` (the inverse of :func:`split_frames` for frames
    without the separator, and for any non-empty list)."""
    return SEPARATOR.join(frames)


def fuzz_registration(data: bytes) -> None:
    """Discriminate, decode the route header and the whole registration."""
    frames = split_frames(data)
    with contextlib.suppress(WireError):
        is_registration(frames)
    try:
        route = decode_registration_route(frames, staging=True)
    except WireError:
        route = None
    try:
        registration = decode_registration(frames, staging=True)
    except WireError:
        return
    # A registration that decodes has a route header that decodes to its route.
    assert route == registration.route, (route, registration.route)
    again = decode_registration(encode_registration(registration), staging=True)
    assert again == registration, (again, registration)


def fuzz_preallocation(data: bytes) -> None:
    """Decode a pre-allocation and parse its manifest frame."""
    frames = split_frames(data)
    try:
        preallocation = decode_preallocation(frames, staging=True)
        manifest = preallocation.manifest()
    except WireError:
        return
    encoded = encode_preallocation(
        preallocation.room, preallocation.session_id, manifest, preallocation.slot
    )
    again = decode_preallocation(encoded, staging=True)
    assert (again.room, again.session_id, again.slot) == (
        preallocation.room,
        preallocation.session_id,
        preallocation.slot,
    )
    assert again.manifest() == manifest


def fuzz_status(data: bytes) -> None:
    """Decode a status message (3..8 frames)."""
    frames = split_frames(data)
    try:
        message = decode_status(frames)
    except WireError:
        return
    encoded = encode_status(message)
    # Re-encoding the decoded message is stable (compared as frames, so a NaN
    # logprob compares by its bits).
    assert encode_status(decode_status(encoded)) == encoded
    if len(frames) == 7:
        assert encoded == frames, (encoded, frames)
    if message.bootstrap_logprob is not None:
        assert struct.pack("<d", message.bootstrap_logprob) == frames[6]


def fuzz_embedding_status(data: bytes) -> None:
    """Decode an EPD embedding status (3 frames)."""
    frames = split_frames(data)
    try:
        message = decode_embedding_status(frames)
    except WireError:
        return
    assert encode_embedding_status(message) == frames


def fuzz_staged_blob(data: bytes) -> None:
    """Read a staged blob's table: the first 4 bytes are the announced length, the
    next 4 the slot's, the rest the slot's bytes. A table that reads has lengths that
    cover exactly the data announced."""
    if len(data) < 8:
        return
    staged = int.from_bytes(data[:4], "little")
    slot = int.from_bytes(data[4:8], "little")
    blob = np.frombuffer(data[8:], dtype=np.uint8)
    try:
        dst, lengths = read_blob_table(blob, staged, slot)
    except WireError:
        return
    assert len(dst) == len(lengths)
    table = BLOB_HEADER_BYTES + BLOB_ENTRY_BYTES * len(lengths)
    assert table + int(lengths.sum()) == staged <= min(slot, len(blob))
    assert (lengths >= 1).all()
    assert (dst >= 0).all()


TARGETS: Final[dict[str, Callable[[bytes], None]]] = {
    "registration": fuzz_registration,
    "preallocation": fuzz_preallocation,
    "status": fuzz_status,
    "embedding_status": fuzz_embedding_status,
    "staged_blob": fuzz_staged_blob,
}
_ORDER: Final = tuple(TARGETS.values())


def test_one_input(data: bytes) -> None:
    """The combined target: the first byte picks a decoder, the rest is its input."""
    if data:
        _ORDER[data[0] % len(_ORDER)](data[1:])


def main(argv: list[str]) -> None:
    """Run one target (or all) under atheris/libFuzzer."""
    # Imported here: atheris is only needed for long runs by hand.
    atheris = importlib.import_module("atheris")

    target: Callable[[bytes], None] = test_one_input
    if len(argv) > 1 and argv[1] in TARGETS:
        target = TARGETS[argv.pop(1)]
    atheris.Setup(argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
