"""MLX inference engine: a token-budgeted chunked-prefill scheduler, a memory model and a runner.

Nothing in this package imports ray (house rule): it is usable on its own. Two layers:
- `engine.core`: the scheduling core (scheduler, KV manager, memory model, request types); no mlx;
- `engine.model`: what runs on MLX (runner, KV pool, loader, sampling, layer loops, kernels).

The public API is exported here. Names that need MLX (Engine, AsyncEngine) load on first use, so that
importing `engine.core` or `engine.config` never imports mlx.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

# MLX's CUDA backend sizes a thread's cuDNN attention graph cache, and arms its thrashing check, when the
# thread first uses it: the thread that loads mlx at once. A server meets new prompt-chunk shapes for
# most prompts, so the engine keeps more graphs and turns the check off, set here before the engine loads
# mlx (an explicit setting wins; the names are CUDA's alone).
CUDA_CACHE_DEFAULTS = {"MLX_CUDA_SDPA_CACHE_SIZE": "1024", "MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}
for _name, _value in CUDA_CACHE_DEFAULTS.items():
    os.environ.setdefault(_name, _value)
# mlx loaded before these were set: the loading thread's caches kept MLX's defaults (engine.backend)
MLX_LOADED_FIRST = "mlx.core" in sys.modules

_EXPORTS = {
    "Engine": "engine.engine",
    "AsyncEngine": "engine.async_engine",
    "EngineConfig": "engine.config",
    "ExecutionConfig": "engine.config",
    "SamplingParams": "engine.core.types",
    "Grammar": "engine.core.types",
    "LogitBias": "engine.core.types",
    "TokenLogprob": "engine.core.types",
    "TopLogprob": "engine.core.types",
    "check_grammar": "engine.model.grammar",
    "JSON_GRAMMAR_OPTIONS": "engine.model.grammar",
    "RequestOutput": "engine.core.types",
    "CompletionOutput": "engine.core.types",
    "FinishReason": "engine.core.types",
    "EngineStats": "engine.core.types",
    "StepRecord": "engine.core.types",
    "StepMemory": "engine.core.types",
    "StepOptions": "engine.core.types",
    "ExecutionPaths": "engine.core.types",
    "ForwardTiming": "engine.core.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
