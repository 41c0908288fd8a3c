"""The model families the runner serves (through the engine's layer loops, engine/model/layers/block.py,
or mlx-lm's modules), and what it reads from a loaded model.

Every shape is read from the model itself, never guessed from the config: the head size from the key
projection's rows (or Phi-3's fused q/k/v rows), the KV dtype from what the embedding produces (the
activations' dtype: a quantized model's weights are uint32, its activations its scales' float type),
the windows from the layers' own `is_sliding`. What differs per family besides:
- the LM head: tied embeddings or `lm_head`, and Gemma 2's final logit softcapping (mlx-lm applies it
  in `Model.__call__`, which the runner's backbone/head split would otherwise skip);
- masks: Gemma 2 asks for explicit boolean masks (`make_mask(return_array=True)`) and applies them to
  scores grouped as [B, H_kv, repeats, T, L], so a batch's padding mask needs that rank;
- windows: Gemma 3's sliding layers ask `make_mask(window_size=w)`; the KV views apply it.
"""

from __future__ import annotations

from dataclasses import dataclass
import logging
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from engine.core.model_config import SUPPORTED_MODULES, supported_list
from engine.model.layers.bound import language_model

logger = logging.getLogger(__name__)

# Families whose layer loops (engine/model/layers/) have run on a GPU against mlx-lm's greedy tokens and
# the memory model's GPU sets (docs/benchmarks.md). The loops of the others are checked on the CPU only:
# on a GPU they run mlx-lm's modules (as measured there) until an H200 run validates their loops.
GPU_LOOP_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
                               "phi3"})


@dataclass(frozen=True)
class ModelLayout:
    """What the runner needs of a loaded model (module docstring)."""

    family: str  # the mlx-lm module's name (mlx_lm.models.<family>)
    backbone: nn.Module  # embeddings, layers, final norm: tokens -> final hidden states
    head: Callable[[mx.array], mx.array]  # hidden states -> logits, as the model's __call__ computes them
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: mx.Dtype
    layer_windows: tuple  # per layer: the sliding window (tokens) or None
    grouped_masks: bool  # explicit masks meet scores shaped [B, H_kv, repeats, T, L] (Gemma 2)


def family_of(model: nn.Module) -> str:
    """The mlx-lm module of `model`; ValueError naming it and the supported ones if the engine does not
    serve it."""
    module = type(model).__module__
    name = module.rsplit(".", 1)[-1]
    if not module.startswith("mlx_lm.models.") or name not in SUPPORTED_MODULES:
        raise ValueError(f"model {module}.{type(model).__name__} is not supported; supported model types: "
                         f"{supported_list()}")
    return name


def _rows(proj: nn.Module) -> int:
    """Output features of a linear layer, float or quantized (packing shrinks the input axis only)."""
    return proj.weight.shape[0]


def _head_dim(attn: nn.Module) -> int:
    if isinstance(getattr(attn, "head_dim", None), int):
        return attn.head_dim
    if "k_proj" in attn:
        return _rows(attn.k_proj) // attn.n_kv_heads
    return _rows(attn.qkv_proj) // (attn.n_heads + 2 * attn.n_kv_heads)


def _head(model: nn.Module, backbone: nn.Module) -> Callable[[mx.array], mx.array]:
    args = getattr(model, "args", None)
    if getattr(args, "tie_word_embeddings", False) or getattr(model, "tie_word_embeddings", False) \
            or "lm_head" not in model:
        linear = backbone.embed_tokens.as_linear
    else:
        linear = model.lm_head
    cap = getattr(model, "final_logit_softcapping", None)
    if not cap:
        return linear

    def softcapped(h: mx.array) -> mx.array:  # gemma2.Model.__call__'s final softcapping
        return mx.tanh(linear(h) / cap) * cap

    return softcapped


def model_layout(model: nn.Module) -> ModelLayout:
    """Read the layout of a loaded mlx-lm model (ValueError if its family is not served)."""
    family = family_of(model)
    text = language_model(model)
    backbone = getattr(text, "model", None)
    if backbone is None or not hasattr(backbone, "layers") or not hasattr(backbone, "embed_tokens"):
        raise ValueError(f"unsupported model {type(model).__name__}: expected model.model.layers")
    attn = backbone.layers[0].self_attn
    windows = tuple(backbone.window_size if getattr(layer.self_attn, "is_sliding", False) else None
                    for layer in backbone.layers)
    kv_dtype = backbone.embed_tokens(mx.array([[0]])).dtype  # the activations' float type
    return ModelLayout(
        family=family, backbone=backbone, head=_head(text, backbone), num_heads=attn.n_heads,
        num_kv_heads=attn.n_kv_heads, head_dim=_head_dim(attn), kv_dtype=kv_dtype, layer_windows=windows,
        grouped_masks=family == "gemma2" and attn.n_heads != attn.n_kv_heads,
    )


def dequantize_on_cpu(model: Any) -> bool:
    """Dequantize a quantized model's layers in place (MLX's CPU quantized matmuls are many times slower
    than float ones); returns whether it was quantized.
    Logged, since the weights then take their float size in memory."""
    from mlx.utils import tree_flatten
    from mlx_lm.utils import dequantize_model

    if not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or "Quantized" in type(m).__name__
               for _, m in model.named_modules()):
        return False
    before = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    dequantize_model(model)
    after = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    logger.info("quantized weights dequantized on the CPU (dtype auto): %d -> %d bytes; set dtype to "
                "float32, bfloat16 or float16 to keep them quantized", before, after)
    return True
