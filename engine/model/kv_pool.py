"""The KV pool (one K and one V array per layer, in blocks of token slots); the views through which a
forward writes and reads it (mlx-lm's cache protocol: offset, update_and_fetch, make_mask) are
engine/model/forward_view.py's.

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
