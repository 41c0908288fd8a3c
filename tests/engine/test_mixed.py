"""engine/model/layers/mixed.py: a step's decode rows run in the same forward as its first prompt chunk. Real forwards
of the tiny llama: greedy output equals mlx-lm's with and without the paged path (its CPU stand-in),
the step really mixes (fewer forwards than separate ones), the scheduler mixes only within the
transient bound, and a mixed forward that cannot be built falls back to separate forwards."""

from __future__ import annotations

import numpy as np
import pytest

from engine.core.memory.model import MemoryModel, PrefillChunkPlan, StepPlan
from engine.model.kernels.paged_attention import ReferenceAttention
from engine.core.types import SamplingParams
from engine.model.runner import RunnerOptions


def prompts_of(lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def count_mixed(engine) -> dict:
    """Count the runner's mixed forwards as the engine builds them."""
    state = {"mixed": 0}
    real = engine.runner.mixed_forward

    def counted(work, decodes):
        state["mixed"] += 1
        return real(work, decodes)

    engine.runner.mixed_forward = counted
    return state


@pytest.mark.parametrize("paged", [False, True], ids=["gather", "paged"])
def test_mixed_steps_greedy_equal_mlx_lm(make_engine, tiny_parts, reference_greedy, run_to_completion, paged):
    # 16-token chunks and staggered prompt lengths: rows decode while later prompts still prefill
    engine = make_engine(prefill_chunk_size=16, max_num_batched_tokens=24, max_num_seqs=4,
                         prefix_cache_fraction=0.0)
    assert engine.runner.mixed is not None and engine.memory.mixed
    if paged:
        runner = engine.runner
        runner.use_paged_attention(ReferenceAttention(runner.pool.num_kv_heads, runner.pool.block_size))
    state = count_mixed(engine)
    prompts = prompts_of([5, 70, 33, 1], engine.memory.shape.vocab_size, seed=3)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=10, ignore_eos=True))
    tokens = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], prompt, 10), i
    assert state["mixed"] >= 3


def test_mixing_saves_forwards_and_changes_no_token(make_engine, run_to_completion):
    def run(mixed: bool):
        engine = make_engine(prefill_chunk_size=16, max_num_batched_tokens=24, max_num_seqs=4,
                             prefix_cache_fraction=0.0, runner_options=RunnerOptions(mixed_batches=mixed))
        assert (engine.runner.mixed is not None) == mixed
        prompts = prompts_of([9, 60, 41], engine.memory.shape.vocab_size, seed=5)
        for i, p in enumerate(prompts):
            # one sampling row: its PRNG stream must not depend on which forward computed its logits
            engine.add_request(str(i), p, SamplingParams(max_tokens=8, ignore_eos=True,
                                                         temperature=0.8 if i == 1 else 0.0, seed=11))
        return run_to_completion(engine), engine.runner.num_forward_calls

    (mixed_tokens, mixed_forwards), (apart_tokens, apart_forwards) = run(True), run(False)
    assert mixed_tokens == apart_tokens
    assert mixed_forwards < apart_forwards


def test_a_mixed_forward_that_fails_to_build_runs_apart(make_engine, tiny_parts, reference_greedy,
                                                        run_to_completion):
    engine = make_engine(prefill_chunk_size=16, max_num_batched_tokens=24, prefix_cache_fraction=0.0)
    calls = {"n": 0}

    def broken(work, decodes):
        calls["n"] += 1
        raise RuntimeError("cannot build")

    engine.runner.mixed_forward = broken
    prompts = prompts_of([4, 50], engine.memory.shape.vocab_size, seed=9)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=6, ignore_eos=True))
    tokens = run_to_completion(engine)
    assert calls["n"] >= 2
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], prompt, 6)


