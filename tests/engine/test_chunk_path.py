"""engine/model/layers/chunk_path.py and engine/model/layers/bound.py: prompt chunks through the engine's own layer loop over bound
weights compute what mlx-lm's modules compute (real MLX forwards of the tiny llama)."""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.core.types import SamplingParams
from engine.model.runner import RunnerOptions


def random_prompt(length, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, 49152) for _ in range(length)]


def run_chunks(runner, row, chunks, read_slices, sample_last):
    """Run the row's chunks through `runner.prefill`'s path (the chunk loop, or mlx-lm's modules if the
    runner has none); the last one samples if `sample_last`. Returns its final hidden state [1, 1, D]."""
    from engine.model.forward_view import ForwardView

    hidden = None
    for i, chunk in enumerate(chunks):
        view = ForwardView(runner.pool, [row], len(chunk), read_slices=read_slices)
        tokens = mx.array(chunk)[None]
        sample = sample_last and i == len(chunks) - 1
        if runner.chunk_path is not None:
            hidden = runner.chunk_path.forward(tokens, view, sample)
        else:
            hidden = runner._forward(tokens, view.layers())[:, -1:]
        mx.eval(runner.pool.keys, runner.pool.values, *([hidden] if sample else []))
        view.advance()
    return hidden


@pytest.mark.parametrize("read_slices", [True, False])
def test_the_chunk_loop_gives_mlx_lm_logits_and_writes_the_same_kv(tiny_parts, read_slices):
    """Three chunks (two that sample nothing, then one that samples): the last position's logits equal
    mlx-lm's for the whole prompt, and every layer's keys and values equal those mlx-lm's modules wrote
    through the same pool."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.model.kv_pool import Row
    from engine.model.runner import ModelRunner

    model = tiny_parts[0]
    loop = ModelRunner(model, block_size=4)
    modules = ModelRunner(model, block_size=4, layer_loops=False)
    assert loop.chunk_path is not None and modules.chunk_path is None
    prompt = random_prompt(19, seed=5)
    chunks = [prompt[:6], prompt[6:13], prompt[13:]]
    rows = []
    for runner in (loop, modules):
        runner.grow_pool(16)
        rows.append(Row(list(range(5)), 4, runner.pool.block_bytes))
    hidden = run_chunks(loop, rows[0], chunks, read_slices, sample_last=True)
    run_chunks(modules, rows[1], chunks, read_slices, sample_last=False)
    want = model(mx.array(prompt)[None], cache=make_prompt_cache(model))[:, -1:]
    assert hidden.shape[:2] == (1, 1)
    assert mx.allclose(loop._head(hidden), want, atol=1e-4, rtol=1e-4).item()
    a, b = (mx.array(r.pool.rows(row.slots(0, 19)).reshape(-1)) for r, row in zip((loop, modules), rows))
    for mine, theirs in ((loop.pool.keys, modules.pool.keys), (loop.pool.values, modules.pool.values)):
        for x, y in zip(mine, theirs):
            assert mx.array_equal(x[a], y[b]).item()


def test_a_chunk_that_samples_nothing_builds_no_output(tiny_parts):
    """Its forward only writes KV: no hidden state, and the runner's Forward finishes on the pool arrays
    as this chunk left them (not the pool's objects, which the next chunk's build rebinds), then lets go."""
    from engine.model.runner import ModelRunner, PrefillWork
    from engine.model.sampling import RequestSampler

    runner = ModelRunner(tiny_parts[0], block_size=4)
    runner.grow_pool(16)
    runner.add_row("a", range(4), RequestSampler(SamplingParams(), 0))
    prompt = random_prompt(12, seed=2)
    first = runner.prefill(PrefillWork("a", prompt[:6], 0, False))
    assert first.tokens is None
    runner.launch(first)
    second = runner.prefill(PrefillWork("a", prompt[6:11], 6, False))  # rebinds the pool's arrays
    pool_objects = {id(a) for a in runner.pool.keys + runner.pool.values}
    assert not any(id(a) in pool_objects for a in first.stages[-1])
    first.finish()
    assert first.stages == []
    runner.launch(second)
    second.finish()
    last = runner.prefill(PrefillWork("a", prompt[11:], 11, True))
    runner.launch(last)
    last.finish()
    assert last.tokens.shape == (1,)


def test_bound_weights_are_views_not_copies(tiny_parts):
    """Binding a model's weights allocates nothing (MLX active memory) and the bound matmul is the
    layer's own."""
    from engine.model.layers.bound import bind_layers
    from engine.model.layers.fused import fuse_projections

    model = tiny_parts[0]
    fuse_projections(model)
    mx.synchronize()
    before = mx.get_active_memory()
    bound = bind_layers(model.model.layers)
    assert mx.get_active_memory() - before < 1 << 16
    x = mx.random.normal((1, 3, model.args.hidden_size), key=mx.random.key(0))
    layer = model.model.layers[0]
    assert mx.array_equal(bound[0].o(x), layer.self_attn.o_proj(x)).item()
    assert mx.array_equal(bound[0].k(x), layer.self_attn.k_proj(x)).item()  # a fused part, alone


