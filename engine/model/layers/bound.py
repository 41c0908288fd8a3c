"""A llama block's weights bound once, for the engine's own layer loops (engine/model/layers/chunk_path.py,
engine/model/layers/decode_path.py, engine/model/layers/mixed.py).

mlx-lm's `nn.Linear` builds `weight.T` at every call, and the fused projections of engine/model/layers/fused.py a
slice and a transpose per part, plus module dispatch: host work at every forward that the GPU waits
for (engine/model/layers/chunk_path.py says why). Here every projection's weight is transposed once, as an evaluated
view of the model's own weight (no copy), so the loops build one matmul (or, with a bias, one addmm)
per projection: the same operation on the same memory as mlx-lm's layer computes.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from engine.model.layers.fused import FusedPart

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


# mlx-lm's phi3 stores q/k/v and gate/up fused already (its own projections' names)
PRE_FUSED_ATTENTION = ("qkv_proj", "o_proj")
PRE_FUSED_MLP = ("gate_up_proj", "down_proj")

# mlx-lm modules whose TransformerBlock is a llama block: pre-norm attention and SwiGLU MLP, RMSNorm,
# q/k/v (with biases in qwen2), RoPE; qwen3 adds an RMSNorm of each query and key head before RoPE;
# phi3's q/k/v and gate/up come as one fused projection each
LLAMA_BLOCK_MODULES = ("llama", "qwen2", "qwen3", "phi3")


def unsupported(model: nn.Module) -> Optional[str]:
    """Why the engine's loops cannot run `model` (None: they can): mlx-lm's llama-shaped blocks
    (LLAMA_BLOCK_MODULES: llama and mistral, qwen2, qwen3, phi3), RMSNorm norms, float linear
    projections (plain or fused; quantized ones are left to mlx-lm's modules)."""
    backbone = getattr(model, "model", None)
    layers = getattr(backbone, "layers", None) or []
    if not layers or not hasattr(backbone, "embed_tokens") or type(getattr(backbone, "norm", None)) is not nn.RMSNorm:
        return "not an mlx-lm llama-shaped model (model.model.layers, embed_tokens, RMSNorm norm)"
    for layer in layers:
        module = type(layer).__module__
        if type(layer).__name__ != "TransformerBlock" or module.rsplit(".", 1)[-1] not in LLAMA_BLOCK_MODULES:
            return f"layer type {module}.{type(layer).__name__} is not a llama-shaped block"
        if getattr(layer, "use_sliding", False):
            return "sliding-window layers"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        norms += [getattr(layer.self_attn, n) for n in ("q_norm", "k_norm") if n in layer.self_attn]
        if any(type(norm) is not nn.RMSNorm for norm in norms):
            return "norms are not nn.RMSNorm"
        for block, names in _projection_names(layer):
            for name in names:
                proj = getattr(getattr(layer, block), name)
                if type(proj) not in (nn.Linear, FusedPart):
                    return f"{block}.{name} is {type(proj).__name__}"
    return None


def _projection_names(layer: nn.Module) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return (("self_attn", ATTENTION if "q_proj" in attn else PRE_FUSED_ATTENTION),
            ("mlp", MLP if "gate_proj" in mlp else PRE_FUSED_MLP))


def project(x: mx.array, weight_t: mx.array, bias: Optional[mx.array] = None) -> mx.array:
    """x @ W^T (+ b): one matmul (or addmm) on the bound W^T."""
    if bias is None:
        return x @ weight_t
    return mx.addmm(bias, x, weight_t)


class Projection:
    """x -> x @ W^T (+ b), with W^T bound once."""

    __slots__ = ("weight_t", "bias")

    def __init__(self, weight: mx.array, bias: Optional[mx.array]):
        self.weight_t = weight.T
        self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        return project(x, self.weight_t, self.bias)

    def arrays(self) -> list:
        return [self.weight_t] + ([self.bias] if self.bias is not None else [])


def _bind(proj: nn.Module) -> Projection:
    if type(proj) is FusedPart:  # its rows of the group's weight (and bias)
        fused = proj._ref.fused
        a, b = fused.bounds(proj._index)
        return Projection(fused.weight[a:b], fused.bias[a:b] if "bias" in fused else None)
    return Projection(proj.weight, proj.bias if "bias" in proj else None)


def _split(proj: nn.Linear, ends: tuple) -> list[Projection]:
    """Projections of consecutive row ranges of one linear layer, ending at `ends`."""
    bias = proj.bias if "bias" in proj else None
    starts = (0,) + ends[:-1]
    return [Projection(proj.weight[a:b], None if bias is None else bias[a:b]) for a, b in zip(starts, ends)]


class BoundLayer:
    """One block: its norms, rotation, and projections (q, k, v, o, gate, up, down; and the fused q/k/v
    and gate/up products where engine/model/layers/fused.py fused them, else None)."""

    def __init__(self, layer: nn.Module):
        attn, mlp = layer.self_attn, layer.mlp
        self.in_w, self.in_eps = layer.input_layernorm.weight, layer.input_layernorm.eps
        self.post_w, self.post_eps = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        if "q_proj" in attn:
            self.q, self.k, self.v = (_bind(getattr(attn, n)) for n in ATTENTION[:3])
        else:  # phi3: the rows of its q/k/v projection
            q_rows, kv_rows = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
            self.q, self.k, self.v = _split(attn.qkv_proj, (q_rows, q_rows + kv_rows, q_rows + 2 * kv_rows))
        if "gate_proj" in mlp:
            self.gate, self.up = (_bind(getattr(mlp, n)) for n in MLP[:2])
        else:  # phi3: gate, then up, in one projection (mlx-lm splits its product in halves)
            rows = mlp.gate_up_proj.weight.shape[0]
            self.gate, self.up = _split(mlp.gate_up_proj, (rows // 2, rows))
        self.o, self.down = _bind(attn.o_proj), _bind(mlp.down_proj)
        self.qkv = _bind(attn.qkv_proj) if "qkv_proj" in attn else None
        self.gate_up = _bind(mlp.gate_up_proj) if "gate_up_proj" in mlp else None
        self.up_start = self.gate.weight_t.shape[1]  # the up part's first column of gate_up's product
        self.rope, self.scale = attn.rope, attn.scale
        # qwen3: RMSNorm of each query / key head before RoPE (weights [d]), else None
        self.q_norm = (attn.q_norm.weight, attn.q_norm.eps) if "q_norm" in attn else None
        self.k_norm = (attn.k_norm.weight, attn.k_norm.eps) if "k_norm" in attn else None

    def norm_q(self, q: mx.array) -> mx.array:
        """q [..., d] through the layer's query-head norm (as is without one)."""
        return q if self.q_norm is None else mx.fast.rms_norm(q, *self.q_norm)

    def norm_k(self, k: mx.array) -> mx.array:
        return k if self.k_norm is None else mx.fast.rms_norm(k, *self.k_norm)

    def projections(self) -> list[Projection]:
        return [p for p in (self.q, self.k, self.v, self.o, self.gate, self.up, self.down, self.qkv,
                            self.gate_up) if p is not None]


def bind_layers(layers: list) -> list[BoundLayer]:
    """Every block's BoundLayer, its views evaluated (they share the weights' memory). Bind after any
    change of the model's weights (fusion, dtype): the views are of the weights as they are now."""
    bound = [BoundLayer(layer) for layer in layers]
    mx.eval([p.arrays() for b in bound for p in b.projections()])
    return bound
