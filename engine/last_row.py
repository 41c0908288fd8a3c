"""The forward of a prompt chunk that ends its prompt: every position's keys and values, but the model's
output at the last position only.

The chunk samples its request's first token from the last position's logits. mlx-lm's model computes
every position through every layer; the KV of all positions is needed, but after the last layer's
keys and values nothing of the other positions is. So the last layer here computes keys and values
for the chunk's T positions, and its query, attention, output projection and MLP for the last
position alone: on a model of L layers that saves about 1/L of the chunk's arithmetic (a chunk that
does not sample already skips the last layer's MLP, which nothing reads). A sequential prefill does
the same work with a last one-token forward (scripts/bench_prefill_memory.py `sequential`).

Only mlx-lm's llama blocks (`decode_path.unsupported(model, kernels=False)` is None) run so; the
runner falls back to the whole forward for other models and one-token chunks.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask


def last_row_forward(backbone, tokens: mx.array, cache: list) -> mx.array:
    """tokens [1, T] (T > 1) -> the final-normed hidden state of the last position, [1, 1, D]. Writes
    every layer's keys and values of the T positions through `cache` (one `_ViewLayer` per layer) as
    mlx-lm's forward does."""
    h = backbone.embed_tokens(tokens)
    mask = create_attention_mask(h, cache[0])
    for layer, layer_cache in zip(backbone.layers[:-1], cache[:-1]):
        h = layer(h, mask, cache=layer_cache)
    layer, layer_cache = backbone.layers[-1], cache[-1]
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    T, offset = x.shape[1], layer_cache.offset
    # mlx-lm's attention module, with the queries of the last position only
    q = attn.q_proj(x[:, -1:]).reshape(1, 1, attn.n_heads, -1).transpose(0, 2, 1, 3)
    k = attn.k_proj(x).reshape(1, T, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    v = attn.v_proj(x).reshape(1, T, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
    q = attn.rope(q, offset=offset + T - 1)
    k = attn.rope(k, offset=offset)
    keys, values = layer_cache.update_and_fetch(k, v)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale)  # the last query sees every key
    h = h[:, -1:] + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, 1, -1))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return backbone.norm(h)
