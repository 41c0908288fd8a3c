"""What differs between the blocks of the families the engine's layer loops run, and the operations that
differ (engine/model/layers/bound.py binds a block, chunk_path.py, decode_path.py and mixed.py loop over them).

A `BlockSpec` per family, read from the mlx-lm module that built the model:
- llama, mistral, qwen2, qwen3, phi3: pre-norm attention and SwiGLU MLP, `x + attn`, `x + mlp`;
- qwen3_moe: qwen3's attention; in its sparse layers mlx-lm's SparseMoeBlock (router, top-k experts
  through SwitchGLU's gather_mm, their outputs weighted): `moe_mlp` computes it with mlx-lm's own
  parts, in stages a runner can wait between (the router, the experts, their sum);
- gemma: RMSNorm scaling by 1 + weight, GELU (erf) MLP, embeddings times sqrt(hidden);
- gemma2: as gemma with GELU-approx, and a norm of the attention's and of the MLP's output before each
  residual add (a pre-feed-forward norm as the MLP's input norm); attention logits soft-capped, so
  attention is explicit (`softcapped_attention`, mlx-lm's formula);
- gemma3_text: gemma2's block with q/k head norms, no softcap, sliding-window layers (each with its own
  RoPE base: the layers' ropes are bound per layer), the embedding scale rounded to bfloat16 and the
  residual adds clipped in float16 (mlx-lm's `clip_residual`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import _gather_sort, _scatter_unsort

# mlx-lm modules (mlx_lm.models.<name>) whose blocks the loops run, and the block class of each
LOOP_BLOCKS = {"llama": "TransformerBlock", "qwen2": "TransformerBlock", "qwen3": "TransformerBlock",
               "phi3": "TransformerBlock", "qwen3_moe": "Qwen3MoeDecoderLayer", "gemma": "TransformerBlock",
               "gemma2": "TransformerBlock", "gemma3_text": "TransformerBlock"}
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text")


@dataclass(frozen=True)
class BlockSpec:
    """A family's block (module docstring)."""

    family: str
    norm_offset: float = 0.0  # RMSNorm scales by norm_offset + weight (Gemma: 1)
    sandwich: bool = False  # norms of the attention's and the MLP's outputs before the residual adds
    activation: str = "silu"  # of the gate: "silu" (SwiGLU), "gelu" (erf), "gelu_approx" (tanh)
    embed_scale: Optional[float] = None  # embeddings times this (Gemma: sqrt(hidden))
    embed_scale_bf16: bool = False  # ... rounded to bfloat16 first (gemma3_text)
    attn_softcap: Optional[float] = None  # attention logits through cap * tanh(x / cap) (gemma2)
    clip_residual: bool = False  # float16 residual adds in float32, clipped (gemma3_text)


def module_family(model: nn.Module) -> str:
    """The mlx-lm module (mlx_lm.models.<name>) a model or block comes from."""
    return type(model).__module__.rsplit(".", 1)[-1]


def block_spec(text_model: nn.Module) -> BlockSpec:
    """The BlockSpec of an mlx-lm text model (its family's; module docstring)."""
    family = module_family(text_model)
    if family not in GEMMA_FAMILIES:
        return BlockSpec(family)
    args = text_model.args
    return BlockSpec(family, norm_offset=1.0, sandwich=family != "gemma",
                     activation="gelu" if family == "gemma" else "gelu_approx",
                     embed_scale=args.hidden_size ** 0.5, embed_scale_bf16=family == "gemma3_text",
                     attn_softcap=getattr(args, "attn_logit_softcapping", None) if family == "gemma2" else None,
                     clip_residual=family == "gemma3_text")


def embed(spec: BlockSpec, embed_tokens: nn.Module, tokens: mx.array) -> mx.array:
    """tokens -> the first layer's input, as the family's model computes it."""
    h = embed_tokens(tokens)
    if spec.embed_scale is None:
        return h
    if spec.embed_scale_bf16:  # gemma3_text: mx.array(sqrt(hidden), bfloat16).astype(h.dtype)
        return h * mx.array(spec.embed_scale, mx.bfloat16).astype(h.dtype)
    return h * spec.embed_scale


