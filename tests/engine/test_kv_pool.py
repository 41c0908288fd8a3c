"""The KV pool (real MLX, tiny model): growth while rows hold KV, blocks given back, decode graph size."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from engine.core.types import SamplingParams


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
        for out in engine.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        pool_sizes.append(engine.runner.pool_tokens)
        stats = engine.stats()
        assert stats.kv_used_bytes == stats.kv_reserved_bytes
        assert stats.kv_used_bytes <= stats.kv_allocated_bytes <= stats.kv_budget_bytes
    assert len(set(pool_sizes)) >= 3  # grew more than once, while earlier rows were decoding
    for i, p in zip(ids, prompts):
        assert tokens[i] == reference_greedy(tiny_parts[0], p, 10)
    assert engine.kv.allocator.num_used == 0  # every block came back


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
        forward = engine.runner._decode_forward
        graphs = []

        def counting(tokens, view, forward=forward, graphs=graphs):
            hidden = forward(tokens, view)
            graphs.append(count_ops(hidden))
            return hidden

        engine.runner._decode_forward = counting
        engine.step()  # the first decode step, pipelined: its forward of all rows and the next one's
        sizes[batch] = graphs
    assert len(sizes[2]) == len(sizes[6]) == 2
    assert sizes[2] == sizes[6]  # per-row KV buffers added 4 ops per row and layer


def forward_logits(runner, row, chunks, read_slices):
    """Each chunk's logits [1, T, V] through a ForwardView of the row, and whether it read a slice."""
    from engine.model.forward_view import ForwardView

    logits, slices = [], []
    for chunk in chunks:
        view = ForwardView(runner.pool, [row], len(chunk), read_slices=read_slices)
        logits.append(runner._head(runner._forward(mx.array(chunk)[None], view.layers())))
        mx.eval(logits[-1])
        view.advance()
        slices.append(view.reads_slice)
    return logits, slices


def test_contiguous_and_fragmented_rows_give_mlx_lm_logits(tiny_parts):
    from mlx_lm.models.cache import make_prompt_cache

    from engine.model.kv_pool import Row
    from engine.core.blocks import BlockAllocator
    from engine.model.runner import ModelRunner

    model = tiny_parts[0]
    runner = ModelRunner(model, block_size=4)
    blocks = BlockAllocator(4, 16)  # the KV manager's part, here by hand
    runner.grow_pool(10)
    blocks.grow(10)
    singles = [blocks.allocate(1) for _ in range(10)]
    for s in singles[1::2]:
        blocks.free(s)  # free: 1 3 5 7 9
    fragmented = blocks.allocate(5)
    runner.grow_pool(16)
    blocks.grow(16)
    contiguous = blocks.allocate(5)
    assert fragmented == [1, 3, 5, 7, 9] and contiguous == [10, 11, 12, 13, 14]

    prompt = random_prompts([13], 49152, seed=3)[0]
    chunks = [prompt[:5], prompt[5:10], prompt[10:], [7], [8], [9]]  # chunked prefill, then 3 decodes
    cache = make_prompt_cache(model)
    expected = [model(mx.array(c)[None], cache=cache) for c in chunks]
    for blocks, read_slices, want_slices in ((contiguous, True, True), (contiguous, False, False),
                                             (fragmented, True, False)):
        row = Row(list(blocks), 4, runner.pool.block_bytes)
        logits, slices = forward_logits(runner, row, chunks, read_slices)
        # prompt chunks only: one-token forwards (the decodes) always gather (engine/model/kv_pool.py)
        assert slices == [want_slices and len(c) > 1 for c in chunks]
        for got, want in zip(logits, expected):
            assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()


