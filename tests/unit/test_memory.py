"""Memory model arithmetic (no mlx)."""

from engine.core.memory.model import MemoryModel, ModelShape, PrefillChunkPlan, StepPlan

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
    assert m.transient_bound_bytes(1, 1024, 8192) > m.transient_bound_bytes(1, 512, 8192)  # prefill-bound
    assert m.transient_bound_bytes(32, 512, 8192) > bound  # decode-bound
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
    # growth of a full pool: one layer's K (or V) of the pool; a prefix copy's also its int32 source and
    # destination rows, one per KV head and token
    assert m.kv_copy_bytes(1000) == 1000 * 8 * (128 * 2 + 8)


# --- backend coefficient sets ------------------------------------------------------------------------
import dataclasses  # noqa: E402

import pytest  # noqa: E402

from engine.core.memory.coefficients import (CPU_COEFFICIENTS, CPU_MLX_ATTENTION_COEFFICIENTS, CUDA_COEFFICIENTS,  # noqa: E402
                           CUDA_OPS8_COEFFICIENTS, TransientCoefficients, coefficients_for_backend)

# the CPU set without its fitted per-forward constants, its forwards in one stage: the CUDA terms'
# tests add them one at a time
NEUTRAL = dataclasses.replace(CPU_COEFFICIENTS, step_overhead_bytes=0, prefill_overhead_bytes=0,
                              prefill_layer_rows=0.0, prefill_stage_rows=0.0, prefill_first_rows=0.0,
                              head_apart=False, phases_apart=False, attention_query_blocks=1)


def test_cpu_sets_predictions_pinned():
    """The shipped CPU sets' predictions of the 8B shape (the layer loops' set fitted on
    scripts/data/cpu_i21_grid.json, the modules' on scripts/data/cpu_i24_grid.json, docs/memory.md): a
    change of the formulas or the sets shows here.
    The CUDA terms are neutral on the CPU (one layer in flight)."""
    assert CPU_MLX_ATTENTION_COEFFICIENTS.layers_in_flight == CPU_COEFFICIENTS.layers_in_flight == 1
    mlx_attention, loops = (MemoryModel(LLAMA3_8B, coefficients=k)
                            for k in (CPU_MLX_ATTENTION_COEFFICIENTS, CPU_COEFFICIENTS))
    for m, want in ((mlx_attention, (663219362, 1179118, 31413130, 575668821, 35334463, 560574)),
                    (loops, (152970939, 661267, 14767390, 582179487, 35846909, 554069))):
        got = (m.prefill_chunk_bytes(512, 8192, samples=True), m.prefill_chunk_bytes(1, 100),
               m.prefill_chunk_bytes(128, 300, computes_logits=False), m.decode_bytes([8192] * 16, samples=True),
               m.decode_bytes([100, 4000]), m.decode_bytes([7]))
        assert got == want
        assert m.transient_bound_bytes(16, 512, 8192) == max(got[0], got[3])


def test_coefficients_for_backend_picks_the_set():
    assert coefficients_for_backend("cpu") is CPU_COEFFICIENTS
    assert coefficients_for_backend("cuda") is CUDA_COEFFICIENTS
    assert coefficients_for_backend("cpu", cpu_math=False) is CPU_MLX_ATTENTION_COEFFICIENTS
    # no Metal measurements yet: the CPU set of MLX's attention, with the head beside the layers (no stage waits)
    assert coefficients_for_backend("metal") == dataclasses.replace(CPU_MLX_ATTENTION_COEFFICIENTS, head_apart=False)
    assert coefficients_for_backend(" CUDA ") is CUDA_COEFFICIENTS
    assert coefficients_for_backend("cuda", 8) is CUDA_OPS8_COEFFICIENTS
    assert coefficients_for_backend("cuda", 64) is CUDA_COEFFICIENTS
    assert coefficients_for_backend("cpu", 8) is CPU_COEFFICIENTS


