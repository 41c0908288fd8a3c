"""What the engine reads from a model's config.json, per family (no mlx: the memory model, the scheduler
and the admission side read it too).

Families are mlx-lm's model modules the engine serves (`SUPPORTED_MODEL_TYPES`): each one's config names
its shape a little differently (a multimodal Gemma 3 nests the text model under `text_config`; Phi-3
and Qwen2 derive the head size from the hidden size whatever `head_dim` says; Qwen3-MoE's MLP is
`num_experts_per_tok` experts of `moe_intermediate_size`; Gemma 3's layers alternate sliding-window
and global attention). `ConfigShape.from_config` reads every one the way mlx-lm's module builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# model_type (config.json) -> the mlx-lm module that builds it (mlx-lm maps mistral to its llama module)
SUPPORTED_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3_text",
    "gemma3": "gemma3",
    "phi3": "phi3",
}
# mlx-lm model modules (mlx_lm.models.<name>) whose models the runner takes
SUPPORTED_MODULES = frozenset(SUPPORTED_MODEL_TYPES.values())
# families whose head size is hidden_size // num_attention_heads in mlx-lm, whatever head_dim says
_DERIVED_HEAD_DIM = frozenset({"qwen2", "phi3"})
# families whose mlx-lm module attends over a sliding window in some layers
_SLIDING_FAMILIES = frozenset({"gemma3_text", "gemma3"})
# families whose attention normalizes each query and key head before RoPE
_QK_NORM_FAMILIES = frozenset({"qwen3", "qwen3_moe", "gemma3_text", "gemma3"})
# families whose blocks norm the attention's and the MLP's outputs before the residual adds
_SANDWICH_FAMILIES = frozenset({"gemma2", "gemma3_text", "gemma3"})
# mlx-lm's gemma3_text defaults, for configs that leave them out (and gemma3's default vocabulary)
_GEMMA3_DEFAULTS = {"sliding_window": 512, "sliding_window_pattern": 6, "max_position_embeddings": 32768,
                    "head_dim": 256, "num_key_value_heads": 1, "num_attention_heads": 4, "vocab_size": 262144}
_GEMMA3_VOCAB = 262208


def supported_list() -> str:
    return ", ".join(sorted(SUPPORTED_MODEL_TYPES))


def model_type(config: dict) -> str:
    """The config's model_type; ValueError naming it and the supported ones if the engine cannot serve it."""
    name = config.get("model_type")
    if name not in SUPPORTED_MODEL_TYPES:
        archs = config.get("architectures")
        raise ValueError(f"model_type={name!r} (architectures {archs}) is not supported; supported model "
                         f"types: {supported_list()}")
    return name


def text_config(config: dict) -> dict:
    """The language model's config: `text_config` merged over the top level where the model nests it
    (multimodal Gemma 3), with the family's defaults for fields mlx-lm fills in."""
    nested = config.get("text_config")
    merged = dict(config)
    if isinstance(nested, dict):
        merged.update(nested)
    if config.get("model_type") == "gemma3":  # what mlx-lm's gemma3 fills into the text model's config
        merged["vocab_size"] = config.get("vocab_size", _GEMMA3_VOCAB)
        merged.setdefault("num_attention_heads", 8)
        merged.setdefault("num_key_value_heads", 4)
    if config.get("model_type") in _SLIDING_FAMILIES:
        merged = {**_GEMMA3_DEFAULTS, **merged}
    return merged