def test_engine_output_is_exact_with_contiguous_and_fragmented_rows(make_engine, tiny_parts, reference_greedy):
    engine = make_engine(prefill_chunk_size=128, max_num_seqs=4, prefix_cache_fraction=0.0)
    runner = engine.runner
    blocks = engine.kv.allocator  # the KV manager's: blocks held here are the engine's
    blocks.grow(4)
    held = [blocks.allocate(1) for _ in range(4)]
    blocks.free(held[0])
    blocks.free(held[2])  # free: 0 2, no run of two
    prompts = random_prompts([300, 280], engine.memory.shape.vocab_size, seed=11)  # 2 blocks of 256 each
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    tokens = {"0": [], "1": []}
    placed = {}
    for i, p in enumerate(prompts):  # one request a step: the first takes the free blocks 0 and 2
        engine.add_request(str(i), p, sampling)
        record = engine.step()
        for out in record.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
        placed.update({r.request_id: list(r.block_ids) for r in record.plan.new_rows})
        assert {i: list(r.blocks) for i, r in runner.rows.items()} == {i: placed[i] for i in runner.rows}
    while engine.has_unfinished():
        for out in engine.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    assert placed["0"] == [0, 2]  # fragmented: read by a gather
    assert placed["1"] == [4, 5]  # the pool grew: consecutive, read by slices
    for i, p in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], p, 6)


