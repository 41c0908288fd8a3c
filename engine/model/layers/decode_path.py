"""The decode forward of llama-shaped models with fewer operations: the engine's own layer loop.

Per layer: RMSNorm, the fused q/k/v matmul (engine/model/layers/fused.py), RoPE of q and k, the KV write,
attention, o, the residual add and RMSNorm, the fused gate/up matmul, SwiGLU, down, add and the next
RMSNorm: the same operations as mlx-lm's llama block, over weights bound once (engine/model/layers/
bound.py), with no module dispatch per layer. Attention: where the runner set a paged kernel
(engine/model/kernels/paged_attention.py, MLX's CUDA backend), this loop calls it explicitly on each row's
KV in the pool; else it attends over the rows' gathered KV with `ReferenceOps.attention` (on the CPU
engine/model/layers/cpu_math.py's). The engine's layer loops (this one, mixed.py, chunk_path.py) are the
only forwards that read the pool in place: mlx-lm's modules attend over what the cache returns, a
gathered copy.

Only decode forwards (one token per row) of models whose layers are mlx-lm's llama `TransformerBlock`
(llama, and the families that reuse it) with fused projections take it (`unsupported` says why not);
everything else runs mlx-lm's modules. It builds a decode's graph in less host time than mlx-lm's
modules, and less again with each layer's operations built from a compiled trace (`CompiledLayers`,
on CUDA): host time the GPU otherwise waits for (docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu

from engine.model.layers import bound, cpu_math

logger = logging.getLogger(__name__)

class RopeSpec:
    """What the rotation of one model needs (mlx-lm's nn.RoPE or Llama3RoPE); the
    compiled layers check that every layer's is the same."""

    def __init__(self, rope: nn.Module, head_dim: int):
        self.module = rope
        self.freqs: Optional[mx.array] = getattr(rope, "_freqs", None)
        self.scale = float(getattr(rope, "scale", 1.0)) if self.freqs is None else 1.0
        base = getattr(rope, "base", None)  # MLX keeps it as a float32 and takes log2 of that on the host
        self.log2_base = float(np.float32(math.log2(np.float32(base)))) if base is not None else 0.0
        self.head_dim = head_dim


class ReferenceOps:
    """The layer loops' RoPE and q/k/v layout, residual add and RMSNorm, exactly mlx-lm's; and their
    attention (of a gathered forward) and SwiGLU: MLX's and mlx-lm's, or with `cpu_math`
    engine/model/layers/cpu_math.py's (MLX's CPU backend: the same formulas with exp as a power)."""

    def __init__(self, cpu_math: bool = False):
        self.cpu_math = cpu_math

    def attention(self, queries, keys, values, scale: float, mask=None, stages: Optional[list] = None) -> mx.array:
        """`stages`: cpu_math.attention's (MLX's fused attention is one operation: none)."""
        if self.cpu_math:
            return cpu_math.attention(queries, keys, values, scale, mask, stages=stages)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    def swiglu(self, gate: mx.array, up: mx.array) -> mx.array:
        return cpu_math.swiglu(gate, up) if self.cpu_math else swiglu(gate, up)

    def attend(self, view, i: int, q: mx.array, scale: float, kv: Optional[tuple] = None,
               stages: Optional[list] = None, drop_keys: int = 0) -> mx.array:
        """Layer i's attention of `q` [B, H, Tq, d] over the KV `view` holds (its new keys written):
        in the pool in place where the view is paged, else over what it reads (a view of one row, or
        the rows' gathered KV) with `attention`, causal for several queries, else masked to each row's
        length (`view.mask`, None for one row). `kv`: what `read_kv` returned for this layer (None:
        read here); `stages`: `attention`'s; `drop_keys`: one row's last keys left out (a padded prompt
        chunk's pad, for the one query of its last real position)."""
        out = view.attend(i, q, scale)
        if out is None:
            keys, values = self.read_kv(view, i) if kv is None else kv
            if drop_keys:
                keys, values = keys[:, :, :-drop_keys], values[:, :, :-drop_keys]
            if q.shape[2] == 1 and view.reads_slice and not self.cpu_math:
                # MLX's one-query attention on CUDA misreads a K/V view that starts inside the pool's
                # buffer (an H200 gave NaN logits for a chunk's last position); a copy is read right.
                # cpu_math's attention (MLX's CPU backend) reads the view: the copy would be the largest
                # array of a long row's last stage (MemoryModel copies_viewed_kv)
                keys, values = mx.contiguous(keys), mx.contiguous(values)
            out = self.attention(q, keys, values, scale, "causal" if q.shape[2] > 1 else view.mask, stages)
        return out

    def read_kv(self, view, i: int) -> tuple:
        """Layer i's keys and values as `view` reads them (a view of the pool, or gathered copies). On
        MLX's CPU backend (`cpu_math`) the keys wait for the values: MLX allocates an operation's output
        when the host queues it and frees its inputs when its worker thread has run it, so whether the
        keys' copy is still alive when the values' is made would depend on how far the worker is behind
        the host; so both are alive at the scores in every run (the memory model counts both)."""
        keys, values = view.read(i)
        if self.cpu_math:
            keys = mx.depends(keys, values)
        return keys, values

    def rope_qkv(self, qkv: mx.array, offsets: mx.array, rope: RopeSpec, heads: int, kv_heads: int,
                 norms: Optional[tuple] = None):
        """qkv [B, 1, (H + 2 H_kv) d] -> q [B, H, 1, d], k and v [B, H_kv, 1, d] (q, k rotated);
        `norms`: ((weight, eps) of the query heads' RMSNorm, that of the key heads') applied before
        RoPE, as qwen3's attention does, or None."""
        B, d = qkv.shape[0], rope.head_dim
        q, k, v = mx.split(qkv, [heads * d, (heads + kv_heads) * d], axis=-1)
        q, k = q.reshape(B, 1, heads, d), k.reshape(B, 1, kv_heads, d)
        if norms is not None:
            q, k = mx.fast.rms_norm(q, *norms[0]), mx.fast.rms_norm(k, *norms[1])
        q = q.transpose(0, 2, 1, 3)
        k = k.transpose(0, 2, 1, 3)
        v = v.reshape(B, 1, kv_heads, d).transpose(0, 2, 1, 3)
        return rope.module(q, offset=offsets), rope.module(k, offset=offsets), v

    def add_rms_norm(self, x: mx.array, r: mx.array, weight: mx.array, eps: float):
        h = x + r
        return h, mx.fast.rms_norm(h, weight, eps)


def unsupported(model: nn.Module) -> Optional[str]:
    """Why this loop cannot run `model`'s decode (None: it can): it takes mlx-lm's llama blocks with
    fused projections (llama, mistral, qwen2, qwen3: engine/model/layers/bound.py) and mlx-lm's RoPE or
    Llama3RoPE."""
    why = bound.unsupported(model)
    if why is not None:
        return why
    backbone = model.model
    for layer in backbone.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if "qkv_proj" not in attn or "gate_up_proj" not in mlp:
            return "projections not fused (engine/model/layers/fused.py)"
        rope = attn.rope
        if type(rope).__name__ not in ("RoPE", "Llama3RoPE"):
            return f"rotary embedding {type(rope).__name__}"
    return None


class DecodePath:
    """The decode forward of a supported model (module docstring) with `ops`."""

    def __init__(self, model: nn.Module, ops: ReferenceOps, compiled: bool = False):
        """`compiled`: with `ReferenceOps`, the layers' work around the KV write and attention runs as
        compiled functions (`CompiledLayers`) where one trace serves every layer (else, logged, not)."""
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"decode path: {why}")
        self.backbone = model.model
        self.ops = ops
        attn = self.backbone.layers[0].self_attn
        self.heads, self.kv_heads = attn.n_heads, attn.n_kv_heads
        self.head_dim = attn.o_proj.weight.shape[1] // attn.n_heads
        self.ropes = [RopeSpec(layer.self_attn.rope, self.head_dim) for layer in self.backbone.layers]
        self.layers = bound.bind_layers(self.backbone.layers)
        self.compiled: Optional[CompiledLayers] = None
        if compiled and type(ops) is ReferenceOps:
            why = CompiledLayers.unsupported(self)
            if why is None:
                self.compiled = CompiledLayers(self)
            else:
                logger.info("decode layers not compiled (%s)", why)

    def forward(self, tokens: mx.array, view) -> mx.array:
        """tokens [B, 1] -> the final-normed hidden states [B, 1, D]; `view` a ForwardView
        (engine/model/kv_pool.py) whose KV it writes and reads (in place when paged, else gathered)."""
        offsets = view.offset if isinstance(view.offset, mx.array) else mx.array([view.offset])
        offsets = offsets.astype(mx.int32)
        h = self.backbone.embed_tokens(tokens)  # [B, 1, D]
        if self.compiled is not None:
            return self.compiled.forward(h, offsets, view)
        first = self.layers[0]
        y = mx.fast.rms_norm(h, first.in_w, first.in_eps)
        for i, layer in enumerate(self.layers):
            q, k, v = self.ops.rope_qkv(layer.qkv(y), offsets, self.ropes[i], self.heads, self.kv_heads,
                                        qk_norms(layer))
            out = self.attend(view, i, q, k, v, layer.scale)
            h, y = self.block_end(h, out, layer.o, layer.post_w, layer.post_eps, layer.gate_up, layer.down,
                                  layer.up_start, *self.next_norm(i))
        return y

    def attend(self, view, i: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Write layer i's new keys and values, then attend (`ReferenceOps.attend`) -> [B, H, 1, d]."""
        view.write(i, k, v)
        return self.ops.attend(view, i, q, scale)

    def block_end(self, h, out, o, post_w, post_eps, gate_up, down, up_start: int, next_w, next_eps):
        """A layer after its attention (out [B, H, 1, d]): o, the residual add and the post-attention
        norm, the MLP, the add and the next norm -> (h, the next norm's output). The projections are
        callables (bound, or their arrays in a compiled trace)."""
        B = h.shape[0]
        h, y = self.ops.add_rms_norm(h, o(out.reshape(B, 1, self.heads * self.head_dim)), post_w, post_eps)
        return self.ops.add_rms_norm(h, swiglu_mlp(y, gate_up, down, up_start, self.ops.swiglu), next_w, next_eps)

    def mlp(self, layer: bound.BoundLayer, y: mx.array) -> mx.array:
        """The MLP from its fused gate/up product, as engine/model/layers/fused.py's parts compute it."""
        return swiglu_mlp(y, layer.gate_up, layer.down, layer.up_start, self.ops.swiglu)

    def next_norm(self, i: int) -> tuple:
        """(weight, eps) of the norm after layer i's block: the next layer's input norm, or the final."""
        if i + 1 < len(self.layers):
            return self.layers[i + 1].in_w, self.layers[i + 1].in_eps
        return self.backbone.norm.weight, self.backbone.norm.eps


def qk_norms(layer: bound.BoundLayer) -> Optional[tuple]:
    """The layer's query and key head norms for `ReferenceOps.rope_qkv` (None: it has none)."""
    return None if layer.q_norm is None else (layer.q_norm, layer.k_norm)


def swiglu_mlp(y: mx.array, gate_up, down, up_start: int, act=swiglu) -> mx.array:
    """down(act(gate, up)) from the fused gate/up product (columns [0, up_start) gate, the rest up);
    `act` a SwiGLU (mlx-lm's, or `ReferenceOps.swiglu`)."""
    product = gate_up(y)
    return down(act(product[..., :up_start], product[..., up_start:]))


class CompiledLayers:
    """A decode forward's layers as three compiled functions: MLX's counterpart of the CUDA graphs vLLM
    captures for decode. `mx.compile` traces each once per batch size, then builds its operations from
    the trace in C++ with no Python per operation. Per layer the host makes one call for everything
    between the layer's attention and the next layer's KV write (`DecodePath.block_end`, then the next
    layer's q/k/v and `ReferenceOps.rope_qkv`: the same functions the Python loop calls), where
    `DecodePath.forward` builds some 25 operations in Python. The KV write and the paged attention stay
    outside: a compiled write would return a new pool array instead of writing the pool in place (and
    the attention's traces would be per batch size and block count). The weights are the functions'
    inputs, so one trace serves every layer (`unsupported`: one RoPE, one epsilon, one bias structure).
    The engine compiles on MLX's CUDA backend, where the graph's host time is what a decode step waits
    for (docs/benchmarks.md)."""

    def __init__(self, path: DecodePath):
        self.path = path
        layers = path.layers
        rope, eps, up_start = path.ropes[0], layers[0].in_eps, layers[0].up_start
        counts = [len(p.arrays()) for p in (layers[0].o, layers[0].gate_up, layers[0].down)]
        ends = [sum(counts[:j + 1]) for j in range(3)]  # where o's, gate/up's and down's arrays end

        def projection(ws):  # a projection of its bound arrays (W^T, and the bias if any)
            return lambda x: bound.project(x, *ws)

        num_qkv = len(layers[0].qkv.arrays())
        norm_eps = (layers[0].q_norm[1], layers[0].k_norm[1]) if layers[0].q_norm is not None else None

        def qkv_rope(y, offsets, ws):  # ws: q/k/v's arrays, then the q and k head norms' weights if any
            norms = None if norm_eps is None else ((ws[num_qkv], norm_eps[0]), (ws[num_qkv + 1], norm_eps[1]))
            return path.ops.rope_qkv(bound.project(y, *ws[:num_qkv]), offsets, rope, path.heads,
                                     path.kv_heads, norms)

        def block_end(h, out, post_w, next_w, ws):
            return path.block_end(h, out, projection(ws[:ends[0]]), post_w, eps, projection(ws[ends[0]:ends[1]]),
                                  projection(ws[ends[1]:ends[2]]), up_start, next_w, eps)

        def first(h, offsets, in_w, *ws):
            return qkv_rope(mx.fast.rms_norm(h, in_w, eps), offsets, ws)

        def middle(h, out, offsets, post_w, next_w, *ws):
            h, y = block_end(h, out, post_w, next_w, ws[:ends[2]])
            return (h, *qkv_rope(y, offsets, ws[ends[2]:]))

        def last(h, out, post_w, next_w, *ws):
            return block_end(h, out, post_w, next_w, ws)[1]

        self._first, self._middle, self._last = mx.compile(first), mx.compile(middle), mx.compile(last)
        self._qkv = [tuple(layer.qkv.arrays()) + (() if norm_eps is None else (layer.q_norm[0], layer.k_norm[0]))
                     for layer in layers]
        self._end = [(layer.post_w, path.next_norm(i)[0], *layer.o.arrays(), *layer.gate_up.arrays(),
                      *layer.down.arrays()) for i, layer in enumerate(layers)]

    @staticmethod
    def unsupported(path: DecodePath) -> Optional[str]:
        """Why one trace cannot serve every layer (None: it can): the trace holds one RoPE, one epsilon
        and one projection structure (with or without biases)."""
        layers = path.layers
        ropes = {(type(r.module), r.module.dims, r.module.traditional, r.scale, r.log2_base) for r in path.ropes}
        first_freqs = path.ropes[0].freqs
        if len(ropes) != 1 or any(r.freqs is not None and not mx.array_equal(r.freqs, first_freqs).item()
                                  for r in path.ropes):
            return "the layers' rotary embeddings differ"
        eps = {path.backbone.norm.eps} | {x for layer in layers for x in (layer.in_eps, layer.post_eps)}
        if len({(layer.q_norm or (None, None))[1] for layer in layers}
               | {(layer.k_norm or (None, None))[1] for layer in layers}) != 1:
            return "the q/k head norms' presence or epsilons differ"
        if len(eps) != 1:
            return "the norms' epsilons differ"
        if len({tuple(len(p.arrays()) for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
                for layer in layers}) != 1:
            return "the layers' projections differ in their biases"
        return None

    def forward(self, h: mx.array, offsets: mx.array, view) -> mx.array:
        """h [B, 1, D] (the embedded tokens), offsets [B] -> the final-normed hidden states; `view` as
        `DecodePath.forward`'s."""
        layers = self.path.layers
        q, k, v = self._first(h, offsets, layers[0].in_w, *self._qkv[0])
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            out = self.path.attend(view, i, q, k, v, layer.scale)  # [B, H, 1, d]
            if i == last:
                return self._last(h, out, *self._end[i])
            h, q, k, v = self._middle(h, out, offsets, *self._end[i], *self._qkv[i + 1])