def residual_add(spec: BlockSpec) -> Callable[[mx.array, mx.array], mx.array]:
    """x + y as the family's block adds a branch to the residual stream: gemma3_text's `clip_residual`
    in float16 (a float32 sum, clipped), else a plain add (what that compiled function computes for
    other dtypes, without holding its inputs as a compiled function does)."""
    if not spec.clip_residual:
        return mx.add
    from mlx_lm.models.gemma3_text import clip_residual

    def add(x: mx.array, y: mx.array) -> mx.array:
        return clip_residual(x, y) if x.dtype == mx.float16 else x + y

    return add


def gate_activation(name: str, swiglu: Callable) -> Callable[[mx.array, mx.array], mx.array]:
    """(gate, up) -> the MLP's hidden activations: `swiglu` (mlx-lm's or cpu_math's) for "silu", else
    mlx's GELU of the gate times up, as mlx-lm's Gemma MLPs compute them."""
    if name == "silu":
        return swiglu
    gelu = nn.gelu if name == "gelu" else nn.gelu_approx
    return lambda gate, up: gelu(gate) * up


def mlp(layer, y: mx.array, swiglu: Callable, fused: bool = False, stages: Optional[list] = None) -> mx.array:
    """A bound layer's (BoundLayer) MLP of its input y: the sparse MLP (`moe_mlp`), or down(act(gate,
    up)) from the fused gate/up product where `fused` (decodes: one matmul; columns [0, up_start) gate,
    the rest up) else from gate and up apart (prompt chunks: each a contiguous array). `swiglu`:
    mlx-lm's or engine/model/layers/cpu_math.py's."""
    if layer.moe is not None:
        return moe_mlp(layer.moe, y, swiglu, stages)
    if fused and layer.gate_up is not None:
        return layer.down(mlp_hidden(layer, y, swiglu))
    act = gate_activation(layer.spec.activation, swiglu)
    return layer.down(act(layer.gate(y), layer.up(y)))


def mlp_hidden(layer, y: mx.array, swiglu: Callable) -> mx.array:
    """A dense MLP's hidden activations (down's input) from its fused gate/up product of y."""
    product = layer.gate_up(y)
    return gate_activation(layer.spec.activation, swiglu)(product[..., :layer.up_start], product[..., layer.up_start:])


def after_attention(layer, h: mx.array, r: mx.array, add_rms_norm: Callable) -> tuple:
    """The residual stream h plus the attention's output r (after o) -> (h, the MLP's input): a llama
    block's add and post-attention norm; Gemma 2/3's norm of r first, then the pre-feed-forward norm."""
    if layer.attn_out_norm is not None:
        r = mx.fast.rms_norm(r, *layer.attn_out_norm)
    return add_rms_norm(h, r, layer.post_w, layer.post_eps, layer.add)


def after_mlp(layer, h: mx.array, m: mx.array, next_norm: Optional[tuple], add_rms_norm: Callable) -> tuple:
    """h plus the MLP's output m -> (h, the next norm's output: `next_norm` (weight, eps) of the next
    layer's input norm or the final norm; None: not computed, (h, None))."""
    if layer.mlp_out_norm is not None:
        m = mx.fast.rms_norm(m, *layer.mlp_out_norm)
    if next_norm is None:
        return layer.add(h, m), None
    return add_rms_norm(h, m, *next_norm, layer.add)


class BoundMoE:
    """mlx-lm's SparseMoeBlock of one layer: its router bound as a projection, its SwitchGLU's expert
    projections called as they are (gather_mm over the stacked experts' weights)."""

    def __init__(self, block: nn.Module, router):
        self.router = router
        self.top_k = block.top_k
        self.norm_topk_prob = block.norm_topk_prob
        switch = block.switch_mlp
        self.gate_proj, self.up_proj, self.down_proj = switch.gate_proj, switch.up_proj, switch.down_proj


