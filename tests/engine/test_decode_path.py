"""engine/model/layers/decode_path.py: the engine's own decode layer loop. Here it runs with `ReferenceOps`
(MLX operations) and `ReferenceAttention` in the paged kernel's place, so the loop itself (add + norm
order, RoPE offsets per row, the pool writes, the final norm) is checked on real forwards against
mlx-lm."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from engine.model.layers.decode_path import DecodePath, unsupported
from engine.model.layers.ops import ReferenceOps
from engine.model.kernels.paged_attention import ReferenceAttention
from engine.core.types import SamplingParams
from tests.engine.stand_ins import OrderedReferenceAttention, PoolWritingRope


class CountingOps(ReferenceOps):
    def __init__(self):
        super().__init__()
        self.calls = {"rope_qkv": 0, "add_rms_norm": 0}

    def rope_qkv(self, *args):
        self.calls["rope_qkv"] += 1
        return super().rope_qkv(*args)

    def add_rms_norm(self, *args):
        self.calls["add_rms_norm"] += 1
        return super().add_rms_norm(*args)


def prompts_of(lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def serve_capturing_logits(engine, run_to_completion, seed: int):
    """Three prompts (70, 5 and 300 tokens, 10 / 4 / 10 new tokens: batches of 3 rows, then 2) served to
    the end -> (prompts, greedy tokens by request id, the logits of every decode of several rows)."""
    runner = engine.runner
    prompts = prompts_of([70, 5, 300], engine.memory.shape.vocab_size, seed=seed)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=[10, 4, 10][i], ignore_eos=True))
    captured = []
    head = runner._head
    runner._head = lambda h: captured.append(head(h)) or captured[-1]
    tokens = run_to_completion(engine)
    return prompts, tokens, [c for c in captured if c.shape[0] > 1]


@pytest.mark.parametrize("async_decode", [False, True])
def test_decode_path_greedy_equals_mlx_lm(make_engine, tiny_parts, reference_greedy, run_to_completion,
                                         async_decode):
    engine = make_engine(prefill_chunk_size=128, max_num_seqs=4, prefix_cache_fraction=0.0,
                         async_decode=async_decode)
    runner = engine.runner
    runner.use_paged_attention(ReferenceAttention(runner.pool.num_kv_heads, runner.pool.block_size))
    ops = CountingOps()
    runner.use_decode_path(ops)
    prompts = prompts_of([250, 3, 40], engine.memory.shape.vocab_size, seed=7)
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)  # the first row crosses position 256
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sampling)
    tokens = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], prompt, 12)
    layers = engine.memory.shape.num_layers
    assert ops.calls["rope_qkv"] >= 11 * layers and ops.calls["rope_qkv"] % layers == 0
    assert ops.calls["add_rms_norm"] == 2 * ops.calls["rope_qkv"]  # two per layer, none left to mlx-lm


def test_decode_path_logits_equal_mlx_lm_modules(make_engine):
    """Per-row logits of one batched decode: the loop against mlx-lm's modules on the same pool."""
    def logits_after(use_path: bool):
        engine = make_engine(prefill_chunk_size=64, prefix_cache_fraction=0.0, async_decode=False)
        runner = engine.runner
        runner.use_paged_attention(ReferenceAttention(runner.pool.num_kv_heads, runner.pool.block_size))
        runner.use_decode_path(ReferenceOps() if use_path else None)
        for i, p in enumerate(prompts_of([70, 5, 300], engine.memory.shape.vocab_size, seed=3)):
            engine.add_request(str(i), p, SamplingParams(max_tokens=12, ignore_eos=True))
        captured = []
        head = runner._head
        runner._head = lambda h: captured.append(head(h)) or captured[-1]
        while engine.has_unfinished():
            engine.step()
        return [c for c in captured if c.shape[0] == 3]

    with_path, without = logits_after(True), logits_after(False)
    assert with_path and len(with_path) == len(without)
    for a, b in zip(with_path, without):
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()


