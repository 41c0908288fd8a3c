"""Several rows' prompt chunks packed into one forward (ModelRunner.prefill_packed, ChunkPath.forward_packed;
up to ExecutionConfig.max_packed_tokens tokens in all): real forwards of the tiny
llama on the CPU give mlx-lm's greedy tokens and the same tokens as one forward per chunk, padded and
one-token chunks and batches of first chunks included; the scheduler packs only distinct rows, within the transient bound and the
free memory; every packed step's measured transient stays within its prediction; a packed forward that
cannot be built runs its chunks apart."""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.memory.model import MemoryModel, ModelShape, PrefillChunkPlan, StepPlan
from engine.core.memory.plan import pack_groups
from engine.core.types import SamplingParams


def packing(most, **more):
    """ExecutionConfig fields: packs of up to `most` tokens, long prompts' chunks included."""
    return {"max_packed_tokens": most, "pack_long_prompts": True, **more}


def prompts_of(lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def serve(engine, prompts, max_tokens=8, sampled=()):
    """Every prompt at once (those in `sampled` sampling at temperature 0.8): (tokens per request, the
    steps' plans, their StepMemory records)."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=5,
                                                     temperature=0.8 if i in sampled else 0.0))
    tokens, plans, memory = {}, [], []
    while engine.has_unfinished():
        record = engine.step()
        for out in record.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if record.plan is not None:
            plans.append(record.plan)
        if record.memory is not None:
            memory.append(record.memory)
    return tokens, plans, memory


@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
def test_packed_chunks_give_mlx_lm_greedy_tokens(make_engine, tiny_parts, reference_greedy, pad):
    engine = make_engine(prefill_chunk_size=32, max_num_batched_tokens=128, max_num_seqs=6,
                         prefix_cache_fraction=0.0, execution=packing(128, pad_last_chunk=pad))
    assert engine.memory.packed
    # a one-token prompt, prompts ending inside a chunk and one of several chunks (two of its chunks
    # in a step never share a forward)
    prompts = prompts_of([1, 45, 20, 100, 7, 64], engine.memory.shape.vocab_size, seed=2)
    tokens, plans, memory = serve(engine, prompts)
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], prompt, 8), i
    packed = [p for p in plans if any(n > 1 for n in p.packs)]
    assert packed, "no step packed its chunks"
    for plan in packed:
        for group in pack_groups(plan.prefills, plan.packs):
            assert len({c.request_id for c in group}) == len(group)  # one chunk per row
        if plan.mixed:
            assert plan.packs[0] == 1  # the mixed forward's chunk is alone
    assert any(c.num_pad_tokens for p in packed for c in p.prefills) == pad
    # first chunks of as many tokens: one batch of rows in the chunk loop (ChunkPath.forward_packed)
    assert any(len([c for c in group if c.start == 0 and c.num_forward_tokens == 32]) > 1
               for p in packed for group in pack_groups(p.prefills, p.packs))
    for m in memory:
        assert m.measured_bytes <= m.predicted_bytes, m


def test_packing_saves_forwards_and_changes_no_token(make_engine):
    def run(pack: bool):
        engine = make_engine(prefill_chunk_size=16, max_num_batched_tokens=64, max_num_seqs=4,
                             prefix_cache_fraction=0.0, execution=packing(64 if pack else 0))
        assert engine.memory.packed == pack
        prompts = prompts_of([9, 60, 41, 17], engine.memory.shape.vocab_size, seed=5)
        tokens, plans, _ = serve(engine, prompts, sampled=(1,))  # a sampling row's stream is its own
        return tokens, engine.runner.num_forward_calls, plans

    (packed, packed_forwards, plans), (apart, apart_forwards, unpacked) = run(True), run(False)
    assert packed == apart
    assert packed_forwards < apart_forwards
    assert any(p.packs for p in plans) and not any(p.packs for p in unpacked)


def test_a_packed_forward_that_fails_to_build_runs_apart(make_engine, tiny_parts, reference_greedy,
                                                        run_to_completion):
    engine = make_engine(prefill_chunk_size=16, max_num_batched_tokens=64, prefix_cache_fraction=0.0,
                         execution=packing(64))
    calls = {"n": 0}

    def broken(works):
        calls["n"] += 1
        raise RuntimeError("cannot build")

    engine.runner.prefill_packed = broken
    prompts = prompts_of([20, 50, 33], engine.memory.shape.vocab_size, seed=9)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=6, ignore_eos=True))
    tokens = run_to_completion(engine)
    assert calls["n"] >= 1
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], prompt, 6)


def test_scheduler_packs_within_the_bound_and_the_free_memory(make_engine):
    def plan_with(shrink: int = 0, room=None, most: int = 128):
        engine = make_engine(prefill_chunk_size=32, max_num_batched_tokens=128, max_num_seqs=4,
                             prefix_cache_fraction=0.0, execution=packing(most))
        for i, p in enumerate(prompts_of([32, 32, 32, 32], engine.memory.shape.vocab_size, seed=1)):
            engine.add_request(str(i), p, SamplingParams(max_tokens=4, ignore_eos=True))
        scheduler = engine.scheduler
        scheduler.transient_bound_bytes -= shrink
        if room is not None:
            scheduler.config = type(scheduler.config)(**{**scheduler.config.__dict__,
                                                         "max_memory_bytes": room + engine.kv.pool_bytes})
        return scheduler, scheduler.schedule()

    scheduler, plan = plan_with()
    assert len(plan.prefills) == 4 and plan.packs == (4,)
    four = plan.predicted_transient_bytes
    assert four == scheduler.memory.packed_bytes(scheduler.memory_plan((), plan.prefills).prefill_chunks)
    single = scheduler.predict((), plan.prefills[:1])
    assert four > single
    # a bound that four chunks' forward passes: packs of fewer
    scheduler, plan = plan_with(shrink=scheduler.transient_bound_bytes - four + 1)
    assert len(plan.prefills) == 4 and 1 < len(plan.packs) < 4
    assert plan.predicted_transient_bytes <= scheduler.transient_bound_bytes
    # free memory for one chunk's forward only: no pack (the chunks run one after another)
    scheduler, plan = plan_with(room=single)
    assert plan.packs == () and plan.predicted_transient_bytes <= single
    # at most 64 tokens a forward: a pack of two 32-token chunks, one pack a step (the others alone)
    scheduler, plan = plan_with(most=64)
    assert plan.packs == (2, 1, 1)


def test_by_default_only_whole_prompts_pack(make_engine, tiny_parts, reference_greedy):
    """pack_long_prompts off (the default): prompts that fit one chunk pack; the chunks of longer prompts
    run one at a time, so a burst of long prompts keeps one chunk's prefill transient."""
    def run(lengths):
        engine = make_engine(prefill_chunk_size=32, max_num_batched_tokens=256, max_num_seqs=8,
                             prefix_cache_fraction=0.0, execution={"max_packed_tokens": 256})
        prompts = prompts_of(lengths, engine.memory.shape.vocab_size, seed=3)
        tokens, plans, memory = serve(engine, prompts, max_tokens=4)
        for i, prompt in enumerate(prompts):
            assert tokens[str(i)] == reference_greedy(tiny_parts[0], prompt, 4), i
        groups = [g for p in plans for g in pack_groups(p.prefills, p.packs) if len(g) > 1]
        return prompts, groups, memory

    prompts, groups, memory = run([20, 100, 32, 70, 9, 12])
    assert groups, "no whole prompts packed"
    for group in groups:
        for chunk in group:
            assert chunk.start == 0 and chunk.num_tokens == len(prompts[int(chunk.request_id)]), chunk
    assert all(m.measured_bytes <= m.predicted_bytes for m in memory)
    assert not run([100, 70, 65, 33])[1]  # long prompts only: no pack


def test_a_prompt_whose_uncached_rest_fits_a_chunk_packs(make_engine):
    """After a prefix-cache hit a prompt's rest is what it computes: one chunk of it is a whole prompt."""
    engine = make_engine(prefill_chunk_size=16, max_num_batched_tokens=64, max_num_seqs=4,
                         execution={"max_packed_tokens": 64})
    shared, a, b = prompts_of([40, 10, 10], engine.memory.shape.vocab_size, seed=8)
    greedy = SamplingParams(max_tokens=3, ignore_eos=True)
    cold = {i: o.token_ids for i, o in enumerate(make_engine(prefix_cache_fraction=0.0).generate(
        [shared + a, shared + b], greedy))}
    engine.generate([shared + [7]], greedy)  # the shared prefix into the cache
    tokens, plans, _ = serve(engine, [shared + a, shared + b], max_tokens=3)
    assert tokens == {str(i): t for i, t in cold.items()}
    first = plans[0]
    assert [c.start for c in first.prefills] == [40, 40] and first.packs == (2,)


def test_memory_model_predicts_a_packed_forward():
    """A packed forward: every stage of its chunks' own forwards added, and PACK_ROWS query-sized rows a
    token; one chunk is that chunk's forward; a step's forwards are packs (`packs`)."""
    shape = ModelShape(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                       intermediate_size=512, vocab_size=1000, dtype_bytes=4)
    model = MemoryModel(shape, max_packed_tokens=64)
    chunks = (PrefillChunkPlan(16, 300, False), PrefillChunkPlan(32, 32, True), PrefillChunkPlan(1, 40, True))
    alone = [model.prefill_chunk_bytes(c.num_tokens, c.context_len, c.computes_logits) for c in chunks]
    packed = model.packed_bytes(chunks)
    assert max(alone) + model.pack_rows_bytes(49) < packed <= sum(alone) + model.pack_rows_bytes(49)
    assert model.packed_bytes(chunks[:1]) == alone[0]
    assert model.step_transient_bytes(StepPlan(prefill_chunks=chunks, packs=(1, 2))) == max(
        alone[0], model.packed_bytes(chunks[1:]))
    assert model.step_transient_bytes(StepPlan(prefill_chunks=chunks)) == max(alone)
    with pytest.raises(ValueError, match="packs"):
        model.step_transient_bytes(StepPlan(prefill_chunks=chunks, packs=(2,)))
    with pytest.raises(ValueError, match="pack of its own"):
        model.step_transient_bytes(StepPlan(decode_context_lens=(10,), prefill_chunks=chunks, packs=(2, 1)),
                                   mixed=True)


def test_a_packed_forward_whose_head_fails_runs_apart(make_engine, tiny_parts, reference_greedy,
                                                      run_to_completion, monkeypatch):
    """The failure comes after the pack's layers were built: its rows must still be where they were, so
    that its chunks run apart and every request gets mlx-lm's tokens."""
    import engine.model.runner as runner_module

    engine = make_engine(prefill_chunk_size=16, max_num_batched_tokens=64, prefix_cache_fraction=0.0,
                         execution=packing(64))
    real_sample, real_packed = runner_module.sample_rows, engine.runner.prefill_packed
    state = {"packing": False, "failed": 0}

    def sample_rows(logits, samplers):
        if state["packing"] and not state["failed"]:
            state["failed"] += 1
            raise RuntimeError("head failed")
        return real_sample(logits, samplers)

    def packed(works):
        state["packing"] = True
        try:
            return real_packed(works)
        finally:
            state["packing"] = False

    monkeypatch.setattr(runner_module, "sample_rows", sample_rows)
    engine.runner.prefill_packed = packed
    prompts = prompts_of([12, 9, 15], engine.memory.shape.vocab_size, seed=4)  # one chunk each: they sample
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=5, ignore_eos=True))
    tokens = run_to_completion(engine)
    assert state["failed"] == 1
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], prompt, 5)


