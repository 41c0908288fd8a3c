"""A forward's view of the KV pool (engine/model/kv_pool.py): the rows it writes its new keys and values
to, how it reads them back (a slice, a gather, or nothing where the paged kernel reads the pool), its
masks and RoPE offsets, and mlx-lm's cache protocol for its modules (`layers`)."""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from engine.model.kv_pool import KVPool, Row, chunk_view, slice_start
from engine.model.kv_windows import padding_mask, window_mask, window_reads


class _ViewLayer:
    """One layer of a forward, as an mlx-lm attention layer sees its cache."""

    def __init__(self, view: "ForwardView", index: int):
        self._view = view
        self._index = index

    @property
    def offset(self):
        return self._view.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return self._view.write_and_read(self._index, keys, values)

    def make_mask(self, n: int, return_array: bool = False, window_size: Optional[int] = None):
        return self._view.make_mask(n, return_array, window_size)


class ForwardView:
    """The cache list of one forward: B rows, T new tokens each (prefill: B = 1; decode: T = 1)."""

    def __init__(self, pool: KVPool, rows: list[Row], num_new: int, read_slices: Optional[bool] = None):
        """`read_slices`: read a consecutive row as a slice (None: the pool's `read_slices`)."""
        if num_new > 1 and len(rows) > 1:
            raise ValueError("a forward of several rows computes one token per row")
        self.pool = pool
        self.rows = rows
        self.num_new = num_new
        lengths = [r.offset + num_new for r in rows]  # KV length after this forward
        self._lengths = lengths
        self._masks: dict = {}  # (return_array, window_size) -> the mask mlx-lm's modules asked for
        if num_new == 1:  # a decode: one slot per row, without numpy per row (host time of every step)
            write = np.array([row.slot(row.offset) for row in rows], np.int64)[:, None]  # [B, 1]
        else:
            write = np.stack([row.slots(row.offset, n) for row, n in zip(rows, lengths)])  # [B, T]
        write_rows = pool.rows(write).transpose(1, 0, 2).reshape(-1)  # [B*H_kv*T]
        ring_rows = None  # the same positions in the rows' rings
        if pool.ring_layers:
            ring_rows = np.stack([pool.ring_pool_rows(row.ring, np.arange(row.offset, n))
                                  for row, n in zip(rows, lengths)], axis=1).transpose(1, 0, 2).reshape(-1)
        for row in rows:
            row._pending = num_new
        self._slice: Optional[tuple[int, int]] = None  # slots [s0, s0 + n) of the one row, when consecutive
        self._read: Optional[mx.array] = None
        self._paged: Optional[tuple[mx.array, mx.array]] = None  # (block table, lengths) of a paged read
        # a paged decode's per-row RoPE offsets [B], with its other inputs made on the host (`step_inputs`)
        self.offsets: Optional[mx.array] = None
        if pool.paged is not None and num_new == 1:
            num_blocks = -(-max(lengths) // pool.block_size)
            # past a row's blocks: block 0, unread
            table = [row.blocks[:num_blocks] + [0] * (num_blocks - len(row.blocks)) for row in rows]
            parts = [write_rows, ring_rows, np.array(table, np.int32), np.array(lengths, np.int32),
                     np.array([r.offset for r in rows], np.int32)]
            made = step_inputs(parts) if pool.pack_step_inputs else [
                None if p is None else mx.array(p, mx.int32) for p in parts]
            self._write, self._write_ring, table_array, lengths_array, self.offsets = made
            self._paged = (table_array, lengths_array)
        else:
            self._write = mx.array(write_rows, mx.int32)
            self._write_ring = None if ring_rows is None else mx.array(ring_rows, mx.int32)
            if (start := slice_start(pool, rows, num_new, read_slices)) is not None:
                self._slice = (start, start + lengths[0])
            else:
                self._read = _read_index(pool, rows, lengths)
        # per-row RoPE offsets ([B]; one row's an int) and, for a gathered batch, a [B, 1, 1, L_max] mask,
        # True where a row has a real key (one row needs none; the paged kernel reads each row's own length)
        if len(rows) == 1:
            self.offset = rows[0].offset
        else:
            self.offset = self.offsets if self.offsets is not None else mx.array([r.offset for r in rows])
        self.mask = None
        if len(rows) > 1 and self._read is not None:
            self.mask = padding_mask(lengths)
        # a paged forward's sliding layers gather their window (the kernel reads a row's blocks from its
        # first key; a ring layer's KV is not in the blocks at all)
        self._windowed = None if pool.window is None else window_reads(self, num_new)

    @property
    def write_rows(self) -> mx.array:
        """The pool rows this forward's keys and values go to, [B * H_kv * T] (row b's head h, then T)."""
        return self._write

    def rope_offsets(self) -> mx.array:
        """The rows' RoPE offsets as an int32 array [B] (a paged decode's from `step_inputs`)."""
        if self.offsets is not None:
            return self.offsets
        return (self.offset if isinstance(self.offset, mx.array) else mx.array([self.offset])).astype(mx.int32)

    def make_mask(self, n: int, return_array: bool = False, window_size: Optional[int] = None):
        """The attention mask of this forward's `n` queries per row over the keys `read` returns (mlx-lm's
        cache protocol): "causal" or None where MLX's modes do, else a boolean array, True where a
        query reads a key: causal, within each row's length, and within `window_size` keys of the
        query (a sliding layer: p - window < key <= p, as mlx-lm's RotatingKVCache masks)."""
        key = (return_array, window_size)
        if key not in self._masks:
            self._masks[key] = self._build_mask(n, return_array, window_size)
        return self._masks[key]

    def _build_mask(self, n: int, return_array: bool, window_size: Optional[int]):
        if window_size is not None and window_size == self.pool.window and self._windowed is not None:
            return window_mask(self, n, window_size)
        if n > 1:  # one row's chunk: queries at positions offset ... offset + n - 1
            if window_size is None and not return_array:
                return "causal"  # MLX's causal mode aligns queries to the last keys
            keys = mx.arange(self._lengths[0])[None]  # [1, L]
            queries = mx.arange(self._lengths[0] - n, self._lengths[0])[:, None]  # [n, 1]
            allowed = keys <= queries
            if window_size is not None:
                allowed = allowed & (keys > queries - window_size)
            return allowed  # [n, L]
        if window_size is None:
            mask = self.mask
        else:  # each row's one query sits at its last position
            lengths = np.array(self._lengths)[:, None]
            keys = np.arange(max(self._lengths))[None]
            mask = mx.array((keys < lengths) & (keys >= lengths - window_size))[:, None, None, :]
        if mask is not None and self.pool.grouped_masks:
            mask = mask[:, :, None]  # [B, 1, 1, 1, L]: scores are [B, H_kv, repeats, 1, L]
        return mask

    def layer_mask(self, layer: int, num_queries: int):
        """The mask of the engine's layer loops: `num_queries` queries per row (the last positions of
        this forward's) over what `read(layer)` returns: a sliding layer's window mask (or padding), else
        "causal" for several queries, else the rows' padding mask (None for one row)."""
        if self._windowed is not None and self.pool.layer_windows[layer] is not None:
            key = ("loops", num_queries)  # built once a forward, for all its sliding layers
            if key not in self._masks:
                self._masks[key] = window_mask(self, num_queries, self.pool.window, grouped=False)
            return self._masks[key]
        return "causal" if num_queries > 1 else self.mask

    def layers(self) -> list[_ViewLayer]:
        return [_ViewLayer(self, i) for i in range(self.pool.num_layers)]

    @property
    def reads_slice(self) -> bool:
        return self._slice is not None

    def write_and_read(self, layer: int, keys: mx.array, values: mx.array):
        """keys/values [B, H_kv, T, D] -> all rows' KV, right-padded: [B, H_kv, L_max, D] (what mlx-lm's
        modules read). A paged forward is the engine's layer loops' alone: they read with `attend`."""
        if self._paged is not None:
            raise RuntimeError("a paged forward is read in place by the engine's layer loops, not mlx-lm's modules")
        self.write(layer, keys, values)
        return self.read(layer)

    def write(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """Scatter this forward's new keys/values [B, H_kv, T, D] into the pool, in place. A forward
        that writes through two views (engine/model/layers/mixed.py) makes both writes of a layer before either view
        reads it: a read holds the pool array, and MLX would copy it for a later write."""
        _scatter(self.pool, layer, self._write_ring if layer in self.pool.ring_layers else self._write, keys, values)

    def written(self, layer: int) -> tuple:
        """The layer's pool arrays as this forward's `write` left them, as handles that stay those arrays
        when a later write rebinds the pool's (a runner evaluates the write as a stage of its own)."""
        return tuple(a.reshape(a.shape) for a in (self.pool.keys[layer], self.pool.values[layer]))

    def read(self, layer: int):
        """All rows' KV, right-padded [B, H_kv, L_max, D] (a gathered copy, or a view of a consecutive
        row): what mlx-lm's attention takes. A sliding layer's: only the keys its windows reach."""
        if self._windowed is not None and self.pool.layer_windows[layer] is not None:
            w = self._windowed
            return (self._read_layer(self.pool.keys[layer], w.slice, w.index),
                    self._read_layer(self.pool.values[layer], w.slice, w.index))
        return (self._read_layer(self.pool.keys[layer], self._slice, self._read),
                self._read_layer(self.pool.values[layer], self._slice, self._read))

    def attend(self, layer: int, queries: mx.array, scale: float) -> Optional[mx.array]:
        """queries [B, H, 1, D] -> attention over each row's KV in the pool, [B, H, 1, D]; None if this
        forward is not paged. Called after the layer's write: the pool holds the new keys."""
        if self._paged is None or self.pool.layer_windows[layer] is not None:
            return None
        table, lengths = self._paged
        return self.pool.paged(queries, self.pool.keys[layer], self.pool.values[layer], table, lengths, scale)

    @property
    def reads_paged(self) -> bool:
        return self._paged is not None

    def _read_layer(self, pool_array: mx.array, span: Optional[tuple[int, int]], index) -> mx.array:
        if span is None:
            return pool_array[index]  # [B, H_kv, L_max, D], a copy
        view = chunk_view(pool_array, self.pool.num_kv_heads, self.pool.head_dim, *span)
        return mx.contiguous(view) if self.pool.copy_views else view

    def advance(self) -> None:
        for row in self.rows:
            row.advance()


class GroupWrite:
    """The KV writes of several one-row views of one forward (a packed forward's chunks of equal length,
    engine/model/layers/chunk_path.py `forward_packed`) as one scatter per pool array: their write
    indices joined once, for every layer."""

    def __init__(self, views: Sequence[ForwardView]):
        self.pool = views[0].pool
        self._write = mx.concatenate([v._write for v in views]) if len(views) > 1 else views[0]._write
        self._write_ring = None
        if self.pool.ring_layers:
            self._write_ring = mx.concatenate([v._write_ring for v in views]) if len(views) > 1 else views[0]._write_ring

    def write(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """keys/values [B, H_kv, T, D], row b of the views' b-th: into the pool, in place (`ForwardView.write`)."""
        _scatter(self.pool, layer, self._write_ring if layer in self.pool.ring_layers else self._write, keys, values)


def _scatter(pool: KVPool, layer: int, index: mx.array, keys: mx.array, values: mx.array) -> None:
    """keys/values [B, H_kv, T, D] into rows `index` ([B*H_kv*T], in that order) of the layer's pool arrays."""
    for pool_arrays, new in ((pool.keys, keys), (pool.values, values)):
        pool_arrays[layer][index] = new.reshape(-1, new.shape[-1])  # [B*H_kv*T, D]


def _read_index(pool: KVPool, rows: list[Row], lengths: list[int]) -> mx.array:
    """Pool rows a gathered forward reads, [B, H_kv, L_max] (padded positions read slot 0, masked)."""
    read = np.zeros((len(rows), max(lengths)), np.int64)
    for b, (row, n) in enumerate(zip(rows, lengths)):
        read[b, :n] = row.slots(0, n)
    return mx.array(pool.rows(read).transpose(1, 0, 2), mx.int32)


def step_inputs(parts: Sequence[Optional[np.ndarray]]) -> list[Optional[mx.array]]:
    """Integer inputs a step makes on the host, as int32 views of one array (None stays None).

    MLX's CUDA backend keeps an array made on the host in managed memory, whose pages move to the device
    when a kernel first reads them: in a 64-row decode's profile that first kernel took 0.167 ms against
    4.4 us (docs/decode.md). One array a step instead of one per input measured shorter decode steps
    (KVPool.pack_step_inputs)."""
    sizes = [0 if p is None else p.size for p in parts]
    whole = mx.array(np.concatenate([p.reshape(-1) for p in parts if p is not None]).astype(np.int32))
    out, start = [], 0
    for p, n in zip(parts, sizes):
        out.append(None if p is None else whole[start:start + n].reshape(p.shape))
        start += n
    return out
