"""The KV pool (one K and one V array per layer, in blocks of token slots) and the views through which
mlx-lm attention layers read and write it (mlx-lm's cache protocol: offset, update_and_fetch, make_mask).

Layout: per layer, keys and values are each one `[num_slots * H_kv, D]` array (token-major: slot s's
heads are rows s*H_kv ... s*H_kv + H_kv - 1), with `num_slots = num_blocks * block_size`. Token-major
so that a view's strides do not depend on num_slots: MLX's CUDA attention keys its cuDNN graphs by the
K/V strides, and a head-major view's changed with every growth of the pool (vLLM's layout, for the same
reason). A request owns a list of blocks (engine/core/blocks.py); its position p lives in slot
`blocks[p // block_size] * block_size + p % block_size`. Every forward, prefill of one row or decode of
B rows, touches each layer with a fixed number of operations whatever B is (a packed forward of several
rows' chunks, engine/model/layers/chunk_path.py, one write per run of equal chunks, `GroupWrite`):
- write: one scatter per K and V of the forward's new tokens (`[B, H_kv, T, D]` flattened, rows
  `slot*H_kv + h`) into the pool, in place (the pool array is donated to the scatter);
- read, a prompt chunk (T > 1) of a row whose blocks are consecutive: its positions [0, n) are slots
  s0 ... s0 + n - 1, so K and V are each a strided view of `pool.reshape(num_slots, H_kv, D)[s0:s0 + n]`
  transposed to `[1, H_kv, n, D]`, no copy (BlockAllocator prefers such runs);
- read, a one-query forward (decode) of the engine's layer loops with a paged-attention kernel set
  (`KVPool.paged`, engine/model/kernels/paged_attention.py): nothing is read here; attention reads each
  row's blocks in the pool through a `[B, NB]` block table (`ForwardView.attend`), and no mask is built;
- read, otherwise: one gather per K and V with a `[B, H_kv, L_max]` row index, which yields the
  contiguous `[B, H_kv, L_max, D]` that attention wants (no transposed copy); padded positions read
  row 0 and are masked by a `[B, 1, 1, L_max]` boolean mask (none for one row).
The choice and the indices are made once per forward (numpy, shared by all layers); `KVPool.read_slices
= False` (or ForwardView's `read_slices`) forces the gather, so benchmarks can compare the two. Per layer
and step: 2 scatters, 2 gathers (or 2 slices) and 2 reshapes, against 2 + 4B small operations of the
per-row buffers this replaces. The gathered copy is one layer's KV of the rows in the forward, which
the memory model counts; a view costs none (`slice_start` decides, for the forward and the prediction
alike) but where the attention could not read it in place (`copy_views`: one copy, counted).

Why a pool rather than one `[B, H_kv, L, D]` batch tensor (mlx-lm's BatchKVCache): a batch tensor is
padded to the longest row and must be rebuilt (a copy of all of it) when rows join or leave; blocks
keep KV equal to what the scheduler reserved and never copy a row's KV. The pool is allocated lazily
and grows (doubling, capped at the KV budget) by one copy per array, between forwards, each array
evaluated before the next: that transient is one layer's K (or V) of the old pool, which the memory
model counts (`MemoryModel.kv_copy_bytes`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from engine.model.kv_windows import padding_mask, window_mask, window_reads


class Row:
    """One request's KV: the pool blocks it owns and how many positions hold computed KV."""

    def __init__(self, blocks: list[int], block_size: int, block_bytes: int):
        self.blocks = blocks
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.offset = 0  # tokens whose KV is stored
        self.ring: Optional[int] = None  # its ring in the pool's sliding-window layers (KVPool.ring_rows)
        self._pending = 0  # tokens written by the forward being built, committed by advance()

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.block_bytes

    def slots(self, start: int, end: int) -> np.ndarray:
        """Pool slots of positions [start, end)."""
        self._check_end(end)
        pos = np.arange(start, end)
        blocks = np.asarray(self.blocks, np.int64)[pos // self.block_size]
        return blocks * self.block_size + pos % self.block_size

    def slot(self, position: int) -> int:
        """Pool slot of one position (`slots` of [position, position + 1))."""
        self._check_end(position + 1)
        return self.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def _check_end(self, end: int) -> None:
        if end > self.capacity:
            raise ValueError(f"row KV overflow: {end} tokens > capacity {self.capacity}")

    def contiguous_start(self, end: int) -> Optional[int]:
        """First slot of positions [0, end) if they lie in consecutive blocks (so in consecutive
        slots), else None."""
        num = -(-end // self.block_size)
        first = self.blocks[0] if self.blocks else 0
        if self.blocks[:num] != list(range(first, first + num)):
            return None
        return first * self.block_size

    def advance(self) -> None:
        self.offset += self._pending
        self._pending = 0


def slice_start(pool: "KVPool", rows: list["Row"], num_new: int, read_slices: Optional[bool] = None
                ) -> Optional[int]:
    """First pool slot of the one row's KV when a forward of `rows` computing `num_new` tokens each reads
    it as a view of the pool, else None (it gathers). Views are for prompt chunks (T > 1) of a row in
    consecutive blocks only: for one query (decode, or a 1-token chunk) MLX's CUDA attention takes a K/V
    view whose buffer is a 256-multiple long for mlx-lm's `keys[..., :n, :]` and reads from the
    buffer's start, which is not our row's (seen on an H200: an illegal memory access).
    `read_slices`: None follows `pool.read_slices`."""
    use = pool.read_slices if read_slices is None else read_slices
    if not use or len(rows) != 1 or num_new < 2 or not rows[0].blocks:
        return None
    return rows[0].contiguous_start(rows[0].offset + num_new)


def chunk_view(pool_array: mx.array, num_kv_heads: int, head_dim: int, start: int, end: int) -> mx.array:
    """Slots [start, end) of one layer's `[num_slots * H_kv, D]` pool array as `[1, H_kv, n, D]`, a view:
    its strides do not depend on the pool's size (ChunkPath.warm_attention builds the same view)."""
    slots = pool_array.reshape(-1, num_kv_heads, head_dim)
    return slots[start:end].transpose(1, 0, 2)[None]


def attention_copies_views(backend: str, head_dim: int, dtype: mx.Dtype, family: str) -> bool:
    """Whether MLX's attention of a prompt chunk would copy K and V read as a view of this pool (a head's
    rows H_kv * D apart): on CUDA cuDNN's reads them in place (2-byte float, head size a multiple of 8 up to
    128, no soft-capped scores); a matmul path copies them broadcast to the query heads, so the pool hands
    it one contiguous copy instead (KVPool.copy_views)."""
    if backend != "cuda":
        return True
    return not (dtype in (mx.float16, mx.bfloat16) and head_dim % 8 == 0 and head_dim <= 128 and family != "gemma2")


def sliding_window(layer_windows: Sequence[Optional[int]]) -> Optional[int]:
    """The one sliding window of a model's sliding layers (None: none); ValueError for several."""
    windows = {w for w in layer_windows if w is not None}
    if len(windows) > 1:
        raise ValueError(f"layer_windows: one sliding window per model is supported, got {sorted(windows)}")
    return windows.pop() if windows else None


class KVPool:
    """Per layer one `[num_slots * H_kv, D]` key and one value array (token-major), grown on demand."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype, block_size: int,
                 read_slices: bool = True, grouped_masks: bool = False,
                 layer_windows: Optional[Sequence[Optional[int]]] = None, ring_rows: int = 0,
                 ring_tokens: int = 0):
        """`grouped_masks`: explicit masks meet scores grouped as [B, H_kv, repeats, T, L] (mlx-lm's
        gemma2 attention), so a batch's mask gets that rank. `layer_windows`: per layer its sliding
        window in tokens (None: global attention); a sliding layer reads only the keys its queries'
        windows reach (one window per model, engine/model/kv_windows.py). `ring_rows`: sliding layers
        keep their KV in that many rings of `ring_tokens` slots, one per running row (`Row.ring`),
        instead of in the row's blocks: position p lives in slot p % ring_tokens of its row's ring, so
        a ring of window - 1 + the most tokens of one forward holds every key a forward reads (0:
        sliding layers use the blocks)."""
        self.read_slices = read_slices  # False: every forward gathers (to measure what slices save)
        # a viewed row read as one contiguous copy per layer where the attention would copy the view
        # itself, in its broadcast of the KV heads to the query heads (attention_copies_views)
        self.copy_views = False
        self.grouped_masks = grouped_masks
        self.layer_windows = tuple(layer_windows or (None,) * num_layers)
        self.window = sliding_window(self.layer_windows)
        self.ring_rows = ring_rows if self.window is not None else 0
        self.ring_tokens = ring_tokens
        if self.ring_rows and ring_tokens < self.window:
            raise ValueError(f"ring_tokens={ring_tokens} must hold the window of {self.window} tokens")
        self.ring_layers = frozenset(i for i, w in enumerate(self.layer_windows) if w is not None and self.ring_rows)
        # One-query forwards' attention straight from the pool (engine/model/kernels/paged_attention.py); None: they gather
        self.paged = None
        # a paged decode's host-made inputs as views of one array (`step_inputs`; ModelRunner sets it)
        self.pack_step_inputs = False
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self._dtype = dtype
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []
        self.num_slots = 0

    @property
    def block_bytes(self) -> int:
        """One block of the layers that keep KV in blocks (all but the ring layers)."""
        layers = self.num_layers - len(self.ring_layers)
        return 2 * layers * self.block_size * self.num_kv_heads * self.head_dim * self._dtype.size

    @property
    def ring_bytes(self) -> int:
        """The rings of the sliding layers (allocated with the pool's first blocks, then fixed)."""
        slots = self.ring_rows * self.ring_tokens
        return 2 * len(self.ring_layers) * slots * self.num_kv_heads * self.head_dim * self._dtype.size

    def ring_pool_rows(self, ring: int, positions: np.ndarray) -> np.ndarray:
        """Rows of a ring layer's arrays holding `positions` ([...]) of ring `ring`, every head: [H_kv, ...]."""
        heads = np.arange(self.num_kv_heads).reshape((-1,) + (1,) * positions.ndim)
        slots = ring * self.ring_tokens + positions[None] % self.ring_tokens
        return slots * self.num_kv_heads + heads

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """Pool rows of `slots` ([...]) for every head: [H_kv, ...]."""
        heads = np.arange(self.num_kv_heads).reshape((-1,) + (1,) * slots.ndim)
        return slots[None] * self.num_kv_heads + heads

    def grow(self, num_blocks: int) -> None:
        """Resize to `num_blocks`: one array at a time, so the transient is one old array (an empty pool
        allocates every array at once: nothing is copied)."""
        slots = num_blocks * self.block_size
        if slots <= self.num_slots:
            return
        h, d = self.num_kv_heads, self.head_dim
        if not self.num_slots:  # nothing to copy: every array at once (one wait, not one per array)
            ring = self.ring_rows * self.ring_tokens
            self.keys = [mx.zeros(((ring if i in self.ring_layers else slots) * h, d), self._dtype)
                         for i in range(self.num_layers)]
            self.values = [mx.zeros(k.shape, self._dtype) for k in self.keys]
            mx.eval(self.keys, self.values)
            self.num_slots = slots
            return
        for arrays in (self.keys, self.values):
            for i, old in enumerate(arrays):
                if i in self.ring_layers:  # fixed size
                    continue
                # token-major: the new slots are rows at the end
                arrays[i] = mx.pad(old, [(0, (slots - self.num_slots) * h), (0, 0)])  # [slots * H_kv, D]
                del old
                mx.eval(arrays[i])
        self.num_slots = slots
        mx.clear_cache()  # the old arrays' buffers are smaller than any later pool array

    def copy(self, src_slots: np.ndarray, dst_slots: np.ndarray) -> None:
        """KV of `src_slots` into `dst_slots` (a prefix-cache hit), one array at a time."""
        if self.ring_layers:
            raise RuntimeError("a pool with sliding-window rings keeps no prefix KV of its sliding layers")
        src = mx.array(self.rows(src_slots).reshape(-1), mx.int32)
        dst = mx.array(self.rows(dst_slots).reshape(-1), mx.int32)
        for arrays in (self.keys, self.values):
            for i in range(self.num_layers):
                # the rows read first: a write into a pool array that a pending read still holds
                # copies the whole array instead of writing it in place
                rows = arrays[i][src]  # [H_kv * n, D]
                mx.eval(rows)
                arrays[i][dst] = rows
                del rows
                mx.eval(arrays[i])


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
    def writes_in_place(self) -> bool:
        """Whether a kernel may write this forward's keys and values into the pool in place
        (decode_path.DecodePath.rope_into_pool): a paged decode without sliding-window layers."""
        return self._paged is not None and self.pool.window is None

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

    MLX's CUDA backend keeps an array made on the host in managed memory, and the first kernel to read
    it on the device takes a page fault and the page's move; one array a step instead of one per input
    is one such fault instead of several (KVPool.pack_step_inputs)."""
    sizes = [0 if p is None else p.size for p in parts]
    whole = mx.array(np.concatenate([p.reshape(-1) for p in parts if p is not None]).astype(np.int32))
    out, start = [], 0
    for p, n in zip(parts, sizes):
        out.append(None if p is None else whole[start:start + n].reshape(p.shape))
        start += n
    return out