def test_a_shape_calibration_replaces_the_backend_set_for_that_shape_only():
    """memory.SHAPE_CALIBRATIONS: the Llama-3-8B shape in bf16 under CUDA's ops-8 set takes its own fit
    (tighter for it); another shape, dtype or backend set keeps the backend's."""
    from engine.core.memory.coefficients import coefficients_for

    bf16 = LLAMA3_8B
    calibrated, what = coefficients_for("cuda", 8, bf16)
    assert calibrated is not CUDA_OPS8_COEFFICIENTS and "llama-3-8b" in what
    # tighter on the 8B's default 512-token chunk, and still an upper bound the scheduler bounds with
    models = [MemoryModel(bf16, coefficients=c, paged_decode=True) for c in (calibrated, CUDA_OPS8_COEFFICIENTS)]
    tight, generic = (m.prefill_chunk_bytes(512, 8192, computes_logits=False, gathers=False) for m in models)
    assert 335_562_440 <= tight < generic  # 335.56 MB: that chunk measured on an H200 (docs/memory_cuda.md)
    # the terms no 8B grid point fits (a fragmented row's gathered KV) count as in the backend's set. (Its
    # worst-case bound is no longer below the set's: its paged-partials term covers today's decodes with the
    # q/k rope fused, 4.70 GB against 4.22 at 16 rows of 131072 keys; the bound gates mixed steps and the
    # admission's fallback, the KV budget follows the floor step: docs/memory_cuda.md)
    for name in ("decode_gather", "prefill_gather", "layers_in_flight", "row_gather_layers"):
        assert getattr(calibrated, name) == getattr(CUDA_OPS8_COEFFICIENTS, name), name
    assert calibrated.mixed_min_layers == CUDA_OPS8_COEFFICIENTS.mixed_min_layers
    for args in (("cuda", 8, dataclasses.replace(bf16, dtype_bytes=4)), ("cuda", 8, dataclasses.replace(bf16, num_layers=16)),
                 ("cuda", None, bf16), ("cpu", None, bf16)):
        got, what = coefficients_for(*args)
        assert got is coefficients_for_backend(args[0], args[1]) and what.endswith("set")
    assert coefficients_for("cuda", 8) == (CUDA_OPS8_COEFFICIENTS, "cuda-ops8 set")


def test_the_qwen3_8b_calibration_is_below_the_set_and_above_its_measured_chunk():
    """The Qwen3-8B shape in bf16 under ops 8 takes its calibration (prompt chunks: docs/memory_cuda.md):
    its 512-token chunk is predicted above the 276.8 MB the H200 measured and below the set's prediction;
    its decodes are the set's, with a per-forward constant no smaller."""
    from engine.core.memory.coefficients import QWEN3_8B_BF16, coefficients_for, shape_key

    qwen3 = ModelShape(num_layers=36, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                       intermediate_size=12288, vocab_size=151936, dtype_bytes=2, extra_attention_rows=1.25)
    assert shape_key(qwen3) == QWEN3_8B_BF16
    calibrated, what = coefficients_for("cuda", 8, qwen3)
    assert "qwen3-8b" in what
    models = [MemoryModel(qwen3, coefficients=c, paged_decode=True) for c in (calibrated, CUDA_OPS8_COEFFICIENTS)]
    tight, generic = (m.prefill_chunk_bytes(512, 8192, computes_logits=False, gathers=False) for m in models)
    assert 1.0 * 276_822_984 <= tight < 1.2 * 276_822_984 < generic
    for rows in ([100], [8192] * 16):
        assert models[0].decode_bytes(rows) >= models[1].decode_bytes(rows)
    assert coefficients_for("cuda", 8, dataclasses.replace(qwen3, num_layers=28))[0] is CUDA_OPS8_COEFFICIENTS
    # chunks larger than its fit measured take the set (whose fit covers them); up to 512, the calibration
    assert coefficients_for("cuda", 8, qwen3, prefill_chunk_size=512)[0] is calibrated
    generic_set, why = coefficients_for("cuda", 8, qwen3, prefill_chunk_size=1024)
    assert generic_set is CUDA_OPS8_COEFFICIENTS and "up to 512" in why


@pytest.mark.parametrize("name", ["rocm", "", "gpu"])
def test_coefficients_for_backend_rejects_unknown_names(name):
    with pytest.raises(ValueError, match=repr(name)):
        coefficients_for_backend(name)


