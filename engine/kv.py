"""Per-request KV storage and the batched decode view, both speaking mlx-lm's cache protocol.

Each running request owns one `RowKV`: per layer a `[1, H_kv, capacity, D]` key and value buffer,
allocated once, on admission, at the request's reserved size (prompt + max_tokens, rounded up to the cache step), so
the KV never grows, never copies, and the bytes in use are exactly what the scheduler reserved.

Prefill runs one row at a time through `RowKV.layer(i)` (B = 1, causal mask by offset, no mask array).
Decode of all running rows is one forward through `DecodeView`: per layer it writes each row's new
key/value in place, then gathers the rows into one right-padded `[B, H_kv, L_max, D]` tensor with a
`[B, 1, 1, L_max]` boolean mask. On the CPU only one layer's gathered copy is alive at a time (MLX
frees it once that layer's attention ran), which the memory model counts as the decode transient. On
CUDA, MLX frees temporaries per committed batch of ops, so several layers' copies can coexist
(docs/benchmarks.md); MLX_MAX_OPS_PER_BUFFER bounds that. The 2 + 4B small ops per layer are also
the decode's main cost on a GPU (a shared batched layout is the fix, not done yet).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx


def round_up(n: int, step: int) -> int:
    return ((n + step - 1) // step) * step


class _RowLayer:
    """One layer of one row: the object an mlx-lm attention layer sees during that row's prefill."""

    def __init__(self, row: "RowKV", index: int):
        self._row = row
        self._index = index

    @property
    def offset(self) -> int:
        return self._row.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return self._row.write(self._index, keys, values)

    def make_mask(self, n: int, return_array: bool = False, window_size: Optional[int] = None):
        if window_size is not None or return_array:
            raise NotImplementedError("sliding-window / explicit-mask models are not supported")
        return None if n == 1 else "causal"  # MLX's causal mode aligns queries to the last keys


class RowKV:
    """KV cache of one request, allocated at its full reserved capacity when the request is admitted.

    Allocating before the first forward (not inside it) keeps a step's measured peak a clean
    transient: no KV appears halfway through a forward.
    """

    def __init__(self, num_layers: int, capacity: int, num_kv_heads: int, head_dim: int, dtype: mx.Dtype):
        self.capacity = capacity
        self.offset = 0  # tokens whose KV is stored
        shape = (1, num_kv_heads, capacity, head_dim)
        self.keys = [mx.zeros(shape, dtype) for _ in range(num_layers)]  # [1, H_kv, capacity, D]
        self.values = [mx.zeros(shape, dtype) for _ in range(num_layers)]
        mx.eval(self.keys, self.values)
        self._pending = 0  # tokens written in the current forward, committed by advance()

    def layers(self) -> list[_RowLayer]:
        return [_RowLayer(self, i) for i in range(len(self.keys))]

    def write(self, layer: int, keys: mx.array, values: mx.array):
        """Store `keys`/`values` ([1, H_kv, n, D]) at the current offset; return all stored KV."""
        n = keys.shape[2]
        start, end = self.offset, self.offset + n
        if end > self.capacity:
            raise ValueError(f"row KV overflow: {end} tokens > capacity {self.capacity}")
        self.keys[layer][..., start:end, :] = keys  # in place: the old buffer is donated
        self.values[layer][..., start:end, :] = values
        self._pending = n
        return self.keys[layer][..., :end, :], self.values[layer][..., :end, :]

    def advance(self) -> None:
        """Commit the tokens written by the forward that just ran (all layers wrote the same n)."""
        self.offset += self._pending
        self._pending = 0

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())


class _DecodeLayer:
    """One layer of the batched decode forward over several rows of different lengths."""

    def __init__(self, view: "DecodeView", index: int):
        self._view = view
        self._index = index

    @property
    def offset(self) -> mx.array:
        return self._view.positions  # per-row RoPE offsets, [B]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return self._view.write_and_gather(self._index, keys, values)

    def make_mask(self, n: int, return_array: bool = False, window_size: Optional[int] = None):
        if window_size is not None:
            raise NotImplementedError("sliding-window models are not supported")
        return self._view.mask


class DecodeView:
    """The cache list for one batched decode step over `rows` (one new token each)."""

    def __init__(self, rows: list[RowKV]):
        self.rows = rows
        lengths = [r.offset + 1 for r in rows]  # KV length after this step's token
        self.max_len = max(lengths)
        self.positions = mx.array([r.offset for r in rows])
        # [B, 1, 1, L_max]: True where a row has a real key. One row needs neither mask nor gather.
        self.mask = None
        if len(rows) > 1:
            self.mask = (mx.arange(self.max_len)[None] < mx.array(lengths)[:, None])[:, None, None, :]

    def layers(self) -> list[_DecodeLayer]:
        return [_DecodeLayer(self, i) for i in range(len(self.rows[0].keys))]

    def write_and_gather(self, layer: int, keys: mx.array, values: mx.array):
        """keys/values: [B, H_kv, 1, D] -> right-padded [B, H_kv, L_max, D] over all rows."""
        if len(self.rows) == 1:
            return self.rows[0].write(layer, keys, values)
        gathered = []
        for src in (keys, values):
            b_, h, _, d = src.shape
            gathered.append(mx.zeros((b_, h, self.max_len, d), src.dtype))
        for b, row in enumerate(self.rows):
            k_all, v_all = row.write(layer, keys[b : b + 1], values[b : b + 1])
            n = k_all.shape[2]
            gathered[0][b : b + 1, :, :n, :] = k_all
            gathered[1][b : b + 1, :, :n, :] = v_all
        return gathered[0], gathered[1]

    def advance(self) -> None:
        for row in self.rows:
            row.advance()
