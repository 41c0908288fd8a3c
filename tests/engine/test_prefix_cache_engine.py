"""Prefix cache in the engine (real MLX, tiny model): exact reuse, fewer tokens computed, eviction."""

from __future__ import annotations

import random

from engine.core.types import SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def prompts(seed, n, length, shared=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 49152) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 49152) for _ in range(length)] for _ in range(n)]


def test_hit_output_equals_miss_output_and_skips_the_prefix(make_engine):
    cold = make_engine(prefix_cache_fraction=0.0, prefill_chunk_size=16, max_num_batched_tokens=48)
    warm = make_engine(prefill_chunk_size=16, max_num_batched_tokens=48)
    first, second = prompts(1, 2, 20, shared=70)
    expected = cold.generate([first, second], GREEDY)
    assert warm.generate([first], GREEDY)[0].token_ids == expected[0].token_ids
    before = warm.stats().num_tokens_computed
    out = warm.generate([second], GREEDY)[0]
    assert out.token_ids == expected[1].token_ids
    assert out.num_cached_tokens == 70
    computed = warm.stats().num_tokens_computed - before
    assert computed == (90 - 70) + (12 - 1)  # the new prompt tokens, then one token per decode step
    assert warm.stats().prefix_cache_hits == 1


def test_second_chat_turn_prefills_only_the_new_tokens(make_engine):
    engine = make_engine()
    turn1 = [{"role": "user", "content": "Tell me about the sea."}]
    out1 = engine.generate([turn1], GREEDY)[0]
    ids1 = engine.encode(turn1) + out1.token_ids
    turn2 = engine.encode(turn1 + [{"role": "assistant", "content": out1.text},
                                   {"role": "user", "content": "And rivers?"}])
    reused = next(i for i, (a, b) in enumerate(zip(ids1 + [-1], turn2)) if a != b)
    before = engine.stats().num_tokens_computed
    out2 = engine.generate([turn2], GREEDY)[0]
    assert out2.num_cached_tokens >= reused - 1 > 0
    assert engine.stats().num_tokens_computed - before == len(turn2) - out2.num_cached_tokens + 11


def test_small_budget_evicts_and_eviction_comes_before_waiting(make_engine):
    engine = make_engine(memory_limit_bytes=64 << 20, prefix_cache_fraction=1.0)
    budget = engine.kv.kv_budget_bytes
    per_request = engine.memory.kv_bytes(60 + 12 - 1)
    many = prompts(2, budget // per_request + 3, 60)
    for p in many:  # one after another: each finished request's KV goes into the cache
        engine.generate([p], GREEDY)
    stats = engine.stats()
    assert stats.prefix_cache_evictions > 0
    assert stats.prefix_cache_bytes <= budget
    # the cache may hold the whole budget, yet a new request is admitted at once (cache evicted first)
    engine.add_request("new", prompts(3, 1, 60)[0], GREEDY)
    engine.step()
    assert engine.stats().num_running == 1 and engine.stats().num_waiting == 0
    assert engine.stats().kv_reserved_bytes + engine.stats().prefix_cache_bytes <= budget