def test_cuda_set_predicts_at_least_the_cpu_set():
    # CUDA keeps several layers' intermediates alive: never below the CPU prediction on the 8B shape
    cpu, cuda = MemoryModel(LLAMA3_8B), MemoryModel(LLAMA3_8B, coefficients=CUDA_COEFFICIENTS)
    assert CUDA_COEFFICIENTS.layers_in_flight > 1 and CUDA_COEFFICIENTS.step_overhead_bytes > 0
    for c in (1, 128, 512, 2048):
        for n in (c, 4096, 8192):
            for logits in (False, True):
                assert cuda.prefill_chunk_bytes(c, n, logits) >= cpu.prefill_chunk_bytes(c, n, logits)
    for b in (1, 2, 8, 16):
        for n in (1, 1000, 8192):
            assert cuda.decode_bytes([n] * b) >= cpu.decode_bytes([n] * b)
    assert cuda.transient_bound_bytes(16, 512, 8192) >= cpu.transient_bound_bytes(16, 512, 8192)


def test_layers_in_flight_counts_the_per_layer_terms_up_to_the_depth():
    k = dataclasses.replace(NEUTRAL, layers_in_flight=4)
    one, four = MemoryModel(LLAMA3_8B, coefficients=NEUTRAL), MemoryModel(LLAMA3_8B, coefficients=k)
    no_head = dict(computes_logits=False)
    assert four.prefill_chunk_bytes(512, 4096, **no_head) == pytest.approx(
        4 * one.prefill_chunk_bytes(512, 4096, **no_head), abs=4)
    shallow = dataclasses.replace(LLAMA3_8B, num_layers=2)
    assert MemoryModel(shallow, coefficients=k).layer_factor == 2  # never more layers than the model has
    # the logits are computed once, after the layers: not multiplied
    with_head = four.prefill_chunk_bytes(512, 4096) - four.prefill_chunk_bytes(512, 4096, **no_head)
    assert abs(with_head - (one.prefill_chunk_bytes(512, 4096)
                            - one.prefill_chunk_bytes(512, 4096, **no_head))) <= 2


def test_a_decode_counts_every_layer_s_matmul_workspace_and_its_head_s():
    """The measured workspace (by rows) of one layer's projections counts in every layer of a decode (not
    the layers in flight: no fit says how many coexist), the head's once, each the most at that many rows
    or fewer (more rows never predict less); past the table its largest; prompt chunks do not count it
    (their calibrations measured them with it)."""
    import dataclasses

    import pytest

    from engine.core.memory.coefficients import CUDA_OPS8_COEFFICIENTS
    from engine.core.memory.workspace import MatmulWorkspace

    ws = MatmulWorkspace(per_layer=(0, 1000, 5000, 0, 6000), head=(7, 9, 8, 0, 0))
    plain = MemoryModel(LLAMA3_8B, coefficients=CUDA_OPS8_COEFFICIENTS, paged_decode=True)
    with_ws = MemoryModel(LLAMA3_8B, coefficients=CUDA_OPS8_COEFFICIENTS, paged_decode=True, matmul_workspace=ws)
    for rows, layer, head in ((1, 0, 7), (2, 1000, 9), (3, 5000, 9), (4, 5000, 9), (5, 6000, 9), (40, 6000, 9)):
        lens = [600] * rows
        assert with_ws.decode_bytes(lens) - plain.decode_bytes(lens) == 32 * layer + head, rows
    assert with_ws.prefill_chunk_bytes(64, 600) == plain.prefill_chunk_bytes(64, 600)
    assert with_ws.transient_bound_bytes(3, 512, 8192) >= plain.transient_bound_bytes(3, 512, 8192)
    cpu = dataclasses.replace(CUDA_OPS8_COEFFICIENTS, head_apart=True)  # stages apart: the head's own stage
    apart = MemoryModel(LLAMA3_8B, coefficients=cpu, paged_decode=True, matmul_workspace=MatmulWorkspace(head=(0, 10**9)))
    assert apart.decode_bytes([600, 600]) >= 10**9
    assert not MatmulWorkspace() and MatmulWorkspace(head=(1,))
    with pytest.raises(ValueError, match="per_layer"):
        MatmulWorkspace(per_layer=(1, -2))


def test_step_overhead_is_added_to_every_forward():
    k = dataclasses.replace(NEUTRAL, step_overhead_bytes=1 << 20)
    base, over = MemoryModel(LLAMA3_8B, coefficients=NEUTRAL), MemoryModel(LLAMA3_8B, coefficients=k)
    assert over.prefill_chunk_bytes(256, 1024) == base.prefill_chunk_bytes(256, 1024) + (1 << 20)
    assert over.decode_bytes([100, 200]) == base.decode_bytes([100, 200]) + (1 << 20)
    assert over.step_transient_bytes(StepPlan()) == 0  # no forward, no overhead


