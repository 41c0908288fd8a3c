"""Memory model arithmetic (no mlx)."""

from engine.memory import MemoryModel, ModelShape, PrefillChunkPlan, StepPlan

LLAMA3_8B = ModelShape(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                       intermediate_size=14336, vocab_size=128256, dtype_bytes=2)


def test_kv_bytes_per_token_llama3_8b_bf16():
    m = MemoryModel(LLAMA3_8B)
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert m.kv_tokens(1) == 256 and m.kv_tokens(256) == 256 and m.kv_tokens(257) == 512
    assert m.kv_bytes(8192) == 8192 * 131072


def test_step_transient_is_max_not_sum():
    m = MemoryModel(LLAMA3_8B)
    one = m.prefill_chunk_bytes(512, 4096)
    plan = StepPlan(prefill_chunks=(PrefillChunkPlan(512, 4096), PrefillChunkPlan(512, 1024)))
    assert m.step_transient_bytes(plan) == one
    both = StepPlan(decode_context_lens=(100, 4000), prefill_chunks=(PrefillChunkPlan(512, 4096),))
    assert m.step_transient_bytes(both) == max(one, m.decode_bytes([100, 4000]))


def test_bound_dominates_every_step_and_grows_with_config():
    m = MemoryModel(LLAMA3_8B)
    bound = m.transient_bound_bytes(16, 512, 8192)
    for c in (1, 7, 256, 512):
        for n in (c, 1000, 8192):
            assert m.prefill_chunk_bytes(c, n) <= bound
    assert m.decode_bytes([8192] * 16) <= bound
    assert m.transient_bound_bytes(16, 1024, 8192) > bound
    assert m.transient_bound_bytes(16, 512, 4096) < bound


def test_decode_gathers_every_row_from_the_pool():
    m = MemoryModel(LLAMA3_8B)
    gather = 1000 * 8 * (2 * 128 * 2 + 4)  # one row, one layer: K, V and the int32 slot index
    assert m.decode_bytes([1000]) >= gather
    assert m.decode_bytes([1000, 1000]) - m.decode_bytes([1000]) >= gather


def test_kv_budget_leaves_room_for_the_pool_growth_copy():
    m = MemoryModel(LLAMA3_8B)
    for available, forward in ((100 << 30, 1 << 30), (100 << 30, 1 << 20), (8 << 30, 2 << 30)):
        budget = m.kv_budget_bytes(available, forward)
        growth = m.kv_growth_bound_bytes(budget)
        assert budget + max(forward, growth) <= available
        assert budget + max(forward, growth) >= available - m.kv_bytes_per_token  # nothing wasted
    # growth of a full pool: one layer's K (or V) of the pool and its indices
    assert m.kv_copy_bytes(1000) == 1000 * (8 * 128 * 2 + 8)