def test_scheduler_mixes_only_within_the_bound(make_engine):
    def plan_with_bound(shrink: int):
        """The second step of a decoding row and a new prompt, with the bound lowered by `shrink`. The
        chunk is long enough (96 tokens) that its layers, not the decode row's head, are the mixed
        forward's largest stage (on the CPU a shorter chunk's mixed forward predicts exactly the decode
        row's head: the same as the separate forwards)."""
        engine = make_engine(prefill_chunk_size=96, max_num_batched_tokens=104, max_num_seqs=4,
                             prefix_cache_fraction=0.0)
        prompts = prompts_of([3, 150], engine.memory.shape.vocab_size, seed=1)
        engine.add_request("a", prompts[0], SamplingParams(max_tokens=5, ignore_eos=True))
        engine.step()  # "a" prefilled: it decodes from now on
        engine.add_request("b", prompts[1], SamplingParams(max_tokens=5, ignore_eos=True))
        engine.scheduler.transient_bound_bytes -= shrink
        return engine.scheduler, engine.scheduler.schedule()

    scheduler, plan = plan_with_bound(0)
    assert plan.decodes == ("a",) and plan.prefills and plan.mixed
    mixed_bytes = scheduler.predict(plan.decodes, plan.prefills, mixed=True)
    assert plan.predicted_transient_bytes == mixed_bytes
    assert mixed_bytes > scheduler.predict(plan.decodes, plan.prefills)
    # the same step where the combined forward would exceed the bound: separate forwards
    scheduler, plan = plan_with_bound(scheduler.transient_bound_bytes - mixed_bytes + 1)
    assert plan.decodes == ("a",) and plan.prefills and not plan.mixed
    assert plan.predicted_transient_bytes == scheduler.predict(plan.decodes, plan.prefills)


def test_memory_model_predicts_a_mixed_forward():
    """On the CPU (one layer at a time, each stage waited for) a mixed forward is its largest stage: the
    chunk's layers over T + B rows with one layer of the rows' attention, their MLP, the head of the
    rows: above each forward alone, below their sum. Where layers' temporaries coexist (CUDA) it is the
    larger of the chunk's forward over T + B rows with one layer of the rows' attention, and the rows'
    decode with one layer's share of the chunk: below the sum, above each forward alone. Models no
    deeper than the set's `mixed_min_layers` do not mix."""
    from dataclasses import replace

    from engine.core.memory.model import ModelShape

    from engine.core.memory.coefficients import CUDA_OPS8_COEFFICIENTS

    shape = ModelShape(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                       intermediate_size=512, vocab_size=1000, dtype_bytes=4)
    plan = StepPlan(decode_context_lens=(100, 200), prefill_chunks=(PrefillChunkPlan(16, 300),
                                                                     PrefillChunkPlan(16, 16)))
    model = MemoryModel(shape, mixed=True)
    decode, first = model.decode_bytes([100, 200]), model.prefill_chunk_bytes(16, 300)
    mixed = model.step_transient_bytes(plan, mixed=True)
    assert mixed == max(model.mixed_bytes(plan.prefill_chunks[0], (100, 200)), model.prefill_chunk_bytes(16, 16))
    assert max(first, decode) <= mixed < first + decode
    assert model.step_transient_bytes(plan) == max(decode, first, model.prefill_chunk_bytes(16, 16))
    # without decodes or chunks there is nothing to mix
    only_chunks = StepPlan(prefill_chunks=plan.prefill_chunks)
    assert model.step_transient_bytes(only_chunks, mixed=True) == model.step_transient_bytes(only_chunks)

    deep = replace(shape, num_layers=32, dtype_bytes=2)
    cuda = MemoryModel(deep, coefficients=CUDA_OPS8_COEFFICIENTS, paged_decode=True, mixed=True)
    assert cuda.mixed
    chunk, rows = PrefillChunkPlan(512, 4096), [4096] * 3
    both = cuda.mixed_bytes(chunk, rows)
    assert both < cuda.prefill_chunk_bytes(512, 4096) + cuda.decode_bytes(rows)
    assert both >= cuda.prefill_chunk_bytes(515, 4096) and both >= cuda.decode_bytes(rows)
    many = [8192] * 64  # the rows' attention temporaries dominate: the decode forward's, not one layer's
    assert cuda.mixed_bytes(PrefillChunkPlan(16, 16), many) > cuda.decode_bytes(many)
    # shallow models run the two apart where layers' temporaries coexist; on the CPU any model mixes
    assert not MemoryModel(replace(deep, num_layers=7), coefficients=CUDA_OPS8_COEFFICIENTS, mixed=True).mixed
    assert MemoryModel(replace(deep, num_layers=8), coefficients=CUDA_OPS8_COEFFICIENTS, mixed=True).mixed
    assert MemoryModel(replace(shape, num_layers=1), mixed=True).mixed