def test_layers_in_flight_below_one_is_rejected():
    bad = dataclasses.replace(CPU_COEFFICIENTS, layers_in_flight=0)
    with pytest.raises(ValueError, match="layers_in_flight=0"):
        MemoryModel(LLAMA3_8B, coefficients=bad)


def test_transient_coefficients_stays_frozen_with_defaults():
    assert TransientCoefficients(*(1.0,) * 10).layers_in_flight == 1


def test_memory_coefficient_overrides():
    from engine.core.memory.coefficients import with_overrides

    assert with_overrides(CPU_COEFFICIENTS, None) is CPU_COEFFICIENTS
    tuned = with_overrides(CUDA_COEFFICIENTS, {"prefill_mlp": 2.5, "layers_in_flight": 3.0})
    assert tuned.prefill_mlp == 2.5 and tuned.layers_in_flight == 3 and isinstance(tuned.layers_in_flight, int)
    assert tuned.decode_gather == CUDA_COEFFICIENTS.decode_gather
    with pytest.raises(ValueError, match="'prefil_mlp'"):
        with_overrides(CPU_COEFFICIENTS, {"prefil_mlp": 1.0})
    with pytest.raises(ValueError, match="decode_gather=-1"):
        with_overrides(CPU_COEFFICIENTS, {"decode_gather": -1})


def test_engine_config_checks_memory_coefficients():
    from engine.config import EngineConfig
    from engine.core.memory.coefficients import with_overrides

    assert EngineConfig(memory_coefficients={"decode_logits": 2.0}).memory_coefficients == {"decode_logits": 2.0}
    with pytest.raises(ValueError, match="memory_coefficients.*'decode_logit'"):
        EngineConfig(memory_coefficients={"decode_logit": 2.0})
    with pytest.raises(ValueError, match="memory_coefficients"):
        EngineConfig(memory_coefficients={"decode_logits": -1.0})
    # a fit of a grid without paged decodes prints decode_paged: null, which is taken as "not fitted"
    cfg = EngineConfig(memory_coefficients={"decode_paged": None, "layers_in_flight": 7})
    assert with_overrides(CPU_COEFFICIENTS, cfg.memory_coefficients).decode_paged is None
    with pytest.raises(ValueError, match="memory_coefficients: prefill_mlp=None"):
        EngineConfig(memory_coefficients={"prefill_mlp": None})


def test_decode_counts_sampling_temporaries_per_sampling_row():
    # rows are sampled lazily, in one graph: every sampling row's sort / cumsum temporaries may coexist
    m = MemoryModel(LLAMA3_8B)
    one_row = CPU_COEFFICIENTS.sampling * 4 * LLAMA3_8B.vocab_size
    assert m.decode_bytes([100] * 4, samples=4) - m.decode_bytes([100] * 4, samples=1) == int(3 * one_row)
    assert m.decode_bytes([100] * 4, samples=True) == m.decode_bytes([100] * 4, samples=1)
    assert m.transient_bound_bytes(16, 16, 8192) >= m.decode_bytes([8192] * 16, samples=16)


def test_paged_decode_counts_the_kernels_partials_not_a_gather():
    from engine.core.memory.coefficients import CUDA_OPS8_COEFFICIENTS

    gathering = MemoryModel(LLAMA3_8B, coefficients=CUDA_OPS8_COEFFICIENTS)
    paged = MemoryModel(LLAMA3_8B, coefficients=CUDA_OPS8_COEFFICIENTS, paged_decode=True)
    assert paged.paged_decode and not gathering.paged_decode
    # 3 rows at 8192 keys: 32 pool blocks of 4 spans of 64 keys each; per layer B * H * spans * (d + 2)
    # float32
    assert paged.paged_partials_bytes(3, 8192) == 3 * 32 * 128 * 130 * 4
    assert paged.decode_bytes([8192] * 3) < gathering.decode_bytes([8192] * 3) / 10
    m, k = paged.layer_factor, CUDA_OPS8_COEFFICIENTS
    diff = paged.decode_bytes([8192] * 3, gathers=True) - paged.decode_bytes([8192] * 3)
    expected = m * (k.decode_gather * 3 * 8192 * 8 * (2 * 128 * 2 + 4)
                    - k.decode_paged * paged.paged_partials_bytes(3, 8192))
    assert abs(diff - expected) <= 1
    # one more pool block of context costs its spans' partials per row and head
    assert paged.decode_bytes([257]) > paged.decode_bytes([256])
    # a one-token prompt chunk is the same kind of forward
    assert paged.prefill_chunk_bytes(1, 8192) < gathering.prefill_chunk_bytes(1, 8192)
    # and the bound, which sizes the KV budget, shrinks with it
    assert paged.transient_bound_bytes(16, 512, 131072) < gathering.transient_bound_bytes(16, 512, 131072) / 4


