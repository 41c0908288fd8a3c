"""ModelRunner: the only place that runs the model (mlx, mlx-lm modules).

Takes plain data from the scheduler (which rows compute which tokens) and returns sampled token ids.
- Prefill: one forward per row and chunk, evaluated before the next row's, or several rows' chunks
  packed into one forward (`prefill_packed`) where the scheduler's memory model allows it. Only a
  prompt's last position reaches the LM head.
- Decode: every decoding row in one batched forward, one token each.
Both only build their graph and return it as a `Forward`; `launch` starts it and `Forward.finish`
waits for it. Forwards never overlap on the device (`finish` says why; on CUDA a decode writing its KV
in place is queued before the one before it ends: engine/decode_pipeline.py); the engine builds
the next one while the current one runs (engine/executor.py).
Both read and write the KV pool through a `ForwardView` (engine/model/forward_view.py): per layer a constant number of
operations whatever the number of rows. The runner allocates nothing: each row's blocks, and how many
blocks the pool must hold, come from the KV manager through the plan (engine/core/kv_manager.py).
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from engine.model.layers.bound import BoundModel, language_model
from engine.model.layers.bound import unsupported as loops_unsupported
from engine.model.layers.chunk_path import ChunkPath
from engine.model.layers.decode_path import DecodePath, takes_residual_matmul
from engine.model.layers.decode_path import unsupported as decode_unsupported
from engine.model.layers.ops import ReferenceOps
from engine.model.runner_options import RunnerOptions  # noqa: F401 (the runner's API)
from engine.model.families import model_layout
from engine.model.layers.fused import fuse_projections
from engine.model.forward_view import ForwardView
from engine.model.kv_pool import KVPool, Row, attention_copies_views, slice_start, sliding_window
from engine.model.layers.mixed import MixedForward
from engine.model.kernels import qk_rope
from engine.model.kernels.paged_attention import PagedAttention, first_passing, unsupported
from engine.model.sampling import DeferredSampling, RequestSampler, sample_rows
from engine.model.work import DecodeWork, Forward, PrefillWork, stage_list

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model: nn.Module, seed: int = 0, block_size: int = 256,
                 paged_attention: bool = False, fuse: bool = True, mixed: bool = True,
                 layer_loops: bool = True, compiled_decode: bool = True, cpu_math: bool = False,
                 read_slices: bool = True, max_rows: int = 0, max_forward_tokens: int = 0,
                 stage_waits: bool = False, tiled_attention: bool = True, fused_rope: bool = False,
                 backend: str = "cpu", mma_attention: bool = True, fused_residual: bool = False,
                 pack_step_inputs: bool = False, rope_writes_kv: bool = False):
        """`block_size`: token slots per KV pool block; `read_slices`: prompt chunks of a row in
        consecutive blocks read its KV as a view of the pool (engine/model/kv_pool.py), else gather.
        `max_rows`, `max_forward_tokens`: the most rows running at once and tokens of one row in one
        forward; given, a model's sliding-window layers keep each row's KV in a ring of window - 1 +
        `max_forward_tokens` slots (`KVPool.ring_rows`; `add_row`'s `ring`), else in its blocks.
        `paged_attention`: the engine's decode loop reads the pool in place with the CUDA kernel (the
        engine asks for it where MLX runs on CUDA), if the decode runs that loop, the model's shape
        allows it and the kernel passes its self-check (engine/model/kernels/paged_attention.py); else
        decode gathers. `mma_attention`, `tiled_attention`: that kernel's tensor-core, else tiled variant
        where it applies (else the span one); a variant failing its self-check falls back to the next.
        `fused_rope`: the decode loop's q/k norms, RoPE and q/k/v layout in one CUDA kernel
        (engine/model/kernels/qk_rope.py) where it passes its self-check. `fused_residual`: that loop adds
        o's and down's products to the residual stream inside their matmuls (decode_path.residual_matmul).
        `pack_step_inputs`: a paged decode's host-made inputs are views of one array (KVPool.pack_step_inputs).
        `rope_writes_kv`: with `fused_rope`, that kernel writes a paged decode's keys and values into the pool
        (decode_path.DecodePath.rope_into_pool) where it passes its self-check.
        `fuse`: the engine's layer loops compute q/k/v and gate/up as one matmul each
        (engine/model/layers/fused.py), for models they run; mlx-lm's modules running the same model
        object compute the original layers.
        `mixed`: a prompt chunk and decode rows can run as one forward (`mixed_forward`,
        engine/model/layers/mixed.py), if the model is supported and fused (`self.mixed`).
        `layer_loops`: prompt chunks run engine/model/layers/chunk_path.py's loop, and decodes
        decode_path.py's, if the model is supported (bound after fusion: their views are of the fused
        weights); else mlx-lm's modules.
        `compiled_decode`: that decode loop builds its layers from compiled traces (decode_path.CompiledLayers).
        `cpu_math`: the loops' attention and SwiGLU are engine/model/layers/cpu_math.py's (for MLX's CPU backend).
        `stage_waits`: `launch` waits for each stage of a forward but its last (MLX's CPU backend, `launch`
        says why). `backend`: the MLX backend ("cpu", "cuda", "metal"): where its attention cannot read a
        row's view of the pool in place, the pool hands it a copy (kv_pool.attention_copies_views)."""
        self.model = model
        self.stage_waits = stage_waits
        self.layout = model_layout(model)  # every shape read from the model (engine/model/families.py)
        self._backbone, self._head = self.layout.backbone, self.layout.head
        self.num_layers = len(self._backbone.layers)
        lay = self.layout
        logger.info("model family %s: %d layers, %d KV heads of %d (%s), sliding windows %s", lay.family,
                    self.num_layers, lay.num_kv_heads, lay.head_dim, lay.kv_dtype,
                    sorted({w for w in lay.layer_windows if w}) or "none")
        window = sliding_window(lay.layer_windows) or 0
        rings = max_rows if window and max_forward_tokens else 0
        self.pool = KVPool(self.num_layers, lay.num_kv_heads, lay.head_dim, lay.kv_dtype, block_size, read_slices,
                           grouped_masks=lay.grouped_masks, layer_windows=lay.layer_windows, ring_rows=rings,
                           ring_tokens=window - 1 + max_forward_tokens if rings else 0)
        self.pool.copy_views = attention_copies_views(backend, lay.head_dim, lay.kv_dtype, lay.family)
        self.pool.pack_step_inputs = pack_step_inputs
        self._build_loops(fuse, mixed, layer_loops, compiled_decode, cpu_math)
        if paged_attention:  # only the engine's layer loops read it (a sliding layer its window, gathered)
            self._enable_paged_kernel(lay.num_heads, lay.num_kv_heads, lay.head_dim, block_size, lay.kv_dtype,
                                      tiled_attention, mma_attention)
        if fused_rope and self.decode_path is not None:
            why = qk_rope.enable(self.ops, self.decode_path, lay.kv_dtype, into_pool=rope_writes_kv)
            if why is not None:
                logger.warning("fused q/k rope kernel not used (%s)", why)
        self.ops.residual_matmul = fused_residual and takes_residual_matmul(self.decode_path)
        self.rows: dict[str, Row] = {}
        self.samplers: dict[str, RequestSampler] = {}
        self.num_forward_calls = 0  # counted so tests can check decode is one forward per step
        self.num_tokens_computed = 0

    def _build_loops(self, fuse: bool, mixed: bool, layer_loops: bool, compiled_decode: bool, cpu_math: bool):
        """The engine's layer loops this model and these choices take (`__init__`'s arguments of the same
        names): the fused projections, the bound weights, the decode, mixed and chunk loops."""
        # Only the engine's layer loops call a fused product: fusing a model they do not run gains nothing.
        loops_why_not = loops_unsupported(self.model)
        self.fused = fuse and loops_why_not is None and fuse_projections(language_model(self.model)) > 0
        # after fusion; the loops share it (none where no loop runs: its Gemma norms' 1 + weight are arrays)
        self.bound = BoundModel(self.model) if loops_why_not is None and (layer_loops or mixed) else None
        self.decode_path: Optional[DecodePath] = None
        self.mixed: Optional[MixedForward] = None
        self.ops = ReferenceOps(cpu_math)  # the layer loops' MLX operations
        why_not = decode_unsupported(self.model)
        if layer_loops and self.fused and why_not is None:
            self.decode_path = DecodePath(self.model, self.ops, compiled=compiled_decode, bound_model=self.bound)
        if mixed and self.fused and why_not is None:
            self.mixed = MixedForward(self.decode_path or DecodePath(self.model, self.ops, bound_model=self.bound))
        elif mixed and self.fused:
            logger.info("prompt chunks and decodes run as separate forwards (%s)", why_not)
        self.chunk_path: Optional[ChunkPath] = None
        if layer_loops and loops_why_not is None:
            self.chunk_path = ChunkPath(self.model, self.ops, bound_model=self.bound)
        elif layer_loops:
            logger.info("prompt chunks run mlx-lm's modules (%s)", loops_why_not)

    def _enable_paged_kernel(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                             dtype, tiled: bool = True, mma: bool = True) -> None:
        """The CUDA kernel for one-query forwards, if this model's shape allows it and it passes its
        self-check here (tensor-core, tiled, span variants in turn, as allowed); else decode gathers
        (logged)."""
        why_not = self._loops_why_not() or self._kernel_why_not() or unsupported(
            num_heads, num_kv_heads, head_dim, block_size, dtype)
        kernel = None
        if why_not is None:
            kernel, why_not = first_passing(num_heads, num_kv_heads, head_dim, block_size, dtype, tiled, mma)
        if kernel is None:
            logger.warning("paged decode attention not used (%s): decode gathers the KV", why_not)
        else:
            self.use_paged_attention(kernel)

    def use_decode_path(self, ops: Optional[ReferenceOps], compiled: bool = False) -> None:
        """Decode forwards run engine/model/layers/decode_path.py's loop with `ops` (None: mlx-lm's modules,
        which gather: the pool's paged kernel is dropped), its layers `compiled` where they can be.
        ValueError if the model is not supported."""
        self.decode_path = None if ops is None else DecodePath(self.model, ops, compiled, self.bound)
        if self.decode_path is None:
            self.pool.paged = None
        if self.mixed is not None:  # the mixed forward rotates its decode rows with the same ops
            self.mixed = MixedForward(self.decode_path or DecodePath(self.model, self.ops, bound_model=self.bound))

    @property
    def paged_attention(self) -> bool:
        """Whether one-query forwards read the pool in place (else they gather)."""
        return self.pool.paged is not None

    @property
    def decode_writes_in_place(self) -> bool:
        """Whether a decode writes its KV into the pool without a donated buffer (the rope kernel,
        DecodePath.writes_kv_in_rope): it need not wait for earlier forwards to let go of the pool."""
        return self.decode_path is not None and self.decode_path.writes_kv_in_rope(self.pool)

    def _loops_why_not(self) -> Optional[str]:
        """Why one-query forwards cannot read the pool in place (None: they can): only the engine's own
        layer loops call the paged kernel; mlx-lm's modules attend over what the cache returns."""
        if self.decode_path is None or self.chunk_path is None:
            return "decodes or one-token prompt chunks run mlx-lm's modules, which gather"
        return None

    def _kernel_why_not(self) -> Optional[str]:
        """Why the paged kernel cannot compute the model's attention (None: it can; sliding layers gather)."""
        if any(layer.softcap is not None for layer in self.bound.layers):
            return "attention logits are soft-capped (Gemma 2): decode gathers"
        return None

    def use_paged_attention(self, impl: Optional[PagedAttention]) -> None:
        """One-query forwards of the engine's layer loops compute attention with `impl` over the pool in
        place (None: they gather). ValueError if they run mlx-lm's modules or soft-cap their logits."""
        why_not = (self._loops_why_not() or self._kernel_why_not()) if impl is not None else None
        if why_not is not None:
            raise ValueError(f"{type(self.model).__name__}: paged attention not possible ({why_not})")
        self.pool.paged = impl

    @property
    def attention_kernel(self) -> str:
        """The paged kernel's first pass one-query forwards run (PagedAttention.kind); "" where they gather."""
        impl, lay = self.pool.paged, self.layout
        return "" if impl is None else impl.kind(lay.head_dim, lay.kv_dtype, lay.num_heads // lay.num_kv_heads)

    def warm_chunk_shapes(self, shapes: list) -> tuple[int, float]:
        """Build the attention graphs of prompt chunks of `shapes` ((tokens, context) pairs) now, on this
        thread (MLX's CUDA backend keeps them per thread), where the chunk loop's attention reads a row's
        view in place (no copy of it, no sliding window): (shapes built, seconds)."""
        pool = self.pool
        if not shapes or self.chunk_path is None or not pool.read_slices or pool.copy_views or pool.window:
            return 0, 0.0
        start = time.perf_counter()
        self.chunk_path.warm_attention(shapes, self.layout.kv_dtype)
        mx.clear_cache()  # its scratch buffers back to the device before the KV budget is used
        return len(shapes), round(time.perf_counter() - start, 3)

    # --- KV pool and rows -----------------------------------------------------------------------
    @property
    def pool_tokens(self) -> int:
        return self.pool.num_slots

    @property
    def num_pool_blocks(self) -> int:
        return self.pool.num_slots // self.pool.block_size

    def grow_pool(self, num_blocks: int) -> None:
        """Resize the pool's arrays to hold `num_blocks` blocks (the KV manager decides how many)."""
        self.pool.grow(num_blocks)

    def add_row(self, request_id: str, block_ids: Sequence[int], sampler: RequestSampler,
                ring: Optional[int] = None) -> None:
        """The request's row: its KV lives in `block_ids` (the pool must hold them: `grow_pool`), and in
        ring `ring` for a pool's sliding-window layers (KVPool.ring_rows)."""
        if block_ids and max(block_ids) >= self.num_pool_blocks:
            raise RuntimeError(f"{request_id}: block {max(block_ids)} is past the pool's "
                               f"{self.num_pool_blocks} blocks (grow_pool first)")
        if bool(self.pool.ring_layers) != (ring is not None) or (ring is not None and ring >= self.pool.ring_rows):
            raise RuntimeError(f"{request_id}: ring={ring} for a pool of {self.pool.ring_rows} rings")
        row = Row(list(block_ids), self.pool.block_size, self.pool.block_bytes)
        row.ring = ring
        self.rows[request_id] = row
        self.samplers[request_id] = sampler

    def drop_row(self, request_id: str) -> int:
        """Forget the request's row; returns how many of its positions hold computed KV (0: no row)."""
        self.samplers.pop(request_id, None)
        row = self.rows.pop(request_id, None)
        return 0 if row is None else row.offset

    def copy_prefix(self, request_id: str, source_block_ids: Sequence[int], num_tokens: int) -> None:
        """Start the row with the KV of the first `num_tokens` positions held in `source_block_ids`
        (a prefix-cache hit)."""
        row = self.rows[request_id]
        source = Row(list(source_block_ids), self.pool.block_size, self.pool.block_bytes)
        self.pool.copy(source.slots(0, num_tokens), row.slots(0, num_tokens))
        row.offset = num_tokens

    @property
    def kv_allocated_bytes(self) -> int:
        """The pool's arrays: running rows, prefix-cache entries and free blocks."""
        return self.pool.nbytes

    def reads_slice(self, request_id: str, num_new: int) -> bool:
        """Whether the next forward of this row alone, computing `num_new` tokens, reads its KV as a
        view of the pool instead of a gathered copy (engine/model/kv_pool.py `slice_start`)."""
        row = self.rows.get(request_id)
        return row is not None and slice_start(self.pool, [row], num_new) is not None

    # --- compute --------------------------------------------------------------------------------
    def _count(self, num_tokens: int) -> None:
        """One forward built, of `num_tokens` tokens (tests check the forwards a step runs)."""
        self.num_forward_calls += 1
        self.num_tokens_computed += num_tokens

    def _forward(self, tokens: mx.array, cache: list) -> mx.array:
        """tokens [B, T] -> final hidden states [B, T, D] (no LM head), through mlx-lm's modules."""
        self._count(tokens.size)
        return self._backbone(tokens, cache=cache)

    def _decode_forward(self, tokens: mx.array, view: ForwardView) -> mx.array:
        """tokens [B, 1] -> final hidden states [B, 1, D]: the engine's decode loop where it is enabled
        (engine/model/layers/decode_path.py), else mlx-lm's modules."""
        if self.decode_path is None:
            return self._forward(tokens, view.layers())
        self._count(tokens.size)
        return self.decode_path.forward(tokens, view)

    def _chunk_row(self, work: PrefillWork) -> Row:
        """The row a prompt chunk extends; its KV must end where the chunk starts."""
        row = self.rows[work.request_id]
        if row.offset != work.start:
            raise RuntimeError(f"{work.request_id}: KV holds {row.offset} tokens, chunk starts at {work.start}")
        return row

    def prefill(self, work: PrefillWork) -> "Forward":
        """Build (only: nothing runs) one prompt chunk's forward; `launch` runs it. Its `tokens` is
        the sampled token ([1]) when the chunk ends the prompt, else None."""
        row = self._chunk_row(work)
        tokens = mx.array(work.forward_token_ids())[None]  # [1, T]
        T, pad = tokens.shape[1], work.num_pad_tokens
        view = ForwardView(self.pool, [row], T)
        stages = [] if self.stage_waits else None  # the layers' attention and MLP apart (`launch`)
        if self.chunk_path is not None:
            self._count(T)
            hidden = self.chunk_path.forward(tokens, view, work.sample, stages, num_pad=pad)  # [1, 1, D], or None
        else:
            hidden = self._forward(tokens, view.layers())[:, : T - pad]  # [1, T - pad, D]: the real positions
        view.advance()
        row.offset -= pad  # the pad's slots hold no position's KV: the next token is written over them
        stages = [stage_list(h) for h in stages or ()]
        if not work.sample:  # only the KV writes are needed (the last layer's MLP never runs)
            # Handles to this chunk's pool arrays, not the pool's array objects: MLX rebinds those on
            # `a[idx] = v`, so once the next chunk's graph is built, finishing this forward would
            # evaluate that chunk too, and the host would build the one after with the device idle.
            return Forward(stages + [[_alias(a) for a in self.pool.keys + self.pool.values]], None)
        logits = self._head(hidden[:, -1:, :])[:, 0, :]  # [1, V]: the prompt's last position only
        token = sample_rows(logits, [self.samplers[work.request_id]])
        return Forward(stages + [[token]], token)  # every layer's KV write is in its graph (attention reads it)

    def prefill_packed(self, works: list[PrefillWork]) -> "Forward":
        """Build (only) one forward of several rows' prompt chunks, one chunk per row
        (engine/model/layers/chunk_path.py `forward_packed`; the engine's chunk loop only). Its `tokens`:
        one per chunk that ends its prompt, in `works` order (None if none does)."""
        if self.chunk_path is None:
            raise ValueError("packed prompt chunks run the engine's chunk loop, not mlx-lm's modules")
        if len({w.request_id for w in works}) != len(works):
            raise ValueError("a packed forward computes one chunk per row")
        # chunks of as many tokens from the same position next to each other: the loop batches each run
        order = sorted(range(len(works)), key=lambda j: (works[j].start, len(works[j].token_ids) + works[j].num_pad_tokens))
        asked, works = works, [works[j] for j in order]
        rows = [self._chunk_row(w) for w in works]
        ids = [w.forward_token_ids() for w in works]
        views = [ForwardView(self.pool, [row], len(t)) for row, t in zip(rows, ids)]
        tokens = mx.array([t for chunk in ids for t in chunk])[None]  # [1, N]
        self._count(tokens.shape[1])
        stages = [] if self.stage_waits else None
        hidden = self.chunk_path.forward_packed(tokens, views, [w.sample for w in works],
                                                [w.num_pad_tokens for w in works], stages)  # [1, r, D] or None
        stages = [stage_list(h) for h in stages or ()]
        sampling = [w for w in works if w.sample]
        if not sampling:  # as in `prefill`: handles to the pool arrays this forward leaves
            forward = Forward(stages + [[_alias(a) for a in self.pool.keys + self.pool.values]], None)
        else:
            logits = self._head(hidden[0])  # [r, V]
            sampled = sample_rows(logits, [self.samplers[w.request_id] for w in sampling])
            rank = {w.request_id: n for n, w in enumerate(sampling)}
            back = [rank[w.request_id] for w in asked if w.sample]  # `works` order again
            if back != sorted(back):
                sampled = sampled[mx.array(back)]
            forward = Forward(stages + [[sampled]], sampled)
        # the rows advance once all of it is built: a pack that fails to build leaves them where they
        # were, and its chunks run apart (the executor), writing the same KV again
        for view, row, w in zip(views, rows, works):
            view.advance()
            row.offset -= w.num_pad_tokens  # as in `prefill`
        return forward

    def decode(self, work: list[DecodeWork], tokens: Optional[mx.array] = None,
               defer_sampling: bool = False) -> "Forward":
        """Build (only: nothing runs) one batched decode forward of `work`'s rows; `launch` runs it.
        `tokens` ([B], possibly the lazy output of the previous decode) replaces the rows' `token_id`s
        as inputs, so the engine can build the next step while the device computes the current one.
        `defer_sampling`: the sampling is built by `launch`, once the forward runs (a grammar's mask
        needs the previous token, which the engine reads back just before launching)."""
        view = ForwardView(self.pool, [self.rows[w.request_id] for w in work], 1)
        if tokens is None:
            tokens = mx.array([w.token_id for w in work])
        hidden = self._decode_forward(tokens[:, None], view)  # [B, 1, D]
        logits = self._head(hidden)[:, 0, :]  # [B, V]
        samplers = [self.samplers[w.request_id] for w in work]
        view.advance()
        # The hidden states are their own batch, so the last layer's gathered KV is freed before the
        # logits exist.
        if defer_sampling:
            return Forward([[hidden]], None, sampling=DeferredSampling(logits, samplers))
        sampled = sample_rows(logits, samplers)
        return Forward([[hidden], [sampled]], sampled)

    def mixed_forward(self, work: PrefillWork, decodes: list[DecodeWork]) -> "Forward":
        """Build (only) one forward of a prompt chunk and decode rows (engine/model/layers/mixed.py; `self.mixed`
        must be set). Its `tokens`: the chunk's sampled token if it ends the prompt, then one per
        decode row, in `decodes` order."""
        row = self._chunk_row(work)
        chunk_ids = work.forward_token_ids()
        chunk_view = ForwardView(self.pool, [row], len(chunk_ids))
        decode_view = ForwardView(self.pool, [self.rows[w.request_id] for w in decodes], 1)
        tokens = mx.array(chunk_ids + [w.token_id for w in decodes])
        self._count(tokens.size)
        # the prompt's last position only if it samples, then the decode rows: [1, (1 +) B, D]
        stages = [] if self.stage_waits else None  # the layers' attention and MLP apart (`launch`)
        hidden = self.mixed.forward(tokens, chunk_view, decode_view, sample=work.sample, stages=stages,
                                    num_pad=work.num_pad_tokens)
        chunk_view.advance()
        row.offset -= work.num_pad_tokens  # as in `prefill`
        decode_view.advance()
        samplers = ([self.samplers[work.request_id]] if work.sample else []) + [
            self.samplers[w.request_id] for w in decodes]
        # 2-D: MLX's matmul of a [1, n, D] slice would hold the [n, V] logits twice
        logits = self._head(hidden[0])  # [(1 +) B, V]
        sampled = sample_rows(logits, samplers)
        return Forward([stage_list(h) for h in stages or ()] + [[hidden], [sampled]], sampled)

    def launch(self, forward: "Forward") -> None:
        """Start a built forward on the device without waiting. The caller must `finish` it (and drop
        it) before launching another forward: see `finish`. A deferred sampling is built while the
        forward's first stages run (the grammars' masks are computed on a host thread meanwhile).
        With `stage_waits` (MLX's CPU backend) each stage but the last is waited for: there MLX allocates
        an operation's output when the host queues it and frees its inputs once its worker thread has run
        it, so a head queued while the layers still run would hold its logits beside the last layer's
        gathered KV in some runs and not in others, and a layer's MLP its intermediates beside its
        attention's. Waiting, each stage's arrays are gone before the next stage's exist, in every run:
        the head's after the layers', and in a prompt chunk's forward (engine/model/layers/chunk_path.py,
        mixed.py) each layer's MLP after its attention (the memory model counts the largest stage,
        TransientCoefficients.head_apart and phases_apart)."""
        sampling = forward.sampling
        if sampling is not None:
            sampling.start()
        last = len(forward.stages) - 1 if sampling is None else len(forward.stages)
        if not self.stage_waits and sampling is None:
            # one call: on a launch thread (engine/decode_pipeline.py) the GIL is not taken again between stages
            mx.async_eval(*(a for stage in forward.stages for a in stage))
            return
        try:
            for i, stage in enumerate(forward.stages):
                if self.stage_waits and i < last:
                    mx.eval(*stage)
                    forward.stages[i] = []  # its arrays live on only as long as a later stage reads them
                else:
                    mx.async_eval(*stage)
        except BaseException:
            if sampling is not None:
                sampling.cancel()
            raise
        if sampling is not None:
            forward.tokens, forward.sampling = sampling.build(), None
            forward.stages.append([forward.tokens])
            mx.async_eval(forward.tokens)


def _alias(a: mx.array) -> mx.array:
    """Another handle to the array `a` is now (a reshape to its own shape returns `a` itself): it stays
    that array when `a[idx] = v` rebinds `a`."""
    return a.reshape(a.shape)
