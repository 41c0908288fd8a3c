"""The engine's public observation and construction API, which benchmarks and telemetry use instead of
its internals (issue 20): step options chosen at construction, the step record's schedule and
graph-build times, the prefix cache emptied by `reset_prefix_cache`, the runner's paths by
`execution_paths`. Real MLX forwards on the tiny model."""

import numpy as np

from engine.core.types import SamplingParams


def _prompts(engine, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, engine.memory.shape.vocab_size, n).tolist() for n in lengths]


def _run(engine, prompts, max_tokens=6):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{len(p)}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    records = []
    while engine.has_unfinished():
        records.append(engine.step())
    return records


def test_async_decode_chosen_at_construction(make_engine):
    prompts = None
    for async_decode in (True, False):
        engine = make_engine(async_decode=async_decode)
        prompts = prompts or _prompts(engine, (20, 9))
        records = _run(engine, prompts)
        assert any(r.pipelined for r in records) == async_decode


def test_step_records_time_the_schedule_and_every_graph_build(make_engine):
    engine = make_engine(prefill_chunk_size=16, max_num_batched_tokens=32)
    records = _run(engine, _prompts(engine, (40, 12)))
    planned = [r for r in records if r.plan is not None and not r.pipelined]
    assert planned and all(r.schedule_s > 0 for r in planned)
    # decodes the pipeline planned (after the one schedule() started it): no scheduling of their own
    assert any(r.pipelined and r.schedule_s == 0 for r in records)
    timed = [f for r in records for f in r.forwards if f.build_s is not None]
    assert len(timed) >= sum(len(r.prefill_chunks) for r in records)  # each chunk's forward, and decodes'
    for f in timed:
        assert f.build_s <= f.built_s <= f.launch_s <= f.launched_s
        assert f.build_duration_s == f.built_s - f.build_s
    assert any(f.build_s is not None for r in records if r.pipelined for f in r.forwards)


def test_reset_prefix_cache_empties_it_and_the_next_prompt_finds_no_hit(make_engine):
    engine = make_engine()
    prompt = _prompts(engine, (300,))[0]
    _run(engine, [prompt], max_tokens=2)
    cached = engine.stats().prefix_cache_bytes
    assert cached > 0
    assert engine.reset_prefix_cache() == cached
    assert engine.stats().prefix_cache_bytes == 0
    out = engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert out.num_cached_tokens == 0
    assert engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True))[0].num_cached_tokens > 0


def test_execution_paths_follow_the_runner_options(make_engine):
    from engine.model.runner import RunnerOptions

    default = make_engine().execution_paths()
    assert default.decode_loop and default.chunk_loop and default.mixed_batches
    assert not default.paged_attention and not default.compiled_decode  # CUDA only; the tests run on the CPU
    modules = make_engine(runner_options=RunnerOptions(layer_loops=False, mixed_batches=False)).execution_paths()
    assert not modules.decode_loop and not modules.chunk_loop and not modules.mixed_batches
