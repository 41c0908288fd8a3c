"""The memory model's transient coefficients: the sets per MLX backend and per model shape, each with
where it came from (the script and data file that fitted it), and how the engine picks one.

The coefficients depend on how the backend runs attention. `CPU_COEFFICIENTS` were chosen by hand on
MLX's CPU backend from least-squares fits of measured forwards of small random llamas, rounded up until
no measured step exceeded them (the decode ones refitted by hand on a grid of decode steps when the KV
pool replaced per-request buffers, see docs/memory.md); scripts/calibrate_memory.py reports how they do
on random workloads and searches others, and tests/engine/test_memory_measured.py checks them step by
step.
A set for CUDA depends on how many operations MLX batches per committed CUDA graph
(`ExecutionConfig.max_ops_per_buffer`): MLX frees a kernel's temporaries only when its batch has run.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

from engine.core.memory.shape import ModelShape


@dataclass(frozen=True)
class TransientCoefficients:
    """Multipliers of each term of the transient formulas (see the module docstring)."""

    prefill_scores: float
    prefill_mask: float
    prefill_mlp: float
    prefill_hidden: float
    prefill_logits: float
    decode_gather: float
    decode_scores: float
    decode_logits: float
    decode_mlp: float
    decode_hidden: float
    sampling: float = 11.0  # x 4*V per sampling row: temperature / top-k / top-p temporaries
    prefill_gather: float = 1.0  # x n*H_kv*(2*d*s + 4): one layer's KV of the row, gathered from the pool
    # The per-layer terms count min(L, layers_in_flight) layers: 1 where MLX frees a layer's
    # intermediates before the next layer runs (CPU); more on CUDA, which frees them per committed batch.
    layers_in_flight: int = 1
    step_overhead_bytes: int = 0  # added to every forward (0 on CPU)
    prefill_overhead_bytes: int = 0  # added to every prompt chunk of more than one token (0 on CPU)
    # x I*s per layer in flight, whatever the chunk's size (prompt chunks of more than one token): a
    # per-layer constant that scales with the MLP width (fitted on CUDA; 0 on CPU)
    prefill_layer_rows: float = 0.0
    # x B*H*ceil(n/kv_step)*(kv_step/64)*(d+2)*4, the paged kernel's float32 partials; None: not fitted on
    # paged decodes, which it then predicts as gathering ones (an over-estimate)
    decode_paged: Optional[float] = None
    # A step's decode rows run in its first chunk's forward (engine/model/layers/mixed.py) only for models
    # with more layers than this. On CUDA, which frees per committed batch, a model no deeper than the
    # batches in flight holds every layer's temporaries at once, and there a mixed forward measured above
    # `MemoryModel.mixed_bytes` (docs/memory.md). Not a fitted coefficient: a per-model fit leaves it.
    mixed_min_layers: int = 0


# MLX's CPU backend with the engine's attention and SwiGLU of engine/model/layers/cpu_math.py (what the
# engine's layer loops run there), fitted from above (`bench_memory_grid.py --fit`) on single prompt chunks
# (16-512 tokens, contexts up to 2040, each read as a view and again as a gather) and synchronous decodes
# (1-16 rows, 256-1800 keys) of five 2-layer shapes: the tiny model's (head_dim 16, hidden 64) and head_dim
# 32-64 ones up to hidden 1024. A causal chunk's attention holds about 0.4 x 4*H*c*n bytes (scores by
# blocks of queries, with their mask and exponentials), which shapes of wide hidden sizes alone hid under
# the hidden-size term. prefill_logits is raised to what a prompt of a few tokens measures (its logits
# row, 4*V bytes, and their argmax; the grid has few prompt ends, where the other terms dominate). The
# decode terms are the larger of the fit's and the earlier set's: the grid's decodes run one at a time,
# the engine's are pipelined (measured from launch to finish while the next one is built), which the
# earlier set bounded. The fit touches its largest points; the prefill terms are 5% above it, because the
# same chunk measures a few percent more late in a long test session than in the grid's fresh process (MLX
# serves an allocation from a larger cached buffer and its peak counts the buffer, docs/memory.md):
#     python scripts/bench_memory_grid.py --model tiny --chunks 16,64,128,256,512 --prefill-length 2040 \
#         --decode-rows 16,8,4,2,1 --decode-contexts 256,1024,1800 --variants --out grid.json
#     python scripts/bench_memory_grid.py --model tiny --grids prefill-gathers --chunks 16,64,128,256,512 \
#         --prefill-length 2040 --variants --out gathers.json   # both in scripts/data/cpu_i24_grid.json
#     python scripts/bench_memory_grid.py --fit scripts/data/cpu_i24_grid.json --backend cpu \
#         --layers-in-flight 1                                                # scripts/data/cpu_i24_fit.json
CPU_COEFFICIENTS = TransientCoefficients(  # the fit's prefill terms x 1.05 (below)
    prefill_scores=0.2379, prefill_mask=4.223, prefill_mlp=3.131, prefill_hidden=10.75, prefill_logits=1.05,
    decode_gather=1.038, decode_scores=2.0, decode_logits=1.3, decode_mlp=6.0, decode_hidden=16.0,
    prefill_gather=1.062, step_overhead_bytes=185, prefill_overhead_bytes=930, prefill_layer_rows=18.74,
)
# The CPU backend with MLX's attention (forwards through mlx-lm's modules), and Metal, which has no data
# of its own: the set chosen by hand before cpu_math.py (docs/memory.md).
CPU_MLX_ATTENTION_COEFFICIENTS = TransientCoefficients(
    prefill_scores=1.23, prefill_mask=1.42, prefill_mlp=2.66, prefill_hidden=13.0, prefill_logits=2.4,
    decode_gather=1.0, decode_scores=2.0, decode_logits=1.3, decode_mlp=6.0, decode_hidden=16.0,
)

# Fitted on an H200 (MLX 0.32.4 CUDA, default MLX settings, KV-pool engine before slice reads and the
# summed decode phases; 8B and three 2-layer shapes) from scripts/data/h200_pool_grid.json, from above (no
# grid point under-predicted), with the per-forward constants of the fit (step_overhead_bytes, and per
# prompt chunk prefill_layer_rows: the fixed allocations every forward / chunk makes whatever its size):
#     python scripts/bench_memory_grid.py --fit scripts/data/h200_pool_grid.json --backend cuda
# `sampling` is not in the grids (greedy rows): the CPU value.
CUDA_COEFFICIENTS = TransientCoefficients(
    prefill_scores=0.0005553, prefill_mask=1.437, prefill_mlp=1.91, prefill_hidden=4.752, prefill_logits=143.3,
    decode_gather=0.9606, decode_scores=1.286, decode_logits=4.487, decode_mlp=0.1309, decode_hidden=0.195,
    sampling=11.0, prefill_gather=0.6055, layers_in_flight=32, step_overhead_bytes=248500,
    prefill_overhead_bytes=0, prefill_layer_rows=95.44,
    mixed_min_layers=32,  # not measured without ops 8: its window, as under ops 8
)
# The same with at most 8 ops per committed batch (ExecutionConfig.max_ops_per_buffer, the engine's
# default on CUDA: fewer layers' temporaries coexist), this engine (slice reads, paged decode attention),
# fitted from above on each chunk size's largest point, without context-dependent prefill terms (cuDNN's
# attention never materializes the scores), on the prefill points of scripts/data/h200_s5_grid_paged.json
# and the decode points of scripts/data/h200_s6_grid_decode.json (the paged kernel's partials per 64-key
# span), 8B and three 2-layer shapes:
#     python scripts/bench_memory_grid.py --merge scripts/data/h200_s5_grid_paged.json,\
#         scripts/data/h200_s6_grid_decode.json --out scripts/data/h200_s6_grid_merged.json
#     python scripts/bench_memory_grid.py --fit scripts/data/h200_s6_grid_merged.json --backend cuda \
#         --exclude-terms prefill_scores,prefill_mask --chunk-maxima
# One set for every model shape over-predicts each one; a fit on the served model alone (--fit-variants,
# then EngineConfig.memory_coefficients) is tighter: docs/memory.md.
CUDA_OPS8_COEFFICIENTS = TransientCoefficients(
    prefill_scores=0.0, prefill_mask=0.0, prefill_mlp=2.057, prefill_hidden=6.208, prefill_logits=0.0,
    decode_gather=1.001, decode_scores=0.01799, decode_logits=1.465, decode_mlp=2.729, decode_hidden=2.585,
    sampling=11.0, prefill_gather=1.001, layers_in_flight=7, step_overhead_bytes=50710,
    prefill_overhead_bytes=0, prefill_layer_rows=132.5, decode_paged=1.018, mixed_min_layers=7,
)


def with_overrides(base: TransientCoefficients, overrides: Optional[dict] = None) -> TransientCoefficients:
    """`base` with some coefficients replaced (EngineConfig.memory_coefficients)."""
    if not overrides:
        return base
    known = {f.name for f in fields(TransientCoefficients)}
    for name, value in overrides.items():
        if name not in known:
            raise ValueError(f"memory_coefficients: unknown coefficient {name!r}; known: {sorted(known)}")
        if value is None and name == "decode_paged":
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"memory_coefficients: {name}={value!r} must be a number >= 0")
    values = dict(overrides)
    for name in ("layers_in_flight", "mixed_min_layers", "step_overhead_bytes", "prefill_overhead_bytes"):
        if name in values:
            values[name] = int(values[name])
    return replace(base, **values)


def shape_key(shape: ModelShape) -> tuple:
    """What a shape calibration is keyed by: every dimension the formulas read (not the weights' bytes)."""
    return (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
            shape.intermediate_size, shape.vocab_size, shape.dtype_bytes)


# Calibrations of one model shape under one backend set: that shape's own grid points fitted alone are
# tighter than the set fitted for every shape (vLLM ships its tuned kernel configurations per shape and
# device the same way). Used in place of the backend's set for a model of that shape; a deployment's
# EngineConfig.memory_coefficients still applies on top. The Llama-3-8B shape in bf16 (Llama 3 / 3.1
# 8B), CUDA under ops 8, from the 8B points of scripts/data/h200_s6_grid_merged.json, with the backend
# set's layers_in_flight (so the terms no grid point fits, such as a fragmented row's gathered KV, count
# as many layers as in that set; docs/memory.md):
#     python scripts/bench_memory_grid.py --fit scripts/data/h200_s6_grid_merged.json --backend cuda \
#         --fit-variants llama-8b --exclude-terms prefill_scores,prefill_mask --chunk-maxima \
#         --layers-in-flight 7        # scripts/data/h200_s7_fit_llama8b.json
LLAMA3_8B_BF16 = (32, 4096, 32, 8, 128, 14336, 128256, 2)
SHAPE_CALIBRATIONS = {  # (backend set's name, shape_key) -> (what it is, the set)
    # the fit's coefficients that differ from the set's (gathers and layers_in_flight are the set's)
    ("cuda-ops8", LLAMA3_8B_BF16): ("llama-3-8b bf16 calibration of the cuda-ops8 set", replace(
        CUDA_OPS8_COEFFICIENTS, prefill_mlp=1.578, prefill_hidden=5.522, decode_scores=2.109,
        decode_logits=0.1704, decode_mlp=0.4355, decode_hidden=1.524, step_overhead_bytes=1187000,
        prefill_overhead_bytes=27460000, prefill_layer_rows=136.9, decode_paged=0.03679)),
}


def coefficients_for_backend(name: str, max_ops_per_buffer: Optional[int] = None,
                             cpu_math: bool = True) -> TransientCoefficients:
    """The coefficient set of an MLX backend: "cpu", "cuda", or "metal" (no Metal data yet: the CPU
    set with MLX's attention, whose one-layer-at-a-time freeing Metal's per-command-buffer release may
    not match). `max_ops_per_buffer`: the ops MLX batches per committed CUDA graph
    (ExecutionConfig.max_ops_per_buffer as resolved for the backend; None: MLX's default); on CUDA at
    most 8 picks the set fitted so. `cpu_math`: on the CPU, the engine's layer loops run engine/model/layers/cpu_math.py (else MLX's
    attention)."""
    cpu = CPU_COEFFICIENTS if cpu_math else CPU_MLX_ATTENTION_COEFFICIENTS
    table = {"cpu": cpu, "cuda": CUDA_COEFFICIENTS, "metal": CPU_MLX_ATTENTION_COEFFICIENTS}
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in table:
        raise ValueError(f"unknown MLX backend {name!r}: expected one of {sorted(table)}")
    if key == "cuda" and max_ops_per_buffer is not None and 0 < max_ops_per_buffer <= 8:
        return CUDA_OPS8_COEFFICIENTS
    return table[key]


def coefficients_for(name: str, max_ops_per_buffer: Optional[int] = None,
                     shape: Optional[ModelShape] = None, cpu_math: bool = True) -> tuple[TransientCoefficients, str]:
    """(the set, what it is): the backend's set (`coefficients_for_backend`), or its calibration for
    `shape` where one ships (SHAPE_CALIBRATIONS)."""
    base = coefficients_for_backend(name, max_ops_per_buffer, cpu_math)
    set_name = ("cuda-ops8" if base is CUDA_OPS8_COEFFICIENTS else "cuda" if base is CUDA_COEFFICIENTS
                else "cpu-mlx-attention" if base is CPU_MLX_ATTENTION_COEFFICIENTS and name.strip().lower() == "cpu"
                else name.strip().lower())
    entry = SHAPE_CALIBRATIONS.get((set_name, shape_key(shape))) if shape is not None else None
    return (entry[1], entry[0]) if entry else (base, f"{set_name} set")
