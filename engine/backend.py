"""Which MLX backend this process runs (CPU, CUDA, Metal) and what follows from it: the memory model's
coefficient set, the default dtype, the device's memory."""

from __future__ import annotations

import os
import threading
from typing import Optional

import mlx.core as mx

import engine
from engine.config import ExecutionConfig
from engine.core.memory.coefficients import coefficients_for
from engine.core.memory.model import ModelShape


def mlx_backend() -> str:
    """"cpu", "cuda" or "metal": which MLX backend runs the default device (the memory model's
    coefficients depend on it)."""
    if mx.default_device() == mx.cpu:
        return "cpu"
    cuda = getattr(mx, "cuda", None)
    return "cuda" if cuda is not None and cuda.is_available() else "metal"


def backend_coefficients(shape: Optional[ModelShape] = None, cpu_math: bool = True,
                         max_ops_per_buffer: Optional[int] = None, prefill_chunk_size: Optional[int] = None):
    """(the memory model's coefficients, what they are) for this process's MLX backend, calibrated for
    `shape` where a calibration ships (coefficients.SHAPE_CALIBRATIONS). `cpu_math`: prompt chunks run
    the layer loop with engine/model/layers/cpu_math.py (on the CPU: the default). `max_ops_per_buffer`:
    ExecutionConfig.max_ops_per_buffer (None: the engine's default for the backend); `prefill_chunk_size`:
    a calibration applies only up to the chunks its fit measured (None: any)."""
    backend = mlx_backend()
    ops = max_ops_per_buffer or ExecutionConfig().resolved_max_ops_per_buffer(backend)
    return coefficients_for(backend, ops, shape, cpu_math, prefill_chunk_size)


def resolve_dtype(name: str) -> str:
    if name != "auto":
        return name
    return "float32" if mx.default_device() == mx.cpu else "bfloat16"


def device_memory_bytes() -> int:
    """What MLX reports for the device: recommended working set (Metal), else physical memory."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def sdpa_graph_cache_size() -> int:
    """How many cuDNN attention graphs MLX's CUDA backend keeps for the calling thread, as the environment
    said when it built that thread's cache (MLX_CUDA_SDPA_CACHE_SIZE); 0 where that is unknown: mlx was
    loaded before the engine set its defaults, and this is the main thread or the one that imported the
    engine, either of which may have done GPU work before (engine/__init__.py)."""
    if engine.MLX_LOADED_FIRST and (threading.current_thread() is threading.main_thread()
                                    or threading.get_ident() == engine.IMPORTING_THREAD_ID):
        return 0
    return int(os.environ.get("MLX_CUDA_SDPA_CACHE_SIZE", "256"))
