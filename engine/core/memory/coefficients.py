"""The memory model's transient coefficients: the sets per MLX backend and per model shape, each with
where it came from (the script and data file that fitted it), and how the engine picks one.

The coefficients depend on how the backend runs attention and frees its arrays. The CPU sets are fitted
on a grid of measured forwards (below); tests/engine/test_memory_measured.py, test_step_budget.py and
test_families.py check them step by step, and scripts/calibrate_memory.py reports how they do on random
workloads.
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
    # x a sliding layer's window of KV gathered from its ring, where one layer's attention is a stage
    # (`phases_apart`: the larger of a global layer's and a sliding one's); None: prefill_gather's
    prefill_window_gather: Optional[float] = None
    # The per-layer terms count min(L, layers_in_flight) layers: 1 where MLX frees a layer's
    # intermediates before the next layer runs (CPU); more on CUDA, which frees them per committed batch.
    layers_in_flight: int = 1
    # layers whose gathered row KV (a chunk of a fragmented row) coexist, where a calibration fitted on
    # views only counts fewer layers in flight than its set (0: layers_in_flight)
    row_gather_layers: int = 0
    step_overhead_bytes: int = 0  # added to every forward (0 on CPU)
    prefill_overhead_bytes: int = 0  # added to every prompt chunk of more than one token (0 on CPU)
    # x I*s per layer in flight, whatever the chunk's size (prompt chunks of more than one token): a
    # per-layer constant that scales with the MLP width (fitted on CUDA; 0 on CPU)
    prefill_layer_rows: float = 0.0
    # x D*s per layer in flight in each stage of a prompt chunk of more than one token, whatever its size:
    # what a small chunk's arrays hold beyond their rows (the CPU allocator's pages; 0 on CUDA)
    prefill_stage_rows: float = 0.0
    # x B*H*ceil(n/kv_step)*(kv_step/64)*(d+2)*4, the paged kernel's float32 partials; None: not fitted on
    # paged decodes, which it then predicts as gathering ones (an over-estimate)
    decode_paged: Optional[float] = None
    # The runner waits for a forward's layers before it queues its LM head (ModelRunner.stage_waits, on
    # MLX's CPU backend): a decode's or a mixed forward's transient is then the larger of its layers' and
    # its head's, not their sum
    head_apart: bool = False
    # ... and, in a prompt chunk's forward, for each layer's attention before its MLP (the engine's chunk
    # loop, engine/model/layers/chunk_path.py and mixed.py, on the CPU): a chunk's transient is then the
    # largest of its layers' attention (with `prefill_attention_hidden` hidden rows), their MLP (with
    # `prefill_hidden`) and its head
    phases_apart: bool = False
    # x c*D*s per layer in flight: the hidden-size rows of a chunk's attention stage (`phases_apart`; else
    # all of them are `prefill_hidden`'s) ...
    prefill_attention_hidden: float = 0.0
    # ... and of its projections' stage before it (the norm, q/k/v, their rotation and the KV write; the
    # runner waits for it apart: `phases_apart`)
    prefill_projection_hidden: float = 0.0
    # x c*D*s more in the attention stage of a prompt's first chunk (its context its own tokens alone):
    # measured on the CPU's chunk loop at every shape, 0.4-1.3 hidden rows above a later chunk's
    prefill_first_rows: float = 0.0
    # x (I + D)*s: the last layer's MLP of a prompt's sampled position, in its head's stage (`phases_apart`:
    # one row's operations, too small for MLX's worker to free any before the host queues the next)
    prefill_head_rows: float = 0.0
    # MLX's CPU allocator gives an array of a page or more whole pages: a prompt chunk's per-array terms
    # (its rows, scores, mask, gathered K and V) round each array up to this (0: the bytes as computed)
    allocation_page_bytes: int = 0
    # x a family's extra hidden-size rows (ModelShape.extra_attention_rows, extra_mlp_rows: q/k head norms'
    # outputs, MoE token copies, ...): how many of those arrays the backend keeps alive at the peak
    family_rows: float = 1.0
    # A causal chunk's attention scores its queries in this many blocks, one after another
    # (engine/model/layers/cpu_math.py's QUERY_BLOCKS, the engine's chunk loop on the CPU): the scores and
    # mask terms count one block's ceil(c / blocks) queries (1: every query's at once)
    attention_query_blocks: int = 1
    # A step's decode rows run in its first chunk's forward (engine/model/layers/mixed.py) only for models
    # with more layers than this. On CUDA, which frees per committed batch, a model no deeper than the
    # batches in flight holds every layer's temporaries at once, and there a mixed forward measured above
    # `MemoryModel.mixed_bytes` (docs/memory.md). Not a fitted coefficient: a per-model fit leaves it.
    mixed_min_layers: int = 0


@dataclass(frozen=True)
class TransientTerms:
    """What each coefficient of a TransientCoefficients (the field of the same name) multiplies in one
    forward's transient, and the bytes no coefficient scales (a family's extra arrays, `fixed_bytes`):
    the transient is `bytes(coefficients)`. The memory model builds them (MemoryModel.chunk_terms and
    the decode's), and a fit (scripts/bench_memory_grid.py) reads them as its columns."""

    prefill_scores: float = 0.0
    prefill_mask: float = 0.0
    prefill_gather: float = 0.0
    prefill_window_gather: float = 0.0
    prefill_mlp: float = 0.0
    prefill_hidden: float = 0.0
    prefill_logits: float = 0.0
    prefill_layer_rows: float = 0.0
    prefill_stage_rows: float = 0.0
    prefill_attention_hidden: float = 0.0
    prefill_projection_hidden: float = 0.0
    prefill_first_rows: float = 0.0
    prefill_head_rows: float = 0.0
    family_rows: float = 0.0
    decode_gather: float = 0.0
    decode_paged: float = 0.0
    decode_scores: float = 0.0
    decode_logits: float = 0.0
    decode_mlp: float = 0.0
    decode_hidden: float = 0.0
    sampling: float = 0.0
    step_overhead_bytes: float = 0.0
    prefill_overhead_bytes: float = 0.0
    fixed_bytes: float = 0.0

    def bytes(self, coefficients: "TransientCoefficients") -> float:
        total = self.fixed_bytes
        for f in fields(self):
            if f.name != "fixed_bytes":
                total += (getattr(coefficients, f.name) or 0.0) * getattr(self, f.name)
        if coefficients.prefill_window_gather is None:  # a set without its own: the pool gather's
            total += coefficients.prefill_gather * self.prefill_window_gather
        return total

    def __add__(self, other: "TransientTerms") -> "TransientTerms":
        return TransientTerms(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: "TransientTerms") -> "TransientTerms":
        return TransientTerms(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})


