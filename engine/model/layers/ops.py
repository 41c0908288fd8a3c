"""The layer loops' operations around the projections (engine/model/layers/chunk_path.py, decode_path.py,
mixed.py): RoPE and the q/k/v layout, residual add and RMSNorm, attention over a `ForwardView`
(engine/model/kv_pool.py) and SwiGLU, exactly as mlx-lm's modules compute them; on MLX's CPU backend
(`cpu_math`) the attention and SwiGLU of engine/model/layers/cpu_math.py (the same formulas, exp as a
power), and Gemma 2's soft-capped attention in query blocks (engine/model/layers/block.py)."""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu

from engine.model.layers import block, cpu_math


class RopeSpec:
    """What the rotation of one layer needs (mlx-lm's nn.RoPE or Llama3RoPE); the compiled layers key
    their traces by it."""

    def __init__(self, rope: nn.Module, head_dim: int):
        self.module = rope
        self.freqs: Optional[mx.array] = getattr(rope, "_freqs", None)
        self.scale = float(getattr(rope, "scale", 1.0)) if self.freqs is None else 1.0
        base = getattr(rope, "base", None)  # MLX keeps it as a float32 and takes log2 of that on the host
        self.log2_base = float(np.float32(math.log2(np.float32(base)))) if base is not None else 0.0
        self.head_dim = head_dim

    def key(self) -> tuple:
        """What one compiled trace of it holds: equal keys rotate alike."""
        freqs = None if self.freqs is None else tuple(np.array(self.freqs.astype(mx.float32)).tolist())
        return (type(self.module), self.module.dims, self.module.traditional, self.scale, self.log2_base, freqs)


