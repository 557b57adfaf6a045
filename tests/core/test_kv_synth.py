"""The synthetic KV-event source is realistic: chained hashes, shared prefixes, LRU."""

from __future__ import annotations

import pytest

from tspd.core.kv_events import BlockRemoved, BlockStored, block_hash
from tspd.core.kv_synth import SyntheticCache


def test_stream_is_deterministic_for_a_seed() -> None:
    a = SyntheticCache(seed=3).batch(200)
    b = SyntheticCache(seed=3).batch(200)
    c = SyntheticCache(seed=4).batch(200)
    assert a == b
    assert a != c


def test_stored_blocks_hash_their_tokens_chained_to_their_parent() -> None:
    events = SyntheticCache(seed=1, block_size=4, capacity=10_000).batch(300)
    known: set[int] = set()
    firsts = 0
    for event in events:
        assert isinstance(event, BlockStored)
        (h,) = event.block_hashes
        assert isinstance(h, int)
        assert event.block_size == 4
        assert len(event.token_ids) == 4
        assert h == block_hash(
            event.parent_block_hash if isinstance(event.parent_block_hash, int) else None,
            event.token_ids,
        )
        if event.parent_block_hash is None:
            firsts += 1
        else:
            assert event.parent_block_hash in known  # a parent is stored before its child
        known.add(h)
    # Shared system prompts: few first blocks, however many requests.
    assert 1 <= firsts <= 8


def test_eviction_keeps_the_cache_bounded_and_removes_only_stored_blocks() -> None:
    synth = SyntheticCache(seed=2, block_size=2, capacity=16, prefixes=2, prefix_blocks=1)
    live: set[int] = set()
    for event in synth.batch(500):
        if isinstance(event, BlockStored):
            live.add(event.block_hashes[0])  # type: ignore[arg-type]
        else:
            assert isinstance(event, BlockRemoved)
            assert event.block_hashes[0] in live
            live.discard(event.block_hashes[0])
        assert len(live) <= 17
    assert synth.removed > 0
    assert synth.cached == len(live) <= 16
    assert synth.stored - synth.removed == synth.cached


def test_invalid_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        SyntheticCache(block_size=0)