def test_unsupported_models_and_missing_preconditions(make_engine):
    engine = make_engine()
    assert unsupported(engine.model) is None  # the tiny llama, fused by the engine's runner
    with pytest.raises(ValueError, match="decode path"):
        DecodePath(type("M", (), {"model": None})(), ReferenceOps())
    attention = engine.model.model.layers[0].self_attn
    rope = attention.rope
    attention.rope = nn.Identity()  # not one of mlx-lm's RoPE modules
    try:
        assert "rotary embedding" in unsupported(engine.model)
    finally:
        attention.rope = rope


def test_cpu_decode_runs_the_gathering_loop(make_engine):
    """On the CPU the engine's decode runs the layer loop over gathered KV with
    engine/model/layers/cpu_math.py's attention and SwiGLU, its layers not compiled."""
    engine = make_engine()
    path = engine.runner.decode_path
    assert path is not None and type(path.ops) is ReferenceOps and path.ops.cpu_math
    assert not engine.runner.paged_attention and path.compiled is None


def test_compiled_layers_give_the_same_logits_and_greedy_tokens(make_engine, tiny_parts, reference_greedy,
                                                                run_to_completion):
    """CompiledLayers (mx.compile of each layer's work around the KV write and attention) against the
    Python-built loop: bitwise the same logits of every batched decode, mlx-lm's greedy tokens, and one
    trace per batch size for all layers."""
    def run(compiled: bool):
        engine = make_engine(prefill_chunk_size=64, max_num_seqs=4, prefix_cache_fraction=0.0)
        runner = engine.runner
        runner.use_paged_attention(ReferenceAttention(runner.pool.num_kv_heads, runner.pool.block_size))
        runner.use_decode_path(ReferenceOps(), compiled=compiled)
        assert (runner.decode_path.compiled is not None) == compiled
        return serve_capturing_logits(engine, run_to_completion, seed=11)

    prompts, tokens, logits = run(True)
    _, plain_tokens, plain_logits = run(False)
    assert tokens == plain_tokens
    assert {c.shape[0] for c in logits} == {2, 3} and len(logits) == len(plain_logits)
    for a, b in zip(logits, plain_logits):
        assert mx.array_equal(a, b).item()
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], prompt, [10, 4, 10][i])


def test_compiled_layers_trace_each_layer_structure_once(random_llama):
    """Layers of one structure share a compiled trace; a layer whose norm epsilon differs (a structure of
    its own) gets its own, and the decode's hidden states stay those of the Python-built loop."""
    from engine.model.layers.bound import BoundModel
    from engine.model.forward_view import ForwardView
    from engine.model.kv_pool import Row
    from engine.model.runner import ModelRunner

    model, _ = random_llama(hidden_size=64, intermediate_size=128, vocab_size=256, num_hidden_layers=4)
    runner = ModelRunner(model, block_size=4)  # fuses q/k/v and gate/up
    assert len(DecodePath(model, ReferenceOps(), compiled=True).compiled._traces) == 2  # the middle layers', the last's
    norm = model.model.layers[1].post_attention_layernorm
    eps = norm.eps
    norm.eps = eps * 2
    try:
        bound = BoundModel(model)
    finally:
        norm.eps = eps
    compiled = DecodePath(model, ReferenceOps(), compiled=True, bound_model=bound)
    assert len(compiled.compiled._traces) == 3
    runner.grow_pool(4)
    outs = []
    for path in (compiled, DecodePath(model, ReferenceOps(), bound_model=bound)):
        row = Row([0, 1], 4, runner.pool.block_bytes)
        row.offset = 5
        outs.append(path.forward(mx.array([[7]]), ForwardView(runner.pool, [row], 1)))
    assert mx.array_equal(outs[0], outs[1]).item()


