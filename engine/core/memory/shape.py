"""ModelShape: the dimensions of a served model that the memory model's formulas read (no mlx import).

Its own module because both the formula (model.py) and the coefficient sets (coefficients.py, which key
shape calibrations by these dimensions) need it, and model.py imports coefficients.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.core.model_config import ConfigShape


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

    # hidden-size rows per token a layer of this family holds beyond a llama block's (engine/core/
    # model_config.py), counted once each: in its attention (Qwen3's q/k head norms' outputs, Phi-3's
    # fused q/k/v product through mlx-lm's module) and in its MLP (Qwen3-MoE's token copies per expert)
    extra_attention_rows: float = 0.0
    extra_mlp_rows: float = 0.0
    # float32 score-sized arrays [H, c, keys] a prompt chunk's attention holds where MLX's fused
    # attention holds none, in every layer (engine/core/model_config.py: Gemma 2's softcapped scores in
    # Python; a backend whose attention materializes `prefill_scores` copies anyway counts the larger) ...
    extra_score_copies: int = 0
    # ... and in its sliding-window layers only, over the keys they read (Gemma 3's explicit masks)
    sliding_score_copies: int = 0
    # Through the engine's layer loops (engine/model/layers/block.py), counted as they are, not scaled by a
    # coefficient: Qwen3-MoE's experts per token k (a MoE layer's MLP stage holds the tokens' k copies
    # sorted by expert beside the experts' products, and a stage of its own their k outputs beside their
    # unsorted copy: 2 k rows; block.moe_mlp) ...
    moe_experts_per_token: int = 0
    # ... and hidden-size rows per token a layer's MLP stage holds beyond a llama block's (Gemma 2/3's norm
    # of the MLP's output: engine/core/model_config.py)
    mlp_out_norm_rows: float = 0.0
    # ... and, where the runner waits for a layer's attention apart (the CPU's chunk loop), the hidden-size
    # rows per token its attention stage holds once the scores are freed, where the family norms the
    # attention's output before its residual add (Gemma 2/3): that stage's transient is then the larger of
    # its scores' part and this (0: the scores' part alone)
    attention_output_rows: float = 0.0
    # ... and the MLP-wide arrays that stage holds at once (3: SwiGLU's, as the coefficient sets count them)
    mlp_arrays: int = 3
    # the attention normalizes each query and key head: their outputs and MLX's CPU temporaries are four
    # more arrays in a layer's attention stage, each of which may come from a larger cached buffer
    # (MemoryModel's PAGE_SLACK_BYTES)
    qk_norms: bool = False
    # layers whose KV grows with a request (None: all); a model's sliding-window layers may keep theirs in
    # fixed rings instead (engine/model/kv_pool.py), counted with the weights
    num_kv_layers: Optional[int] = None
    # per layer its sliding window in tokens, or None (global attention); () : every layer global. A
    # sliding layer's forward of T tokens per row reads at most window - 1 + T keys of each row.
    layer_windows: tuple = ()

    @property
    def extra_hidden_rows(self) -> float:
        return self.extra_attention_rows + self.extra_mlp_rows

    @classmethod
    def from_config(cls, config: dict, dtype_bytes: int, weights_bytes: int = 0,
                    module_forwards: bool = True) -> "ModelShape":
        """From an mlx-lm / HF config.json dict, read per family (engine/core/model_config.py: a nested
        text_config, head_dim, MoE experts, windows). `dtype_bytes`: the activations' (and KV's) float size;
        `module_forwards`: prompt chunks run mlx-lm's modules (else the engine's chunk loop, which
        computes q, k and v apart: no fused product of Phi-3's; Qwen3-MoE's experts and Gemma's output
        norms counted as the loop holds them, moe_experts_per_token and mlp_out_norm_rows)."""
        c = ConfigShape.from_config(config)
        loops = not module_forwards
        return cls(
            num_layers=c.num_layers, hidden_size=c.hidden_size, num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size, dtype_bytes=dtype_bytes, weights_bytes=weights_bytes,
            extra_attention_rows=c.extra_attention_rows + (c.fused_qkv_rows + c.quantized_rows) * module_forwards,
            extra_mlp_rows=0.0 if loops and c.num_experts_per_tok else c.extra_mlp_rows,
            moe_experts_per_token=c.num_experts_per_tok if loops else 0,
            mlp_out_norm_rows=c.loop_mlp_out_norm_rows if loops else 0.0,
            attention_output_rows=c.loop_attention_output_rows if loops else 0.0, qk_norms=c.qk_norms,
            mlp_arrays=c.loop_mlp_arrays if loops else 3,
            extra_score_copies=c.extra_score_copies,
            sliding_score_copies=c.sliding_score_copies,
            layer_windows=c.layer_windows if any(w is not None for w in c.layer_windows) else (),
        )

    @property
    def sliding_window(self) -> Optional[int]:
        """The window of the sliding layers (the largest, if several), None without any."""
        return max((w for w in self.layer_windows if w is not None), default=None)

    def global_layers(self, num_layers: int) -> tuple[int, int]:
        """(fewest, most) global-attention layers among any `num_layers` consecutive layers (the layers
        whose intermediates coexist, `MemoryModel.layer_factor`)."""
        if not self.layer_windows:
            return num_layers, num_layers
        flags = [w is None for w in self.layer_windows]
        counts = [sum(flags[i:i + num_layers]) for i in range(len(flags) - num_layers + 1)]
        return min(counts), max(counts)
