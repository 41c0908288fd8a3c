"""Prefix cache: KV of earlier requests' tokens, reused by later requests that start the same way.

When a request finishes, its KV buffer (prompt and the output tokens already fed back) is kept here,
keyed by those token ids, under a byte budget of its own and evicted least-recently-used first. A new
request takes the longest common prefix with any entry: KV at position i depends only on tokens
0..i, so copying the first m positions of a matching entry is exact (greedy output with a hit equals
the output without it). At least one prompt token is always recomputed, for the first output's logits.

Cached bytes are reclaimable: the KV manager evicts entries (`evict`) before it would make a
request wait for KV, so the cache never causes a refusal. An entry a waiting request is going to copy
from is pinned until then. No mlx import: an entry holds the KV pool block ids of its tokens; an
evicted entry's block ids go to `on_evict` (the KV manager gives them back to the pool).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from engine.core.prefix_hash import block_hashes


@dataclass
class CacheEntry:
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]  # the pool blocks that hold the KV of token_ids
    nbytes: int
    pins: int = 0
    block_hashes: tuple[int, ...] = ()  # engine/core/prefix_hash.py, of token_ids


@dataclass(frozen=True)
class PrefixHit:
    entry_key: int
    num_tokens: int  # prompt tokens whose KV is copied from the entry


@dataclass
class PrefixCacheStats:
    num_queries: int = 0
    num_hits: int = 0
    num_hit_tokens: int = 0
    num_evictions: int = 0


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(self, max_bytes: int, min_hit_tokens: int = 1,
                 on_evict: Callable[[tuple[int, ...]], None] = lambda block_ids: None):
        self.max_bytes = max_bytes
        self._on_evict = on_evict
        self.min_hit_tokens = min_hit_tokens
        self._entries: "OrderedDict[int, CacheEntry]" = OrderedDict()  # LRU order: oldest first
        self._next_key = 0
        self.nbytes = 0
        self.stats = PrefixCacheStats()
        self.block_hash_chains: tuple[tuple[int, ...], ...] = ()  # per entry, most recently used first

    def _refresh_chains(self) -> None:
        self.block_hash_chains = tuple(e.block_hashes for e in reversed(self._entries.values()))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def evictable_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.pins == 0)

    def lookup(self, prompt_ids: Sequence[int]) -> Optional[PrefixHit]:
        """Longest reusable prefix of `prompt_ids` (pinned until `take` or `unpin`)."""
        self.stats.num_queries += 1
        best_key, best_len = None, 0
        limit = len(prompt_ids) - 1  # the last prompt token is always computed
        for key, entry in self._entries.items():
            n = min(common_prefix_len(entry.token_ids, prompt_ids), limit)
            if n > best_len:
                best_key, best_len = key, n
        if best_key is None or best_len < self.min_hit_tokens:
            return None
        entry = self._entries[best_key]
        entry.pins += 1
        self._entries.move_to_end(best_key)
        self._refresh_chains()
        self.stats.num_hits += 1
        self.stats.num_hit_tokens += best_len
        return PrefixHit(best_key, best_len)

    def take(self, hit: PrefixHit) -> tuple[int, ...]:
        """The entry's block ids, to copy from before anything else is evicted or allocated; unpins it."""
        entry = self._entries[hit.entry_key]
        entry.pins -= 1
        return entry.block_ids

    def unpin(self, hit: PrefixHit) -> None:
        entry = self._entries.get(hit.entry_key)
        if entry is not None:
            entry.pins -= 1

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int], nbytes: int) -> bool:
        """Keep `block_ids` (`nbytes` of KV of `token_ids`) if they fit the budget after evicting unpinned
        LRU entries. False: not kept, the blocks stay the caller's."""
        if nbytes > self.max_bytes or not token_ids:
            return False
        self.evict(self.nbytes + nbytes - self.max_bytes)
        if self.nbytes + nbytes > self.max_bytes:
            return False
        self._entries[self._next_key] = CacheEntry(tuple(token_ids), tuple(block_ids), nbytes,
                                                   block_hashes=block_hashes(token_ids))
        self._next_key += 1
        self.nbytes += nbytes
        self._refresh_chains()
        return True

    def evict(self, num_bytes: int) -> int:
        """Evict unpinned entries, oldest first, until `num_bytes` are freed. Returns bytes freed."""
        freed = 0
        for key in [k for k, e in self._entries.items() if e.pins == 0]:
            if freed >= num_bytes:
                break
            entry = self._entries.pop(key)
            freed += entry.nbytes
            self.nbytes -= entry.nbytes
            self.stats.num_evictions += 1
            self._on_evict(entry.block_ids)
        if freed:
            self._refresh_chains()
        return freed
