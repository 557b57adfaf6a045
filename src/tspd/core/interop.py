"""The interop test pattern: bytes a Prefill writes and a Decode expects.

The pattern is stated in docs/protocol.md#proto-interop. This is a tspd convention, not
part of TokenSpeed's wire. It fixes, from a seed and a room alone, the payload of every
transferred block and the bootstrap token with its speculative candidates, so two
implementations (or two processes of this one) can verify each other's transfers byte
for byte without sharing any state.

Every value is SHAKE-256 of an ASCII message, truncated to the length wanted:

* block payload: ``tspd-interop-v1|seed=<seed>|room=<room>|group=<group>|field=<field>|slot=<slot>``
* token and candidates: ``tspd-interop-v1|seed=<seed>|room=<room>|token``, taking
  ``4 + 4K`` bytes; each value is a little-endian ``u32`` masked to 31 bits.
"""

from __future__ import annotations

import hashlib

from tspd.core.errors import ConfigError

__all__ = [
    "INTEROP_PREFIX",
    "block_bytes",
    "block_message",
    "bootstrap_token_and_candidates",
    "token_message",
]

INTEROP_PREFIX = "tspd-interop-v1"

_MASK31 = 0x7FFFFFFF


def _check_unsigned(name: str, value: int) -> None:
    # The message spells integers in base 10 without sign, so negative values (and
    # bools, which would print as "True") have no encoding.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"interop {name} must be a non-negative integer, got {value!r}")


def _check_label(name: str, value: str) -> None:
    # '|' separates the message's parts; a label containing it would be ambiguous.
    if not value or not value.isascii() or "|" in value:
        raise ConfigError(f"interop {name} must be non-empty ASCII without '|', got {value!r}")


def block_message(seed: int, room: int, group_id: str, field_id: str, slot: int) -> bytes:
    """The ASCII message whose SHAKE-256 stream is one block's payload."""
    _check_unsigned("seed", seed)
    _check_unsigned("room", room)
    _check_unsigned("slot", slot)
    _check_label("group id", group_id)
    _check_label("field id", field_id)
    return (
        f"{INTEROP_PREFIX}|seed={seed}|room={room}|group={group_id}|field={field_id}|slot={slot}"
    ).encode("ascii")


def block_bytes(
    seed: int, room: int, group_id: str, field_id: str, slot: int, length: int
) -> bytes:
    """The ``length`` payload bytes of field ``field_id`` in the block holding logical
    slot ``slot`` of group ``group_id`` for ``room`` (stride padding excluded)."""
    _check_unsigned("length", length)
    return hashlib.shake_256(block_message(seed, room, group_id, field_id, slot)).digest(length)


def token_message(seed: int, room: int) -> bytes:
    """The ASCII message whose SHAKE-256 stream yields the bootstrap token and the
    speculative candidates of ``room``."""
    _check_unsigned("seed", seed)
    _check_unsigned("room", room)
    return f"{INTEROP_PREFIX}|seed={seed}|room={room}|token".encode("ascii")


def bootstrap_token_and_candidates(seed: int, room: int, k: int) -> tuple[int, tuple[int, ...]]:
    """The bootstrap token of ``room`` and its ``k`` speculative candidate ids, each a
    31-bit non-negative integer (so it fits the status message's int32 frames)."""
    _check_unsigned("candidate count", k)
    stream = hashlib.shake_256(token_message(seed, room)).digest(4 + 4 * k)
    values = [
        int.from_bytes(stream[i : i + 4], "little") & _MASK31 for i in range(0, len(stream), 4)
    ]
    return values[0], tuple(values[1:])