@pytest.mark.parametrize("compiled", [False, True])
def test_residual_matmul_gives_mlx_lm_greedy_tokens(make_engine, tiny_parts, reference_greedy, run_to_completion,
                                                    compiled):
    """ReferenceOps.residual_matmul (RunnerOptions.fused_residual, CUDA's default): o's and down's products
    added to the residual stream inside their matmuls (mx.addmm), no separate residual add in any decode
    layer of several rows (one row keeps the plain matmul and add); the logits of every batched decode
    within float32 rounding of the plain loop's, and mlx-lm's greedy tokens, with the layers compiled (the
    trace built with it) and not."""
    def run(fused: bool):
        engine = make_engine(prefill_chunk_size=64, max_num_seqs=4, prefix_cache_fraction=0.0)
        runner = engine.runner
        runner.use_paged_attention(ReferenceAttention(runner.pool.num_kv_heads, runner.pool.block_size))
        ops = ReferenceOps() if compiled else CountingOps()  # CompiledLayers takes ReferenceOps itself only
        ops.residual_matmul = fused
        runner.use_decode_path(ops, compiled=compiled)
        assert (runner.decode_path.compiled is not None) == compiled
        return (*serve_capturing_logits(engine, run_to_completion, seed=5),
                getattr(ops, "calls", {}).get("add_rms_norm"))

    prompts, tokens, logits, adds = run(True)
    _, plain_tokens, plain_logits, plain_adds = run(False)
    if not compiled:
        assert adds == 0 and plain_adds > 0
    assert tokens == plain_tokens and {c.shape[0] for c in logits} == {2, 3} and len(logits) == len(plain_logits)
    for a, b in zip(logits, plain_logits):
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], prompt, [10, 4, 10][i])


def test_residual_matmul_builds_one_matmul_per_branch():
    """The residual matmul's graph: the layer's block end over 2 rows has one AddMM per branch and no
    residual add, and its output is the plain block end's within float32 rounding; over one row it keeps
    the plain matmul and add (MLX's one-row gemv)."""
    from engine.model.layers import bound
    from engine.model.layers.fused import fuse_projections
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256)
    model = llama.Model(args)
    mx.eval(model.parameters())
    fuse_projections(model)
    ops, plain = ReferenceOps(), ReferenceOps()
    ops.residual_matmul = True
    fused_path, plain_path = DecodePath(model, ops), DecodePath(model, plain)
    layer = fused_path.layers[0]
    for rows, addmms in ((2, 2), (1, 0)):
        h = mx.random.normal((rows, 1, 64), key=mx.random.key(1))
        out = mx.random.normal((rows, 4, 1, 16), key=mx.random.key(2))
        mx.eval(h, out)
        got = fused_path.block_end(layer, h, out, fused_path.next_norm(0))
        want = plain_path.block_end(layer, h, out, plain_path.next_norm(0))
        # (on the CPU an RMSNorm's graph has an Add of its own, its eps)
        assert _count_primitives(got[0], "AddMM") == addmms and _count_primitives(want[0], "AddMM") == 0
        assert _count_primitives(want[0], "Add") - _count_primitives(got[0], "Add") == addmms
        for a, b in zip(got, want):
            assert mx.allclose(a, b, atol=1e-5, rtol=1e-5).item()


def _count_primitives(out: mx.array, name: str) -> int:
    """How many operations named `name` the (unevaluated) graph of `out` holds (MLX's DOT export)."""
    import io

    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    return dot.getvalue().count(f'[label ="{name}"')


