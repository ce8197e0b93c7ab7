"""The mock engine's prefix cache: an LRU of prompt block hashes, counted as vLLM counts.

A real engine caches every full block of a prompt it computed, keyed by a hash chain over
the blocks (the cache salt in the first), and evicts the least recently used free blocks
when it needs room. :class:`PrefixCache` keeps that as an LRU of chain hashes bounded by
``capacity`` blocks (the engine's KV cache, ``MockEngineConfig.prefix_cache_size``): a
request's cached tokens are its longest run of leading blocks found, in whole blocks, never
the block of the last prompt token (vLLM always computes that one), none when the request
wants prompt logprobs (vLLM skips the cache then); its full blocks are then inserted as the
most recent. It also keeps vLLM's ``PrefixCacheStats`` counters.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

__all__ = ["PrefixCache"]


class PrefixCache:
    """One engine's cached blocks (see the module docstring)."""

    __slots__ = ("_blocks", "_hits", "_queries", "_requests", "_reset", "block_size",
                 "capacity")

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._reset = False
        self._requests = self._queries = self._hits = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup_and_insert(self, prompt: Sequence[int], cache_salt: str | None, *,
                          read: bool = True) -> int:
        """Tokens of ``prompt`` found cached (whole blocks); then cache its full blocks.
        ``read=False``: count nothing as cached (prompt logprobs), but insert."""
        bs = self.block_size
        n = len(prompt)
        tokens = prompt if isinstance(prompt, tuple) else tuple(prompt)
        hashes = []
        h = hash(("salt", cache_salt))
        for i in range(n // bs):
            h = hash((h, tokens[i * bs:(i + 1) * bs]))
            hashes.append(h)
        blocks = self._blocks
        hits = 0
        if read:
            for h in hashes[:(n - 1) // bs]:  # the last prompt token is always computed
                if h not in blocks:
                    break
                hits += 1
        move = blocks.move_to_end
        for h in hashes:
            if h in blocks:
                move(h)
            else:
                blocks[h] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        cached = hits * bs
        self._requests += 1
        self._queries += n
        self._hits += cached
        return cached

    def reset(self) -> None:
        """Empty the cache (``reset_prefix_cache``); the next stats say ``reset``."""
        self._blocks.clear()
        self._reset = True

    def take_stats(self) -> dict[str, Any]:
        """vLLM's ``PrefixCacheStats`` since the last call (the counters restart)."""
        stats: dict[str, Any] = {
            "reset": self._reset, "requests": self._requests,
            "queries": self._queries, "hits": self._hits,
            "preempted_requests": 0, "preempted_queries": 0, "preempted_hits": 0,
            "hits_by_source": {},
        }
        self._reset = False
        self._requests = self._queries = self._hits = 0
        return stats
