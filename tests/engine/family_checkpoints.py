"""Tiny random checkpoints of every served family, built at test time with mlx-lm's own model classes
and saved in mlx-lm's folder format (config.json, safetensors, the tiny model's tokenizer files).

Weights are redrawn with std 0.3 (as the project's tiny llama is): with mlx-lm's small initial
weights greedy output repeats one token, and comparisons of outputs could not fail. Norm weights are
their initial value plus noise, so that each norm differs from the others.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import shutil
from typing import Optional

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
VOCAB = 49152  # the SmolLM2 tokenizer's, so the served app can encode and decode real text

_COMMON = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, max_position_embeddings=2048,
               rope_theta=10000.0)

# model_type -> its config beyond _COMMON (shapes mlx-lm reads: explicit head_dim, windows, experts)
FAMILY_CONFIGS = {
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=True),
    # head_dim 32 where hidden / heads is 16: the explicit head size must be read, not derived
    "qwen3": dict(head_dim=32, tie_word_embeddings=True),
    "qwen3_moe": dict(head_dim=16, tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=32, norm_topk_prob=True),
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   query_pre_attn_scalar=16),
    # 4 layers alternating sliding (window 24) and global attention
    "gemma3_text": dict(head_dim=16, num_hidden_layers=4, sliding_window=24, sliding_window_pattern=2,
                        query_pre_attn_scalar=16, rope_local_base_freq=10000.0),
    "phi3": dict(tie_word_embeddings=False),
}
_MODULES = {"mistral": "llama"}
# Gemma 2's norms scale by 1 + weight and its blocks normalize every residual branch: with std 0.3 its
# greedy output repeats one token, with 0.1 it changes from token to token
FAMILY_STD = {"gemma2": 0.1}
# weights whose greedy tokens for the tests' prompts have no near tie (two logits within float32
# rounding of each other, which any change in the order of operations may flip)
FAMILY_SEED = {"qwen2": 1}


def family_config(model_type: str, **overrides) -> dict:
    if model_type == "gemma3":  # the multimodal wrapper: its text model's config nested, as HF ships it
        text = family_config("gemma3_text", **overrides)
        return {"model_type": "gemma3", "vocab_size": text.pop("vocab_size"), "text_config": text}
    return {"model_type": model_type, **_COMMON, **FAMILY_CONFIGS[model_type], **overrides}


def build_checkpoint(out: pathlib.Path, tokenizer_dir: pathlib.Path, model_type: str,
                     quantize_bits: Optional[int] = None, seed: Optional[int] = None, std: Optional[float] = None,
                     **overrides) -> pathlib.Path:
    """Write a random `model_type` checkpoint into `out` (mlx-lm's folder format) and return `out`."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import quantize_model, save_config, save_model

    config = family_config(model_type, **overrides)
    std = FAMILY_STD.get(model_type, 0.3) if std is None else std
    seed = FAMILY_SEED.get(model_type, 0) if seed is None else seed
    module = importlib.import_module(f"mlx_lm.models.{_MODULES.get(model_type, model_type)}")
    model = module.Model(module.ModelArgs.from_dict(config))
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    # norms near their initial scale, but each its own (a loop applying the wrong norm must show)
    weights = [(name, (p + 0.2 * mx.random.normal(p.shape, key=k)) if "norm" in name
                else std * mx.random.normal(p.shape, key=k)) for (name, p), k in zip(params, keys)]
    weights = [(name, w.astype(p.dtype)) for (name, w), (_, p) in zip(weights, params)]
    model.update(tree_unflatten(weights))
    mx.eval(model.parameters())
    if quantize_bits is not None:
        model, config = quantize_model(model, config, group_size=32, bits=quantize_bits)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(dict(config), out / "config.json")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def read_config(folder: pathlib.Path) -> dict:
    return json.loads((folder / "config.json").read_text())
