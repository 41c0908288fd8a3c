"""The KV pool (real MLX, tiny model): growth while rows hold KV, blocks given back, decode graph size."""

from __future__ import annotations

import random

import mlx.core as mx

from engine.request import SamplingParams


def random_prompts(lengths, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def test_pool_grows_while_rows_hold_kv_and_output_is_exact(make_engine, tiny_parts, reference_greedy):
    # one new request per step, each needing a block more than the pool has: it grows mid-flight
    engine = make_engine(prefill_chunk_size=8, max_num_batched_tokens=9, max_num_seqs=6,
                         prefix_cache_fraction=0.0)
    prompts = random_prompts([20, 7, 33, 12, 5], engine.memory.shape.vocab_size, seed=5)
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    ids = [str(i) for i in range(len(prompts))]
    for i, p in zip(ids, prompts):
        engine.add_request(i, p, sampling)
    tokens = {i: [] for i in ids}
    pool_sizes = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        pool_sizes.append(engine.runner.pool_tokens)
        stats = engine.stats()
        assert stats.kv_used_bytes == stats.kv_reserved_bytes
        assert stats.kv_used_bytes <= stats.kv_allocated_bytes <= stats.kv_budget_bytes
    assert len(set(pool_sizes)) >= 3  # grew more than once, while earlier rows were decoding
    for i, p in zip(ids, prompts):
        assert tokens[i] == reference_greedy(tiny_parts[0], p, 10)
    assert engine.runner.blocks.num_used == 0  # every block came back


def count_ops(array) -> int:
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, array)
        return sum("shape=rectangle" in line for line in f.read().splitlines())


def test_decode_graph_does_not_grow_with_the_batch(make_engine):
    sizes = {}
    for batch in (2, 6):
        engine = make_engine(max_num_seqs=batch)
        for i, p in enumerate(random_prompts([40 + 7 * i for i in range(batch)], 49152, seed=batch)):
            engine.add_request(str(i), p, SamplingParams(max_tokens=4, ignore_eos=True))
        engine.step()  # every prompt prefills
        forward = engine.runner._forward
        graphs = []

        def counting(tokens, cache, forward=forward, graphs=graphs):
            hidden = forward(tokens, cache)
            graphs.append(count_ops(hidden))
            return hidden

        engine.runner._forward = counting
        engine.step()  # the first decode step, pipelined: its forward of all rows and the next one's
        sizes[batch] = graphs
    assert len(sizes[2]) == len(sizes[6]) == 2
    assert sizes[2] == sizes[6]  # per-row KV buffers added 4 ops per row and layer
