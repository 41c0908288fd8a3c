"""MemoryModel: KV bytes, the transient peak of one engine step, and the bound over all steps.

Pure arithmetic on the model's shape and the engine's configuration (no mlx import), so the scheduler,
the admission controller and the tests share one model. The derivation is in docs/memory.md.

Terms, for a model with L layers, H query heads, H_kv KV heads of size d, hidden size D, MLP size I,
vocabulary V, dtype size s bytes (scores are float32: 4 bytes):
- KV per token: 2 * L * H_kv * d * s, reserved per request in steps of `kv_step` tokens.
- Prefill chunk of c tokens of one row whose context after the chunk is n:
      a_s * 4*H*c*n + a_m * c*n + a_g * n*H_kv*(2*d*s + 4) + a_i * c*I*s + a_d * c*D*s + (a_v + z) * 4*V
  (attention scores and their softmax, the causal mask, one layer's KV of the row gathered from the
  pool with its int32 slot index, the MLP intermediates, the hidden-size activations, the last
  position's logits). Rows prefill one after another, each evaluated before the next, so a step's
  prefill transient is the largest chunk's, not the sum.
- Decode of B rows, the longest with n keys, r of them sampling:
      b_d * B*D*s + g * B*n*H_kv*(2*d*s + 4) + b_s * 4*B*H*n + b_i * B*I*s + (b_v * B + z * r) * 4*V
  the hidden states, one layer's KV of the rows gathered from the pool (right-padded to n, with its
  int32 slot index), the scores, the MLP intermediates and the logits: a sum, since the runner
  launches the head while the layers still run (runner.launch), so the last layer's gathered KV and
  the logits can be alive together. A paged decode (`MemoryModel(paged_decode=True)`: the engine's
  runner reads the pool in place with engine/model/kernels/paged_attention.py's kernel) makes no gathered copy; its
  term is instead the kernel's float32 partials, p * B*H*ceil(n / kv_step)*(d + 2)*4 (one softmax
  partial and its two statistics per row, query head and pool block). A one-token prompt chunk is such
  a forward too. Only a coefficient set fitted on paged decodes (p not None) predicts them so; the
  others count the gather (an over-estimate).
- KV pool growth and prefix-cache copies run between forwards, one array at a time: their transient
  is one layer's K (or V) of the old pool / of the copied prefix, plus int32 slot indices
  (`kv_copy_bytes`). The pool never exceeds the KV budget, so `kv_budget_bytes` splits the memory left
  after the weights so that budget + max(forward bound, growth of a full pool) fits in it.
- z (`sampling`): temperature / top-k / top-p temporaries of one row (sort, cumsum, masks), counted
  per sampling row (their graphs are built together, nothing forces one row's to be freed before the
  next one's exist); greedy rows take one argmax.
- On CUDA, MLX frees a kernel's temporaries only when its committed batch of ops has run, so several
  layers' intermediates coexist: every per-layer term above (all but the logits / sampling ones) is
  counted m = min(L, layers_in_flight) times, and a constant `step_overhead_bytes` is added to every
  forward (plus `prefill_overhead_bytes` to every prompt chunk of more than one token, and per layer
  `prefill_layer_rows` rows of MLP width, I*s each, whatever the chunk's size); on the CPU m = 1 and
  these constants are 0 (`coefficients_for_backend`).
The coefficients depend on how the backend runs attention. `CPU_COEFFICIENTS` were chosen by hand on
MLX's CPU backend from least-squares fits of measured forwards of small random llamas, rounded up until
no measured step exceeded them (the decode ones refitted by hand on a grid of decode steps when the KV
pool replaced per-request buffers, see docs/memory.md); scripts/calibrate_memory.py reports how they do
on random workloads and searches others, and tests/engine/test_memory_measured.py checks them step by
step.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

FLOAT32_BYTES = 4
# keys per partial of the paged decode kernel (engine/model/kernels/paged_attention.py): each pool block of kv_step
# tokens gives kv_step / PAGED_PARTIAL_KEYS partials per row and query head
PAGED_PARTIAL_KEYS = 64


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int
    weights_bytes: int = 0

    @classmethod
    def from_config(cls, config: dict, dtype_bytes: int, weights_bytes: int = 0) -> "ModelShape":
        """From an mlx-lm / HF config.json dict (llama family field names)."""
        heads = config["num_attention_heads"]
        return cls(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            dtype_bytes=dtype_bytes,
            weights_bytes=weights_bytes,
        )


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
    # A step's decode rows run in its first chunk's forward (engine/model/layers/mixed.py) only for models with more
    # layers than this. On CUDA, which frees per committed batch, a model no deeper than the batches in
    # flight holds every layer's temporaries at once, and there a mixed forward measured above
    # `MemoryModel.mixed_bytes` (2-layer shapes on an H200 under ops 8: predicted / measured down to 0.687;
    # 8 and 32 layers: at least 1.28; docs/memory.md). Not a fitted coefficient: a per-model fit leaves it.
    mixed_min_layers: int = 0


# MLX's CPU backend with the engine's attention and SwiGLU of engine/model/layers/cpu_math.py (EngineConfig.cpu_math,
# the default there): its prompt chunks score 1/16 of their queries at a time, so the scores term is
# small beside the hidden-size ones. The prefill terms fitted from 2011 prompt chunks of four 2-layer
# shapes (predicted / measured 1.0-1.74); the decode terms kept at the earlier set's, which bound the
# engine's decode loop from above on the same run's 985 decode steps (1.02-2.22: it holds less than
# mlx-lm's modules did):
#     python scripts/calibrate_memory.py --iterations 600
CPU_COEFFICIENTS = TransientCoefficients(
    prefill_scores=0.1, prefill_mask=0.4, prefill_mlp=0.25, prefill_hidden=19.2, prefill_logits=1.6,
    decode_gather=1.0, decode_scores=2.0, decode_logits=1.3, decode_mlp=6.0, decode_hidden=16.0,
    prefill_gather=1.13,
)
# The CPU backend with MLX's attention (cpu_math off), and Metal, which has no data of its own: the set
# chosen by hand before cpu_math (docs/memory.md).
CPU_MLX_ATTENTION_COEFFICIENTS = TransientCoefficients(
    prefill_scores=1.23, prefill_mask=1.42, prefill_mlp=2.66, prefill_hidden=13.0, prefill_logits=2.4,
    decode_gather=1.0, decode_scores=2.0, decode_logits=1.3, decode_mlp=6.0, decode_hidden=16.0,
)

# Fitted on an H200 (MLX 0.32.4 CUDA, default MLX settings, KV-pool engine before slice reads and the
# summed decode phases; 8B and three 2-layer shapes) from scripts/data/h200_pool_grid.json, scaled up
# until no grid point is under-predicted:
#     python scripts/bench_memory_grid.py --fit scripts/data/h200_pool_grid.json --backend cuda
# `sampling` is not in the grids (greedy rows): the CPU value.
CUDA_COEFFICIENTS = TransientCoefficients(
    prefill_scores=0.0, prefill_mask=0.0, prefill_mlp=1.939, prefill_hidden=6.829, prefill_logits=123.0,
    decode_gather=0.9141, decode_scores=2.491, decode_logits=6.371, decode_mlp=0.0, decode_hidden=0.0,
    sampling=11.0, prefill_gather=0.9596, layers_in_flight=29, step_overhead_bytes=1064000,
    mixed_min_layers=29,  # not measured without ops 8: its window, as under ops 8
)
# The same under MLX_MAX_OPS_PER_BUFFER=8 (what scripts/serve sets on CUDA: MLX commits every 8 ops,
# so fewer layers' temporaries coexist), this engine (slice reads, paged decode attention), fitted from
# above on each chunk size's largest point, without context-dependent prefill terms (cuDNN's attention
# never materializes the scores), on the prefill points of the grids of sessions 5 and 6 and the decode
# points of session 6 (the paged kernel's partials per 64-key span), 8B and three 2-layer shapes:
#     python scripts/bench_memory_grid.py --merge scripts/data/h200_s5_grid_paged.json,\
#         scripts/data/h200_s6_grid_decode.json --out scripts/data/h200_s6_grid_merged.json
#     python scripts/bench_memory_grid.py --fit scripts/data/h200_s6_grid_merged.json --backend cuda \
#         --exclude-terms prefill_scores,prefill_mask --chunk-maxima
# One set for every model shape over-predicts each one (1.25x an 8B 512-token chunk); a fit on the served
# model alone (--fit-variants, then EngineConfig.memory_coefficients) is tighter: docs/memory.md.
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


def shape_key(shape: "ModelShape") -> tuple:
    """What a shape calibration is keyed by: every dimension the formulas read (not the weights' bytes)."""
    return (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim,
            shape.intermediate_size, shape.vocab_size, shape.dtype_bytes)


# Calibrations of one model shape under one backend set: that shape's own grid points fitted alone are
# tighter than the set fitted for every shape (vLLM ships its tuned kernel configurations per shape and
# device the same way). Used in place of the backend's set for a model of that shape; a deployment's
# EngineConfig.memory_coefficients still applies on top. The Llama-3-8B shape in bf16 (Llama 3 / 3.1
# 8B), CUDA under ops 8, from the 8B points of session 6's merged grid (173 points, predicted /
# measured 1.0-4.75), with the backend set's layers_in_flight (so the terms no grid point fits, such
# as a fragmented row's gathered KV, count as many layers as in that set; docs/memory.md):
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
    not match). `max_ops_per_buffer`: MLX_MAX_OPS_PER_BUFFER if set; on CUDA at most 8 picks the set
    fitted so. `cpu_math`: on the CPU, the engine's layer loops run engine/model/layers/cpu_math.py (else MLX's
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
                     shape: Optional["ModelShape"] = None, cpu_math: bool = True) -> tuple[TransientCoefficients, str]:
    """(the set, what it is): the backend's set (`coefficients_for_backend`), or its calibration for
    `shape` where one ships (SHAPE_CALIBRATIONS)."""
    base = coefficients_for_backend(name, max_ops_per_buffer, cpu_math)
    set_name = ("cuda-ops8" if base is CUDA_OPS8_COEFFICIENTS else "cuda" if base is CUDA_COEFFICIENTS
                else "cpu-mlx-attention" if base is CPU_MLX_ATTENTION_COEFFICIENTS and name.strip().lower() == "cpu"
                else name.strip().lower())
    entry = SHAPE_CALIBRATIONS.get((set_name, shape_key(shape))) if shape is not None else None
    return (entry[1], entry[0]) if entry else (base, f"{set_name} set")


