"""EngineConfig: every knob of the engine, validated by pydantic.

The YAML (serve.yaml), the CLI and the Python API all build this model, so a bad value fails the same
way everywhere: pydantic's ValidationError is a ValueError whose message names the field and the value.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.core.memory.coefficients import CPU_COEFFICIENTS, with_overrides

DType = Literal["auto", "float32", "float16", "bfloat16"]


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(
        "default",
        min_length=1,
        description="'default' (embedded SmolLM2-135M-Instruct), 'tiny' (random tiny llama with the "
        "default tokenizer, for tests) or the path of a local MLX / mlx-lm model folder.",
    )
    dtype: DType = Field(
        "auto",
        description="Weights and KV dtype. 'auto': float32 on the CPU (quantized and half matmuls are "
        "slow there), the model's own float dtype (bfloat16 for the default) on a GPU.",
    )
    max_num_seqs: int = Field(16, ge=1, le=4096, description="Requests running (holding KV) at once.")
    max_num_batched_tokens: int = Field(
        2048, ge=1, le=1 << 20, description="Token budget of one engine step, decode tokens included."
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
    seed: int = Field(0, ge=0, description="Seed of the engine's sampler (requests may override).")
    prefix_cache_fraction: float = Field(
        0.25, ge=0.0, le=1.0,
        description="Share of the KV budget that finished requests' KV may keep for prefix reuse "
        "(evicted LRU, and before any request has to wait for KV). 0 disables the prefix cache.",
    )
    memory_coefficients: Optional[dict[str, Optional[float]]] = Field(
        None,
        description="Overrides of the memory model's transient coefficients for this backend (fields of "
        "engine.core.memory.model.TransientCoefficients), e.g. the 'coefficients' that `python scripts/"
        "bench_memory_grid.py --fit GRID --backend cuda` prints for a grid measured on your device.",
    )
    async_decode: bool = Field(
        True,
        description="Pipeline decode steps (after mlx-lm's BatchGenerator): build the next decode's graph "
        "while the current one runs, launch it as soon as that is done, and read back and detokenize the "
        "current one's tokens while the next runs. A request that stops on EOS or a stop string has one "
        "extra token computed and dropped.",
    )
    overlap_steps: bool = Field(
        True,
        description="On MLX's CUDA backend, a step whose last forward is a prompt chunk that samples nothing "
        "returns without waiting for it: the next step is scheduled and its first forward built while it "
        "runs (vLLM's async scheduling, for prompt chunks). Forwards still never overlap on the device. "
        "Not on the CPU, where a forward returns before it has run: a step's measured transient would be "
        "mostly the next step's.",
    )
    paged_attention: bool = Field(
        True,
        description="Decode attention reads each row's KV where it lies in the pool, with a CUDA kernel "
        "(MLX's CUDA backend only). False, or on other backends: decode gathers every layer's KV of "
        "the batch into a contiguous copy and runs MLX's attention on it.",
    )
    fuse_projections: bool = Field(
        True,
        description="Decode forwards compute attention's q, k, v projections as one matmul, and the MLP's "
        "gate and up as one (plain float linear layers only; quantized ones are left as they are).",
    )
    decode_kernels: bool = Field(
        False,
        description="Decode forwards of llama-shaped models run the engine's own layer loop with one CUDA "
        "kernel for q/k RoPE and the q/k/v layout and one for each residual add and the RMSNorm after it "
        "(MLX's CUDA backend, with paged_attention and fuse_projections; engine/model/layers/decode_path.py). Off by "
        "default: on the H200 it did not make decode steps consistently faster. False, or elsewhere: "
        "MLX's own operations.",
    )
    mixed_batches: bool = Field(
        True,
        description="A step that prefills while other rows decode runs its decode rows in the same forward "
        "as its first prompt chunk: the linear layers read the weights once for both (llama-shaped models "
        "with fuse_projections; engine/model/layers/mixed.py). False, or other models: the decode rows run their own "
        "forward.",
    )
    layer_loops: bool = Field(
        True,
        description="Prompt chunks and decodes of llama-shaped models run the engine's own layer loops "
        "over weights bound once (engine/model/layers/chunk_path.py, decode_path.py): the same operations as "
        "mlx-lm's modules with less host work per forward, which the GPU otherwise waits for. False, or "
        "other models: mlx-lm's modules.",
    )
    compiled_decode: bool = Field(
        True,
        description="The layer loop's decodes (layer_loops on CUDA) build each layer's operations from a "
        "compiled trace (mx.compile, one trace per batch size; engine/model/layers/decode_path.py CompiledLayers): "
        "less host work per decode step, the same operations. False: built in Python.",
    )
    cpu_math: bool = Field(
        True,
        description="On MLX's CPU backend, the layer loops compute attention and SwiGLU with exp as a "
        "power (engine/model/layers/cpu_math.py): MLX's CPU exp is some 3x slower than its power, and the softmax and "
        "SiLU are most of a small model's CPU forward beside the matmuls. The same formulas; greedy "
        "output equals mlx-lm's. False, or other backends: MLX's attention and mlx-lm's SwiGLU.",
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

    @model_validator(mode="after")
    def _cross_field(self) -> "EngineConfig":
        if isinstance(self.memory_limit_bytes, int) and self.memory_limit_bytes < (1 << 20):
            raise ValueError(f"memory_limit_bytes={self.memory_limit_bytes} must be 'auto' or >= 1 MiB")
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
