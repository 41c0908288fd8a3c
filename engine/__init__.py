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
import threading
from typing import Any

# MLX's CUDA backend sizes a thread's cuDNN attention graph cache, and arms its thrashing check, at that
# thread's first GPU work (an allocation: importing mlx_lm makes one). A server meets new prompt-chunk
# shapes for most prompts, so the engine keeps more graphs and turns the check off, set here, before the
# engine's own MLX work (an explicit setting wins; the names are CUDA's alone).
CUDA_CACHE_DEFAULTS = {"MLX_CUDA_SDPA_CACHE_SIZE": "1024", "MLX_ENABLE_CACHE_THRASHING_CHECK": "0"}
for _name, _value in CUDA_CACHE_DEFAULTS.items():
    os.environ.setdefault(_name, _value)
# mlx loaded before these were set: the main thread's and this importing thread's caches may have been
# built with MLX's defaults already (engine.backend.sdpa_graph_cache_size)
MLX_LOADED_FIRST = "mlx.core" in sys.modules
IMPORTING_THREAD_ID = threading.get_ident()

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
