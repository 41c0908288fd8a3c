"""Paged decode attention (engine/model/kernels/paged_attention.py): the engine's one-query forwards reading the pool
through a block table instead of a gathered copy. The CUDA kernel runs only on a GPU
(scripts/bench_decode_attention.py checks it there against MLX's attention); here the engine takes
the same path with `ReferenceAttention`, so the table, lengths and mask-free views are checked on real
forwards, and so is which forwards take it: only the engine's own layer loops call it; models decoding
through mlx-lm's modules gather, and the memory model predicts the gather for them."""

from __future__ import annotations

import random

import pytest

from engine.model.kernels.paged_attention import ReferenceAttention, unsupported
from engine.model.runner import RunnerOptions
from engine.core.types import SamplingParams


class CountingReference(ReferenceAttention):
    def __init__(self, *args):
        super().__init__(*args)
        self.calls = 0
        self.batches = set()

    def __call__(self, queries, *args):
        self.calls += 1
        self.batches.add(queries.shape[0])
        return super().__call__(queries, *args)


def random_prompts(lengths, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("async_decode,packed", [(False, False), (True, False), (True, True)])
def test_paged_decode_greedy_equals_mlx_lm(make_engine, tiny_parts, reference_greedy, run_to_completion,
                                          async_decode, packed):
    """Rows of different lengths (one across a 256-token block boundary, one in non-consecutive
    blocks), decoded together through the block table: mlx-lm's greedy tokens; `packed`: the decode's
    host-made inputs as views of one array (KVPool.pack_step_inputs, CUDA's default)."""
    engine = make_engine(prefill_chunk_size=128, max_num_seqs=4, prefix_cache_fraction=0.0,
                         async_decode=async_decode)
    runner = engine.runner
    runner.pool.pack_step_inputs = packed
    impl = CountingReference(runner.pool.num_kv_heads, runner.pool.block_size)
    runner.use_paged_attention(impl)
    blocks = engine.kv.allocator  # the KV manager's: blocks held here are the engine's
    blocks.grow(4)
    held = [blocks.allocate(1) for _ in range(4)]
    blocks.free(held[0])
    blocks.free(held[2])  # the first request gets blocks 0 and 2
    prompts = random_prompts([250, 3, 40], engine.memory.shape.vocab_size, seed=5)
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)  # the first row crosses position 256
    engine.add_request("0", prompts[0], sampling)
    # the first request alone takes the free blocks 0 and 2 (and may finish its prompt in this step)
    early = {o.request_id: list(o.new_token_ids) for o in engine.step().outputs}
    assert runner.rows["0"].blocks == [0, 2]
    for i, p in enumerate(prompts[1:], 1):
        engine.add_request(str(i), p, sampling)
    tokens = run_to_completion(engine)
    for rid, ids in early.items():
        tokens[rid] = ids + tokens.get(rid, [])
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], prompt, 12)
    num_layers = engine.memory.shape.num_layers
    assert impl.calls >= 11 * num_layers and impl.calls % num_layers == 0
    assert 3 in impl.batches  # the three rows decoded in one forward