@dataclass(frozen=True)
class ConfigShape:
    """The dimensions of a model as its mlx-lm module builds them from the config."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # the widest MLP a token goes through (MoE: its experts' widths together)
    vocab_size: int
    max_position_embeddings: Optional[int]
    num_experts_per_tok: int = 0  # MoE: experts each token runs (0: a dense model)
    num_experts: int = 0
    layer_windows: tuple = ()  # per layer: the sliding window in tokens, or None (global attention)
    # hidden-size rows per token a layer holds beyond a llama block's, in its attention: Qwen3's and Gemma
    # 3's q/k head norms' outputs ...
    extra_attention_rows: float = 0.0
    # ... in its MLP: a MoE token's copies per expert (mlx-lm's SwitchGLU gathers it in, each expert's
    # output, unsorted back, weighted: one after another, at most 2 per expert alive at once) ...
    extra_mlp_rows: float = 0.0
    # ... and Phi-3's fused q/k/v product, alive whole until its last part is used, where mlx-lm's module
    # computes it (the engine's chunk loop computes q, k and v apart)
    fused_qkv_rows: float = 0.0
    # ... and a quantized model's layers there (mlx-lm's quantized matmuls)
    quantized_rows: float = 0.0
    # float32 score-sized arrays a prompt chunk's attention holds where MLX's fused attention holds none
    # (on a backend that materializes the scores anyway, those count instead): Gemma 2 computes its
    # softcapped scores in Python in every layer; Gemma 3's sliding layers (only) pass an explicit mask,
    # over the keys they read
    extra_score_copies: int = 0
    sliding_score_copies: int = 0
    # Through the engine's layer loops (engine/model/layers/block.py), counted as they are: hidden-size
    # rows per token a layer's MLP stage holds beyond a llama block's for Gemma 2/3's norm of the MLP's
    # output before its residual add (MLX's CPU rms_norm holds its output and one temporary; Gemma 3 up
    # to half a row more at 512-token chunks: scripts/data/cpu_i21_grid.json) ...
    loop_mlp_out_norm_rows: float = 0.0
    # ... the rows a layer's attention stage holds after its scores, where it norms the attention's output
    # (the stage's least over contexts on the CPU's chunk loop, hidden 256, float32, chunks of 16-512 tokens:
    # Gemma 2 up to 7.01 rows per token, Gemma 3 up to 7.50: `bench_memory_grid.py --stage-rows
    # scripts/data/cpu_i21_grid.json`; set 2-5 % above) ...
    loop_attention_output_rows: float = 0.0
    # ... and the MLP-wide arrays its MLP stage holds at once: SwiGLU through cpu_math's operations three,
    # Gemma's exact GELU (one compiled operation of mlx-lm's) two
    loop_mlp_arrays: int = 3
    qk_norms: bool = False  # the attention normalizes each query and key head (Qwen3, Gemma 3)

    @classmethod
    def from_config(cls, config: dict) -> "ConfigShape":
        name = config.get("model_type") or "llama"  # test configs without model_type are llamas
        text = text_config(config)
        hidden, heads = text["hidden_size"], text["num_attention_heads"]
        head_dim = text.get("head_dim") or hidden // heads
        if name in _DERIVED_HEAD_DIM:
            head_dim = hidden // heads
        num_layers = text["num_hidden_layers"]
        intermediate = text["intermediate_size"]
        experts_per_tok, num_experts = 0, 0
        if name == "qwen3_moe" and text.get("num_experts", 0) > 0:
            experts_per_tok, num_experts = text["num_experts_per_tok"], text["num_experts"]
            moe_width = experts_per_tok * text["moe_intermediate_size"]
            dense = _dense_layers(text, num_layers)
            intermediate = max(moe_width, intermediate if dense else 0)
        kv_heads = text.get("num_key_value_heads") or heads
        attention, fused = 0, 0
        if name in _QK_NORM_FAMILIES:  # the q/k head norms' outputs, beside q and k themselves
            attention += (heads + kv_heads) * head_dim / hidden
        # mlx-lm's quantized layers (through its modules; the engine's loops run float weights): on the CPU
        # a prompt chunk measured up to a row per token above the float model's prediction
        quantized = 1.0 if config.get("quantization") else 0.0
        if name == "phi3":
            # +1: on the CPU a chunk's peak measured up to a row above the product's own size
            # (tests/engine/test_families.py)
            attention, fused = 0, (heads + 2 * kv_heads) * head_dim / hidden + 1
        return cls(
            model_type=name, num_layers=num_layers, hidden_size=hidden, num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads, head_dim=head_dim,
            intermediate_size=intermediate, vocab_size=text["vocab_size"],
            max_position_embeddings=text.get("max_position_embeddings"),
            num_experts_per_tok=experts_per_tok, num_experts=num_experts,
            layer_windows=_layer_windows(name, text, num_layers), extra_attention_rows=attention,
            extra_mlp_rows=2 * experts_per_tok, fused_qkv_rows=fused, quantized_rows=quantized,
            extra_score_copies=1 if name == "gemma2" else 0,
            sliding_score_copies=1 if name in _SLIDING_FAMILIES else 0,
            loop_mlp_out_norm_rows=(2.5 if name in ("gemma3", "gemma3_text") else 2.0) if name in _SANDWICH_FAMILIES
            else 0.0, qk_norms=name in _QK_NORM_FAMILIES,
            loop_attention_output_rows=(7.17 if name == "gemma2" else 7.84) if name in _SANDWICH_FAMILIES else 0.0,
            loop_mlp_arrays=2 if name == "gemma" else 3,
        )


def _dense_layers(text: dict, num_layers: int) -> list[int]:
    """Qwen3-MoE layers with a dense MLP (mlx-lm's rule: mlp_only_layers, or off the sparse step)."""
    step = text.get("decoder_sparse_step", 1) or 1
    only = set(text.get("mlp_only_layers") or [])
    return [i for i in range(num_layers) if i in only or (i + 1) % step != 0]


def _layer_windows(name: str, text: dict, num_layers: int) -> tuple:
    """Gemma 3: every `sliding_window_pattern`-th layer is global, the others slide (mlx-lm's rule)."""
    if name not in _SLIDING_FAMILIES:
        return (None,) * num_layers
    pattern, window = text["sliding_window_pattern"], text["sliding_window"]
    return tuple(None if i % pattern == pattern - 1 else window for i in range(num_layers))
