"""Attention and SwiGLU for MLX's CPU backend, with exp computed as a power.

MLX's CPU `exp` (behind `softmax`, `sigmoid`, `silu`, and the CPU fallback of
`mx.fast.scaled_dot_product_attention`) runs about 19 ns an element with the Linux x86 wheel, where its
`power` runs about 6 ns (`scripts/bench_cpu_math.py` measures both on the machine at hand). A prompt
chunk's attention softmax and its MLP's SiLU are then most of a small model's CPU forward beside the
BLAS matmuls. These functions compute the same formulas as MLX's, with exp(x) = e^x as `power`:

- `attention`: `mx.fast.scaled_dot_product_attention`'s contract (grouped-query heads, `mask` None,
  "causal" aligned to the last keys, or a boolean array) as its CPU fallback computes it: scaled
  queries times the keys, masked, a float32 softmax (max subtracted), times the values (the softmax's
  division after that product);
- `swiglu`: SiLU(gate) * up as gate / (1 + e^-gate) * up.

e^x as `power(e, x)` differs from `exp(x)` by the rounding of e to the dtype: for float32, a relative
3e-8 * |x|, below float32's resolution for the softmax's exponents (x <= 0, e^x negligible past -17).
The engine uses them on the CPU only (`RunnerOptions.cpu_math`); greedy output still equals mlx-lm's
(tests).
"""

from __future__ import annotations

import math
from typing import Optional, Union

import mlx.core as mx

from engine.model.layers.block import query_blocks


def exp(x: mx.array) -> mx.array:
    """e^x through MLX's `power` (module docstring)."""
    return mx.power(math.e, x)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """SiLU(gate) * up, as mlx-lm's `swiglu` (for large negative gates, e^-gate = inf gives -0)."""
    return gate / (1 + exp(-gate)) * up


QUERY_BLOCKS = 16


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
              mask: Union[None, str, mx.array] = None, blocks: int = QUERY_BLOCKS,
              stages: Optional[list] = None) -> mx.array:
    """queries [B, H, T, d], keys/values [B, H_kv, L, d] (H a multiple of H_kv) -> [B, H, T, d].
    `mask`: None (every key), "causal" (query i reads keys up to L - T + i), or a boolean array that
    broadcasts to [B, H, T, L] (True: read). A chunk's queries (a causal mask, or a [T, L] array: causal,
    perhaps windowed) run in `blocks` blocks, one after another, each over the keys its last query
    reads: the masked keys past a block are never scored (scripts/bench_cpu_math.py measures the peak
    with one block and with the default; block.query_blocks).
    `stages`: a list each block's output is appended to, for a runner that evaluates them one by one
    (ModelRunner.stage_waits): only then is one block's scores alive at a time; else MLX's host may
    queue (and allocate) several blocks' while its worker thread runs an earlier one."""
    def attend(q, k, v, m):
        return _attend(q, k, v, scale, m)

    out = query_blocks(attend, queries, keys, values, mask, blocks, stages)
    return _attend(queries, keys, values, scale, mask) if out is None else out


def _attend(queries, keys, values, scale: float, mask) -> mx.array:
    B, H, T, d = queries.shape
    H_kv, L = keys.shape[1], keys.shape[2]
    rep = H // H_kv
    q = (queries * mx.array(scale, queries.dtype)).reshape(B, H_kv, rep * T, d)
    scores = (q @ keys.swapaxes(-1, -2)).reshape(B, H_kv, rep, T, L)
    allowed = _allowed(mask, B, H_kv, rep, T, L)
    if allowed is not None:
        scores = mx.where(allowed, scores, mx.array(-mx.inf, scores.dtype))
    # the softmax normalized after the values' product: its unnormalized weights are then read twice
    # (the product, the sum) and no normalized copy of them is made
    scores = scores.astype(mx.float32)
    weights = exp(scores - mx.max(scores, axis=-1, keepdims=True)).reshape(B, H_kv, rep * T, L)
    out = (weights.astype(values.dtype) @ values).astype(mx.float32) / mx.sum(weights, axis=-1, keepdims=True)
    return out.astype(values.dtype).reshape(B, H, T, d)


def _allowed(mask, B: int, H_kv: int, rep: int, T: int, L: int) -> Optional[mx.array]:
    """The mask as a boolean array that broadcasts to [B, H_kv, rep, T, L] (None: every key)."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask={mask!r}: only 'causal' is a named mask")
        if T == 1:
            return None
        return mx.arange(L)[None] <= mx.arange(L - T, L)[:, None]  # [T, L]
    if mask.dtype != mx.bool_:
        raise ValueError(f"mask dtype {mask.dtype}: only boolean masks are supported")
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if mask.shape[1] == 1:
        return mask[:, :, None]  # [B|1, 1, 1, T|1, L]
    return mask.reshape(mask.shape[0], H_kv, rep, mask.shape[2], mask.shape[3])