@pytest.mark.parametrize("processing", [{"logprobs": 3}, {"repetition_penalty": 1.3}], ids=["logprobs", "penalty"])
def test_a_pack_with_one_processed_row_is_predicted_as_all_processed(make_engine, processing):
    """One row asking for logprobs or a penalty sends every sampled row of its pack through the sampler's
    processing path ([r, V] float32 arrays): the plan counts them all, and no step measures above it."""
    def loaded():
        engine = make_engine(prefill_chunk_size=32, max_num_batched_tokens=256, max_num_seqs=8,
                             prefix_cache_fraction=0.0, execution=packing(256))
        for i, p in enumerate(prompts_of([20] * 8, engine.memory.shape.vocab_size, seed=6)):
            engine.add_request(str(i), p, SamplingParams(max_tokens=3, ignore_eos=True,
                                                         **(processing if i == 3 else {})))
        return engine

    scheduler = loaded().scheduler
    plan = scheduler.schedule()
    assert plan.packs == (8,)
    assert all(c.samples for c in scheduler.memory_plan((), plan.prefills, packs=plan.packs).prefill_chunks)
    # apart, only the processed row's own chunk
    assert [c.samples for c in scheduler.memory_plan((), plan.prefills).prefill_chunks] == [i == 3 for i in range(8)]
    engine = loaded()
    while engine.has_unfinished():
        record = engine.step()
        if record.memory is not None:
            assert record.memory.measured_bytes <= record.memory.predicted_bytes, record.plan.packs


def test_a_sampling_pack_runs_its_kv_writes_in_its_own_forward(tiny_parts):
    """A pack's first chunks attend over their own rotated keys and values, not the pool: its forward
    still runs every layer's KV write (as MLX's CUDA backend runs it: no stage waits), so no pending
    write holds the pack's keys and values, allocated, into the next forward's transient."""
    import mlx.core as mx

    from engine.model.runner import ModelRunner, PrefillWork
    from engine.model.sampling import RequestSampler

    runner = ModelRunner(tiny_parts[0], block_size=4, stage_waits=False)
    runner.grow_pool(32)
    prompts = prompts_of([12, 12, 12], 1000, seed=4)
    for r, prompt in enumerate(prompts):
        runner.add_row(str(r), range(4 * r, 4 * r + 4), RequestSampler(SamplingParams(), 0))
    pack = runner.prefill_packed([PrefillWork(str(r), p, 0, True) for r, p in enumerate(prompts)])
    runner.launch(pack)
    pack.finish()
    mx.synchronize()
    before = mx.get_active_memory()
    mx.eval(runner.pool.keys + runner.pool.values)  # nothing left to run: nothing released
    mx.synchronize()
    assert mx.get_active_memory() == before