def test_models_the_loop_cannot_run_keep_mlx_lm_modules(random_llama):
    """Quantized projections: the loops say why, and the runner keeps mlx-lm's modules."""
    from engine.model.layers.bound import unsupported
    from engine.model.layers.chunk_path import ChunkPath
    from engine.model.runner import ModelRunner

    model, _ = random_llama(hidden_size=64, intermediate_size=128, vocab_size=256)
    nn.quantize(model, group_size=32, bits=8)
    assert "QuantizedLinear" in unsupported(model)
    runner = ModelRunner(model, block_size=4)
    assert runner.chunk_path is None and runner.decode_path is None
    with pytest.raises(ValueError, match="chunk path"):
        ChunkPath(model)


def test_engine_greedy_tokens_do_not_depend_on_the_layer_loops(make_engine):
    """The same prompts through the engine with and without its layer loops: the same greedy tokens."""
    prompts = [random_prompt(n, seed=n) for n in (3, 17, 40)]
    outputs = []
    for loops in (True, False):
        engine = make_engine(runner_options=RunnerOptions(layer_loops=loops), prefill_chunk_size=16)
        assert (engine.runner.chunk_path is not None) == loops
        outputs.append([o.token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))])
    assert outputs[0] == outputs[1]


def test_one_token_chunks_of_a_paged_pool_equal_mlx_lm(make_engine, tiny_parts, reference_greedy, run_to_completion):
    """A paged pool (the CUDA kernel's reference in its place): a prompt whose last chunk is one token,
    and a one-token prompt, read their keys through the paged attention in the chunk loop, and the
    engine's greedy tokens equal mlx-lm's."""
    from engine.model.kernels.paged_attention import ReferenceAttention

    engine = make_engine(prefill_chunk_size=64, max_num_batched_tokens=64, max_num_seqs=4,
                         prefix_cache_fraction=0.0)
    runner = engine.runner
    runner.use_paged_attention(ReferenceAttention(runner.pool.num_kv_heads, runner.pool.block_size))
    assert runner.chunk_path is not None
    chunks = []  # (tokens, read in place) of every chunk the loop ran
    forward, packed = runner.chunk_path.forward, runner.chunk_path.forward_packed
    runner.chunk_path.forward = lambda t, view, sample, *a, **k: chunks.append((t.shape[1], view.reads_paged)) or forward(
        t, view, sample, *a, **k)
    runner.chunk_path.forward_packed = lambda t, views, *a, **k: chunks.extend(
        (v.num_new, v.reads_paged) for v in views) or packed(t, views, *a, **k)
    prompts = [random_prompt(n, seed=n) for n in (65, 1, 30)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=5, ignore_eos=True))
    tokens = run_to_completion(engine)
    for i, p in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], p, 5)
    assert (1, True) in chunks and all(paged == (n == 1) for n, paged in chunks)


def test_warm_attention_runs_the_attention_of_each_shape_as_a_chunk_forward_calls_it(tiny_parts, monkeypatch):
    """The start's warm-up (ModelRunner.warm_chunk_shapes, on CUDA) calls the chunk loop's attention once
    per grid shape with what a chunk forward of that shape passes it: same shapes, dtypes and mask."""
    from engine.core.chunk_grid import grid_shapes
    from engine.model.forward_view import ForwardView
    from engine.model.kv_pool import Row
    from engine.model.runner import ModelRunner

    runner = ModelRunner(tiny_parts[0], block_size=16, max_forward_tokens=32)
    assert runner.pool.copy_views  # on the CPU MLX's attention cannot read the views in place: the pool copies
    runner.pool.copy_views = False  # as on CUDA, where cuDNN's attention reads the pool's views in place
    path, seen = runner.chunk_path, []
    attention = path.ops.attention

    def record(q, k, v, scale, mask=None, stages=None, softcap=None):
        seen.append((q.shape, q.dtype, k.shape, k.dtype, v.shape, mask, scale))
        return attention(q, k, v, scale, mask, stages, softcap)

    monkeypatch.setattr(path.ops, "attention", record)
    shapes = grid_shapes(16, 32, 96, 7)
    assert runner.warm_chunk_shapes(shapes)[0] == 7 and len(seen) == 7
    H, H_kv, d = path.heads, path.kv_heads, path.head_dim
    assert [(s[0], s[2], s[4], s[5]) for s in seen] == [((1, H, t, d), (1, H_kv, n, d), (1, H_kv, n, d), "causal")
                                                        for t, n in shapes]
    warmed = seen[shapes.index((16, 32))]
    runner.pool.grow(4)  # a row of two 16-token chunks, read as a view: its second chunk is (16, 32)
    row = Row([0, 1, 2, 3], 16, runner.pool.block_bytes)
    seen.clear()
    for chunk in ([1] * 16, [2] * 16):
        view = ForwardView(runner.pool, [row], 16)
        assert view.reads_slice
        path.forward(mx.array(chunk)[None], view, False)
        mx.eval(runner.pool.keys, runner.pool.values)
        view.advance()
    assert seen[-1] == warmed  # the first layer's attention of the (16, 32) chunk: the same call
    runner.pool.copy_views = True  # the attention would copy the view: nothing to warm
    assert runner.warm_chunk_shapes(shapes) == (0, 0.0)
