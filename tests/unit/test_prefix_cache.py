"""Prefix cache index and budget (pure Python: entries hold block ids and their bytes)."""

from engine.core.prefix_cache import PrefixCache


def test_longest_common_prefix_wins_and_last_token_is_recomputed():
    cache = PrefixCache(max_bytes=1000)
    cache.insert([1, 2, 3, 4], (0,), 100)
    cache.insert([1, 2, 9, 9, 9], (0,), 100)
    hit = cache.lookup([1, 2, 3, 4, 5, 6])
    assert hit.num_tokens == 4
    cache.unpin(hit)
    hit = cache.lookup([1, 2, 3, 4])  # the whole prompt is cached: still compute its last token
    assert hit.num_tokens == 3
    cache.unpin(hit)
    assert cache.lookup([7, 8]) is None


def test_lru_eviction_under_budget_and_pins():
    cache = PrefixCache(max_bytes=250)
    cache.insert([1], (0,), 100)
    cache.insert([2], (0,), 100)
    pinned = cache.lookup([1, 5])  # touches and pins [1]
    cache.insert([3], (0,), 100)  # over budget: evicts the least recently used unpinned entry, [2]
    assert cache.lookup([2, 5]) is None
    assert cache.nbytes == 200 and cache.stats.num_evictions == 1
    assert cache.evict(1000) == 100  # [1] is pinned and stays
    cache.take(pinned)
    assert cache.evict(1000) == 100 and cache.nbytes == 0


def test_entry_larger_than_budget_is_not_kept():
    cache = PrefixCache(max_bytes=50)
    assert not cache.insert([1, 2], (0,), 100)
    assert len(cache) == 0


def test_evicted_blocks_go_to_on_evict():
    evicted = []
    cache = PrefixCache(max_bytes=250, on_evict=evicted.append)
    cache.insert([1], [4, 5], 100)
    cache.insert([2], [6], 100)
    cache.insert([3], [7], 100)  # evicts [1]: its blocks go back to the pool
    assert evicted == [(4, 5)]
    cache.evict(1000)
    assert evicted == [(4, 5), (6,), (7,)]
