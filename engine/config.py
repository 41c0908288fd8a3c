"""EngineConfig: every knob of the engine, validated by pydantic.

The YAML (serve.yaml), the CLI and the Python API all build this model, so a bad value fails the same
way everywhere: pydantic's ValidationError is a ValueError whose message names the field and the value.
"""

from __future__ import annotations

import logging
import os
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.core.memory.coefficients import CPU_COEFFICIENTS, with_overrides

logger = logging.getLogger(__name__)

DType = Literal["auto", "float32", "float16", "bfloat16"]
MAX_OPS_ENV = "MLX_MAX_OPS_PER_BUFFER"
# On MLX's CUDA backend: what the shipped CUDA coefficient set for bounded batches was fitted under.
CUDA_MAX_OPS_PER_BUFFER = 8
# The step token budget when EngineConfig.max_num_batched_tokens is None: on a GPU a larger step halves the
# mean TTFT of many prompts arriving together (docs/benchmarks.md); on CUDA a burst's prompts then run in
# fewer steps of prompts (with PACKED_TOKENS_CUDA, one pack a step), which every decoding row waits through
# (docs/decode.md "Serving"); on the CPU a step's forwards run one core-bound chunk after another, and a
# larger budget only delays the decode rows riding in it.
CUDA_MAX_NUM_BATCHED_TOKENS = 16384
GPU_MAX_NUM_BATCHED_TOKENS = 8192  # Metal
CPU_MAX_NUM_BATCHED_TOKENS = 2048
# ExecutionConfig.max_packed_tokens when None, on MLX's CUDA backend (docs/decode.md)
PACKED_TOKENS_CUDA = 16384


