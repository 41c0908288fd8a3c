"""The chunk-shape warm-up (ExecutionConfig.warm_chunk_shapes, engine/warmup.py) on the tiny model with
real MLX forwards: one chunk of every (tokens, context) pair of the grid computed at startup over a
scratch row, the row's KV given back, and the engine serving mlx-lm's greedy tokens afterwards."""

from __future__ import annotations

import random

from engine.core.types import SamplingParams
from engine.warmup import grid_shapes


def test_grid_shapes_cover_the_chunk_grid_shortest_contexts_first():
    shapes = grid_shapes(128, 512, 1024)
    assert len(shapes) == len(set(shapes)) == 8 + 7 + 6 + 5  # tokens 128 / 256 / 384 / 512 at starts 0..
    assert all(start % 128 == 0 and tokens % 128 == 0 and start + tokens <= 1024 for start, tokens in shapes)
    ends = [start + tokens for start, tokens in shapes]
    assert ends == sorted(ends) and shapes[0] == (0, 128)
    assert grid_shapes(16, 32, 40) == [(0, 16), (16, 16), (0, 32)]  # (start, tokens) by the keys they reach
    assert grid_shapes(128, 512, 100) == []


def test_warm_up_computes_every_grid_shape_then_serves_mlx_lms_greedy_tokens(make_engine, tiny_parts,
                                                                               reference_greedy):
    engine = make_engine(prefill_chunk_size=32, max_num_batched_tokens=48, max_num_seqs=4, max_model_len=96,
                         prefix_cache_fraction=0.0,
                         execution={"warm_chunk_shapes": True, "chunk_granule": 16, "pad_last_chunk": True})
    want_shapes = grid_shapes(16, 32, 96)
    report = engine.warmup
    assert report is not None and report.num_shapes == len(want_shapes) == 6 + 5 and report.max_context == 96
    assert engine.runner.num_forward_calls == len(want_shapes)
    assert engine.runner.num_tokens_computed == sum(tokens for _, tokens in want_shapes)
    assert engine.kv.used_bytes == 0 and not engine.runner.rows  # the scratch row's KV is given back
    assert engine.stats().num_steps == 0
    rng = random.Random(5)
    prompts = [[rng.randrange(3, engine.memory.shape.vocab_size) for _ in range(n)] for n in (21, 50, 7)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    tokens: dict = {}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [tokens[str(i)] for i in range(3)] == [reference_greedy(tiny_parts[0], p, 8) for p in prompts]


def test_warm_up_takes_the_shorter_contexts_when_the_kv_budget_is_small(make_engine):
    """A KV budget below max_model_len tokens: the scratch row takes what it holds; off by default."""
    assert make_engine().warmup is None
    engine = make_engine(prefill_chunk_size=64, max_num_seqs=1, memory_limit_bytes=15 << 20,
                         prefix_cache_fraction=0.0, execution={"warm_chunk_shapes": True, "chunk_granule": 64})
    report = engine.warmup
    budget_tokens = engine.stats().kv_budget_bytes // engine.memory.kv_bytes_per_token
    assert report.max_context < engine.max_model_len and budget_tokens - 256 < report.max_context <= budget_tokens
    assert report.num_shapes == len(grid_shapes(64, 64, report.max_context)) > 0
    assert engine.kv.used_bytes == 0