def test_a_set_not_fitted_on_paged_decodes_predicts_them_as_gathering():
    from engine.core.memory.coefficients import CPU_COEFFICIENTS, CUDA_COEFFICIENTS

    for coefficients in (CPU_COEFFICIENTS, CUDA_COEFFICIENTS):
        assert coefficients.decode_paged is None
        m = MemoryModel(LLAMA3_8B, coefficients=coefficients, paged_decode=True)
        assert not m.paged_decode
        assert m.decode_bytes([4096] * 4) == MemoryModel(LLAMA3_8B, coefficients=coefficients).decode_bytes([4096] * 4)


def test_prefill_overhead_is_added_to_prompt_chunks_only():
    from engine.core.memory.coefficients import TransientCoefficients, with_overrides, CPU_COEFFICIENTS

    base = MemoryModel(LLAMA3_8B, coefficients=NEUTRAL)
    over = MemoryModel(LLAMA3_8B, coefficients=with_overrides(NEUTRAL, {"prefill_overhead_bytes": 5e6}))
    assert over.coefficients.prefill_overhead_bytes == 5_000_000
    assert over.prefill_chunk_bytes(512, 4096) == base.prefill_chunk_bytes(512, 4096) + 5_000_000
    assert over.prefill_chunk_bytes(1, 4096) == base.prefill_chunk_bytes(1, 4096)
    assert over.decode_bytes([100, 200]) == base.decode_bytes([100, 200])
    assert TransientCoefficients(*(1.0,) * 10).prefill_overhead_bytes == 0


def test_prefill_layer_rows_is_per_layer_in_flight_and_chunk_independent():
    from engine.core.memory.coefficients import CPU_COEFFICIENTS, with_overrides

    k = with_overrides(NEUTRAL, {"prefill_layer_rows": 100.0, "layers_in_flight": 4})
    base = MemoryModel(LLAMA3_8B, coefficients=with_overrides(NEUTRAL, {"layers_in_flight": 4}))
    m = MemoryModel(LLAMA3_8B, coefficients=k)
    extra = 4 * 100.0 * 14336 * 2  # layers in flight x rows x I*s
    for c, n in ((16, 16), (512, 4096), (2048, 8192)):
        assert m.prefill_chunk_bytes(c, n) - base.prefill_chunk_bytes(c, n) == pytest.approx(extra, abs=2)
    assert m.prefill_chunk_bytes(1, 4096) == base.prefill_chunk_bytes(1, 4096)  # a one-query forward
    assert m.decode_bytes([4096] * 4) == base.decode_bytes([4096] * 4)