class ExecutionConfig(BaseModel):
    """The execution choices a deployment may have a reason to turn. The engine's other ways of running
    a forward (pipelined decode, fused projections, its own layer loops, mixed batches, compiled decode
    layers, the CPU's exp-as-power math) are what measured best and are not configurable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    paged_attention: bool = Field(
        True,
        description="On MLX's CUDA backend, decodes of llama-shaped models read each row's KV where it "
        "lies in the pool with the engine's CUDA kernel (engine/model/kernels/paged_attention.py), "
        "checked against MLX's attention once at start and left out if it disagrees. Turn it off if "
        "decode output on your GPU or MLX version looks wrong, to rule the hand-written kernel out: "
        "decode then gathers each layer's KV into a copy for MLX's attention (more memory per step, "
        "which the memory model then predicts).",
    )
    max_ops_per_buffer: Optional[int] = Field(
        None, ge=1, le=1024,
        description="Operations MLX batches into one committed GPU command batch (it sets "
        "MLX_MAX_OPS_PER_BUFFER for the process before MLX runs its first GPU work). MLX's CUDA backend "
        "frees a kernel's temporaries only when its committed batch has run, so fewer ops per batch "
        "bound the prefill transient, at a small cost in launch overhead; the memory model picks its "
        "coefficients from this value. None: 8 on MLX's CUDA backend, MLX's own default elsewhere. "
        "Raise it only with coefficients fitted for it (memory_coefficients).",
    )

    pad_last_chunk: bool = Field(
        False,
        description="A prompt's last chunk computes up to the next multiple of chunk_granule tokens (or of a smaller "
        "power of two where that would pass the chunk size, the step's budget or the free memory) past "
        "the prompt's end, so the (tokens, context) shapes of prompt chunks repeat: MLX's CUDA backend "
        "builds a cuDNN attention graph on the host for each new shape, several times a repeated "
        "chunk's cost. The pad's KV goes to the request's own slots past its prompt, which decode "
        "overwrites; outputs are unchanged. Off by default: on the CPU the pad is extra compute with no "
        "graph to save, and on an H200 burst it saved little wall time (docs/tight_burst.md).",
    )
    chunk_granule: int = Field(
        128, ge=1, le=1 << 16,
        description="A power of two: prompt chunks cut short (by the step's budget or the free memory) end "
        "on a multiple of it, or of a smaller power of two where it would take more than a quarter of the "
        "chunk; with pad_last_chunk a prompt's last chunk is padded up to it. A coarser grid repeats more "
        "(tokens, context) shapes on MLX's CUDA backend (fewer cuDNN graph builds) at the cost of shorter "
        "cut chunks and more pad tokens computed (docs/tight_burst.md).",
    )

    max_warmup_chunk_shapes: int = Field(
        0, ge=0, le=1024,
        description="On MLX's CUDA backend, at start the engine builds the cuDNN attention graphs of up to this "
        "many prompt-chunk shapes on the chunk_granule grid (tokens up to prefill_chunk_size, contexts up to "
        "max_model_len, shortest first), so that a prompt's whole chunks and chunks cut on the grid find "
        "theirs built (a prompt's last chunk is on the grid only where it ends there, or with "
        "pad_last_chunk). Off by default: each graph is built on the host, so it lengthens every replica's "
        "start, while on an H200 burst it did not shorten the wall time (docs/tight_burst.md). At most half "
        "of MLX_CUDA_SDPA_CACHE_SIZE, the graphs MLX keeps.",
    )

    max_packed_tokens: Optional[int] = Field(
        None, ge=0, le=1 << 20,
        description="The most prompt tokens one forward may compute of several rows' chunks packed together "
        "(one chunk per row; 0: one forward per chunk). Packed, the matmuls run over all their tokens at "
        "once: on an H200 an 8B llama served 64 / 128 streams of 512-token prompts 1.11 / 1.16 x as fast with "
        "8192 as unpacked, and with 16384 (and a step budget of as many tokens) its 32 prompts a step cut the time "
        "decoding rows wait through steps of prompts (docs/decode.md). A pack holds its chunks' temporaries together: the memory model predicts it, "
        "and the scheduler packs only within the configuration's transient bound and the free memory (a burst "
        "of short prompts peaks with the pack: 16 x 512 tokens on an 8B, 5.4 GB against 0.34 GB a chunk). Only "
        "prompts whose uncached rest fits one chunk pack (pack_long_prompts), so a burst of long prompts "
        "still prefills one chunk at a time, within 1.25 x sequential chunked prefill's transient "
        "(docs/memory.md). None: "
        "PACKED_TOKENS_CUDA on MLX's CUDA backend, 0 elsewhere (on the CPU a forward's tokens run one "
        "core-bound matmul after another either way); the engine's chunk loop only (not mlx-lm's modules).",
    )
    pack_long_prompts: bool = Field(
        False,
        description="Also pack the chunks of prompts longer than one chunk (prefill_chunk_size). Their packs "
        "are faster still at the price of the bound on long prompts' prefill transient: on an H200 four "
        "long prompts' prefill peaked at 6 x sequential chunked prefill's with it (docs/memory.md).",
    )

    start_warmup: bool = Field(
        True,
        description="On a GPU, before its first request the serving engine (AsyncEngine) runs the kinds of "
        "step it will meet once each (engine/warmup.py: prompt chunks, chunks beside decode rows, decodes "
        "of up to 8 rows, sampled rows): MLX compiles each kernel at its first use, which for an 8B llama "
        "on a fresh H200 took 38 s in all (its first mixed step 22.5 s), time that requests would "
        "otherwise wait mid-serving (docs/tight_burst.md). Turn it off for a faster start where the first "
        "requests may wait. Not run on the CPU.",
    )

    @field_validator("chunk_granule")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"chunk_granule={value} is not a power of two")
        return value

    def resolved_max_ops_per_buffer(self, backend: str) -> Optional[int]:
        """The value for MLX backend `backend` ("cpu", "cuda", "metal"); None: MLX's default."""
        if self.max_ops_per_buffer is not None:
            return self.max_ops_per_buffer
        return CUDA_MAX_OPS_PER_BUFFER if backend == "cuda" else None


    def resolved_max_packed_tokens(self, backend: str) -> int:
        """The value for MLX backend `backend`: max_packed_tokens, else PACKED_TOKENS_CUDA on CUDA, else 0."""
        if self.max_packed_tokens is not None:
            return self.max_packed_tokens
        return PACKED_TOKENS_CUDA if backend == "cuda" else 0