def test_residual_matmul_keeps_the_plain_add_where_the_block_needs_it(random_llama):
    """A clipped residual add (gemma3_text in float16), a biased projection, Gemma's normed branches or a
    sparse MLP keep the block's own add; a runner asked for the residual matmul takes it only where some
    decode layer does (not Gemma 3's, every branch normed)."""
    import copy

    from mlx_lm.models import gemma3_text

    from engine.model.layers import bound
    from engine.model.layers.decode_path import _plain_add, fuses_attention_residual, fuses_mlp_residual
    from engine.model.runner import ModelRunner
    from tests.engine.family_checkpoints import family_config

    model, _ = random_llama(hidden_size=64, intermediate_size=128, vocab_size=256, num_hidden_layers=2)
    runner = ModelRunner(model, block_size=4, fused_residual=True)  # fuses q/k/v and gate/up
    assert runner.ops.residual_matmul and not ModelRunner(model, block_size=4).ops.residual_matmul
    layer = runner.decode_path.layers[0]
    assert fuses_attention_residual(layer) and fuses_mlp_residual(layer) and _plain_add(layer, layer.o)
    assert not _plain_add(layer, bound.Projection.of(layer.o.weight_t, mx.zeros((64,))))
    clipped = copy.copy(layer)
    clipped.add = lambda x, y: x + y
    assert not fuses_attention_residual(clipped) and not fuses_mlp_residual(clipped)
    sandwich = copy.copy(layer)
    sandwich.attn_out_norm = sandwich.mlp_out_norm = (layer.post_w, layer.post_eps)
    assert not fuses_attention_residual(sandwich) and not fuses_mlp_residual(sandwich)
    sparse = copy.copy(layer)
    sparse.moe = object()
    assert fuses_attention_residual(sparse) and not fuses_mlp_residual(sparse)
    gemma = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(family_config("gemma3_text")))
    mx.eval(gemma.parameters())
    gemma_runner = ModelRunner(gemma, block_size=4, fused_residual=True)
    assert gemma_runner.decode_path is not None and not gemma_runner.ops.residual_matmul


def test_an_engine_with_the_residual_matmul_predicts_fused_decodes(make_engine, monkeypatch):
    """Fewer operations a decode layer: an engine whose runner adds the residual inside the matmuls builds
    its memory model with the fused decode's layers in flight, as with the fused q/k rope kernel."""
    from engine.engine import Engine

    plain = make_engine(max_num_seqs=2)
    assert not plain.memory.fused_decode and plain.execution_paths().fused_residual is False
    build = Engine._build_runner

    def with_residual_matmul(*args, **kwargs):
        runner = build(*args, **kwargs)
        runner.ops.residual_matmul = True
        return runner

    monkeypatch.setattr(Engine, "_build_runner", staticmethod(with_residual_matmul))
    fused = make_engine(max_num_seqs=2)
    assert fused.memory.fused_decode and fused.execution_paths().fused_residual
    assert fused.memory.decode_layer_factor > plain.memory.decode_layer_factor


@pytest.mark.parametrize("compiled", [False, True])
def test_rope_writing_the_pool_gives_the_scattering_loops_logits(make_engine, tiny_parts, reference_greedy,
                                                                  run_to_completion, compiled):
    """ReferenceOps.rope_writes_kv (RunnerOptions.rope_writes_kv, CUDA's default): a paged decode's keys and
    values go into the pool from the rope kernel (`DecodePath.rope_write`; here a stand-in), the compiled
    traces ending at the q/k/v product; every batched decode's logits equal the scattering loop's bitwise,
    and the greedy tokens are mlx-lm's, compiled and not."""
    def run(into_pool: bool):
        engine = make_engine(prefill_chunk_size=64, max_num_seqs=4, prefix_cache_fraction=0.0)
        runner = engine.runner
        runner.use_paged_attention(OrderedReferenceAttention(runner.pool.num_kv_heads, runner.pool.block_size))
        ops = ReferenceOps()
        ops.qk_rope, ops.rope_writes_kv = PoolWritingRope(), into_pool
        runner.use_decode_path(ops, compiled=compiled)
        return (*serve_capturing_logits(engine, run_to_completion, seed=13), ops.qk_rope.into_pool)

    prompts, tokens, logits, writes = run(True)
    _, plain_tokens, plain_logits, plain_writes = run(False)
    layers = len(tiny_parts[0].model.layers)
    assert plain_writes == 0 and writes >= 5 * layers and writes % layers == 0  # (mixed steps scatter)
    assert tokens == plain_tokens and {c.shape[0] for c in logits} == {2, 3} and len(logits) == len(plain_logits)
    for a, b in zip(logits, plain_logits):
        assert mx.array_equal(a, b).item()
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], prompt, [10, 4, 10][i])