@pytest.mark.parametrize("async_decode", [False, True])
def test_forwards_never_overlap_on_the_device(make_engine, monkeypatch, async_decode):
    """Every forward writes the KV pool in place; on MLX's GPU backends a forward launched while the
    previous one still runs would copy whole pool arrays (work.finish). So no forward is launched
    before the previous one is finished, in steps mixing decode and prompt chunks and in pipelined
    decode alike (but decodes launched ahead, which write the pool without a donated buffer:
    test_decode_path.py), and every launched forward is finished."""
    import engine.decode_pipeline
    import engine.model.work

    state = {"in_flight": False, "launches": 0}
    real_finish = engine.model.work.finish

    def finish(*arrays):
        real_finish(*arrays)
        state["in_flight"] = False

    monkeypatch.setattr(engine.model.work, "finish", finish)  # Forward.finish
    monkeypatch.setattr(engine.decode_pipeline, "finish", finish)  # the pipelined decode's wait
    eng = make_engine(max_num_seqs=4, prefill_chunk_size=8, max_num_batched_tokens=24,
                      async_decode=async_decode)
    real_launch = eng.runner.launch

    def launch(forward):
        assert not state["in_flight"], "a forward was launched while another one ran"
        state["in_flight"] = True
        state["launches"] += 1
        real_launch(forward)

    eng.runner.launch = launch
    for i, p in enumerate(random_prompts([5, 30, 17, 9], 49152, seed=12)):  # chunks and decodes mix
        eng.add_request(str(i), p, SamplingParams(max_tokens=10, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    # every forward built was launched (a mixed runner runs fewer: decode rows ride with prompt chunks)
    assert state["launches"] == eng.runner.num_forward_calls > 15 and not state["in_flight"]


def test_a_request_with_two_chunks_in_a_step_is_predicted_as_gathering_if_either_chunk_gathers(make_engine,
                                                                                                tiny_parts,
                                                                                                reference_greedy):
    """The budget left after a prompt's first chunk gives it a second one in the same step; its row in
    blocks 0 and 2 reads the first chunk's keys as a view of block 0 and the second's, past the end of
    block 0, as a gathered copy: the step is predicted with the gather (no under-prediction)."""
    engine = make_engine(prefill_chunk_size=200, max_num_seqs=4, prefix_cache_fraction=0.0)
    runner = engine.runner
    blocks = engine.kv.allocator  # the KV manager's: blocks held here are the engine's
    blocks.grow(4)
    held = [blocks.allocate(1) for _ in range(4)]
    blocks.free(held[0])
    blocks.free(held[2])
    prompt = random_prompts([300], engine.memory.shape.vocab_size, seed=8)[0]
    engine.add_request("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    seen = []
    tokens = []
    while engine.has_unfinished():
        record = engine.step()
        seen.append(([(c.start, c.num_tokens) for c in record.prefill_chunks], record.slice_reads))
        for out in record.outputs:
            tokens += out.new_token_ids
    assert runner.rows.get("a") is None and tokens == reference_greedy(tiny_parts[0], prompt, 3)
    assert seen[0] == ([(0, 200), (200, 100)], set())
    assert engine.stats().max_measured_transient_bytes <= engine.stats().max_predicted_transient_bytes


@pytest.mark.parametrize("read_slices", [True, False], ids=["slice", "gather"])
def test_sliding_layers_read_only_their_window(read_slices):
    """A sliding layer (window 8) reads only the keys its queries' windows reach, with positions the
    mask names; a global layer reads the whole row."""
    import numpy as np

    from engine.model.forward_view import ForwardView
    from engine.model.kv_pool import KVPool, Row

    pool = KVPool(2, 1, 4, mx.float32, 16, read_slices=read_slices, layer_windows=(8, None))
    pool.grow(8)
    for layer in range(2):  # key value = its slot, so a read shows which positions it holds
        pool.keys[layer] = mx.broadcast_to(mx.arange(pool.num_slots, dtype=mx.float32)[:, None], (pool.num_slots, 4))
        pool.values[layer] = pool.keys[layer]
    row = Row([0, 1, 2, 3], 16, pool.block_bytes)
    row.offset = 40
    view = ForwardView(pool, [row], 5)  # positions 40..44; the first query's window starts at 33
    keys, _ = view.read(0)
    assert keys[0, 0, :, 0].tolist() == list(range(33, 45))
    assert view.read(1)[0].shape[2] == 45
    mask = np.array(view.make_mask(5, window_size=8))  # [5, 12]
    assert mask.shape == (5, 12)
    assert mask[0].tolist() == [True] * 8 + [False] * 4  # query 40: keys 33..40
    assert mask[4].tolist() == [False] * 4 + [True] * 8  # query 44: keys 37..44
    assert view.make_mask(5) == "causal"

    short = Row([4, 5], 16, pool.block_bytes)
    short.offset = 3
    decode = ForwardView(pool, [row, short], 1)  # lengths 41 and 4
    keys, _ = decode.read(0)
    assert keys.shape[2] == 8 and keys[0, 0, :, 0].tolist() == list(range(33, 41))
    assert keys[1, 0, :4, 0].tolist() == [64, 65, 66, 67]
    assert np.array(decode.make_mask(1, window_size=8))[:, 0, 0].tolist() == [[True] * 8, [True] * 4 + [False] * 4]


def test_sliding_layers_in_rings_read_their_window_from_the_row_s_ring():
    """With rings (window 8, rings of 12 slots): position p of ring r is row r * 12 + p % 12 of the
    sliding layer's arrays, which stay their fixed size; writes and window reads go there."""
    from engine.model.forward_view import ForwardView
    from engine.model.kv_pool import KVPool, Row

    pool = KVPool(2, 1, 4, mx.float32, 16, layer_windows=(8, None), ring_rows=2, ring_tokens=12)
    pool.grow(4)
    pool.grow(8)
    assert pool.keys[0].shape == (24, 4) and pool.keys[1].shape == (128, 4)
    assert pool.block_bytes == 2 * 1 * 16 * 4 * 4  # the global layer alone
    pool.keys[0] = mx.broadcast_to(mx.arange(24, dtype=mx.float32)[:, None], (24, 4))
    row = Row([0, 1, 2, 3], 16, pool.block_bytes)
    row.ring, row.offset = 1, 40
    view = ForwardView(pool, [row], 5)
    new = mx.full((1, 1, 5, 4), -1.0)
    view.write(0, new, new)  # positions 40..44: ring rows 12 + 4 ... 12 + 8
    keys, _ = view.read(0)
    expected = [12 + p % 12 for p in range(33, 45)]
    assert keys[0, 0, :, 0].tolist() == [-1.0 if p >= 40 else float(r) for p, r in zip(range(33, 45), expected)]
    with pytest.raises(ValueError, match="ring_tokens=4 must hold the window of 8"):
        KVPool(2, 1, 4, mx.float32, 16, layer_windows=(8, None), ring_rows=2, ring_tokens=4)


def test_prefix_copy_writes_the_pool_in_place():
    """A prefix-cache copy's transient is the copied rows and their indices (MemoryModel.kv_copy_bytes),
    not a copy of the pool's array: its rows are read before the write (KVPool.copy)."""
    import numpy as np

    from engine.core.memory.model import MemoryModel, ModelShape
    from engine.model.kv_pool import KVPool

    pool = KVPool(2, 2, 16, mx.float32, 256)
    pool.grow(4)
    src, dst = np.arange(24), np.arange(256, 280)
    before = np.array(pool.keys[0])
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    pool.copy(src, dst)
    mx.synchronize()
    transient = mx.get_peak_memory() - base
    shape = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=100, dtype_bytes=4)
    assert transient <= MemoryModel(shape).kv_copy_bytes(24) < pool.keys[0].nbytes // 10
    after = np.array(pool.keys[0])
    rows = lambda slots: pool.rows(slots).reshape(-1)  # noqa: E731
    assert np.array_equal(after[rows(dst)], before[rows(src)])


def test_pool_is_token_major_and_growth_keeps_every_slot():
    """Slot s's head h is row s * H_kv + h (so a consecutive row's view has strides that do not depend on
    the pool's size: MLX's CUDA attention keys its cuDNN graphs by them); growth appends slots and keeps
    every row; a consecutive row read as a view and as a gather gives the keys written."""
    import numpy as np

    from engine.model.forward_view import ForwardView
    from engine.model.kv_pool import KVPool, Row

    pool = KVPool(1, 2, 4, mx.float32, 16)
    pool.grow(2)
    row = Row([0, 1], 16, pool.block_bytes)
    first = mx.arange(2 * 20 * 4, dtype=mx.float32).reshape(1, 2, 20, 4)  # [B, H_kv, T, D]
    view = ForwardView(pool, [row], 20)
    view.write(0, first, -first)
    assert view.reads_slice and np.array_equal(np.array(view.read(0)[0]), np.array(first))
    view.advance()
    rows = np.array(pool.keys[0])
    for slot, head in ((0, 0), (0, 1), (5, 1), (19, 0)):
        assert np.array_equal(rows[slot * 2 + head], np.array(first[0, head, slot]))
    pool.grow(4)
    assert pool.keys[0].shape == (64 * 2, 4) and np.array_equal(np.array(pool.keys[0])[:64], rows)
    assert not np.array(pool.keys[0])[64:].any()
    row.blocks.append(2)
    second = mx.full((1, 2, 20, 4), 7.0)
    for read_slices in (True, False):
        view = ForwardView(pool, [row], 20, read_slices=read_slices)
        view.write(0, second, second)
        keys, values = view.read(0)
        assert view.reads_slice == read_slices and keys.shape == (1, 2, 40, 4)
        assert np.array_equal(np.array(keys), np.concatenate([np.array(first), np.array(second)], axis=2))
        assert np.array_equal(np.array(values)[:, :, :20], -np.array(first))


def test_attention_copies_views_where_mlx_cannot_read_the_pool_strides():
    from engine.model.kv_pool import attention_copies_views

    assert not attention_copies_views("cuda", 128, mx.bfloat16, "llama")  # cuDNN reads the view
    assert not attention_copies_views("cuda", 96, mx.float16, "phi3")
    assert attention_copies_views("cuda", 256, mx.bfloat16, "gemma3_text")  # MLX's matmul fallback
    assert attention_copies_views("cuda", 128, mx.float32, "llama")
    assert attention_copies_views("cuda", 128, mx.bfloat16, "gemma2")  # soft-capped scores: matmuls
    assert attention_copies_views("cpu", 128, mx.bfloat16, "llama")