def export_max_ops_per_buffer(value: Optional[int]) -> None:
    """Set MLX_MAX_OPS_PER_BUFFER to `value` (None: leave the environment alone). MLX reads it once per
    process, when its GPU backend first commits work, so call this before any GPU work."""
    if value is None:
        return
    current = os.environ.get(MAX_OPS_ENV)
    if current is not None and current != str(value):
        logger.warning("%s=%s in the environment replaced by execution.max_ops_per_buffer=%d (it takes "
                       "effect only if this process has run no GPU work yet)", MAX_OPS_ENV, current, value)
    os.environ[MAX_OPS_ENV] = str(value)


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        "default",
        min_length=1,
        description="'default' (embedded SmolLM2-135M-Instruct), 'tiny' (random tiny llama with the "
        "default tokenizer, for tests), the path of a local MLX / mlx-lm model folder, or a Hugging Face "
        "repo id (org/name) already in the local Hugging Face cache (never downloaded). Families: llama, "
        "mistral, qwen2, qwen3, qwen3_moe, gemma, gemma2, gemma3 / gemma3_text, phi3; float or mlx-lm "
        "4- / 8-bit quantized.",
    )
    dtype: DType = Field(
        "auto",
        description="Weights and KV dtype. 'auto': float32 on the CPU (quantized and half matmuls are "
        "slow there: a quantized model is dequantized, and the log says so), the model's own float dtype "
        "(bfloat16 for the default) on a GPU. An explicit dtype keeps quantized weights quantized.",
    )
    max_num_seqs: int = Field(16, ge=1, le=4096, description="Requests running (holding KV) at once.")
    max_num_batched_tokens: Optional[int] = Field(
        None, ge=1, le=1 << 20,
        description="Token budget of one engine step, decode tokens included (a step gets less when the "
        "memory its KV leaves free is short). None: 16384 on MLX's CUDA backend, 8192 on Metal, 2048 on "
        "the CPU, raised to max_num_seqs or prefill_chunk_size where either is larger; the engine "
        "resolves it for its device (Engine.config holds the value it runs with).",
    )
    prefill_chunk_size: int = Field(
        512, ge=1, le=1 << 20, description="Most prompt tokens of one request computed in one step."
    )
    max_model_len: Optional[int] = Field(
        None, ge=2, le=1 << 22,
        description="Longest prompt + output in tokens. None: the model's max_position_embeddings.",
    )
    memory_limit_bytes: Union[Literal["auto"], int] = Field(
        "auto",
        description="Memory the engine may use (weights + KV + transients). 'auto': memory_utilization "
        "x what MLX reports for the device (the recommended working set on Metal, physical memory "
        "elsewhere).",
    )
    memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="Fraction of device memory used when memory_limit_bytes is auto."
    )
    memory_margin_fraction: float = Field(
        0.02, ge=0.0, le=0.5,
        description="Share of the memory left after the weights that neither KV nor a step's predicted "
        "transient may use: a safety margin beside the memory model's upper bound (docs/memory.md).",
    )
    seed: int = Field(0, ge=0, description="Seed of the engine's sampler (requests may override).")
    prefix_cache_fraction: float = Field(
        0.25, ge=0.0, le=1.0,
        description="Share of the KV budget that finished requests' KV may keep for prefix reuse "
        "(evicted LRU, and before any request has to wait for KV). 0 disables the prefix cache.",
    )
    memory_coefficients: Optional[dict[str, Optional[float]]] = Field(
        None,
        description="Overrides of the memory model's transient coefficients for this backend (fields of "
        "engine.core.memory.coefficients.TransientCoefficients), e.g. the 'coefficients' that `python scripts/"
        "bench_memory_grid.py --fit GRID --backend cuda` prints for a grid measured on your device.",
    )
    execution: ExecutionConfig = Field(
        default_factory=ExecutionConfig,
        description="How the engine runs its forwards where a deployment has a reason to choose "
        "(ExecutionConfig); everything else runs what measured best.",
    )
    cache_dir: Optional[str] = Field(
        None, description="Where the converted default model is kept. None: $MLX_SERVE_CACHE or "
        "~/.cache/mlx-serve.",
    )

    @field_validator("memory_coefficients")
    @classmethod
    def _known_coefficients(cls, value: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        with_overrides(CPU_COEFFICIENTS, value)  # ValueError naming an unknown or negative coefficient
        return value

    def resolved_max_num_batched_tokens(self, backend: str) -> int:
        """The step token budget on MLX backend `backend` ("cpu", "cuda", "metal"): the configured value,
        else the backend's default raised to what max_num_seqs and prefill_chunk_size need."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        default = {"cuda": CUDA_MAX_NUM_BATCHED_TOKENS, "metal": GPU_MAX_NUM_BATCHED_TOKENS}.get(
            backend, CPU_MAX_NUM_BATCHED_TOKENS)
        return max(default, self.max_num_seqs, self.prefill_chunk_size)

    def for_backend(self, backend: str) -> "EngineConfig":
        """This configuration with the values that depend on the device resolved for `backend` (a new
        object: the engine keeps it as its `config`, so every reader sees what the engine runs with)."""
        update = {}
        if self.max_num_batched_tokens is None:
            update["max_num_batched_tokens"] = self.resolved_max_num_batched_tokens(backend)
        if self.execution.max_packed_tokens is None:
            update["execution"] = self.execution.model_copy(
                update={"max_packed_tokens": self.execution.resolved_max_packed_tokens(backend)})
        return self.model_copy(update=update) if update else self

    @model_validator(mode="after")
    def _cross_field(self) -> "EngineConfig":
        if isinstance(self.memory_limit_bytes, int) and self.memory_limit_bytes < (1 << 20):
            raise ValueError(f"memory_limit_bytes={self.memory_limit_bytes} must be 'auto' or >= 1 MiB")
        if self.max_num_batched_tokens is None:  # resolved per backend, never below the two below
            return self
        if self.prefill_chunk_size > self.max_num_batched_tokens:
            raise ValueError(
                f"prefill_chunk_size={self.prefill_chunk_size} must be <= "
                f"max_num_batched_tokens={self.max_num_batched_tokens}"
            )
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs={self.max_num_seqs} must be <= max_num_batched_tokens="
                f"{self.max_num_batched_tokens}: every running request decodes one token per step"
            )
        return self
