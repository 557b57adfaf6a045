"""Synthetic prefix-cache activity, for exercising KV-event routers and consumers.

:class:`SyntheticCache` plays a scheduler's prefix cache: requests arrive whose
prompts share a few system prompts and end in a random suffix; each full block
not yet cached is stored (one ``BlockStored`` per block, as TokenSpeed emits,
hashed with the spec's FNV-1a and chained to its parent), and when the cache
exceeds its capacity the least recently used blocks are removed. The stream is
deterministic for a seed, so a consumer's index can be checked against it.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterator
from typing import final

from tspd.core.kv_events import BlockRemoved, BlockStored, KVEvent, block_hash

__all__ = ["SyntheticCache"]


@final
class SyntheticCache:
    """A deterministic source of realistic KV events.

    ``prefixes`` shared system prompts of ``prefix_blocks`` blocks each; suffixes of
    1 to ``max_suffix_blocks`` blocks (plus a partial block that is never stored);
    ``capacity`` cached blocks before least-recently-used eviction.
    """

    def __init__(
        self,
        *,
        seed: int = 0,
        block_size: int = 16,
        capacity: int = 4096,
        prefixes: int = 8,
        prefix_blocks: int = 4,
        max_suffix_blocks: int = 8,
        vocab: int = 32_000,
    ) -> None:
        if block_size < 1 or capacity < 1 or prefixes < 1 or max_suffix_blocks < 1:
            raise ValueError("block_size, capacity, prefixes and max_suffix_blocks must be >= 1")
        self._rng = random.Random(seed)
        self._block_size = block_size
        self._capacity = capacity
        self._max_suffix = max_suffix_blocks
        self._vocab = vocab
        self._prefixes = [self._tokens(prefix_blocks * block_size) for _ in range(prefixes)]
        self._cache: OrderedDict[int, None] = OrderedDict()
        self._stream = self._events()
        self.stored = 0
        self.removed = 0

    @property
    def cached(self) -> int:
        """Blocks currently in the cache."""
        return len(self._cache)

    def batch(self, size: int) -> list[KVEvent]:
        """The next ``size`` events (one scheduler round)."""
        return [next(self._stream) for _ in range(size)]

    def _tokens(self, count: int) -> list[int]:
        return [self._rng.randrange(self._vocab) for _ in range(count)]

    def _events(self) -> Iterator[KVEvent]:
        bs = self._block_size
        while True:
            prompt = self._rng.choice(self._prefixes) + self._tokens(
                self._rng.randint(1, self._max_suffix) * bs + self._rng.randrange(bs)
            )
            parent: int | None = None
            for start in range(0, len(prompt) - bs + 1, bs):
                block = tuple(prompt[start : start + bs])
                h = block_hash(parent, block)
                if h in self._cache:
                    self._cache.move_to_end(h)
                else:
                    self._cache[h] = None
                    self.stored += 1
                    yield BlockStored((h,), parent, block, bs)
                parent = h
                while len(self._cache) > self._capacity:
                    old, _ = self._cache.popitem(last=False)
                    self.removed += 1
                    yield BlockRemoved((old,))
