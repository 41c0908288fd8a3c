"""The engine as the benchmarks build and step it: `make_engine` (this engine at its default config
around an already loaded model, with a memory limit that admits the load), `StepRecorder` (each step's
record and each request's progress) and `Meter` (a run's peak and each step's transient).

Not part of the engine: the benchmarks import the engine like any user would.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import mlx.core as mx

from bench_common import LoadedModel, PeakTracker, free_memory, memory_model_for


def model_max_len(lm: LoadedModel) -> int:
    """The model's position range (4096 where its config gives none)."""
    return lm.config.get("max_position_embeddings") or 4096


def max_model_len_for(lm: LoadedModel, need: int) -> Optional[int]:
    """EngineConfig.max_model_len for requests of up to `need` tokens: None (the model's own) where they fit."""
    return None if need <= model_max_len(lm) else need


def admitting_limit_bytes(lm: LoadedModel, memory, context_lens: list[int], num_seqs: int, chunk: int,
                          max_len: int) -> int:
    """Weights + the transient bound of `num_seqs` rows, `chunk`-token prompt chunks and `max_len` keys +
    the KV of rows of `context_lens` tokens, with room to spare: a memory limit that admits them all."""
    kv = sum(memory.kv_bytes(n) for n in context_lens)
    bound = memory.transient_bound_bytes(num_seqs, chunk, max_len)
    return int((lm.weights_bytes + bound + kv) * 1.25) + (1 << 30)


def engine_memory_limit(lm: LoadedModel, lengths: list[int], max_tokens: int, config) -> int:
    """Weights + the configuration's transient bound + every prompt's KV, with room to spare."""
    memory = memory_model_for(lm, config.memory_coefficients)
    model_max = model_max_len(lm)
    return admitting_limit_bytes(lm, memory, [n + max_tokens for n in lengths], config.max_num_seqs,
                                 config.prefill_chunk_size, min(config.max_model_len or model_max, model_max))


ENGINE_OVERRIDES: dict = {}  # --engine-config


# Set (to 1) for the runs that validate, on a GPU, the layer loops of the families not yet validated
# there (engine/model/families.py GPU_LOOP_FAMILIES): RunnerOptions.gpu_unvalidated_loops
GPU_UNVALIDATED_LOOPS_ENV = "MLX_SERVE_GPU_UNVALIDATED_LOOPS"
# RunnerOptions.fused_rope (engine/model/kernels/qk_rope.py) in every benchmark: =1 on, =0 off (unset: its default)
FUSED_ROPE_ENV = "MLX_SERVE_FUSED_ROPE"
# RunnerOptions.fused_residual (engine/model/layers/decode_path.py residual_matmul): =1 on, =0 off
FUSED_RESIDUAL_ENV = "MLX_SERVE_FUSED_RESIDUAL"
# RunnerOptions.pack_step_inputs (engine/model/kv_pool.py step_inputs): =1 on, =0 off
PACK_STEP_INPUTS_ENV = "MLX_SERVE_PACK_STEP_INPUTS"
# RunnerOptions.rope_writes_kv (engine/model/kernels/qk_rope.py rope_into_pool): =1 on, =0 off
ROPE_WRITES_KV_ENV = "MLX_SERVE_ROPE_WRITES_KV"
# RunnerOptions.mma_attention (engine/model/kernels/mma_attention.py): =0 the tiled kernel instead
MMA_ATTENTION_ENV = "MLX_SERVE_MMA_ATTENTION"


def runner_options(**fields):
    """RunnerOptions with `fields`, and the not yet GPU-validated families' loops, the fused q/k rope
    kernel, the residual matmul, the packed step inputs and the tensor-core attention kernel as the
    environment asks (GPU_UNVALIDATED_LOOPS_ENV, FUSED_ROPE_ENV, FUSED_RESIDUAL_ENV, PACK_STEP_INPUTS_ENV,
    ROPE_WRITES_KV_ENV, MMA_ATTENTION_ENV)."""
    from engine.model.runner import RunnerOptions

    env = dict(gpu_unvalidated_loops=os.environ.get(GPU_UNVALIDATED_LOOPS_ENV) == "1")
    if os.environ.get(FUSED_ROPE_ENV) in ("0", "1"):  # else RunnerOptions' default
        env["fused_rope"] = os.environ[FUSED_ROPE_ENV] == "1"
    if os.environ.get(FUSED_RESIDUAL_ENV) in ("0", "1"):
        env["fused_residual"] = os.environ[FUSED_RESIDUAL_ENV] == "1"
    if os.environ.get(ROPE_WRITES_KV_ENV) in ("0", "1"):
        env["rope_writes_kv"] = os.environ[ROPE_WRITES_KV_ENV] == "1"
    if os.environ.get(PACK_STEP_INPUTS_ENV) in ("0", "1"):
        env["pack_step_inputs"] = os.environ[PACK_STEP_INPUTS_ENV] == "1"
    if os.environ.get(MMA_ATTENTION_ENV) in ("0", "1"):
        env["mma_attention"] = os.environ[MMA_ATTENTION_ENV] == "1"
    return RunnerOptions(**{**env, **fields})


