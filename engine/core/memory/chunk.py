"""ChunkTerms: the per-layer arrays of a prompt chunk's stages (its attention, its MLP) and the KV a
forward gathers, as TransientTerms; MemoryModel (model.py) builds its stages from them. Pure arithmetic
on the model's shape and the coefficient set (no mlx import)."""

from __future__ import annotations

from typing import Optional

from engine.core.memory.coefficients import TransientTerms

FLOAT32_BYTES = 4
# What MLX's allocator may count beyond an array's size: it serves an allocation from a cached buffer up
# to two 4 KB pages larger and counts the whole buffer (docs/memory.md). The coefficient sets' per-forward
# constant covers a llama block's arrays; a family's own (a sliding layer's gathered K, V and their index,
# the q/k head norms' outputs: ModelShape.qk_norms) add this each.
PAGE_SLACK_BYTES = 8192
# The MLP-wide arrays a SwiGLU MLP stage holds at once, as the coefficient sets' prefill_mlp counts them
# (ModelShape.mlp_arrays: a family whose MLP holds fewer counts that share of the term)
SWIGLU_MLP_ARRAYS = 3


class ChunkTerms:
    """The terms MemoryModel's stages are built of (its shape, coefficients, layers in flight and reads:
    MemoryModel.__init__)."""

    def _over_layers(self, per_layer, context_len: int, num_tokens: int, num_layers: Optional[int] = None) -> float:
        """A per-layer amount that grows with the keys a layer reads, `per_layer(keys)`, summed over
        `num_layers` (default: the layers in flight) consecutive layers, the most global-attention
        layers among them reading `context_len` keys and the others their window - 1 + `num_tokens`
        (ModelShape.layer_windows): the most any such run of layers holds."""
        m = self.layer_factor if num_layers is None else num_layers
        window = self.shape.sliding_window
        if window is None:
            return m * per_layer(context_len)
        most = self.shape.global_layers(m)[1]
        return most * per_layer(context_len) + (m - most) * per_layer(min(context_len, window - 1 + num_tokens))

    def _array(self, nbytes: int) -> int:
        """An array's bytes as the allocator hands them out (`allocation_page_bytes`: whole pages from one)."""
        page = self.coefficients.allocation_page_bytes
        return -(-nbytes // page) * page if page and nbytes >= page else nbytes

    def _sliding_layers(self, num_layers: int) -> int:
        """The most sliding-window layers among `num_layers` consecutive layers."""
        return num_layers - self.shape.global_layers(num_layers)[0] if self.shape.sliding_window else 0

    def _window_gather(self, context_len: int, num_tokens: int, num_rows: int = 1,
                       num_layers: Optional[int] = None, paged: bool = False) -> float:
        """The KV (with its int32 index) that sliding layers gather where a forward reads the global
        layers' in place (a view of the pool, or the `paged` kernel): the rows' windows, window - 1 + T
        keys each, when they live in rings (engine/model/kv_pool.py) or the forward is paged; 0 else."""
        s = self.shape
        rings = s.num_kv_layers is not None and s.num_kv_layers < s.num_layers
        if s.sliding_window is None or not (rings or paged):
            return 0.0
        m = self.layer_factor if num_layers is None else num_layers
        keys = min(context_len, s.sliding_window - 1 + num_tokens)
        kv = num_rows * keys * s.num_kv_heads * (2 * s.head_dim * s.dtype_bytes + 4)
        return self._sliding_layers(m) * (kv + 3 * PAGE_SLACK_BYTES)

    def _moe_rows(self) -> tuple[float, float]:
        """Hidden-size rows per token of a layer loop's MLP stage beyond a llama block's, and of a MoE
        layer's stage of its experts' outputs unsorted (ModelShape.moe_experts_per_token)."""
        s = self.shape
        return s.moe_experts_per_token + s.mlp_out_norm_rows, 2 * s.moe_experts_per_token

    def _chunk_attention(self, c: int, n: int, rows: int, gathers: bool, computes_logits: bool,
                         norm_slack: int, overheads: dict) -> TransientTerms:
        """A prompt chunk's attention stage (`chunk_phases`): c tokens over n keys, `rows` its hidden rows.
        Where the runner waits for each layer's attention apart (`phases_apart`, one layer in flight) and
        the model has both kinds of layer, the larger of a global layer's and a sliding one's (each
        reads its own keys, only a sliding one its window's extra arrays); else every layer in flight."""
        s, k = self.shape, self.coefficients
        kinds = [self._layer_attention(c, n, rows, gathers, computes_logits, norm_slack, overheads, None)]
        if k.phases_apart and self.layer_factor == 1 and s.sliding_window is not None \
                and s.global_layers(1)[1] and self._sliding_layers(1):
            kinds = [self._layer_attention(c, n, rows, gathers, computes_logits, norm_slack, overheads, sliding)
                     for sliding in (False, True)]
        if k.phases_apart and s.attention_output_rows and c > 1:  # after the scores: the output's norm
            # (with the q/k norms' terms the kinds share, which chunk_phases counts in the projections)
            kinds.append(TransientTerms(fixed_bytes=s.attention_output_rows * rows + norm_slack,
                                        family_rows=s.extra_attention_rows * rows, **overheads))
        return max(kinds, key=lambda t: t.bytes(k))

    def _layer_attention(self, c: int, n: int, rows: int, gathers: bool, computes_logits: bool,
                         norm_slack: int, overheads: dict, sliding: Optional[bool]) -> TransientTerms:
        """`_chunk_attention` over the layers in flight (`sliding` None), or of one global (False) or
        sliding (True) layer."""
        s, m = self.shape, self.layer_factor
        paged = c == 1 and self.paged_decode  # a one-query forward: the paged kernel, no gather
        block = -(-c // self.coefficients.attention_query_blocks)  # the queries scored at once
        array = self._array
        window = s.sliding_window
        rings = s.num_kv_layers is not None and s.num_kv_layers < s.num_layers
        keys = n if not sliding else min(n, window - 1 + c)  # what the one layer reads

        def over(per_layer, num_layers=None) -> float:  # the layers in flight, or the one layer
            return self._over_layers(per_layer, n, c, num_layers) if sliding is None else per_layer(keys)

        def scores(k: int) -> int:
            return array(FLOAT32_BYTES * s.num_heads * block * k) if c > 1 else 0

        def gathered(k: int) -> int:  # K and V of the row, and their int32 slot index
            return 2 * array(k * s.num_kv_heads * s.head_dim * s.dtype_bytes) + array(k * s.num_kv_heads * 4)

        # a family's own score arrays replace the backend attention's (prefill_scores copies), not add to them
        own = self.coefficients.prefill_scores
        sliding_copies = max(0.0, s.sliding_score_copies - own)
        extra_scores = max(0.0, s.extra_score_copies - own) * over(scores)
        if sliding is None:
            extra_scores += sliding_copies * self._sliding_layers(m) * scores(n if window is None else min(n, window - 1 + c))
        elif sliding:
            extra_scores += sliding_copies * scores(keys)
        # a chunk read as a view copies its row's KV for the last layer's one query (ReferenceOps.attend),
        # or for every layer's attention (KVPool.copy_views): one copy per layer in flight; a sliding layer
        # whose window lives in a ring reads no view
        copies = not gathers and c > 1 and (self.copies_every_view or self.copies_viewed_kv and computes_logits)
        view_copy = 2 * array(keys * s.num_kv_heads * s.head_dim * s.dtype_bytes) if copies else 0
        view_copy *= self.layer_factor if self.copies_every_view else 1
        if sliding and rings:
            view_copy = 0
        # never fewer layers than in flight: a calibration's row_gather_layers only raises the count
        rows_gathered = max(self.layer_factor, min(self.shape.num_layers, self.coefficients.row_gather_layers))
        window = 0.0  # one sliding layer's window gathered from its ring (`prefill_window_gather`)
        if sliding is None:
            gather = (self._over_layers(gathered, n, c, rows_gathered) if gathers and not paged
                      else self._window_gather(n, c, paged=paged))
        elif sliding and (rings or paged):
            gather, window = 0.0, self._window_gather(n, c, paged=paged)
        else:
            gather = gathered(keys) if gathers and not paged else 0
        return TransientTerms(
            prefill_scores=over(scores),
            decode_scores=over(lambda k: FLOAT32_BYTES * s.num_heads * k) if c == 1 else 0,
            prefill_mask=over(lambda k: array(block * k)),
            prefill_gather=gather, prefill_window_gather=window,
            prefill_first_rows=rows if c > 1 and n == c else 0,
            decode_paged=m * self.paged_partials_bytes(1, n) if paged else 0,
            prefill_attention_hidden=rows, family_rows=s.extra_attention_rows * rows,
            fixed_bytes=extra_scores + view_copy + norm_slack, **overheads)

    def _chunk_mlp(self, c: int, rows: int, fused_mlp: bool, overheads: dict) -> tuple:
        """A prompt chunk's MLP stage (`chunk_phases`), a MoE layer's stage of its experts' outputs beside
        their unsorted copy (block.moe_mlp; none for a dense MLP), and that stage's hidden rows."""
        s, m, array = self.shape, self.layer_factor, self._array
        mlp_rows, unsorted_rows = self._moe_rows()
        mlp = TransientTerms(
            prefill_layer_rows=m * s.intermediate_size * s.dtype_bytes if c > 1 else 0,
            prefill_mlp=m * array(c * s.intermediate_size * s.dtype_bytes)
            * (1 if fused_mlp else s.mlp_arrays / SWIGLU_MLP_ARRAYS),
            prefill_hidden=rows,
            family_rows=s.extra_mlp_rows * rows, fixed_bytes=mlp_rows * rows, **overheads)
        unsorted = (TransientTerms(prefill_hidden=rows, fixed_bytes=unsorted_rows * rows, **overheads),) \
            if unsorted_rows else ()
        return mlp, unsorted, unsorted_rows