# --- the forward's structure: its head apart from its layers, sliding windows -----------------------
def test_cpu_forwards_are_their_largest_stage_cuda_ones_the_sum():
    """On the CPU the runner waits for each stage of a forward before it queues the next
    (ModelRunner.stage_waits): a decode's layers, then its head; a prompt chunk's layers' attention, their
    MLP, its head. The transient is the largest stage's. On CUDA the head is launched while the layers run,
    and several layers' temporaries coexist: one stage, every term summed."""
    from engine.core.memory.coefficients import CUDA_OPS8_COEFFICIENTS, TransientTerms

    assert CPU_COEFFICIENTS.head_apart and CPU_COEFFICIENTS.phases_apart
    assert CPU_MLX_ATTENTION_COEFFICIENTS.head_apart and not CPU_MLX_ATTENTION_COEFFICIENTS.phases_apart
    assert not CUDA_COEFFICIENTS.head_apart and not CUDA_OPS8_COEFFICIENTS.phases_apart
    cpu, cuda = (MemoryModel(LLAMA3_8B, coefficients=k) for k in (CPU_COEFFICIENTS, CUDA_OPS8_COEFFICIENTS))
    for rows, n in ((1, 100), (4, 8192), (16, 2048)):
        layers, head = cpu.decode_phases([n] * rows, samples=1)
        assert head.decode_logits == rows * 4 * LLAMA3_8B.vocab_size and layers.decode_logits == 0
        assert cpu.decode_bytes([n] * rows, samples=1) == int(max(layers.bytes(CPU_COEFFICIENTS),
                                                                 head.bytes(CPU_COEFFICIENTS)))
        (one,) = cuda.decode_phases([n] * rows, samples=1)
        assert one.decode_logits and one.decode_gather
    projections, attention, mlp, head = cpu.chunk_phases(512, 4096)
    assert attention.prefill_scores and not attention.prefill_mlp and mlp.prefill_mlp and not mlp.prefill_scores
    assert projections.prefill_projection_hidden and not (projections.prefill_scores or projections.prefill_mlp)
    assert head.prefill_logits and head.prefill_head_rows and not head.prefill_mlp  # the sampled row's MLP
    assert cpu.prefill_chunk_bytes(512, 4096) == int(max(t.bytes(CPU_COEFFICIENTS)
                                                         for t in (projections, attention, mlp, head)))
    (one,) = MemoryModel(LLAMA3_8B, coefficients=NEUTRAL).chunk_phases(512, 4096)  # one stage, one layer
    together = attention + mlp + head
    assert one.prefill_hidden == together.prefill_hidden and one.prefill_attention_hidden == 0
    assert one.prefill_projection_hidden == one.prefill_head_rows == 0
    assert one.step_overhead_bytes == one.prefill_overhead_bytes == 1
    assert TransientTerms(prefill_mlp=2.0, fixed_bytes=5.0).bytes(CPU_COEFFICIENTS) == 2 * CPU_COEFFICIENTS.prefill_mlp + 5


def test_cpu_mixed_forward_is_one_forward_not_the_sum_of_two():
    """On the CPU a mixed forward runs in stages: the chunk's attention over T + B rows, then the rows'
    attention beside the layer's residual stream (mixed.py, MIXED_STREAM_ROWS), the MLP of the T + B
    rows, the head of the rows and the chunk's sampled position."""
    m = MemoryModel(LLAMA3_8B, mixed=True)
    chunk, rows = PrefillChunkPlan(128, 4096), [2000] * 4
    projections, attention, decode, mlp, head = m.mixed_phases(chunk, rows)
    alone = m.chunk_phases(132, 4096, False)
    assert (projections, attention, mlp) == alone[:3]
    assert decode.decode_gather == m.decode_attention_terms(rows, num_layers=1).decode_gather
    from engine.core.memory.model import MIXED_STREAM_ROWS

    assert decode.fixed_bytes == MIXED_STREAM_ROWS * 132 * 4096 * 2 and not decode.prefill_scores
    assert head.decode_logits == 5 * 4 * LLAMA3_8B.vocab_size
    mixed = m.mixed_bytes(chunk, rows)
    assert mixed == int(max(t.bytes(CPU_COEFFICIENTS) for t in (projections, attention, decode, mlp, head)))
    assert max(m.prefill_chunk_bytes(128, 4096), m.decode_bytes(rows)) <= mixed
    assert mixed < m.prefill_chunk_bytes(128, 4096) + m.decode_bytes(rows)


GEMMA3_LIKE = ModelShape(num_layers=12, hidden_size=1024, num_heads=8, num_kv_heads=4, head_dim=128,
                         intermediate_size=4096, vocab_size=32000, dtype_bytes=2, sliding_score_copies=1,
                         layer_windows=((512,) * 5 + (None,)) * 2)