def test_prompt_chunks_still_read_views_or_gathers(make_engine):
    """Only one-query forwards are paged: a prompt chunk of several tokens never calls the kernel."""
    engine = make_engine(prefill_chunk_size=16, prefix_cache_fraction=0.0)
    impl = CountingReference(engine.runner.pool.num_kv_heads, engine.runner.pool.block_size)
    engine.runner.use_paged_attention(impl)
    engine.add_request("a", random_prompts([40], 49152)[0], SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert impl.calls == 0


def test_cpu_engine_gathers_by_default(make_engine):
    engine = make_engine()
    assert engine.runner.pool.paged is None and not engine.memory.paged_decode  # no CUDA here


def test_decodes_through_mlx_lm_modules_refuse_the_kernel(make_engine, tiny_parts):
    """mlx-lm's modules attend over what the cache returns: a runner whose decode runs them refuses a
    paged kernel, and one told to run them drops the kernel it had."""
    modules = make_engine(runner_options=RunnerOptions(layer_loops=False))
    assert modules.runner.decode_path is None
    with pytest.raises(ValueError, match="mlx-lm's modules"):
        modules.runner.use_paged_attention(ReferenceAttention(1, 256))
    assert not modules.runner.paged_attention
    loops = make_engine()
    loops.runner.use_paged_attention(ReferenceAttention(loops.runner.pool.num_kv_heads, 256))
    assert loops.runner.paged_attention
    loops.runner.use_decode_path(None)
    assert not loops.runner.paged_attention


def test_a_paged_view_refuses_mlx_lm_modules(tiny_parts):
    """A paged forward writes the pool and leaves reading to the layer loops' kernel call: through
    mlx-lm's cache protocol it would attend over the new keys alone, so it raises instead."""
    import mlx.core as mx

    from engine.model.forward_view import ForwardView
    from engine.model.kv_pool import Row
    from engine.model.runner import ModelRunner

    runner = ModelRunner(tiny_parts[0], block_size=4)
    runner.use_paged_attention(ReferenceAttention(runner.pool.num_kv_heads, 4))
    runner.grow_pool(4)
    row = Row([0, 1], 4, runner.pool.block_bytes)
    view = ForwardView(runner.pool, [row], 1)
    with pytest.raises(RuntimeError, match="layer loops"):
        runner._forward(mx.array([[5]]), view.layers())


def test_unsupported_shapes_are_named():
    import mlx.core as mx

    assert unsupported(32, 8, 128, 256, mx.bfloat16) is None
    assert "multiple of" in unsupported(30, 8, 128, 256, mx.bfloat16)
    assert "head_dim" in unsupported(32, 8, 100, 256, mx.bfloat16)
    assert "shared memory" in unsupported(64, 1, 128, 256, mx.bfloat16)


@pytest.mark.parametrize("packed", [False, True])
def test_batched_paged_decode_logits_equal_mlx_lm_per_row(tiny_parts, packed):
    """Two rows of different lengths, one in scattered 4-token blocks, decoded in one paged forward
    for several steps (crossing block boundaries): each row's logits equal mlx-lm's for it alone, the
    step's host-made inputs as arrays of their own or `packed` as views of one (`step_inputs`)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.core.blocks import BlockAllocator
    from engine.model.forward_view import ForwardView
    from engine.model.kv_pool import Row
    from engine.model.runner import ModelRunner

    model = tiny_parts[0]
    runner = ModelRunner(model, block_size=4, pack_step_inputs=packed)
    blocks = BlockAllocator(4, 32)  # the KV manager's part, here by hand
    impl = CountingReference(runner.pool.num_kv_heads, 4)
    runner.use_paged_attention(impl)
    runner.grow_pool(10)
    blocks.grow(10)
    singles = [blocks.allocate(1) for _ in range(10)]
    for s in singles[1::2]:
        blocks.free(s)
    rows = [Row(blocks.allocate(5), 4, runner.pool.block_bytes)]  # blocks 1 3 5 7 9
    runner.grow_pool(16)
    blocks.grow(16)
    rows.append(Row(blocks.allocate(3), 4, runner.pool.block_bytes))
    assert rows[0].blocks == [1, 3, 5, 7, 9]
    prompts = random_prompts([13, 6], 49152, seed=9)
    caches = [make_prompt_cache(model) for _ in rows]
    for row, prompt, cache in zip(rows, prompts, caches):
        view = ForwardView(runner.pool, [row], len(prompt))
        mx.eval(runner._forward(mx.array(prompt)[None], view.layers()))
        view.advance()
        model(mx.array(prompt)[None], cache=cache)
    for step in range(5):  # row 0: positions 13..17 (blocks 3 and 4), row 1: 6..10
        tokens = [100 + step, 200 + step]
        view = ForwardView(runner.pool, rows, 1)
        assert view.reads_paged and view.mask is None
        assert view.rope_offsets().tolist() == [13 + step, 6 + step]
        got = runner._head(runner._decode_forward(mx.array(tokens)[:, None], view))  # [2, 1, V]
        view.advance()
        for b, cache in enumerate(caches):
            want = model(mx.array([[tokens[b]]]), cache=cache)
            assert mx.allclose(got[b], want[0], atol=1e-4, rtol=1e-4).item()
    assert impl.calls == 5 * runner.num_layers


def test_self_check_passes_the_reference_and_fails_a_wrong_kernel():
    import mlx.core as mx

    from engine.model.kernels.paged_attention import self_check

    self_check(ReferenceAttention(2, 256), num_heads=4, head_dim=64, dtype=mx.float32)

    class Wrong(ReferenceAttention):
        def __call__(self, queries, *args):
            return mx.zeros_like(queries)

    with pytest.raises(RuntimeError, match="differs from the reference"):
        self_check(Wrong(2, 256), num_heads=4, head_dim=64, dtype=mx.float32)


@pytest.mark.parametrize("works", ["mma", "tiled", "span", "none"])
def test_runner_uses_the_kernel_only_if_it_passes_its_self_check(tiny_parts, monkeypatch, caplog, works):
    """The tensor-core kernel if it passes its self-check, else the tiled one, else the span one, else none."""
    import engine.model.kernels.paged_attention as kernels_module
    from engine.model.runner import ModelRunner

    order = ["mma", "tiled", "span"]

    class FakeKernel(ReferenceAttention):  # stands for the CUDA kernel on this CPU
        spans = False  # self_check runs it alone (not at every span length, as the CUDA kernel)

        def __init__(self, num_kv_heads, block_size, tiled=True, mma=True):
            super().__init__(num_kv_heads, block_size)
            self.tiled, self.mma = tiled, mma

        def kind(self, head_dim, dtype, num_rep):
            return "mma" if self.mma else "tiled" if self.tiled else "span"

        def __call__(self, queries, *args):
            out = super().__call__(queries, *args)
            kind = self.kind(0, None, 0)
            ok = works != "none" and order.index(kind) >= order.index(works)
            return out if ok else out + 1.0

    monkeypatch.setattr(kernels_module, "CudaPagedAttention", FakeKernel)
    runner = ModelRunner(tiny_parts[0], paged_attention=True)
    if works != "none":
        assert isinstance(runner.pool.paged, FakeKernel) and runner.attention_kernel == works
        untiled = ModelRunner(tiny_parts[0], paged_attention=True, tiled_attention=False, mma_attention=False)
        assert isinstance(untiled.pool.paged, FakeKernel) and untiled.attention_kernel == "span"  # as asked
        no_mma = ModelRunner(tiny_parts[0], paged_attention=True, mma_attention=False)
        assert no_mma.attention_kernel == ("tiled" if works != "span" else "span")
    else:
        assert runner.pool.paged is None and runner.attention_kernel == ""
        assert "paged decode attention not used" in caplog.text and "differs" in caplog.text
    assert ModelRunner(tiny_parts[0]).pool.paged is None  # not asked for (the engine asks on CUDA only)
    # decodes through mlx-lm's modules: never asked of the kernel, whatever the backend
    assert ModelRunner(tiny_parts[0], paged_attention=True, layer_loops=False).pool.paged is None


def test_engine_on_a_paged_backend_sizes_its_budget_with_the_paged_decode_term(make_engine, tiny_parts,
                                                                                reference_greedy, run_to_completion,
                                                                                monkeypatch):
    """What the engine does where MLX runs on CUDA, with the CPU standing in: the runner is built first,
    its decode is paged (here `ReferenceAttention` in the kernel's place), so the memory model counts
    paged decodes (the ops-8 CUDA set is fitted on them), the forwards' bound is smaller than with
    gathering decodes and the KV budget no smaller; decode is still mlx-lm's greedy."""
    import engine.backend as backend_module
    import engine.model.kernels.paged_attention as kernels_module

    monkeypatch.setattr(backend_module, "mlx_backend", lambda: "cuda")  # max_ops_per_buffer: 8 there
    monkeypatch.setattr(kernels_module, "CudaPagedAttention", lambda kv_heads, block, **kinds: ReferenceAttention(
        kv_heads, block))
    monkeypatch.setattr(kernels_module, "self_check", lambda *args: None)
    # small chunks, many long rows: the decode term decides the bound
    paged = make_engine(max_num_seqs=16, max_model_len=2048, prefill_chunk_size=16, prefix_cache_fraction=0.0)
    gathering = make_engine(max_num_seqs=16, max_model_len=2048, prefill_chunk_size=16, prefix_cache_fraction=0.0,
                            execution={"paged_attention": False})
    assert paged.runner.paged_attention and paged.memory.paged_decode
    assert paged.execution_paths().attention_kernel == "reference"  # what stands in for the kernel here
    assert not gathering.runner.paged_attention and not gathering.memory.paged_decode
    assert gathering.execution_paths().attention_kernel == ""
    # on CUDA whole short prompts pack by default (ExecutionConfig.max_packed_tokens), resolved in its config
    assert paged.memory.max_packed_tokens == 16384 == paged.config.execution.max_packed_tokens
    assert paged.memory.coefficients.decode_paged is not None  # the ops-8 CUDA set
    assert paged.memory.decode_bytes([2048] * 16) < gathering.memory.decode_bytes([2048] * 16) / 4
    forwards = [e.memory.transient_bound_bytes(16, 16, 2048) for e in (paged, gathering)]
    assert forwards[0] < forwards[1]  # (here a full pool's growth copy is the larger bound for both)
    assert paged.stats().kv_budget_bytes >= gathering.stats().kv_budget_bytes
    assert paged.kv.allocator.max_blocks * 256 * paged.memory.kv_bytes_per_token <= paged.stats().kv_budget_bytes
    prompt = random_prompts([40], paged.memory.shape.vocab_size, seed=11)[0]
    paged.add_request("a", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    assert run_to_completion(paged)["a"] == reference_greedy(tiny_parts[0], prompt, 6)
    # a model decoding through mlx-lm's modules gathers there, and the memory model predicts the gather
    modules = make_engine(max_num_seqs=16, max_model_len=2048, prefill_chunk_size=16, prefix_cache_fraction=0.0,
                          runner_options=RunnerOptions(layer_loops=False))
    assert not modules.runner.paged_attention and not modules.memory.paged_decode


def test_the_coefficient_set_follows_max_ops_per_buffer_not_the_environment(make_engine, monkeypatch):
    """On CUDA (the CPU standing in) the memory model's set follows execution.max_ops_per_buffer: the
    ops-8 set by default, the default-MLX set for larger batches, whatever the environment holds."""
    import engine.backend as backend_module

    monkeypatch.setattr(backend_module, "mlx_backend", lambda: "cuda")
    monkeypatch.setenv("MLX_MAX_OPS_PER_BUFFER", "64")
    assert make_engine().memory_coefficients_source == "cuda-ops8 set"
    monkeypatch.delenv("MLX_MAX_OPS_PER_BUFFER")
    assert make_engine(execution={"max_ops_per_buffer": 64}).memory_coefficients_source == "cuda set"


def test_cuda_kernel_call_arguments_per_shape():
    """CudaPagedAttention builds its two kernels' arguments once per call shape (the layers of a forward
    share them): a call passes its arrays with the planned scale and span inputs, the launch grid covers
    every (row, KV head, span), and a new batch or block count gets its own plan; where every row fits
    one span the span kernel's direct variant writes the output alone. The kernels themselves
    run only on a GPU: recorders stand in for them (the object is made without its CUDA constructor)."""
    import mlx.core as mx

    from engine.model.kernels import mma_attention, split_attention
    from engine.model.kernels.paged_attention import CudaPagedAttention

    calls = []

    def recorder(name):
        def kernel(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            calls.append((name, inputs, dict(template), grid, threadgroup, output_shapes, output_dtypes))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        return kernel

    attn = CudaPagedAttention.__new__(CudaPagedAttention)
    attn.num_kv_heads, attn.block_size, attn.keys_per_partial, attn.threads = 8, 256, 64, 128
    attn.spans, attn.keys_per_span, attn.tiled, attn.mma = True, None, True, True
    attn.span_loads, attn.span_threads = split_attention.SPAN_LOADS, split_attention.SPAN_THREADS
    attn._scales, attn._spans, attn._calls = {}, {}, {}
    attn._partial, attn._span_partial = recorder("partial"), recorder("span")
    attn._tiled_partial, attn._combine = recorder("tiled"), recorder("combine")
    attn._mma_partial = recorder("mma")
    attn._direct = {attn._span_partial: recorder("span_direct"), attn._tiled_partial: recorder("tiled_direct"),
                    attn._mma_partial: recorder("mma_direct")}
    threads = mma_attention.THREADS  # bf16, groups of 4, D = 128: the tensor-core kernel
    table, lengths = mx.zeros((64, 3), mx.int32), mx.full((64,), 600, mx.int32)
    k_pool = v_pool = mx.zeros((4, 128), mx.bfloat16)
    for _ in range(3):  # three layers of one forward
        q = mx.zeros((64, 32, 1, 128), mx.bfloat16)
        out = attn(q, k_pool, v_pool, table, lengths, 0.0884)
        assert out.shape == (64, 32, 1, 128) and out.dtype == mx.bfloat16
    # 64 rows of 3 blocks: one span a row, so the tensor-core kernel writes the output (no combine)
    ch = split_attention.span_keys(64, 8, 3 * 256, blocks_per_sm=mma_attention.BLOCKS_PER_SM)
    assert ch >= 3 * 256
    assert len(attn._calls) == 1 and [c[0] for c in calls] == ["mma_direct"] * 3
    name, inputs, template, grid, threadgroup, shapes, dtypes = calls[0]
    assert inputs[3] is table and inputs[4] is lengths and inputs[5][0].item() == pytest.approx(0.0884)
    assert inputs[6][0].item() == ch and template == {"T": mx.bfloat16, "D": 128, "NREP": 4, "HKV": 8, "BLOCK": 256,
                                                   "THREADS": threads}
    assert grid == (64 * 8 * threads, 1, 1) and threadgroup == (threads, 1, 1)
    assert shapes == [(64, 32, 1, 128)] and dtypes == [mx.bfloat16]
    attn(mx.zeros((16, 32, 1, 128), mx.bfloat16), k_pool, v_pool, mx.zeros((16, 9), mx.int32),
         mx.full((16,), 2200, mx.int32), 0.0884)  # another batch: its own plan, its own span
    ch16 = split_attention.span_keys(16, 8, 9 * 256, blocks_per_sm=mma_attention.BLOCKS_PER_SM)
    spans = -(-9 * 256 // ch16)
    assert spans > 1 and len(attn._calls) == 2 and [c[0] for c in calls[-2:]] == ["mma", "combine"]
    assert calls[-2][1][6][0].item() == ch16 and calls[-2][3] == (16 * 8 * spans * threads, 1, 1)
    assert calls[-2][5] == [(16, 8, spans, 4, 128), (16, 8, spans, 4, 2)] and calls[-2][6] == [mx.float32] * 2
    assert calls[-1][3] == (16 * 32 * 128, 1, 1) and calls[-1][5] == [(16, 32, 1, 128)]
    # float16 KV (no bf16 tensor-core path here): the tiled kernel, 128 threads a block
    attn(mx.zeros((16, 32, 1, 128), mx.float16), k_pool.astype(mx.float16), v_pool.astype(mx.float16),
         mx.zeros((16, 9), mx.int32), mx.full((16,), 2200, mx.int32), 0.0884)
    assert calls[-2][0] == "tiled" and calls[-2][2]["THREADS"] == 128 and calls[-2][4] == (128, 1, 1)
    assert attn.kind(256, mx.bfloat16, 2) == "tiled" and attn.kind(128, mx.bfloat16, 16) == "span"


def test_direct_span_kernel_source():
    """split_attention.direct turns each span kernel (span, tiled, tensor-core) into one writing the
    output: the partial and statistics writes and the empty-span path are gone, the merge's quotient is
    the output, and a source without them is refused."""
    from engine.model.kernels import mma_attention, split_attention

    for source in (split_attention.SPAN_PARTIAL, split_attention.TILED_PARTIAL, mma_attention.PARTIAL):
        got = split_attention.direct(source)
        assert "part_out" not in got and "stats_out" not in got and "pa_empty_span" not in got
        assert got.count("out_row[i] = static_cast<T>(A / L);") == 1
        assert got.count("T* out_row = out + (size_t)g * NREP * D;") == 1
    with pytest.raises(ValueError, match="span kernel"):
        split_attention.direct("  out[0] = 0;")


def test_direct_kernels_pair_with_their_span_kernels(monkeypatch):
    """Each span kernel's direct variant is made from that kernel's own source and header (the
    constructor's pairing; MLX's kernel factory recorded here, the CPU build has no CUDA kernels)."""
    import mlx.core as mx

    from engine.model.kernels import mma_attention, split_attention
    from engine.model.kernels.paged_attention import CudaPagedAttention

    class Made:
        def __init__(self, **spec):
            self.spec = spec

    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **spec: Made(**spec))
    attn = CudaPagedAttention(8, 256)
    pairs = ((attn._span_partial, split_attention.SPAN_PARTIAL), (attn._tiled_partial, split_attention.TILED_PARTIAL),
             (attn._mma_partial, mma_attention.PARTIAL))
    assert len(attn._direct) == 3
    for kernel, source in pairs:
        direct = attn._direct[kernel].spec
        assert kernel.spec["source"] == source and direct["source"] == split_attention.direct(source)
        assert direct["header"] == kernel.spec["header"] and direct["output_names"] == ["out"]
        assert direct["input_names"] == kernel.spec["input_names"]


def test_step_inputs_are_views_of_one_array_with_each_inputs_values():
    """forward_view.step_inputs: each part's values and shape, int32, None kept in its place."""
    import mlx.core as mx
    import numpy as np

    from engine.model.forward_view import step_inputs

    parts = [np.arange(6, dtype=np.int64), None, np.array([[3, 4, 5], [6, 7, 8]]), np.array([9], np.int32)]
    made = step_inputs(parts)
    assert made[1] is None
    for got, want in zip(made, parts):
        if want is not None:
            assert got.dtype == mx.int32 and got.shape == want.shape and got.tolist() == want.tolist()