def test_decodes_launched_ahead_give_the_same_logits(make_engine, tiny_parts, reference_greedy, run_to_completion):
    """StepOptions.launch_ahead: with the launch thread and a decode writing the pool in place (the
    stand-ins), each pipelined decode is encoded before the one before it ends, its tokens read from their
    copy; every batched decode's logits equal those launched one after another bitwise, the greedy tokens
    are mlx-lm's, and every pipelined step, predicted as both decodes, is within its prediction (in a run
    that keeps no logits: the capture's are alive past their step, where the measure counts them)."""
    def engine_with_stand_ins(ahead: bool):
        engine = make_engine(prefill_chunk_size=64, max_num_seqs=4, prefix_cache_fraction=0.0,
                             launch_thread=True, launch_ahead=ahead)
        runner = engine.runner
        runner.use_paged_attention(OrderedReferenceAttention(runner.pool.num_kv_heads, runner.pool.block_size))
        ops = ReferenceOps()
        ops.qk_rope, ops.rope_writes_kv = PoolWritingRope(), True
        runner.use_decode_path(ops)
        assert engine.execution_paths().launch_ahead == ahead
        return engine

    def run(ahead: bool):
        engine = engine_with_stand_ins(ahead)
        return (*serve_capturing_logits(engine, run_to_completion, seed=17), engine.executor.pipeline.num_ahead_launches)

    prompts, tokens, logits, ahead = run(True)
    _, plain_tokens, plain_logits, plain_ahead = run(False)
    assert plain_ahead == 0 and ahead >= 8
    assert tokens == plain_tokens and len(logits) == len(plain_logits)
    for a, b in zip(logits, plain_logits):
        assert mx.array_equal(a, b).item()
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], prompt, [10, 4, 10][i])

    engine, memories, uncaptured = engine_with_stand_ins(True), [], {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=[10, 4, 10][i], ignore_eos=True))
    while engine.has_unfinished():
        record = engine.step()
        memories += [record.memory] if record.memory is not None and record.memory.pipelined else []
        for out in record.outputs:
            uncaptured.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert uncaptured == tokens and engine.executor.pipeline.num_ahead_launches == ahead
    assert len([m for m in memories if m.other_predicted_bytes]) >= ahead - 1
    assert all(m.measured_bytes <= m.predicted_bytes for m in memories)


def test_rope_writes_the_pool_only_where_the_attention_reads_after_the_queries(make_engine):
    """An attention that reads the pool with MLX operations (ReferenceAttention's gather) has no order
    after a kernel writing the pool in place: the decode then scatters its KV."""
    from engine.model.forward_view import ForwardView
    from engine.model.kv_pool import Row

    engine = make_engine(prefill_chunk_size=64, max_num_seqs=4, prefix_cache_fraction=0.0)
    runner = engine.runner
    ops = ReferenceOps()
    ops.qk_rope, ops.rope_writes_kv = PoolWritingRope(), True
    runner.use_decode_path(ops)
    runner.grow_pool(2)
    row = Row([0], runner.pool.block_size, runner.pool.block_bytes)
    row.offset = 3
    for attention, writes in ((ReferenceAttention, False), (OrderedReferenceAttention, True)):
        runner.use_paged_attention(attention(runner.pool.num_kv_heads, runner.pool.block_size))
        assert runner.decode_path.rope_into_pool(ForwardView(runner.pool, [row], 1)) == writes