def test_sliding_layers_count_the_keys_of_their_window():
    """Gemma 3's sliding layers read at most window - 1 + c keys of a row and only they hold its explicit
    mask's score copy: past the window the chunk's transient grows with the global layers' terms only,
    and is below what the same model with every layer global (and the copy over every key) would hold."""
    from engine.core.memory.coefficients import CUDA_OPS8_COEFFICIENTS

    everywhere = dataclasses.replace(GEMMA3_LIKE, layer_windows=(), sliding_score_copies=0, extra_score_copies=1)
    assert GEMMA3_LIKE.sliding_window == 512 and GEMMA3_LIKE.global_layers(7) == (1, 2)
    assert GEMMA3_LIKE.global_layers(1) == (0, 1) and everywhere.global_layers(7) == (7, 7)
    c, w, H = 256, 512, 8
    for coefficients in (CPU_COEFFICIENTS, CUDA_OPS8_COEFFICIENTS):
        windowed = MemoryModel(GEMMA3_LIKE, coefficients=coefficients)
        full = MemoryModel(everywhere, coefficients=coefficients)
        for n in (256, 600, 4096, 16384):
            assert windowed.prefill_chunk_bytes(c, n) <= full.prefill_chunk_bytes(c, n)
            assert windowed.decode_bytes([n] * 4) <= full.decode_bytes([n] * 4)
        # within the window both read every key; the copy is in the sliding layers in flight only (at
        # most 6 of 7 on CUDA: one layer in six is global; on the CPU the one layer may be a sliding one)
        m = windowed.layer_factor
        sliding = m - GEMMA3_LIKE.global_layers(m)[0]
        assert full.prefill_chunk_bytes(c, c) - windowed.prefill_chunk_bytes(c, c) == pytest.approx(
            (m - sliding) * 4 * H * c * c, abs=4)
    # one layer at a time, attention that holds no scores of its own (a fused one): the score copy is
    # over the window's keys whatever the context
    fused = dataclasses.replace(NEUTRAL, prefill_scores=0.0)
    one = MemoryModel(GEMMA3_LIKE, coefficients=fused)
    plain = MemoryModel(dataclasses.replace(GEMMA3_LIKE, sliding_score_copies=0), coefficients=fused)
    grow = one.prefill_chunk_bytes(c, 16384) - one.prefill_chunk_bytes(c, 4096)
    assert grow == pytest.approx(plain.prefill_chunk_bytes(c, 16384) - plain.prefill_chunk_bytes(c, 4096), abs=2)
    assert one.prefill_chunk_bytes(c, 4096) - plain.prefill_chunk_bytes(c, 4096) == pytest.approx(
        4 * H * c * (w - 1 + c), abs=2)
    # where the backend's attention materializes a copy anyway (MLX's CPU fallback), the family's copy is
    # that one, not one more
    cpu = MemoryModel(GEMMA3_LIKE, coefficients=CPU_MLX_ATTENTION_COEFFICIENTS)
    assert CPU_MLX_ATTENTION_COEFFICIENTS.prefill_scores < 1
    extra = cpu.prefill_chunk_bytes(c, 4096) - MemoryModel(dataclasses.replace(GEMMA3_LIKE, sliding_score_copies=0),
                                                           coefficients=CPU_MLX_ATTENTION_COEFFICIENTS).prefill_chunk_bytes(c, 4096)
    assert extra == pytest.approx((1 - CPU_MLX_ATTENTION_COEFFICIENTS.prefill_scores) * 4 * H * c * (w - 1 + c), abs=2)


def test_a_viewed_chunk_s_kv_copy_counts_for_its_last_query_or_for_every_chunk():
    """A chunk read as a view adds one copy of its row's K and V of one layer (2*n*H_kv*d*s) in its
    attention stage: only when it ends its prompt (`copies_viewed_kv`: the chunk loop's last query off the
    CPU), or every chunk (`copies_every_view`: cpu_math's attention, which copies the token-major view);
    a gathered chunk counts its gather instead, never the copy."""
    copy = 2 * 4096 * 8 * 128 * 2
    plain, last, every = (MemoryModel(LLAMA3_8B, coefficients=CPU_COEFFICIENTS, copies_viewed_kv=a,
                                      copies_every_view=b) for a, b in ((False, False), (True, False), (False, True)))

    def attention(model, logits, gathers=False):
        return model.chunk_phases(512, 4096, computes_logits=logits, gathers=gathers)[1].fixed_bytes

    assert attention(last, False) == attention(plain, False) and attention(last, True) == attention(plain, True) + copy
    assert attention(every, False) == attention(every, True) == attention(plain, False) + copy
    assert attention(every, True, gathers=True) == attention(plain, True, gathers=True)
    assert every.prefill_chunk_bytes(512, 4096, False, gathers=False) > plain.prefill_chunk_bytes(512, 4096, False,
                                                                                                  gathers=False)
