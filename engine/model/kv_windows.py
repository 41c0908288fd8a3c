"""What a forward's sliding-window layers read of the KV pool (engine/model/kv_pool.py), and their masks.

A sliding layer's query at position p reads keys (p - window, p] (mlx-lm's RotatingKVCache masks so),
so a forward of T new tokens per row reads, per row, positions [length - T - window + 1, length): a
view of the pool for a row in consecutive blocks, else a gather, from the row's blocks or, where the pool
keeps sliding layers in rings (`KVPool.ring_rows`), from its ring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np


def padding_mask(lengths: Sequence[int]) -> mx.array:
    """[B, 1, 1, L_max]: True where row b has a real key (its first lengths[b] positions)."""
    return mx.array(np.arange(max(lengths))[None] < np.array(lengths)[:, None])[:, None, None, :]


@dataclass(frozen=True)
class WindowReads:
    """What a forward's sliding layers read: per row the first position read, and a view (slots
    [s0, s1) of the one row) or a gather index [B, H_kv, L_w] with its padding mask."""

    firsts: list
    slice: Optional[tuple]
    index: Optional[mx.array]
    mask: Optional[mx.array]


def window_reads(view, num_new: int) -> WindowReads:
    """The reads of `view`'s (a ForwardView) sliding layers: per row, positions [first, length) where
    `first` is the earliest key the window of the forward's first query reaches."""
    pool, window, lengths = view.pool, view.pool.window, view._lengths
    firsts = [max(0, n - num_new - window + 1) for n in lengths]
    if view._slice is not None and not pool.ring_layers:
        start, end = view._slice
        return WindowReads(firsts, (start + firsts[0], end), None, None)
    spans = [n - f for n, f in zip(lengths, firsts)]
    index = np.zeros((pool.num_kv_heads, len(view.rows), max(spans)), np.int64)  # padding reads row 0, masked
    for b, (row, first, n) in enumerate(zip(view.rows, firsts, lengths)):
        if pool.ring_layers:
            index[:, b, : n - first] = pool.ring_pool_rows(row.ring, np.arange(first, n))
        else:
            index[:, b, : n - first] = pool.rows(row.slots(first, n))
    index = mx.array(index.transpose(1, 0, 2), mx.int32)  # [B, H_kv, L_w]
    return WindowReads(firsts, None, index, padding_mask(spans) if len(view.rows) > 1 else None)


def window_mask(view, n: int, window: int, grouped: bool = True):
    """The mask of a sliding layer's `n` last queries per row over what it reads (`window_reads`): one
    row's queries each within its window and causal (a prompt chunk's, or its last position's alone);
    one query per row of a forward of one token per row: every key read is in its window, so only
    padding. `grouped`: shaped for scores grouped as [B, H_kv, repeats, T, L] where the pool's are
    (mlx-lm's gemma2 module)."""
    if n > 1 or (len(view.rows) == 1 and view.num_new > 1):
        first, end = view._windowed.firsts[0], view._lengths[0]
        keys = mx.arange(first, end)[None]  # [1, L_w] positions
        queries = mx.arange(end - n, end)[:, None]  # [n, 1]
        return (keys <= queries) & (keys > queries - window)  # [n, L_w]
    mask = view._windowed.mask
    if mask is not None and grouped and view.pool.grouped_masks:
        mask = mask[:, :, None]  # [B, 1, 1, 1, L_w]: scores are [B, H_kv, repeats, 1, L_w]
    return mask
