"""KVManager: the one owner of KV (reservations, blocks, prefix cache). Pure Python, no mlx."""

import pytest

from engine.core.kv_manager import KVManager
from engine.core.memory.model import MemoryModel, ModelShape
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.types import FinishReason, Request, SamplingParams

BLOCK = 4
PER_TOKEN = 10  # bytes of KV per token
BLOCK_BYTES = BLOCK * PER_TOKEN


def manager(num_blocks=8, cache_blocks=0) -> KVManager:
    return KVManager(BLOCK, PER_TOKEN, num_blocks * BLOCK_BYTES, cache_blocks * BLOCK_BYTES)


def test_reservations_stay_within_budget_and_none_when_they_do_not_fit():
    kv = manager(num_blocks=8)
    assert kv.allocate("a", 9) == 3  # 9 tokens: three blocks of four
    assert kv.allocate("b", 20) == 5
    assert kv.reserved_bytes == kv.kv_budget_bytes
    assert kv.allocate("c", 1) is None  # the budget is full: the caller decides (it waits)
    rows = kv.place_admitted()
    assert [r.request_id for r in rows] == ["a", "b"]
    assert rows[0].block_ids == (0, 1, 2) and rows[1].block_ids == (3, 4, 5, 6, 7)
    assert kv.used_bytes == kv.reserved_bytes
    kv.free("a")
    assert kv.reserved_bytes == 5 * BLOCK_BYTES and kv.allocator.num_free == 3
    assert kv.allocate("c", 12) is not None  # fits again in what "a" gave back
    assert kv.place_admitted()[0].block_ids == (0, 1, 2)


def test_pool_grows_lazily_doubling_and_capped_at_the_budget():
    kv = manager(num_blocks=10)
    kv.allocate("a", 4)
    kv.place_admitted()
    assert kv.num_pool_blocks == 1  # only what is needed at first
    kv.allocate("b", 8)
    kv.allocate("c", 4)
    kv.place_admitted()  # three more blocks: once for the step, at least double
    assert kv.num_pool_blocks == 4
    kv.allocate("d", 24)
    kv.place_admitted()
    assert kv.num_pool_blocks == 10  # 4 used + 6 needed, doubling capped at the budget


def test_prefix_cache_keeps_a_finished_prefix_and_eviction_gives_its_blocks_back():
    kv = manager(num_blocks=6, cache_blocks=3)
    prompt = list(range(100, 110))
    kv.allocate("a", 12)
    (row,) = kv.place_admitted()
    kv.free("a", keep_token_ids=prompt[:6])  # 6 computed tokens: two blocks kept, one freed
    assert kv.reserved_bytes == 0 and kv.cached_bytes == 2 * BLOCK_BYTES
    assert kv.allocator.num_used == 2
    assert kv.lookup_prefix("b", prompt) == 6
    kv.allocate("b", 12)
    (hit,) = kv.place_admitted()
    assert hit.prefix.source_block_ids == row.block_ids[:2] and hit.prefix.num_tokens == 6
    # the cache's bytes are reclaimed before a request waits: "c" needs what only eviction frees
    assert kv.allocate("c", 8) is not None
    assert kv.cached_bytes == 0 and kv.prefix_cache.stats.num_evictions == 1
    kv.place_admitted()
    assert kv.allocator.num_used == 5  # "b" three blocks, "c" two: the evicted blocks came back


def test_a_pinned_hit_is_never_evicted_and_an_unplaced_one_is_let_go():
    kv = manager(num_blocks=4, cache_blocks=4)
    kv.allocate("a", 8)
    kv.place_admitted()
    kv.free("a", keep_token_ids=[1, 2, 3, 4, 5, 6, 7, 8])
    assert kv.lookup_prefix("b", [1, 2, 3, 4, 5, 9]) == 5
    assert kv.allocate("c", 16) is None  # would need the pinned entry's blocks
    kv.free("b")  # finished while waiting: unpinned
    assert kv.allocate("c", 16) is not None and kv.cached_bytes == 0


def test_errors_and_an_empty_prefix_free_everything():
    kv = manager(num_blocks=4, cache_blocks=4)
    kv.allocate("a", 8)
    kv.place_admitted()
    kv.free("a", keep_token_ids=())
    assert kv.cached_bytes == 0 and kv.allocator.num_used == 0
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        KVManager(BLOCK, PER_TOKEN, BLOCK_BYTES, 2 * BLOCK_BYTES)


SHAPE = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=1000, dtype_bytes=4)


def test_scheduler_hands_block_ids_and_prefix_copies_to_the_plan():
    memory = MemoryModel(SHAPE, kv_step=BLOCK)
    kv = KVManager(BLOCK, memory.kv_bytes_per_token, 16 * BLOCK * memory.kv_bytes_per_token,
                   8 * BLOCK * memory.kv_bytes_per_token)
    s = Scheduler(SchedulerConfig(4, 64, 16, 64), memory, kv)
    s.add(Request("a", list(range(1, 11)), SamplingParams(max_tokens=3)))  # 12 tokens of KV: 3 blocks
    plan = s.schedule()
    (row,) = plan.new_rows
    assert row.request_id == "a" and row.block_ids == (0, 1, 2) and row.prefix is None
    assert plan.num_pool_blocks == 3
    s.update(plan, {"a": 7})
    s.finish("a", FinishReason.STOP, num_kv_tokens=10)  # its prompt's KV goes into the cache
    assert kv.reserved_bytes == 0 and kv.cached_bytes == 3 * kv.block_bytes
    s.add(Request("b", list(range(1, 9)) + [50, 51], SamplingParams(max_tokens=2)))
    assert s.requests["b"].num_computed_tokens == 8  # starts after its cached tokens
    plan = s.schedule()
    (row,) = plan.new_rows
    assert row.prefix.source_block_ids == (0, 1, 2) and row.prefix.num_tokens == 8
    assert set(row.block_ids).isdisjoint({0, 1, 2}) and plan.num_pool_blocks >= 6
    assert [(c.start, c.num_tokens) for c in plan.prefills] == [(8, 2)]


def test_each_placed_request_gets_a_sliding_window_ring_given_back_when_it_finishes():
    kv = KVManager(BLOCK, PER_TOKEN, 8 * BLOCK_BYTES, num_rings=2)
    kv.allocate("a", 4)
    kv.allocate("b", 4)
    assert [r.ring for r in kv.place_admitted()] == [0, 1]
    kv.free("a")
    kv.allocate("c", 4)
    assert [r.ring for r in kv.place_admitted()] == [0]  # a's ring, reused
    plain = manager()
    plain.allocate("x", 4)
    assert [r.ring for r in plain.place_admitted()] == [None]  # a model without rings
    with pytest.raises(ValueError, match="num_rings=2.*prefix_cache_bytes=40"):
        KVManager(BLOCK, PER_TOKEN, 8 * BLOCK_BYTES, prefix_cache_bytes=BLOCK_BYTES, num_rings=2)
