"""The interop pattern reproduces the vectors of docs/protocol.md#proto-interop exactly."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tspd.core.errors import ConfigError
from tspd.core.interop import (
    block_bytes,
    block_message,
    bootstrap_token_and_candidates,
    token_message,
)

MAX_ROOM = 2**63 - 1


@pytest.mark.parametrize(
    ("seed", "room", "slot", "prefix_hex"),
    [
        (0, 1_000_000, 0, "742f864c028ea01c1c2b65921b811493"),
        (0, 1_000_000, 1, "eb0f2c950d00dadfac638d2a1d20a145"),
        (0, MAX_ROOM, 1, "dca76beccfbeeaae11fee480f3eead46"),
        (1, 1_000_000, 0, "9ecbc12497794973620ce436401000ba"),
    ],
)
def test_block_vectors(seed: int, room: int, slot: int, prefix_hex: str) -> None:
    payload = block_bytes(seed, room, "full", "layer.0.kv", slot, 4096)
    assert len(payload) == 4096
    assert payload[:16].hex() == prefix_hex


def test_token_vectors() -> None:
    assert bootstrap_token_and_candidates(0, 1_000_000, 3) == (
        621224652,
        (1210209511, 701474692, 832778341),
    )
    assert bootstrap_token_and_candidates(0, MAX_ROOM, 0) == (823152738, ())
    assert bootstrap_token_and_candidates(1, 1_000_000, 0)[0] == 912761903


def test_messages_are_the_documented_ascii() -> None:
    assert block_message(0, 1_000_000, "full", "layer.0.kv", 0) == (
        b"tspd-interop-v1|seed=0|room=1000000|group=full|field=layer.0.kv|slot=0"
    )
    assert token_message(7, 12) == b"tspd-interop-v1|seed=7|room=12|token"


@given(
    seed=st.integers(0, 2**32),
    room=st.integers(0, MAX_ROOM),
    k=st.integers(0, 16),
)
def test_token_stream_is_a_prefix_of_more_candidates(seed: int, room: int, k: int) -> None:
    token, candidates = bootstrap_token_and_candidates(seed, room, k)
    more_token, more = bootstrap_token_and_candidates(seed, room, k + 2)
    assert token == more_token
    assert more[:k] == candidates
    assert all(0 <= v <= 0x7FFFFFFF for v in (token, *more))


@given(length=st.integers(0, 300), slot=st.integers(0, 10_000))
def test_block_bytes_is_shake256_truncated(length: int, slot: int) -> None:
    message = block_message(3, 5, "g", "layer.1.k", slot)
    assert block_bytes(3, 5, "g", "layer.1.k", slot, length) == hashlib.shake_256(message).digest(
        length
    )


@pytest.mark.parametrize(
    "call",
    [
        lambda: block_bytes(-1, 1, "full", "layer.0.kv", 0, 4),
        lambda: block_bytes(0, -1, "full", "layer.0.kv", 0, 4),
        lambda: block_bytes(0, 1, "full", "layer.0.kv", -1, 4),
        lambda: block_bytes(0, 1, "full", "layer.0.kv", 0, -4),
        lambda: block_bytes(0, 1, "fu|ll", "layer.0.kv", 0, 4),
        lambda: block_bytes(0, 1, "full", "", 0, 4),
        lambda: block_bytes(True, 1, "full", "layer.0.kv", 0, 4),
        lambda: bootstrap_token_and_candidates(0, 1, -1),
    ],
)
def test_values_without_an_encoding_are_refused(call: Callable[[], object]) -> None:
    with pytest.raises(ConfigError, match="interop"):
        call()
