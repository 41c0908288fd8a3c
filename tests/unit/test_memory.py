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


def test_single_row_decode_has_no_gather():
    m = MemoryModel(LLAMA3_8B)
    gather = 2 * 2 * 8 * 1000 * 128 * 2
    assert m.decode_bytes([1000, 1000]) - 2 * m.decode_bytes([1000]) >= gather