class ReferenceOps:
    """The layer loops' RoPE and q/k/v layout, residual add and RMSNorm, exactly mlx-lm's; and their
    attention (of a gathered forward) and SwiGLU: MLX's and mlx-lm's, or with `cpu_math`
    engine/model/layers/cpu_math.py's (MLX's CPU backend: the same formulas with exp as a power)."""

    def __init__(self, cpu_math: bool = False):
        self.cpu_math = cpu_math
        # the CUDA kernel for rope_qkv (engine/model/kernels/qk_rope.py), where the runner enabled it
        self.qk_rope = None
        # the decode loop adds o's and down's products to the residual stream inside their matmuls
        # (decode_path.residual_matmul), where the runner enabled it (before the first decode: compiled
        # layers read it when they trace)
        self.residual_matmul = False
        # a paged decode's keys and values go into the pool from qk_rope's kernel (`rope_into_pool`), not a
        # scatter, where the runner enabled it
        self.rope_writes_kv = False

    def attention(self, queries, keys, values, scale: float, mask=None, stages: Optional[list] = None,
                  softcap: Optional[float] = None) -> mx.array:
        """`stages`: cpu_math.attention's (MLX's fused attention is one operation: none). `softcap`:
        Gemma 2's soft-capped scores (block.softcapped_attention, in query blocks on the CPU)."""
        if softcap is not None:
            def attend(q, k, v, m):
                return block.softcapped_attention(q, k, v, scale, softcap, m)

            blocks = cpu_math.QUERY_BLOCKS if self.cpu_math else 1
            out = block.query_blocks(attend, queries, keys, values, mask, blocks, stages)
            return attend(queries, keys, values, mask) if out is None else out
        if self.cpu_math:
            return cpu_math.attention(queries, keys, values, scale, mask, stages=stages)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    def swiglu(self, gate: mx.array, up: mx.array) -> mx.array:
        return cpu_math.swiglu(gate, up) if self.cpu_math else swiglu(gate, up)

    def attend(self, view, i: int, q: mx.array, scale: float, kv: Optional[tuple] = None,
               stages: Optional[list] = None, softcap: Optional[float] = None, drop_keys: int = 0) -> mx.array:
        """Layer i's attention of `q` [B, H, Tq, d] over the KV `view` holds (its new keys written):
        in the pool in place where the view is paged (not a sliding layer's, nor soft-capped), else over
        what it reads (a view of one row, or the rows' gathered KV; a sliding layer's window) with
        `attention`, masked as `view.layer_mask` says. `kv`: what `read_kv` returned for this layer
        (None: read here); `stages`: `attention`'s; `softcap`: the layer's attention logit cap;
        `drop_keys`: one row's last keys left out (a padded prompt chunk's pad, for the one query of its
        last real position)."""
        out = None if softcap is not None or drop_keys else view.attend(i, q, scale)
        if out is None:
            keys, values = self.read_kv(view, i) if kv is None else kv
            mask = view.layer_mask(i, q.shape[2])
            if drop_keys:
                keys, values = keys[:, :, :-drop_keys], values[:, :, :-drop_keys]
                mask = _mask_before_pad(view, i, q.shape[2], drop_keys)
            if q.shape[2] == 1 and view.reads_slice and not view.pool.copy_views:
                # MLX's one-query attention on CUDA misreads a K/V view that starts inside the pool's
                # buffer (an H200 gave NaN logits for a chunk's last position); a copy is read right
                # (MemoryModel copies_viewed_kv). Where the pool copies views, it is one already.
                keys, values = mx.contiguous(keys), mx.contiguous(values)
            out = self.attention(q, keys, values, scale, mask, stages, softcap)
        return out

    def read_kv(self, view, i: int) -> tuple:
        """Layer i's keys and values as `view` reads them (a view of the pool, or copies: gathered, or
        of a view the attention could not read in place, KVPool.copy_views). With `cpu_math` (MLX's CPU
        backend) the keys wait for the values: MLX allocates an operation's output when the host queues it and
        frees its inputs when its worker thread has run it, so whether the keys' copy is still alive when
        the values' is made would depend on how far the worker is behind the host; so both are alive at
        the scores in every run (the memory model counts both)."""
        keys, values = view.read(i)
        if self.cpu_math:
            keys = mx.depends(keys, values)
        return keys, values

    def rope_qkv(self, qkv: mx.array, offsets: mx.array, rope: RopeSpec, heads: int, kv_heads: int,
                 norms: Optional[tuple] = None):
        """qkv [B, 1, (H + 2 H_kv) d] -> q [B, H, 1, d], k and v [B, H_kv, 1, d] (q, k rotated);
        `norms`: ((weight, eps) of the query heads' RMSNorm, that of the key heads') applied before
        RoPE, as qwen3's and gemma3's attention do, or None."""
        if self.qk_rope is not None and self.qk_rope.handles(rope):
            return self.qk_rope(qkv, offsets, rope, heads, kv_heads, norms)
        B, d = qkv.shape[0], rope.head_dim
        q, k, v = mx.split(qkv, [heads * d, (heads + kv_heads) * d], axis=-1)
        q, k = q.reshape(B, 1, heads, d), k.reshape(B, 1, kv_heads, d)
        if norms is not None:
            q, k = mx.fast.rms_norm(q, *norms[0]), mx.fast.rms_norm(k, *norms[1])
        q = q.transpose(0, 2, 1, 3)
        k = k.transpose(0, 2, 1, 3)
        v = v.reshape(B, 1, kv_heads, d).transpose(0, 2, 1, 3)
        return rope.module(q, offset=offsets), rope.module(k, offset=offsets), v

    def add_rms_norm(self, x: mx.array, r: mx.array, weight: mx.array, eps: float, add=mx.add):
        """(x + r, its RMSNorm); `add`: the family's residual add (block.residual_add)."""
        h = add(x, r)
        return h, mx.fast.rms_norm(h, weight, eps)


def _mask_before_pad(view, i: int, num_queries: int, num_pad: int):
    """Layer i's mask for `num_queries` queries that end `num_pad` positions before the forward's last,
    over its keys less the last `num_pad`: the rows of those queries in the mask of the forward's last
    `num_queries + num_pad` positions (a sliding layer's window ends at each query), the pad's columns
    dropped; none where that mask is causal (the queries see every key left)."""
    mask = view.layer_mask(i, num_queries + num_pad)
    if isinstance(mask, mx.array):
        return mask[..., :num_queries, :-num_pad]
    return mask if num_queries > 1 else None
