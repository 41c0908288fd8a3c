"""The forward of a prompt chunk with less host work: the engine's own layer loop over weights bound once.

Building a forward's graph is host work the device waits for: MLX's CUDA backend lets the host run at
most some ten committed batches of operations ahead of the GPU (`mlx/transforms.cpp`,
`MAX_ACTIVE_TASKS`; 8 operations a batch under `MLX_MAX_OPS_PER_BUFFER=8`), so launching a forward
returns only when most of it has run, and the next forward's graph is built while the device finishes
the last few layers. On an H200 host, mlx-lm's modules took 5 ms to build an 8B chunk's graph, against
some 1.5 ms of device work left (docs/benchmarks.md, session 8): the device idled for the rest, at
every forward.

This loop builds the same operations as mlx-lm's llama block (RMSNorm, q/k/v, RoPE, the KV write and
read through the `ForwardView`, MLX's causal attention, o, RMSNorm, gate/up, SwiGLU, down) with:
- every projection's weight transposed once, as an evaluated view of the model's own weight (no copy;
  mlx-lm's `nn.Linear` builds `weight.T` per call, the fused projections of engine/fused.py a slice
  and a transpose per part), so the same matmuls run, on the same memory;
- no module dispatch (attribute lookups, fused-product bookkeeping) per layer;
- in the last layer, only what the chunk's output needs: the keys and values of every position, and,
  when the chunk samples, the query, attention and MLP of its last position alone (engine/last_row.py
  computes the same through mlx-lm's modules); nothing more for a chunk that samples nothing.

Models: mlx-lm's llama blocks whose projections are `nn.Linear` without bias or the engine's fused parts
(`unsupported` says why not); others run mlx-lm's modules. Greedy output equals mlx-lm's (tests).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu

from engine.fused import FusedPart

_PROJECTIONS = (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                ("mlp", ("gate_proj", "up_proj", "down_proj")))


def unsupported(model: nn.Module) -> Optional[str]:
    """Why this loop cannot run `model`'s prompt chunks (None: it can)."""
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None) or []
    if not layers or not hasattr(backbone, "embed_tokens") or type(getattr(backbone, "norm", None)) is not nn.RMSNorm:
        return "not an mlx-lm llama-shaped model (model.model.layers, embed_tokens, RMSNorm norm)"
    for layer in layers:
        if type(layer).__name__ != "TransformerBlock" or not type(layer).__module__.endswith(".llama"):
            return f"layer type {type(layer).__module__}.{type(layer).__name__} is not mlx-lm's llama block"
        if getattr(layer, "use_sliding", False):
            return "sliding-window layers"
        if not (type(layer.input_layernorm) is nn.RMSNorm and type(layer.post_attention_layernorm) is nn.RMSNorm):
            return "norms are not nn.RMSNorm"
        for block, names in _PROJECTIONS:
            for name in names:
                proj = getattr(getattr(layer, block), name)
                if type(proj) is FusedPart:
                    if "bias" in proj._ref.fused:
                        return f"{block}.{name} has a bias"
                elif type(proj) is not nn.Linear or "bias" in proj:
                    return f"{block}.{name} is {type(proj).__name__}{' with a bias' if 'bias' in proj else ''}"
    return None


class _Layer:
    """One block's bound weights (transposed views), norms and rotation."""

    __slots__ = ("in_w", "in_eps", "post_w", "post_eps", "wq", "wk", "wv", "wo", "wg", "wu", "wd", "rope",
                 "scale")

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.in_w, self.in_eps = layer.input_layernorm.weight, layer.input_layernorm.eps
        self.post_w, self.post_eps = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        self.wq, self.wk, self.wv, self.wo = (getattr(attn, n).weight.T for n in _PROJECTIONS[0][1])
        self.wg, self.wu, self.wd = (getattr(mlp, n).weight.T for n in _PROJECTIONS[1][1])
        self.rope, self.scale = attn.rope, attn.scale


class ChunkPath:
    """Prompt-chunk forwards of a supported model (module docstring). Bind after any change of the
    model's weights (fusion, dtype): the views are of the weights as they are now."""

    def __init__(self, model: nn.Module):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"chunk path: {why}")
        backbone = model.model
        self.embed = backbone.embed_tokens
        self.layers = [_Layer(layer) for layer in backbone.layers]
        mx.eval([[l.wq, l.wk, l.wv, l.wo, l.wg, l.wu, l.wd] for l in self.layers])  # views: no copy
        self.norm_w, self.norm_eps = backbone.norm.weight, backbone.norm.eps
        attn = backbone.layers[0].self_attn
        self.heads, self.kv_heads = attn.n_heads, attn.n_kv_heads
        self.head_dim = attn.o_proj.weight.shape[1] // attn.n_heads

    def forward(self, tokens: mx.array, view, sample: bool) -> Optional[mx.array]:
        """tokens [1, T] -> the final-normed hidden state of the last position, [1, 1, D], if `sample`
        (else None: the forward only writes the KV of its T positions). `view`: a ForwardView of one
        row and T new tokens, whose KV it writes (and reads)."""
        H, H_kv, d = self.heads, self.kv_heads, self.head_dim
        T = tokens.shape[1]
        offset = view.offset
        h = self.embed(tokens)  # [1, T, D]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = mx.fast.rms_norm(h, layer.in_w, layer.in_eps)
            k = layer.rope((x @ layer.wk).reshape(1, T, H_kv, d).transpose(0, 2, 1, 3), offset=offset)
            v = (x @ layer.wv).reshape(1, T, H_kv, d).transpose(0, 2, 1, 3)
            view.write(i, k, v)
            if i == last:
                if not sample:
                    return None
                if T > 1:  # the last position's query, attention and MLP alone
                    x, h = x[:, -1:], h[:, -1:]
            Tq = x.shape[1]
            q = layer.rope((x @ layer.wq).reshape(1, Tq, H, d).transpose(0, 2, 1, 3), offset=offset + T - Tq)
            out = view.attend(i, q, layer.scale)  # a one-token chunk of a paged pool
            if out is None:
                keys, values = view.read(i)
                out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=layer.scale,
                                                           mask="causal" if Tq > 1 else None)
            h = h + out.transpose(0, 2, 1, 3).reshape(1, Tq, H * d) @ layer.wo
            x = mx.fast.rms_norm(h, layer.post_w, layer.post_eps)
            h = h + swiglu(x @ layer.wg, x @ layer.wu) @ layer.wd
        return mx.fast.rms_norm(h, self.norm_w, self.norm_eps)