def test_traditional_rope_models_mix_too(tiny_parts, random_llama, reference_greedy, run_to_completion,
                                         model_cache_dir):
    """The embedded SmolLM2 (from its GGUF) rotates with traditional RoPE: the layer loops and the mixed
    forward rotate with mlx-lm's own module and take it."""
    from engine.config import EngineConfig
    from engine.model.layers.decode_path import unsupported
    from engine.engine import Engine

    model, config = random_llama(hidden_size=64, intermediate_size=128, vocab_size=1000, rope_traditional=True)
    engine = Engine(model, tiny_parts[1], EngineConfig(model="tiny", cache_dir=model_cache_dir,
                                                       prefill_chunk_size=16, max_num_batched_tokens=24,
                                                       prefix_cache_fraction=0.0, memory_limit_bytes=1 << 30),
                    config)
    assert unsupported(model) is None and engine.runner.mixed is not None
    state = count_mixed(engine)
    prompts = prompts_of([6, 45, 20], 1000, seed=4)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=8, ignore_eos=True))
    tokens = run_to_completion(engine)
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(model, prompt, 8), i
    assert state["mixed"] >= 2


@pytest.mark.parametrize("paged", [False, True], ids=["gather", "paged"])
def test_a_one_token_prompt_mixes_with_decoding_rows(make_engine, tiny_parts, reference_greedy,
                                                     run_to_completion, paged):
    """A one-token chunk is itself a one-query forward (paged on CUDA): in a mixed forward it attends
    through its own view, beside the decode rows."""
    engine = make_engine(prefill_chunk_size=16, max_num_batched_tokens=24, prefix_cache_fraction=0.0)
    if paged:
        runner = engine.runner
        runner.use_paged_attention(ReferenceAttention(runner.pool.num_kv_heads, runner.pool.block_size))
    sizes = []
    real = engine.runner.mixed_forward
    engine.runner.mixed_forward = lambda work, decodes: (sizes.append(len(work.token_ids)), real(work, decodes))[1]
    first, one = prompts_of([5, 1], engine.memory.shape.vocab_size, seed=6)
    engine.add_request("a", first, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()  # "a" decodes from now on
    engine.add_request("b", one, SamplingParams(max_tokens=6, ignore_eos=True))
    tokens = run_to_completion(engine)
    assert sizes == [1]
    assert tokens["b"] == reference_greedy(tiny_parts[0], one, 6)
    assert tokens["a"] == reference_greedy(tiny_parts[0], first, 6)[1:]  # its first came from engine.step()


@pytest.mark.parametrize("sample", [True, False], ids=["chunk-samples", "chunk-goes-on"])
def test_mixed_forward_logits_equal_mlx_lm(tiny_parts, sample):
    """The mixed forward's output rows, through the LM head, equal mlx-lm's logits: the chunk's last
    position (when it samples; its last layer computes that position alone) and each decode row."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from engine.model.forward_view import ForwardView
    from engine.model.kv_pool import Row
    from engine.model.runner import ModelRunner

    model = tiny_parts[0]
    runner = ModelRunner(model, block_size=4)
    assert runner.mixed is not None
    runner.grow_pool(32)
    prompts = prompts_of([9, 7, 21], model.args.vocab_size, seed=9)
    rows = [Row(list(range(8 * i, 8 * i + 8)), 4, runner.pool.block_bytes) for i in range(len(prompts))]
    for row, prompt in zip(rows[:2], prompts[:2]):  # two decoding rows, their prompts' KV in the pool
        view = ForwardView(runner.pool, [row], len(prompt))
        mx.eval(runner._forward(mx.array(prompt)[None], view.layers()), runner.pool.keys, runner.pool.values)
        view.advance()
    chunk = prompts[2]
    view = ForwardView(runner.pool, [rows[2]], 12)  # the third prompt's first 12 tokens, then 9 mixed
    mx.eval(runner._forward(mx.array(chunk[:12])[None], view.layers()), runner.pool.keys, runner.pool.values)
    view.advance()
    fed = [5, 6]  # each decoding row's next token
    chunk_view = ForwardView(runner.pool, [rows[2]], 9)
    decode_view = ForwardView(runner.pool, rows[:2], 1)
    hidden = runner.mixed.forward(mx.array(chunk[12:] + fed), chunk_view, decode_view, sample=sample)
    got = runner._head(hidden[0])
    assert got.shape[0] == 2 + sample

    def last_logits(tokens):
        return model(mx.array(tokens)[None], cache=make_prompt_cache(model))[0, -1]

    want = ([last_logits(chunk)] if sample else []) + [last_logits(p + [t]) for p, t in zip(prompts[:2], fed)]
    for g, w in zip(got, want):
        assert mx.allclose(g, w, atol=1e-4, rtol=1e-4).item()