@dataclass(frozen=True)
class PrefillChunkPlan:
    num_tokens: int  # c: tokens computed in this chunk
    context_len: int  # n: tokens of KV the chunk attends to, itself included
    computes_logits: bool = True  # only the chunk that ends a prompt reaches the LM head
    samples: bool = False  # ... and samples (not greedy) from them
    gathers: bool = True  # False: the row's KV is read as a view of the pool (consecutive blocks)


@dataclass(frozen=True)
class StepPlan:
    """What one engine step computes, as the memory model needs it (plain ints)."""

    decode_context_lens: tuple[int, ...] = ()  # n per decoding row, this step's token included
    decode_samples: int = 0  # decoding rows that sample (temperature > 0)
    prefill_chunks: tuple[PrefillChunkPlan, ...] = ()


def round_up(n: int, step: int) -> int:
    return ((n + step - 1) // step) * step


class MemoryModel:
    def __init__(self, shape: ModelShape, kv_step: int = 256,
                 coefficients: TransientCoefficients = CPU_COEFFICIENTS, paged_decode: bool = False,
                 mixed: bool = False):
        """`paged_decode`: one-query forwards read the KV pool in place (the engine's CUDA kernel, blocks
        of `kv_step` tokens) instead of gathering it. `mixed`: the runner can run a step's decode rows in
        the same forward as its first prompt chunk (engine/model/layers/mixed.py); the scheduler has it do so when
        that forward's transient, both's, stays within the bound of separate forwards."""
        if kv_step < 1:
            raise ValueError(f"kv_step={kv_step} must be >= 1")
        if coefficients.layers_in_flight < 1:
            raise ValueError(f"layers_in_flight={coefficients.layers_in_flight} must be >= 1")
        self.shape = shape
        self.kv_step = kv_step
        self.coefficients = coefficients
        # paged decodes are predicted as such only by a coefficient set fitted on them
        self.paged_decode = paged_decode and coefficients.decode_paged is not None
        self.mixed = mixed and shape.num_layers > coefficients.mixed_min_layers
        # layers whose per-layer intermediates are alive together (1 on CPU)
        self.layer_factor = min(shape.num_layers, coefficients.layers_in_flight)

    # --- KV ---------------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        s = self.shape
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * s.dtype_bytes

    def kv_tokens(self, num_tokens: int) -> int:
        """Tokens of KV actually allocated for `num_tokens`: rounded up to the cache step."""
        return round_up(max(num_tokens, 1), self.kv_step)

    def kv_bytes(self, num_tokens: int) -> int:
        return self.kv_tokens(num_tokens) * self.kv_bytes_per_token

    def kv_copy_bytes(self, num_tokens: int) -> int:
        """Transient of copying one layer's K (or V) of `num_tokens` slots of the pool (growth of a
        pool of that size, or a prefix-cache copy), with its int32 source and destination slots."""
        s = self.shape
        return num_tokens * (s.num_kv_heads * s.head_dim * s.dtype_bytes + 8)

    def kv_budget_bytes(self, available_bytes: int, forward_bound_bytes: int) -> int:
        """KV budget out of `available_bytes` (memory limit less weights) such that
        budget + max(forward_bound, kv_copy_bytes(budget in tokens)) <= available: a full pool's
        growth copy must fit beside it, like a forward's transient (they never run together)."""
        per_token = self.kv_bytes_per_token
        copy_fraction = self.kv_copy_bytes(1) / per_token  # growth transient per byte of pool
        return max(0, min(available_bytes - forward_bound_bytes, int(available_bytes / (1 + copy_fraction))))

    def kv_growth_bound_bytes(self, kv_budget_bytes: int) -> int:
        """The largest pool-growth or prefix-copy transient: one array of a pool as large as the budget."""
        return self.kv_copy_bytes(kv_budget_bytes // self.kv_bytes_per_token)

    # --- transients -------------------------------------------------------------------------------
    def prefill_chunk_bytes(self, num_tokens: int, context_len: int, computes_logits: bool = True,
                            samples: bool = False, gathers: bool = True) -> int:
        s, k, c, n = self.shape, self.coefficients, num_tokens, context_len
        scores = FLOAT32_BYTES * s.num_heads * c * n if c > 1 else 0
        single = FLOAT32_BYTES * s.num_heads * n if c == 1 else 0
        gather = n * s.num_kv_heads * (2 * s.head_dim * s.dtype_bytes + 4) * gathers  # K, V, int32 index
        paged = 0
        if c == 1 and self.paged_decode:  # a one-query forward: the paged kernel, no gather
            gather, paged = 0, self.paged_partials_bytes(1, n)
        per_layer = (
            k.prefill_scores * scores + k.decode_scores * single + k.prefill_mask * c * n
            + k.prefill_gather * gather + (k.decode_paged or 0.0) * paged
            + (k.prefill_layer_rows if c > 1 else 0.0) * s.intermediate_size * s.dtype_bytes
            + k.prefill_mlp * c * s.intermediate_size * s.dtype_bytes
            + k.prefill_hidden * c * s.hidden_size * s.dtype_bytes
        )
        head = (k.prefill_logits * computes_logits + k.sampling * samples) * FLOAT32_BYTES * s.vocab_size
        overhead = k.step_overhead_bytes + (k.prefill_overhead_bytes if c > 1 else 0)
        return int(self.layer_factor * per_layer + head + overhead)

    def paged_partials_bytes(self, num_rows: int, context_len: int) -> int:
        """One layer's float32 partials of the paged decode kernel (engine/model/kernels/paged_attention.py): per row,
        query head and span of PAGED_PARTIAL_KEYS keys of its pool blocks (of `kv_step` tokens), a partial
        output of d values and 2 statistics."""
        s = self.shape
        spans = -(-context_len // self.kv_step) * max(1, self.kv_step // PAGED_PARTIAL_KEYS)
        return num_rows * s.num_heads * spans * (s.head_dim + 2) * FLOAT32_BYTES

    def _decode_attention_bytes(self, context_lens: Sequence[int], gathers: Optional[bool] = None) -> float:
        """One layer's attention temporaries of decoding rows: their KV as attention reads it (a gathered
        copy, or the paged kernel's partials) and their scores."""
        s, k, b, n = self.shape, self.coefficients, len(context_lens), max(context_lens)
        if gathers is None:
            gathers = not self.paged_decode
        gather = b * n * s.num_kv_heads * (2 * s.head_dim * s.dtype_bytes + 4) * gathers  # K, V, int32 index
        paged = self.paged_partials_bytes(b, n) if self.paged_decode and not gathers else 0
        return (k.decode_gather * gather + (k.decode_paged or 0.0) * paged
                + k.decode_scores * FLOAT32_BYTES * b * s.num_heads * n)

    def _decode_head_bytes(self, num_rows: int, samples: int = 0) -> float:
        k = self.coefficients
        return (k.decode_logits * num_rows + k.sampling * samples) * FLOAT32_BYTES * self.shape.vocab_size

    def decode_bytes(self, context_lens: Sequence[int], samples: int = 0, gathers: Optional[bool] = None) -> int:
        """Hidden states, the rows' KV as attention reads it, scores, MLP and logits (module docstring).
        `samples`: rows that sample (a bool counts as one). `gathers`: whether attention reads a gathered
        copy of the rows' KV (None: unless the model is `paged_decode`); False without paging is for grid
        points recorded when one-row decodes read a view of the pool."""
        if not context_lens:
            return 0
        s, k, b = self.shape, self.coefficients, len(context_lens)
        m = self.layer_factor
        layers = m * (self._decode_attention_bytes(context_lens, gathers)
                      + k.decode_mlp * b * s.intermediate_size * s.dtype_bytes)
        hidden = m * k.decode_hidden * b * s.hidden_size * s.dtype_bytes
        # A sum, not the larger of the two phases: the head's graph is launched while the layers' still
        # runs (runner.launch), so the last layer's gathered KV and the logits can be alive together.
        return int(hidden + layers + self._decode_head_bytes(b, samples) + k.step_overhead_bytes)

    def mixed_bytes(self, chunk: PrefillChunkPlan, context_lens: Sequence[int], samples: int = 0) -> int:
        """One forward of a prompt chunk (T tokens) and B decoding rows (engine/model/layers/mixed.py): the larger of
        - the chunk's forward over T + B rows up to the LM head (no layer's MLP skipped), with one
          layer's attention temporaries of the rows and their logits: the peak among the MLPs;
        - the rows' decode forward with one layer's share of the chunk's: the peak among the rows'
          attention temporaries, which on CUDA coexist over layers like a decode step's.
        On the CPU (one layer at a time, m = 1) the second is the plain sum of the two forwards. Measured
        on an H200 (docs/memory.md): 68 mixed steps of an 8B llama and an 8-layer one, predicted /
        measured >= 1.28."""
        if not context_lens:
            return self.prefill_chunk_bytes(chunk.num_tokens, chunk.context_len, chunk.computes_logits,
                                            chunk.samples, chunk.gathers)
        b = len(context_lens)
        rows = (self.prefill_chunk_bytes(chunk.num_tokens + b, chunk.context_len, True, chunk.samples,
                                         chunk.gathers)
                + self._decode_attention_bytes(context_lens) + self._decode_head_bytes(b, samples))
        alone = self.prefill_chunk_bytes(chunk.num_tokens, chunk.context_len, chunk.computes_logits,
                                         chunk.samples, chunk.gathers)
        attention = self.decode_bytes(context_lens, samples) + alone / self.layer_factor
        return int(max(rows, attention))

    def step_transient_bytes(self, plan: StepPlan, mixed: bool = False) -> int:
        """Decode and each prefill chunk are evaluated one after another: the peak is their max.
        `mixed`: the decode rows run with the first chunk (engine/model/layers/mixed.py), one forward (`mixed_bytes`)."""
        chunks = [self.prefill_chunk_bytes(p.num_tokens, p.context_len, p.computes_logits, p.samples, p.gathers)
                  for p in plan.prefill_chunks]
        if mixed and chunks and plan.decode_context_lens:
            first = self.mixed_bytes(plan.prefill_chunks[0], plan.decode_context_lens, plan.decode_samples)
            return max([first] + chunks[1:])
        return max([self.decode_bytes(plan.decode_context_lens, plan.decode_samples)] + chunks)

    def transient_bound_bytes(self, max_num_seqs: int, prefill_chunk_size: int, max_model_len: int) -> int:
        """Largest transient of any step the scheduler can produce under this configuration.

        Both formulas grow with every argument; a chunk attends to at most max_model_len keys and a
        decode step has at most max_num_seqs rows of at most max_model_len keys each. Forwards never
        overlap on the device (runner.finish), pipelined decode included; a step mixes its decode rows
        into a chunk's forward only within this bound (Scheduler.schedule).
        """
        chunk = min(prefill_chunk_size, max_model_len)
        return max(
            self.prefill_chunk_bytes(chunk, max_model_len, samples=True),
            self.decode_bytes([max_model_len] * max_num_seqs, samples=max_num_seqs),
        )
