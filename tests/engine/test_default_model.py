"""The embedded default model (SmolLM2-135M-Instruct) through the engine: real weights, real tokenizer."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.core.types import FinishReason, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three colors.", "What is 2+2?", "Say hello.",
             "Count from 1 to 5.", "Who wrote Hamlet? Answer in one short sentence please."]


@pytest.fixture(scope="module")
def engine(model_cache_dir):
    return Engine.from_config(EngineConfig(model="default", cache_dir=model_cache_dir, prefill_chunk_size=16,
                                           max_num_batched_tokens=40, max_num_seqs=8,
                                           memory_limit_bytes=4 << 30))


def test_paris(engine):
    out = engine.generate([[{"role": "user", "content": "What is the capital of France?"}]],
                          SamplingParams(max_tokens=20))[0]
    assert "Paris" in out.text
    assert out.finish_reason == FinishReason.STOP


def test_concurrent_chunked_greedy_equals_mlx_lm(engine, reference_greedy):
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=16))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(engine.model, engine.encode(prompt), 16, engine.eos_token_ids)
    assert engine.stats().kv_used_bytes == 0 and engine.stats().num_running == 0


def test_prefix_cache_hit_equals_miss_on_the_default_model(engine, reference_greedy):
    system = {"role": "system", "content": "You are a terse assistant. Answer every question in at most "
                                           "one short sentence, with no preamble and no follow-up."}
    first = [system, {"role": "user", "content": "What is the capital of Italy?"}]
    second = [system, {"role": "user", "content": "What is the capital of Spain?"}]
    greedy = SamplingParams(max_tokens=12)
    engine.generate([first], greedy)
    hits = engine.stats().prefix_cache_hits
    warm = engine.generate([second], greedy)[0]
    assert engine.stats().prefix_cache_hits == hits + 1 and warm.num_cached_tokens > 20
    assert warm.token_ids == reference_greedy(engine.model, engine.encode(second), 12, engine.eos_token_ids)
