"""Engine fixtures: the tiny random llama (real MLX) with the default model's tokenizer."""

from __future__ import annotations

import json
import os

import pytest

from engine.config import EngineConfig


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory):
    """Reuse $MLX_SERVE_CACHE (scripts/test sets it) so conversions happen once per machine."""
    return os.environ.get("MLX_SERVE_CACHE") or str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def random_llama():
    """Build a random-weight mlx-lm llama from ModelArgs fields (2 layers, 4 heads, 2 KV heads unless
    given): (model, the config.json-style dict an Engine takes)."""
    def build(**fields):
        import mlx.core as mx
        from mlx_lm.models import llama

        args = llama.ModelArgs(**{**dict(model_type="llama", num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=4096),
                                  **fields})
        model = llama.Model(args)
        mx.eval(model.parameters())
        config = {k: getattr(args, k) for k in ("hidden_size", "num_hidden_layers", "intermediate_size",
                                                "num_attention_heads", "num_key_value_heads", "vocab_size",
                                                "max_position_embeddings")}
        return model, config

    return build


@pytest.fixture(scope="session")
def tiny_parts(model_cache_dir):
    from engine.model.loader import load_model, resolve_model_path

    path = resolve_model_path("tiny", cache_dir=model_cache_dir, progress=False)
    model, tokenizer = load_model(path)
    return model, tokenizer, json.loads((path / "config.json").read_text())


def reference_greedy_ids(model, prompt_ids, max_tokens, eos_ids=()):
    """mlx-lm's own greedy generation of one prompt alone: what the engine must reproduce."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens):
        out.append(int(token))
        if out[-1] in eos_ids:
            break
    return out


@pytest.fixture
def reference_greedy():
    return reference_greedy_ids


@pytest.fixture
def run_to_completion():
    """Step an engine until every request finished: request id -> its generated token ids."""
    def run(engine) -> dict:
        tokens: dict = {}
        while engine.has_unfinished():
            for out in engine.step().outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens

    return run


@pytest.fixture
def make_engine(tiny_parts, model_cache_dir):
    """Build an Engine on the shared tiny model with any config overrides."""
    from engine.engine import Engine

    def build(runner_options=None, async_decode: bool = True, overlap_steps=None, launch_thread=None,
              launch_ahead=None, **overrides):
        """`runner_options`: a RunnerOptions (the runner's other ways, to compare); `async_decode`:
        False runs decode steps one after another (the engine pipelines them); `overlap_steps`: True
        leaves a step's last prompt chunk running into the next (None: the engine's choice);
        `launch_thread`: True encodes pipelined decodes on a thread of their own (None: on CUDA only);
        `launch_ahead`: False keeps the thread from encoding the next decode before the one before ends."""
        from engine.core.types import StepOptions
        from engine.model.runner import RunnerOptions

        model, tokenizer, model_config = tiny_parts
        cfg = EngineConfig(model="tiny", cache_dir=model_cache_dir,
                           memory_limit_bytes=overrides.pop("memory_limit_bytes", 4 << 30), **overrides)
        return Engine(model, tokenizer, cfg, model_config, runner_options=runner_options or RunnerOptions(),
                      step_options=StepOptions(async_decode=async_decode, overlap_steps=overlap_steps,
                                                         launch_thread=launch_thread, launch_ahead=launch_ahead))

    return build