def moe_mlp(moe: BoundMoE, x: mx.array, swiglu: Callable, stages: Optional[list] = None) -> mx.array:
    """x [..., D] -> the sparse MLP's output [..., D], with mlx-lm's operations (Qwen3MoeSparseMoeBlock,
    SwitchGLU). `stages`: appended, for a runner that waits for each (ModelRunner.stage_waits), the
    router's choice (with the tokens' copies sorted by expert), the experts' up and gate products, their
    activation, and the experts' outputs: MLX's CPU backend allocates the outputs of what the host
    queued while its worker still runs earlier operations, so without the waits every one of them (some
    5 k rows per token) would be alive at once; with them at most the copies, two of the products, or
    the outputs beside their unsorted copy (MemoryModel counts k rows per token)."""
    gates = mx.softmax(moe.router(x), axis=-1, precise=True)
    k = moe.top_k
    inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if moe.norm_topk_prob:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    y = mx.expand_dims(x, (-2, -3))
    do_sort = inds.size >= 64  # SwitchGLU sorts many tokens' copies by expert
    idx, inv_order = inds, None
    if do_sort:
        y, idx, inv_order = _gather_sort(y, inds)
    _stage(stages, scores, y, idx)
    up = moe.up_proj(y, idx, sorted_indices=do_sort)
    gate = moe.gate_proj(y, idx, sorted_indices=do_sort)
    _stage(stages, up, gate)
    hidden = swiglu(gate, up)
    _stage(stages, hidden)
    y = moe.down_proj(hidden, idx, sorted_indices=do_sort)
    _stage(stages, y)
    if do_sort:  # a stage of its own: the weighting below then writes into the unsorted copy
        y = _scatter_unsort(y, inv_order, inds.shape)
        _stage(stages, y)
    y = y.squeeze(-2)  # [..., k, D]
    return (y * scores[..., None]).sum(axis=-2).astype(y.dtype)


def _stage(stages: Optional[list], *arrays) -> None:
    if stages is not None:
        stages.append(list(arrays))


def softcapped_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, cap: float,
                         mask) -> mx.array:
    """queries [B, H, T, d], keys/values [B, H_kv, L, d] -> [B, H, T, d] as mlx-lm's gemma2 attention
    computes it: scaled queries, scores grouped per KV head, cap * tanh(scores / cap), a boolean mask
    (None, "causal" aligned to the last keys, or an array that broadcasts to [B, 1, T, L]) as the
    dtype's lowest value, a precise softmax, times the values."""
    B, H, T, d = queries.shape
    H_kv, L = keys.shape[1], keys.shape[2]
    repeats = H // H_kv
    queries = queries * scale
    if isinstance(mask, str):
        mask = mx.arange(L)[None] <= mx.arange(L - T, L)[:, None] if T > 1 else None  # [T, L]
    if repeats > 1:
        queries = queries.reshape(B, H_kv, repeats, T, d)
        keys, values = mx.expand_dims(keys, 2), mx.expand_dims(values, 2)
        if mask is not None and mask.ndim == 4:
            mask = mx.expand_dims(mask, 2)  # [B, 1, 1, T|1, L]
    scores = queries @ keys.swapaxes(-1, -2)
    scores = mx.tanh(scores / cap)
    scores = scores * cap
    if mask is not None:
        scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    scores = mx.softmax(scores, precise=True, axis=-1)
    out = scores @ values
    return out.reshape(B, H, T, d) if repeats > 1 else out


def query_blocks(attend: Callable, queries: mx.array, keys: mx.array, values: mx.array, mask, blocks: int,
                 stages: Optional[list] = None) -> Optional[mx.array]:
    """A prompt chunk's attention `attend(q, k, v, mask)` in `blocks` blocks of its queries, one after
    another, each over the keys its last query reads (the masked keys past a block are never scored),
    or None if the mask is not a chunk's: "causal" or a [T, L] array (causal, perhaps windowed).
    `stages`: each block's output is appended (ModelRunner.stage_waits): only then is one block's
    scores alive at a time."""
    T, L = queries.shape[2], keys.shape[2]
    chunk_mask = (isinstance(mask, str) and mask == "causal") or (isinstance(mask, mx.array) and mask.ndim == 2)
    if T < 2 or blocks < 2 or not chunk_mask:
        return None
    size = -(-T // blocks)
    parts = []
    for start in range(0, T, size):
        end = min(T, start + size)
        last_key = L - T + end  # keys [0, last_key) are read by some query of the block
        block = queries[:, :, start:end]
        if parts:  # after the previous block: MLX would otherwise score every block at once
            block = mx.depends(block, parts[-1])
        block_mask = mask if isinstance(mask, str) else mask[start:end, :last_key]
        parts.append(attend(block, keys[:, :, :last_key], values[:, :, :last_key], block_mask))
        if stages is not None:
            stages.append(parts[-1])
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def softcap_of(spec: BlockSpec) -> Optional[float]:
    cap = spec.attn_softcap
    return float(cap) if cap and math.isfinite(cap) else None