def make_engine(lm: LoadedModel, lengths: list[int], max_tokens: int, chunk: Optional[int] = None,
                layer_loops: bool = True, async_decode: bool = True, overlap_steps: Optional[bool] = None,
                read_slices: bool = True, mixed_batches: bool = True, mix_beyond_bound: bool = False,
                launch_thread: Optional[bool] = None, **overrides):
    """This engine at its default config around the already loaded model. `layer_loops`,
    `read_slices`, `mixed_batches` (RunnerOptions'), `async_decode`, `overlap_steps` (None: the
    engine's choice), `mix_beyond_bound`, `launch_thread` (StepOptions'; None: the engine's choice):
    its ways to compare, chosen at construction; `overrides`: EngineConfig fields."""
    from engine.config import EngineConfig
    from engine.core.types import StepOptions
    from engine.engine import Engine

    fields = dict(model=lm.name, dtype=lm.dtype, max_model_len=max_model_len_for(lm, max(lengths) + max_tokens),
                  **ENGINE_OVERRIDES)
    if chunk:
        fields["prefill_chunk_size"] = chunk
    fields.update(overrides)
    limit = engine_memory_limit(lm, lengths, max_tokens, EngineConfig(**fields))
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(memory_limit_bytes=limit, **fields), lm.config,
                    runner_options=runner_options(layer_loops=layer_loops, read_slices=read_slices,
                                                  mixed_batches=mixed_batches),
                    step_options=StepOptions(async_decode=async_decode, overlap_steps=overlap_steps,
                                             mix_beyond_bound=mix_beyond_bound, launch_thread=launch_thread))
    return engine


class StepRecorder:
    """Steps the engine and keeps each step's record (engine.core.types.StepRecord): its plan, the
    prompt chunks it read as views of the pool, its forwards' times and its memory; and each request's
    progress as the records' outputs tell it (the engine's public step records, not its scheduler)."""

    def __init__(self, engine):
        self.engine = engine
        self.records: list = []
        self.num_tokens: dict[str, int] = {}  # request id -> prompt + output tokens so far
        self.num_output_tokens: dict[str, int] = {}
        self.finished: set[str] = set()

    def step(self):
        record = self.engine.step()
        self.records.append(record)
        for out in record.outputs:
            self._observe(out)
        return record

    def abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        if out is not None:
            self._observe(out)

    def _observe(self, out) -> None:
        self.num_tokens[out.request_id] = out.num_prompt_tokens + out.num_output_tokens
        self.num_output_tokens[out.request_id] = out.num_output_tokens
        if out.finished:
            self.finished.add(out.request_id)


class Meter:
    """Peak/active readings of one way. `baseline` is what was alive before (the weights)."""

    def __init__(self):
        free_memory()
        self.baseline = mx.get_active_memory()
        self.tracker = PeakTracker().__enter__()
        self.tracker.start()
        self.peak = 0
        self.stepwise = 0  # largest (peak - live before - KV added) of one forward / step
        self._before = (0, 0)
        self.t0 = time.perf_counter()

    def begin(self, kv_bytes: int) -> None:
        """Start one forward (or step) whose transient is measured on its own."""
        self.observe()
        self._before = (mx.get_active_memory(), kv_bytes)

    def end(self, kv_bytes: int) -> int:
        """End it: its peak over what was live before, less the KV it added."""
        active, kv = self._before
        transient = self.observe() - active - (kv_bytes - kv)
        self.stepwise = max(self.stepwise, transient)
        return transient

    def observe(self) -> int:
        """Fold in the peak since the last observe(); return that window's peak."""
        window = self.tracker.read()
        self.peak = max(self.peak, window)
        self.tracker.start()
        return window

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def result(self, kv_live_bytes: int, predicted: Optional[int], ttft: list[float], prefill_s: float,
               **extra) -> dict:
        self.observe()
        self.tracker.__exit__()
        over = self.peak - self.baseline
        return dict(
            peak_bytes=over, peak_over_weights_bytes=over, transient_peak_bytes=over - kv_live_bytes,
            stepwise_transient_bytes=self.stepwise or over - kv_live_bytes, kv_live_bytes=kv_live_bytes, predicted_peak_bytes=predicted, ttft_s=ttft,
            mean_ttft_s=sum(ttft) / len(ttft), prefill_s=prefill_s, **extra,
        )
