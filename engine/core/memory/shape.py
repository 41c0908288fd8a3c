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
    # model_config.py: Qwen3-MoE's token copies per expert, Phi-3's fused q/k/v product), counted once each
    extra_hidden_rows: int = 0
    # float32 score-sized arrays [H, c, n] a prompt chunk's attention holds beyond MLX's fused attention
    # (engine/core/model_config.py: Gemma 2's softcapped scores in Python, Gemma 3's windowed masks)
    extra_score_copies: int = 0
    # layers whose KV grows with a request (None: all); a model's sliding-window layers may keep theirs in
    # fixed rings instead (engine/model/kv_pool.py), counted with the weights
    num_kv_layers: Optional[int] = None

    @classmethod
    def from_config(cls, config: dict, dtype_bytes: int, weights_bytes: int = 0) -> "ModelShape":
        """From an mlx-lm / HF config.json dict, read per family (engine/core/model_config.py: a nested
        text_config, head_dim, MoE experts). `dtype_bytes`: the activations' (and KV's) float size."""
        c = ConfigShape.from_config(config)
        return cls(
            num_layers=c.num_layers, hidden_size=c.hidden_size, num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size, dtype_bytes=dtype_bytes, weights_bytes=weights_bytes,
            extra_hidden_rows=c.extra_hidden_rows, extra_score_copies=c.extra_score_copies,
        )
