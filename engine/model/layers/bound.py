"""A block's weights bound once, for the engine's own layer loops (engine/model/layers/chunk_path.py,
engine/model/layers/decode_path.py, engine/model/layers/mixed.py), and the family's block description
(engine/model/layers/block.py: norms, MLP, softcap, embedding scale) with them.

mlx-lm's `nn.Linear` builds `weight.T` at every call, and the fused projections of engine/model/layers/fused.py a
slice and a transpose per part, plus module dispatch: host work at every forward that the GPU waits
for (engine/model/layers/chunk_path.py says why). Here every projection's weight is transposed once, as an evaluated
view of the model's own weight (no copy), so the loops build one matmul (or, with a bias, one addmm)
per projection: the same operation on the same memory as mlx-lm's layer computes. Gemma's norms
(1 + weight) are the one copy: a hidden-size vector per norm (`BoundModel.extra_bytes`).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from engine.model.layers import block
from engine.model.layers.fused import FusedPart

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


# mlx-lm's phi3 stores q/k/v and gate/up fused already (its own projections' names)
PRE_FUSED_ATTENTION = ("qkv_proj", "o_proj")
PRE_FUSED_MLP = ("gate_up_proj", "down_proj")

# mlx-lm's norms the loops bind: nn.RMSNorm, and Gemma's RMSNorm (its modules' own class, scaling by
# 1 + weight: bound as that sum, computed once here where mlx-lm adds it at every call)
OFFSET_NORM_MODULES = block.GEMMA_FAMILIES


def unsupported(model: nn.Module) -> Optional[str]:
    """Why the engine's loops cannot run `model` (None: they can): mlx-lm's blocks of the families in
    block.LOOP_BLOCKS (llama and mistral, qwen2, qwen3, phi3, qwen3_moe, gemma, gemma2, gemma3_text,
    and Gemma 3's text model inside its multimodal wrapper), their RMSNorms, float linear projections
    (plain or fused; quantized ones are left to mlx-lm's modules), float experts."""
    text = language_model(model)
    backbone = getattr(text, "model", None)
    layers = getattr(backbone, "layers", None) or []
    family = block.module_family(text)
    if family not in block.LOOP_BLOCKS:
        return f"model family {family} has no layer loop"
    if not layers or not hasattr(backbone, "embed_tokens") or _norm_why(backbone.norm):
        return "not an mlx-lm model of a known shape (model.layers, embed_tokens, an RMSNorm norm)"
    for layer in layers:
        if type(layer).__name__ != block.LOOP_BLOCKS[family] or block.module_family(layer) != family:
            return f"layer type {type(layer).__module__}.{type(layer).__name__} is not its family's block"
        if getattr(layer, "use_sliding", False):
            return "sliding-window layers"
        norms = [getattr(layer, n) for n in NORMS if n in layer]
        norms += [getattr(layer.self_attn, n) for n in ("q_norm", "k_norm") if n in layer.self_attn]
        why = next((w for w in map(_norm_why, norms) if w), None)
        if why:
            return why
        for part, names in _projection_names(layer):
            for name in names:
                proj = getattr(getattr(layer, part), name)
                if type(proj) not in (nn.Linear, FusedPart):
                    return f"{part}.{name} is {type(proj).__name__}"
        if "switch_mlp" in layer.mlp and not _float_experts(layer.mlp):
            return "experts are not float SwitchGLU projections"
    return None


NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def _norm_why(norm) -> Optional[str]:
    if type(norm) is nn.RMSNorm:
        return None
    if type(norm).__name__ == "RMSNorm" and block.module_family(norm) in OFFSET_NORM_MODULES:
        return None
    return f"norm {type(norm).__module__}.{type(norm).__name__} is not an RMSNorm"


def _float_experts(moe: nn.Module) -> bool:
    switch = moe.switch_mlp
    projections = [getattr(switch, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return (type(switch).__name__ == "SwitchGLU" and type(switch.activation).__name__ == "SwiGLU"
            and all(type(p).__name__ == "SwitchLinear" and "bias" not in p for p in projections))


def language_model(model: nn.Module) -> nn.Module:
    """The text model inside a multimodal wrapper (mlx-lm's gemma3.Model holds a gemma3_text.Model)."""
    inner = getattr(model, "language_model", None)
    return inner if isinstance(inner, nn.Module) else model


def norm_of(norm: nn.Module) -> tuple:
    """(weight, eps) of an RMSNorm as mx.fast.rms_norm takes them: Gemma's 1 + weight (module docstring)."""
    if type(norm) is nn.RMSNorm:
        return norm.weight, norm.eps
    return 1.0 + norm.weight, norm.eps


def _projection_names(layer: nn.Module) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    if "switch_mlp" in mlp:  # qwen3_moe's sparse MLP: its router (the experts: _float_experts)
        mlp_names = ("gate",)
    else:
        mlp_names = MLP if "gate_proj" in mlp else PRE_FUSED_MLP
    return (("self_attn", ATTENTION if "q_proj" in attn else PRE_FUSED_ATTENTION), ("mlp", mlp_names))


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

    @classmethod
    def of(cls, weight_t: mx.array, bias: Optional[mx.array] = None) -> "Projection":
        """The projection of a bound W^T (and bias): a compiled trace's inputs."""
        out = cls.__new__(cls)
        out.weight_t, out.bias = weight_t, bias
        return out

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
    """One block: its norms ((weight, eps) as rms_norm takes them), rotation, and projections (q, k, v,
    o, gate, up, down; the fused q/k/v and gate/up products where engine/model/layers/fused.py fused
    them, else None; a sparse MLP's `moe` instead of gate/up/down) and the family's `spec` (a sliding
    layer's window is the pool's: KVPool.layer_windows)."""

    def __init__(self, layer: nn.Module, spec: Optional[block.BlockSpec] = None):
        attn, mlp = layer.self_attn, layer.mlp
        self.spec = spec or block.BlockSpec(block.module_family(layer))
        self.in_w, self.in_eps = norm_of(layer.input_layernorm)
        # the MLP's input norm (post_w): a llama block's post-attention norm, Gemma 2/3's pre-feed-forward
        # norm, whose post-attention and post-feed-forward norms apply to the branches' outputs
        self.attn_out_norm = self.mlp_out_norm = None
        if self.spec.sandwich:
            self.attn_out_norm = norm_of(layer.post_attention_layernorm)
            self.post_w, self.post_eps = norm_of(layer.pre_feedforward_layernorm)
            self.mlp_out_norm = norm_of(layer.post_feedforward_layernorm)
        else:
            self.post_w, self.post_eps = norm_of(layer.post_attention_layernorm)
        if "q_proj" in attn:
            self.q, self.k, self.v = (_bind(getattr(attn, n)) for n in ATTENTION[:3])
        else:  # phi3: the rows of its q/k/v projection
            q_rows, kv_rows = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
            self.q, self.k, self.v = _split(attn.qkv_proj, (q_rows, q_rows + kv_rows, q_rows + 2 * kv_rows))
        self.gate = self.up = self.down = self.gate_up = self.moe = None
        self.up_start = 0
        if "switch_mlp" in mlp:
            self.moe = block.BoundMoE(mlp, _bind(mlp.gate))
        else:
            if "gate_proj" in mlp:
                self.gate, self.up = (_bind(getattr(mlp, n)) for n in MLP[:2])
            else:  # phi3: gate, then up, in one projection (mlx-lm splits its product in halves)
                rows = mlp.gate_up_proj.weight.shape[0]
                self.gate, self.up = _split(mlp.gate_up_proj, (rows // 2, rows))
            self.down = _bind(mlp.down_proj)
            self.gate_up = _bind(mlp.gate_up_proj) if "gate_up_proj" in mlp else None
            self.up_start = self.gate.weight_t.shape[1]  # the up part's first column of gate_up's product
        self.o = _bind(attn.o_proj)
        self.qkv = _bind(attn.qkv_proj) if "qkv_proj" in attn else None
        self.rope, self.scale = attn.rope, attn.scale
        self.softcap = block.softcap_of(self.spec)
        self.add = block.residual_add(self.spec)
        # qwen3, gemma3: RMSNorm of each query / key head before RoPE (weights [d]), else None
        self.q_norm = norm_of(attn.q_norm) if "q_norm" in attn else None
        self.k_norm = norm_of(attn.k_norm) if "k_norm" in attn else None

    def norm_q(self, q: mx.array) -> mx.array:
        """q [..., d] through the layer's query-head norm (as is without one)."""
        return q if self.q_norm is None else mx.fast.rms_norm(q, *self.q_norm)

    def norm_k(self, k: mx.array) -> mx.array:
        return k if self.k_norm is None else mx.fast.rms_norm(k, *self.k_norm)

    def projections(self) -> list[Projection]:
        router = [self.moe.router] if self.moe is not None else []
        return [p for p in (self.q, self.k, self.v, self.o, self.gate, self.up, self.down, self.qkv,
                            self.gate_up) if p is not None] + router

    def norm_weights(self) -> list[mx.array]:
        norms = (self.attn_out_norm, self.mlp_out_norm, self.q_norm, self.k_norm)
        return [self.in_w, self.post_w] + [n[0] for n in norms if n is not None]


def bind_layers(layers: list, spec: Optional[block.BlockSpec] = None) -> list[BoundLayer]:
    """Every block's BoundLayer, its views evaluated (they share the weights' memory). Bind after any
    change of the model's weights (fusion, dtype): the views are of the weights as they are now."""
    bound = [BoundLayer(layer, spec) for layer in layers]
    mx.eval([p.arrays() for b in bound for p in b.projections()] + [b.norm_weights() for b in bound])
    return bound


class BoundModel:
    """A text model's layers bound once (BoundLayer), its embedding and final norm, and its family's
    block (engine/model/layers/block.py); the loops share one (ModelRunner)."""

    def __init__(self, model: nn.Module):
        why = unsupported(model)
        if why is not None:
            raise ValueError(why)
        text = language_model(model)
        self.backbone = backbone = text.model
        self.spec = block.block_spec(text)
        self.layers = bind_layers(backbone.layers, self.spec)
        self.final_norm = norm_of(backbone.norm)
        mx.eval(self.final_norm[0])
        attn = backbone.layers[0].self_attn
        self.heads, self.kv_heads = attn.n_heads, attn.n_kv_heads
        self.head_dim = attn.o_proj.weight.shape[1] // attn.n_heads

    def embed(self, tokens: mx.array) -> mx.array:
        """tokens -> the first layer's input ([..., D])."""
        return block.embed(self.spec, self.backbone.embed_tokens, tokens)

    @property
    def extra_bytes(self) -> int:
        """What binding allocated beyond views of the weights: Gemma's 1 + weight norms."""
        if not self.spec.norm_offset:
            return 0
        return self.final_norm[0].nbytes + sum(w.nbytes for b in self.layers for w in b.norm_weights())