# MLX's CPU backend with the engine's layer loops (attention and SwiGLU of engine/model/layers/cpu_math.py),
# whose every stage the runner waits for (`head_apart`, `phases_apart`, one query block of 16 at a time:
# docs/memory.md). Fitted by a linear program (`bench_memory_grid.py --fit --fit-method lp`) on one grid of
# this engine (scripts/data/cpu_i21_grid.json): single prompt chunks (16-512 tokens, contexts up to 2040,
# each read as a view and again as a gather), each stage of those chunks measured alone (`--grids
# stages`), pipelined decodes (1-16 rows, 256-1800 keys) and every engine step of the engine tests'
# workloads (`--grids steps`), for four 2-layer llama shapes (head_dim 32-64, hidden 256-1024) and the
# engine tests' checkpoint of every family at hidden 256 (`--families all`; a family's own arrays counted
# by ModelShape's terms). Every grid point is predicted at >= 1.02 x its measure + 8 KB (each measured on a
# fresh buffer cache; a serving process's warm one counts up to a page or two more per array), every
# recorded engine step (measured as the engine runs) at >= its measure + 8 KB, and the families' steps'
# excess over 1.2 x least (`--fit-steps`). The tiny test model (hidden 64, whose 4 KB pages weigh most) has its own
# calibration (SHAPE_CALIBRATIONS):
#     python scripts/bench_memory_grid.py --model tiny --chunks 16,64,128,256,512 --prefill-length 2040 \
#         --decode-rows 16,8,4,2,1 --decode-contexts 256,1024,1800 \
#         --grids prefill,prefill-gathers,stages,decode,steps --variants --families all --pipelined \
#         --out scripts/data/cpu_i21_grid.json
#     python scripts/bench_memory_grid.py --fit scripts/data/cpu_i21_grid.json --backend cpu --fit-path loops \
#         --fit-method lp --fit-start scripts/data/cpu_i24_fit.json:cpu --min-terms prefill_window_gather=1 \
#         --fit-variants test-2layers,test-wide-mlp,d256-h4-i512-v32k,d1024-h16-i2816-v16k,$F --fit-steps $F \
#         --layers-in-flight 1 --margin 1.02 --margin-bytes 8192           # scripts/data/cpu_i21_fit.json "cpu"
# with F=llama-d256,qwen2-d256,qwen3-d256,phi3-d256,qwen3_moe-d256,gemma-d256,gemma2-d256,gemma3_text-d256
CPU_COEFFICIENTS = TransientCoefficients(
    prefill_scores=3.112, prefill_mask=0.0, prefill_mlp=3.176, prefill_hidden=2.888, prefill_logits=1.057,
    decode_gather=1.014, decode_scores=1.712, decode_logits=1.068, decode_mlp=5.572, decode_hidden=17.2,
    prefill_gather=0.9903, prefill_window_gather=1.001, step_overhead_bytes=6160,
    prefill_overhead_bytes=0, prefill_layer_rows=0.0, prefill_stage_rows=9.396,
    prefill_attention_hidden=3.571, prefill_projection_hidden=6.969, prefill_first_rows=0.9992,
    prefill_head_rows=3.061, family_rows=1.42, allocation_page_bytes=4096, head_apart=True,
    phases_apart=True, attention_query_blocks=16,
)
# The CPU backend with forwards through mlx-lm's modules (quantized weights; or
# RunnerOptions(layer_loops=False) / cpu_math off): the runner waits between a forward's layers and its
# head only. Fitted on the same grid's points of Qwen3-MoE, Gemma 1-3 and quantized weights (recorded when
# those ran the modules) and of every loop family and llama shape run through the modules:
#     python scripts/bench_memory_grid.py --fit scripts/data/cpu_i24_grid.json --backend cpu \
#         --fit-path modules --layers-in-flight 1 --margin 1.03 --margin-bytes 24576
#                                                        # scripts/data/cpu_i24_fit.json "cpu-mlx-attention"
CPU_MLX_ATTENTION_COEFFICIENTS = TransientCoefficients(
    prefill_scores=0.9494, prefill_mask=2.763, prefill_mlp=2.695, prefill_hidden=14.64, prefill_logits=1.02,
    decode_gather=1.034, decode_scores=0.8015, decode_logits=1.044, decode_mlp=2.1, decode_hidden=13.52,
    prefill_gather=1.025, step_overhead_bytes=24977, prefill_overhead_bytes=364, prefill_layer_rows=3.627,
    family_rows=1.226, head_apart=True,
)
# Metal, which has no data of its own: the same, with the head's logits beside the last layer's arrays
# (the runner waits between a forward's stages on the CPU only)
METAL_COEFFICIENTS = replace(CPU_MLX_ATTENTION_COEFFICIENTS, head_apart=False)

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
    for name in ("layers_in_flight", "row_gather_layers", "mixed_min_layers", "step_overhead_bytes",
                 "prefill_overhead_bytes", "attention_query_blocks", "allocation_page_bytes"):
        if name in values:
            values[name] = int(values[name])
    for name in ("head_apart", "phases_apart"):
        if name in values:
            values[name] = bool(values[name])
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
# Its five decode terms (scores, logits, MLP, hidden, paged partials) are each the larger of that fit's
# and a second one's, with the decodes of today's kernel (the span kernel, the token-major pool) measured
# with the q/k rope unfused and fused: a one-row decode measured 1.007 x the first fit's prediction
# unfused (1.11 x fused), while the second fit alone (decode scores 0.0294, a per-forward constant of 8.3
# MB) under-predicted 81 one- and two-row decodes of the 3 GB tight burst by up to 1.23 x (fused: 460
# decodes of 1-4 rows, 1.39 x; scripts/data/h200_i24_tight_burst.json, refit_decode_at_d6d6a06; its grid
# has 1, 4 and 16 rows). A prediction grows with every coefficient, so it is never below either fit's:
# the recorded runs with the q/k rope unfused stayed within the first's, and the second's grid points are
# predicted at >= 1.18 x unfused and >= 1.05 x fused (tests/unit/test_bench_scripts.py). The prefill
# terms, the gathered decode's and the per-forward constant are the first fit's:
#     python scripts/bench_memory_grid.py --merge scripts/data/h200_s6_grid_merged.json,\
#         scripts/data/h200_i25_grid_decode.json:plain,scripts/data/h200_i25_grid_decode.json:fused_rope \
#         --out scripts/data/h200_i25_grid_merged.json
#     python scripts/bench_memory_grid.py --fit scripts/data/h200_i25_grid_merged.json --backend cuda \
#         --fit-variants llama-8b --exclude-terms prefill_scores,prefill_mask --chunk-maxima \
#         --layers-in-flight 7        # scripts/data/h200_i25_fit_llama8b.json
LLAMA3_8B_BF16 = (32, 4096, 32, 8, 128, 14336, 128256, 2)
# The Qwen3-8B shape in bf16, CUDA under ops 8, measured in prompt chunks of 512 tokens only (the H200
# prefill runs of scripts/data/h200_i21_prefill_families.json at 9c28baa and c25d549): the Llama-3-8B
# calibration's prefill terms (the same dimensions but the MLP and vocabulary; its fit separates the
# per-token and per-chunk terms over five chunk sizes) with its two per-token coefficients scaled by the
# one factor that predicts both runs' tightest step at 1.05 x its measure: the copy of a long prompt's KV
# for its last query and a mixed forward's decode rows (neither of which the runs' measures show) then
# stay within 1.2 x (docs/memory_cuda.md). The decode terms stay the set's (no Qwen3 decode was measured):
#     python scripts/bench_memory_grid.py --replay-prefill scripts/data/h200_i21_prefill_families.json:qwen3-8b,\
#         scripts/data/h200_i21_prefill_families.json:at_c25d549/qwen3-8b --backend cuda --replay-views \
#         --replay-coefficients scripts/data/h200_s7_fit_llama8b.json --fit-scale prefill_mlp,prefill_hidden \
#         --margin 1.05
QWEN3_8B_BF16 = (36, 4096, 32, 8, 128, 12288, 151936, 2)
# The Gemma-3-12B shape in bf16 (sliding-window layers in rings), CUDA under ops 8, through the engine's
# layer loops: its H200 grids in scripts/data/h200_i21_prefill_families.json (prompt chunks of 128-2048
# tokens read as views at c25d549; 512- and 2048-token chunks gathered, decodes of 1-16 rows at d1a5613),
# merged, fitted from above with one layer in flight, chunks under 512 tokens bounding the fit only. Three
# coefficients have floors the grids' short contexts cannot set: a global layer's [H, c, n] bf16 scores
# and boolean mask (33 bytes per query and key: the 512-token chunks' growth to 8192 keys), one layer's
# gathered row KV and one layer's paged partials (docs/memory_cuda.md):
#     python scripts/bench_memory_grid.py --merge scripts/data/h200_i21_prefill_families.json:at_c25d549/gemma3-12b_grid,\
#         scripts/data/h200_i21_prefill_families.json:at_d1a5613/gemma3-12b_grid \
#         --out scripts/data/h200_i21_gemma3_grid_merged.json
#     python scripts/bench_memory_grid.py --fit scripts/data/h200_i21_gemma3_grid_merged.json --backend cuda \
#         --fit-variants gemma3-12b --exclude-terms prefill_scores --fit-min-chunk 512 --layers-in-flight 1 \
#         --min-terms prefill_mask=33,prefill_gather=1,decode_paged=1
# The decode's gather and score terms then raised to the set's: the grids' decodes were paged, so the fit saw
# only the sliding layers' window gathers, not a decode that gathers every layer (paged_attention off).
# Its three per-row decode terms (logits, MLP, hidden) are the larger of that fit's and a second one's, with
# the decodes of today's kernels (span kernel, token-major pool) measured with the q/k rope unfused and
# fused (scripts/data/h200_i21_decode_families.json): the first fit under-predicted them, below 0.9 x in
# either grid (a test checks; docs/memory_cuda.md). Its prefill terms are the first fit's:
#     python scripts/bench_memory_grid.py --merge scripts/data/h200_i21_prefill_families.json:at_c25d549/gemma3-12b_grid,\
#         scripts/data/h200_i21_prefill_families.json:at_d1a5613/gemma3-12b_grid,\
#         scripts/data/h200_i21_decode_families.json:gemma3-12b_plain,\
#         scripts/data/h200_i21_decode_families.json:gemma3-12b_fused_rope \
#         --out scripts/data/h200_i21_gemma3_grid_merged_decodes.json
#     python scripts/bench_memory_grid.py --fit scripts/data/h200_i21_gemma3_grid_merged_decodes.json --backend cuda \
#         --fit-variants gemma3-12b --exclude-terms prefill_scores --fit-min-chunk 512 --layers-in-flight 1 \
#         --min-terms prefill_mask=33,prefill_gather=1,decode_paged=1     # h200_i21_fit_gemma3_decodes.json
GEMMA3_12B_BF16 = (48, 3840, 16, 8, 256, 15360, 262208, 2)
# The engine tests' tiny model (hidden 64, float32) under the CPU set, through the layer loops: its own grid
# points and engine steps of scripts/data/cpu_i21_grid.json, fitted as the set is; its prompt-chunk terms and
# per-forward constants (its 256-byte rows make whole 4 KB pages weigh more than at hidden 256), the set's
# decode terms (the tiny fit's decode scores and hidden rows, 0, are what its three rows of 1 KB hide):
#     python scripts/bench_memory_grid.py --fit scripts/data/cpu_i21_grid.json --backend cpu --fit-path loops \
#         --fit-method lp --fit-start scripts/data/cpu_i24_fit.json:cpu --fit-variants tiny --fit-steps tiny \
#         --layers-in-flight 1 --margin 1.02 --margin-bytes 24576         # scripts/data/cpu_i21_fit.json "tiny"
# (24 KB: with 8 KB, a step of 16-token chunks, which the grid's workloads do not make, measured above its
# prediction in tests/engine/test_async_engine.py)
TINY_F32 = (2, 64, 4, 2, 16, 128, 49152, 4)
# (backend set's name, shape_key) -> (what it is, the set, the largest prompt chunk its fit measured: a
# larger prefill_chunk_size takes the backend's set, whose fit covers it; None: the set's chunks)
SHAPE_CALIBRATIONS = {
    # the fit's coefficients that differ from the set's (gathers and layers_in_flight are the set's)
    ("cuda-ops8", LLAMA3_8B_BF16): ("llama-3-8b bf16 calibration of the cuda-ops8 set", replace(
        CUDA_OPS8_COEFFICIENTS, prefill_mlp=1.578, prefill_hidden=5.522, decode_scores=2.109,
        decode_logits=0.4259, decode_mlp=1.089, decode_hidden=3.811, step_overhead_bytes=1187000,
        prefill_overhead_bytes=27460000, prefill_layer_rows=136.9, decode_paged=0.1666), 2048),
    ("cuda-ops8", QWEN3_8B_BF16): ("qwen3-8b bf16 calibration of the cuda-ops8 set (prompt chunks)", replace(
        CUDA_OPS8_COEFFICIENTS, prefill_mlp=1.056, prefill_hidden=3.694, step_overhead_bytes=1187000,
        prefill_overhead_bytes=27460000, prefill_layer_rows=136.9), 512),
    ("cpu", TINY_F32): ("tiny test model calibration of the cpu set", replace(
        CPU_COEFFICIENTS,
        prefill_scores=2.439, prefill_mlp=1.736, prefill_hidden=5.585, prefill_logits=1.042,
        prefill_gather=0.9372, step_overhead_bytes=24130, prefill_overhead_bytes=658,
        prefill_stage_rows=53.79, prefill_attention_hidden=2.617, prefill_projection_hidden=6.411,
        prefill_first_rows=0.0, prefill_head_rows=0.0, family_rows=1.127), None),
    ("cuda-ops8", GEMMA3_12B_BF16): ("gemma-3-12b bf16 calibration of the cuda-ops8 set (layer loops)", replace(
        CUDA_OPS8_COEFFICIENTS, layers_in_flight=1, prefill_mask=33.04, prefill_mlp=8.114, prefill_hidden=32.46,
        prefill_gather=1.393, prefill_layer_rows=944.9, family_rows=0.5875, step_overhead_bytes=0,
        prefill_overhead_bytes=29030000, decode_gather=1.001, decode_scores=0.01799, decode_logits=11.59,
        decode_mlp=395.7, decode_hidden=1583.0, decode_paged=1.001), 2048),
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
    table = {"cpu": cpu, "cuda": CUDA_COEFFICIENTS, "metal": METAL_COEFFICIENTS}
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in table:
        raise ValueError(f"unknown MLX backend {name!r}: expected one of {sorted(table)}")
    if key == "cuda" and max_ops_per_buffer is not None and 0 < max_ops_per_buffer <= 8:
        return CUDA_OPS8_COEFFICIENTS
    return table[key]


def coefficients_for(name: str, max_ops_per_buffer: Optional[int] = None,
                     shape: Optional[ModelShape] = None, cpu_math: bool = True,
                     prefill_chunk_size: Optional[int] = None) -> tuple[TransientCoefficients, str]:
    """(the set, what it is): the backend's set (`coefficients_for_backend`), or its calibration for
    `shape` where one ships (SHAPE_CALIBRATIONS) and its fit measured chunks of `prefill_chunk_size`
    (None: any size)."""
    base = coefficients_for_backend(name, max_ops_per_buffer, cpu_math)
    set_name = ("cuda-ops8" if base is CUDA_OPS8_COEFFICIENTS else "cuda" if base is CUDA_COEFFICIENTS
                else "cpu-mlx-attention" if base is CPU_MLX_ATTENTION_COEFFICIENTS and name.strip().lower() == "cpu"
                else name.strip().lower())
    entry = SHAPE_CALIBRATIONS.get((set_name, shape_key(shape))) if shape is not None else None
    if entry and prefill_chunk_size is not None and entry[2] is not None and prefill_chunk_size > entry[2]:
        return base, f"{set_name} set ({entry[0]} measured chunks up to {entry[2]} tokens)"
    return (entry[1], entry[0]) if entry else (base, f"{set_name} set")
