"""MemoryModel: KV bytes, the transient peak of one engine step, and the bound over all steps.

Pure arithmetic on the model's shape and the engine's configuration (no mlx import), so the scheduler,
the admission controller and the tests share one model. The derivation is in docs/memory.md.

Terms, for a model with L layers, H query heads, H_kv KV heads of size d, hidden size D, MLP size I,
vocabulary V, dtype size s bytes (scores are float32: 4 bytes):
- KV per token: 2 * L * H_kv * d * s, reserved per request in steps of `kv_step` tokens.
- Prefill chunk of c tokens of one row whose context after the chunk is n:
      a_s * 4*H*c*n + a_m * c*n + a_g * n*H_kv*(2*d*s + 4) + a_i * c*I*s + a_d * c*D*s + (a_v + z) * 4*V
  (attention scores and their softmax, the causal mask, one layer's KV of the row gathered from the
  pool with its int32 slot index, the MLP intermediates, the hidden-size activations, the last
  position's logits); a chunk that reads its row's KV as a view of the pool and ends the prompt adds
  one copy of that KV (n*H_kv*2*d*s), read by its last position's one query (the engine's chunk
  loop); with cpu_math's attention on MLX's CPU backend every chunk read as a view adds it (its
  matmuls need a head's keys in consecutive rows). Rows prefill one after
  another, each evaluated before the next, so a step's prefill transient is the largest chunk's; or
  several rows' chunks run as one packed forward (`packed_bytes`: their stages added, PACK_ROWS more
  rows a token).
- Decode of B rows, the longest with n keys, r of them sampling:
      b_d * B*D*s + g * B*n*H_kv*(2*d*s + 4) + b_s * 4*B*H*n + b_i * B*I*s + (b_v * B + z * r) * 4*V
  the hidden states, one layer's KV of the rows gathered from the pool (right-padded to n, with its
  int32 slot index), the scores, the MLP intermediates and the logits. A paged decode
  (`paged_decode=True`: the CUDA kernel reads the pool in place) counts the kernel's float32 partials
  instead of the gather, p * B*H*ceil(n / kv_step)*(d + 2)*4, where the set was fitted on such decodes.
- Also (docs/memory.md): pool growth and prefix-cache copies between forwards (`kv_copy_bytes`); the
  sampling temporaries per sampling row (z); on CUDA, per-layer terms counted for the layers whose
  temporaries coexist under MLX's committed batches (`layers_in_flight`) plus per-forward constants,
  and a decode's matmul workspaces, measured, in every layer (L * w(B) + w_head(B), workspace.py);
  where the runner waits between a forward's stages (the CPU), the largest stage's terms
  (`chunk_phases`, `decode_phases`, `mixed_phases` build them as `TransientTerms`); a family's own
  arrays and sliding windows from its config (ModelShape).
The coefficient sets, and where each was fitted: coefficients.py.
"""

from __future__ import annotations

from typing import Optional, Sequence

from engine.core.memory.chunk import FLOAT32_BYTES, PAGE_SLACK_BYTES, ChunkTerms
from engine.core.memory.coefficients import CPU_COEFFICIENTS, TransientCoefficients, TransientTerms
from engine.core.memory.plan import PrefillChunkPlan, StepPlan, pack_groups, round_up  # noqa: F401 (the model's API)
from engine.core.memory.shape import ModelShape
from engine.core.memory.workspace import MatmulWorkspace

# keys per partial of the paged decode kernel (engine/model/kernels/paged_attention.py): each pool block of kv_step
# tokens gives kv_step / PAGED_PARTIAL_KEYS partials per row and query head
PAGED_PARTIAL_KEYS = 64
# Hidden-size rows per token of a mixed forward (engine/model/layers/mixed.py) alive in the stage of its decode
# rows' attention, where the runner waits between stages: the layer's residual stream, the chunk's
# attention output (its q, k, v and norms are gone by then: stages of their own). Measured, not fitted (no
# grid has mixed points on the CPU): 3 covers every mixed step of tests/engine/test_memory_measured.py's,
# test_families.py's and test_mixed.py's workloads (5 before the norm and the projections were stages)
MIXED_STREAM_ROWS = 3
# The prompt chunk of the floor step (`MemoryModel.floor_transient_bytes`): small enough that the floor
# costs the KV budget little, large enough that a prompt still progresses by whole matmul tiles.
FLOOR_CHUNK_TOKENS = 64
# Query-sized rows per token and layer in flight that a packed forward (`packed_bytes`) holds beyond its
# chunks' own forwards added up. Measured on an H200 (the 8B llama's calibration, scripts/data/
# h200_i25_decode.json `packed_prefill`): 4 x 512 and 16 x 512-token packs measured 2.2 and 2.1 such rows
# above the plain sum; 4 keeps their prediction 1.12 x what they measured.
PACK_ROWS = 4
# A decode forward with fewer operations a layer (RunnerOptions.fused_rope: a layer's q/k norms, RoPE and
# q/k/v layout in one kernel instead of five; RunnerOptions.fused_residual: the two residual adds inside
# their matmuls) has MLX's window of committed batches span more of its layers: its per-layer terms count
# this many times the set's layers in flight (within the model's layers). The 8B llama's fused-rope decode
# grid of one H200 lease measured 4 rows at 1,030 keys at 18.1 MB, 0.73 x the shape calibration's
# prediction (another lease: 9.6 MB at the same point; scripts/data/h200_i25_grid_decode.json,
# `variants_fused_rope_at_9d3434c` and `fused_rope`); with 2, every recorded fused decode point of the 8B
# llama, Qwen3-8B and Gemma-3-12B shapes is predicted at >= 1.34 x, the 8B's with the residual matmul too
# (`fused_residual_s28`) at >= 1.62 x (tests/unit/test_bench_scripts.py; 2-layer shapes have all their
# layers in flight already).
FUSED_DECODE_LAYERS_FACTOR = 2


class MemoryModel(ChunkTerms):
    def __init__(self, shape: ModelShape, kv_step: int = 256,
                 coefficients: TransientCoefficients = CPU_COEFFICIENTS, paged_decode: bool = False,
                 mixed: bool = False, copies_viewed_kv: bool = True, copies_every_view: bool = False,
                 max_packed_tokens: int = 0, matmul_workspace: MatmulWorkspace = MatmulWorkspace(),
                 fused_decode: bool = False):
        """`paged_decode`: one-query forwards read the KV pool in place (the engine's CUDA kernel, blocks
        of `kv_step` tokens) instead of gathering it. `mixed`: the runner can run a step's decode rows in
        the same forward as its first prompt chunk (engine/model/layers/mixed.py); the scheduler has it do so when
        that forward's transient, both's, stays within the bound of separate forwards.
        `copies_viewed_kv`: a chunk ending its prompt copies its viewed KV for its last query (the
        engine's chunk loop but with cpu_math's attention; False: also runs recorded by an engine that
        did not, replayed by scripts/bench_memory_grid.py). `copies_every_view`: every chunk read as a
        view copies its row's KV for each layer's attention (KVPool.copy_views: where MLX's attention
        could not read the token-major pool's strides), one copy per layer in flight. `max_packed_tokens`: the
        runner can run several rows' prompt chunks of up to that many tokens in all as one forward
        (`packed_bytes`; 0: never); the scheduler packs them where that forward stays within the
        configuration's bound and the free memory. `matmul_workspace`: what the backend's matmuls allocate
        beside their products by rows (engine/core/memory/workspace.py), counted in every layer of a
        decode and in its head. `fused_decode`: decode forwards run fewer operations a layer (the fused
        q/k rope kernel, the residual matmul: FUSED_DECODE_LAYERS_FACTOR)."""
        if kv_step < 1:
            raise ValueError(f"kv_step={kv_step} must be >= 1")
        if coefficients.layers_in_flight < 1:
            raise ValueError(f"layers_in_flight={coefficients.layers_in_flight} must be >= 1")
        self.shape = shape
        self.kv_step = kv_step
        self.coefficients = coefficients
        # paged decodes are predicted as such only by a coefficient set fitted on them
        self.paged_decode = paged_decode and coefficients.decode_paged is not None
        self.mixed = mixed and shape.num_layers > coefficients.mixed_min_layers
        self.copies_viewed_kv = copies_viewed_kv
        self.copies_every_view = copies_every_view
        self.max_packed_tokens = max_packed_tokens
        self.matmul_workspace = matmul_workspace
        # layers whose per-layer intermediates are alive together (1 on CPU)
        self.layer_factor = min(shape.num_layers, coefficients.layers_in_flight)
        self.fused_decode = fused_decode
        # those of a decode forward; a mixed forward's decode rows run the kernel too, but its prompt chunk's
        # operations set its layers in flight (`mixed_phases`): only its bound by the rows' decode
        # (`mixed_bytes`) takes the fused decode's, more than they hold
        self.decode_layer_factor = (min(shape.num_layers, FUSED_DECODE_LAYERS_FACTOR * self.layer_factor)
                                    if fused_decode else self.layer_factor)

    @property
    def packed(self) -> bool:
        """Whether the runner may pack several rows' prompt chunks into one forward (`max_packed_tokens`)."""
        return self.max_packed_tokens > 0

    # --- KV ---------------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        s = self.shape
        layers = s.num_layers if s.num_kv_layers is None else s.num_kv_layers
        return 2 * layers * s.num_kv_heads * s.head_dim * s.dtype_bytes

    def kv_tokens(self, num_tokens: int) -> int:
        """Tokens of KV actually allocated for `num_tokens`: rounded up to the cache step."""
        return round_up(max(num_tokens, 1), self.kv_step)

    def kv_bytes(self, num_tokens: int) -> int:
        return self.kv_tokens(num_tokens) * self.kv_bytes_per_token

    def kv_copy_bytes(self, num_tokens: int) -> int:
        """Transient of copying one layer's K (or V) of `num_tokens` slots of the pool (growth of a
        pool of that size, or a prefix-cache copy), with its int32 source and destination rows (one
        per KV head and token: engine/model/kv_pool.py `KVPool.copy`)."""
        s = self.shape
        return num_tokens * s.num_kv_heads * (s.head_dim * s.dtype_bytes + 8)

    def kv_budget_bytes(self, available_bytes: int, forward_bound_bytes: int) -> int:
        """KV budget out of `available_bytes` (memory limit less weights) such that
        budget + max(forward_bound, kv_copy_bytes(budget in tokens)) <= available: a full pool's
        growth copy must fit beside it, like a forward's transient (they never run together)."""
        per_token = self.kv_bytes_per_token
        copy_fraction = self.kv_copy_bytes(1) / per_token  # growth transient per byte of pool
        return max(0, min(available_bytes - forward_bound_bytes, int(available_bytes / (1 + copy_fraction))))

    def kv_growth_bound_bytes(self, kv_budget_bytes: int) -> int:
        """The largest pool-growth or prefix-copy transient: one array of a pool as large as the budget."""
        return self.kv_copy_bytes(kv_budget_bytes // self.kv_bytes_per_token)

    # --- transients -------------------------------------------------------------------------------
    def chunk_phases(self, num_tokens: int, context_len: int, computes_logits: bool = True,
                     samples: bool = False, gathers: bool = True, fused_mlp: bool = False) -> tuple[TransientTerms, ...]:
        """A prompt chunk's forward (`prefill_chunk_bytes`, module docstring) as the stages that hold its
        transient: with `phases_apart` (the runner waits for each layer's projections, attention and MLP
        apart, and for the layers before the head: the engine's chunk loop on the CPU) the layers'
        projections (norm, q/k/v, rotation, KV write), their attention, their MLP and the head, whose
        largest is the transient; else one, every term together. `fused_mlp`: the MLP computes gate and
        up as one product (a mixed forward's, engine/model/layers/mixed.py): chunk.SWIGLU_MLP_ARRAYS whatever the
        activation."""
        s, c, m = self.shape, num_tokens, self.layer_factor
        rows = m * self._array(c * s.hidden_size * s.dtype_bytes)
        overheads = dict(step_overhead_bytes=1, prefill_overhead_bytes=1 if c > 1 else 0,
                         prefill_stage_rows=m * s.hidden_size * s.dtype_bytes if c > 1 else 0)
        # ModelShape.qk_norms (where the stages run together: the CPU sets fit the warm cache on engine steps)
        norm_slack = 4 * PAGE_SLACK_BYTES * m if s.qk_norms and c > 1 and not self.coefficients.phases_apart else 0
        attention = self._chunk_attention(c, context_len, rows, gathers, computes_logits, norm_slack, overheads)
        # apart: the projections' rows (the q/k head norms' outputs among them) gone before the scores
        projections = TransientTerms(prefill_projection_hidden=rows, family_rows=attention.family_rows,
                                     fixed_bytes=norm_slack, **overheads)
        mlp, unsorted, unsorted_rows = self._chunk_mlp(c, rows, fused_mlp, overheads)
        head = TransientTerms(prefill_logits=FLOAT32_BYTES * s.vocab_size * computes_logits,
                              sampling=FLOAT32_BYTES * s.vocab_size * samples, **overheads)
        if self.coefficients.phases_apart:  # the head a stage of its own, with the last layer's MLP of
            # the sampled position (ChunkPath.forward: its one row after the last waited stage)
            last = TransientTerms(prefill_head_rows=(s.intermediate_size + s.hidden_size) * s.dtype_bytes
                                  * computes_logits)
            attention -= TransientTerms(family_rows=attention.family_rows, fixed_bytes=norm_slack)
            return (projections, attention, mlp) + unsorted + (head + last,)
        # together: the hidden rows are prefill_hidden's alone, the constants counted once
        extra = TransientTerms(fixed_bytes=unsorted_rows * rows)
        return (attention + mlp + head + extra - TransientTerms(prefill_attention_hidden=rows, **overheads)
                - TransientTerms(**overheads),)

    def prefill_chunk_bytes(self, num_tokens: int, context_len: int, computes_logits: bool = True,
                            samples: bool = False, gathers: bool = True) -> int:
        return _largest(self.chunk_phases(num_tokens, context_len, computes_logits, samples, gathers),
                        self.coefficients)

    def paged_partials_bytes(self, num_rows: int, context_len: int) -> int:
        """One layer's float32 partials of the paged decode kernel (engine/model/kernels/paged_attention.py): per row,
        query head and span of PAGED_PARTIAL_KEYS keys of its pool blocks (of `kv_step` tokens), a partial
        output of d values and 2 statistics."""
        s = self.shape
        spans = -(-context_len // self.kv_step) * max(1, self.kv_step // PAGED_PARTIAL_KEYS)
        return num_rows * s.num_heads * spans * (s.head_dim + 2) * FLOAT32_BYTES

    def decode_attention_terms(self, context_lens: Sequence[int], gathers: Optional[bool] = None,
                               num_layers: Optional[int] = None) -> TransientTerms:
        """`num_layers` (default: the layers in flight) layers' attention temporaries of decoding rows:
        their KV as attention reads it (a gathered copy, or the paged kernel's partials) and their
        scores."""
        s, b, n = self.shape, len(context_lens), max(context_lens)
        m = self.layer_factor if num_layers is None else num_layers
        if gathers is None:
            gathers = not self.paged_decode
        kv_row = s.num_kv_heads * (2 * s.head_dim * s.dtype_bytes + 4)  # K, V and the int32 index, per key
        paged = self.paged_decode and not gathers
        return TransientTerms(
            decode_gather=self._over_layers(lambda keys: b * keys * kv_row, n, 1, m) if gathers else
            self._window_gather(n, 1, b, m, paged),
            decode_paged=m * self.paged_partials_bytes(b, n) if paged else 0,
            decode_scores=self._over_layers(lambda keys: FLOAT32_BYTES * b * s.num_heads * keys, n, 1, m),
        )

    def decode_phases(self, context_lens: Sequence[int], samples: int = 0,
                      gathers: Optional[bool] = None) -> tuple[TransientTerms, ...]:
        """A decode forward (module docstring): its layers (the rows' hidden states, attention temporaries
        and MLP intermediates over the layers in flight) and its head (their logits, and one sampling's
        temporaries per row that samples), apart where the runner waits for the layers before it queues
        the head (`head_apart`); else one stage: the head is launched while the layers still run
        (runner.launch), so the last layer's gathered KV and the logits can be alive together."""
        s, b, m = self.shape, len(context_lens), self.decode_layer_factor
        row = m * b * s.hidden_size * s.dtype_bytes
        mlp_rows, unsorted_rows = self._moe_rows()  # a decode's MLP is one stage: both together
        # the matmuls' workspaces: every layer's (a measure, not a fitted count of the layers in flight)
        workspace = s.num_layers * self.matmul_workspace.layer_bytes(b)
        layers = self.decode_attention_terms(context_lens, gathers, num_layers=m) + TransientTerms(
            decode_mlp=m * b * s.intermediate_size * s.dtype_bytes, decode_hidden=row,
            family_rows=s.extra_hidden_rows * row, fixed_bytes=(mlp_rows + unsorted_rows) * row + workspace,
            step_overhead_bytes=1)
        head = self.decode_head_terms(b, samples) + TransientTerms(fixed_bytes=self.matmul_workspace.head_bytes(b))
        if self.coefficients.head_apart:
            return layers, head + TransientTerms(step_overhead_bytes=1)
        return (layers + head,)

    def decode_head_terms(self, num_rows: int, samples: int = 0) -> TransientTerms:
        """The LM head of `num_rows` rows: their logits, and one sampling's temporaries per row that samples."""
        v = FLOAT32_BYTES * self.shape.vocab_size
        return TransientTerms(decode_logits=num_rows * v, sampling=samples * v)

    def decode_bytes(self, context_lens: Sequence[int], samples: int = 0, gathers: Optional[bool] = None) -> int:
        """Hidden states, the rows' KV as attention reads it, scores, MLP and logits (module docstring).
        `samples`: rows that sample (a bool counts as one). `gathers`: whether attention reads a gathered
        copy of the rows' KV (None: unless the model is `paged_decode`); False without paging is for grid
        points recorded when one-row decodes read a view of the pool."""
        if not context_lens:
            return 0
        return _largest(self.decode_phases(context_lens, samples, gathers), self.coefficients)

    def mixed_phases(self, chunk: PrefillChunkPlan, context_lens: Sequence[int],
                     samples: int = 0) -> tuple[TransientTerms, ...]:
        """One forward of a prompt chunk (T tokens) and B decoding rows (engine/model/layers/mixed.py) as
        the chunk's forward over T + B rows (no layer's MLP skipped) with one layer's attention
        temporaries of the rows and the logits of the rows and of the chunk's sampled position; in
        stages where the runner waits between them (`chunk_phases`, `decode_phases`): then the rows'
        attention is a stage of its own, after the chunk's."""
        k, b = self.coefficients, len(context_lens)
        # the rows' attention temporaries of as many layers as are in flight (m: on CUDA the rows'
        # partials outlive their layer like the chunk's intermediates; on the CPU one)
        rows = self.decode_attention_terms(context_lens)
        if not k.head_apart:  # one stage
            return (self.chunk_phases(chunk.num_tokens + b, chunk.context_len, True, chunk.samples, chunk.gathers, True)[0]
                    + rows + self.decode_head_terms(b, samples),)
        # the chunk's stages over T + B rows, its head apart (the last query's copy of a viewed row kept)
        phases = self.chunk_phases(chunk.num_tokens + b, chunk.context_len, chunk.computes_logits, False,
                                   chunk.gathers, fused_mlp=True)
        head = (self.decode_head_terms(b + chunk.computes_logits, samples + chunk.samples)
                + TransientTerms(step_overhead_bytes=1, prefill_overhead_bytes=1))
        if k.phases_apart:  # the rows' attention a stage of its own, after the chunk's: beside the
            # layer's residual stream of the T + B rows and the chunk's attention output (MIXED_STREAM_ROWS)
            s = self.shape
            stream = TransientTerms(fixed_bytes=MIXED_STREAM_ROWS * self.layer_factor * (chunk.num_tokens + b)
                                    * s.hidden_size * s.dtype_bytes, step_overhead_bytes=1, prefill_overhead_bytes=1)
            projections = phases[0]
            if s.qk_norms:  # the mixed forward norms its queries after the KV write (mixed.py), a chunk's
                # loop both heads' at once: the larger of the q and the k norms' rows, not their sum
                kept = max(s.num_heads, s.num_kv_heads) / (s.num_heads + s.num_kv_heads)
                projections -= TransientTerms(family_rows=projections.family_rows * (1 - kept))
            return (projections, phases[1], stream + rows) + tuple(phases[2:-1]) + (head,)
        together = phases[0] - TransientTerms(prefill_logits=phases[0].prefill_logits)  # the head is apart
        return (together + rows, head)

    def mixed_bytes(self, chunk: PrefillChunkPlan, context_lens: Sequence[int], samples: int = 0) -> int:
        """One forward of a prompt chunk and B decoding rows (engine/model/layers/mixed.py): the larger of
        - its stages (`mixed_phases`): the peak among the MLPs over T + B rows;
        - where layers coexist (layers_in_flight > 1: CUDA), the rows' decode forward with one layer's
          share of the chunk's: the peak among the rows' attention temporaries, which there coexist
          over layers like a decode step's. One layer at a time (CPU), the first holds it.
        Measured on an H200 (docs/memory.md): 68 mixed steps of an 8B llama and an 8-layer one,
        predicted / measured >= 1.28; in a tight burst a 384-token chunk with 16 rows of long contexts
        measured 1.13 x the formula with one layer of the rows' temporaries, whence m of them."""
        if not context_lens:
            return self.prefill_chunk_bytes(chunk.num_tokens, chunk.context_len, chunk.computes_logits,
                                            chunk.samples, chunk.gathers)
        rows = _largest(self.mixed_phases(chunk, context_lens, samples), self.coefficients)
        if self.layer_factor == 1 and self.coefficients.head_apart:  # and no less than the rows' decode,
            return max(rows, self.decode_bytes(context_lens, samples))  # whose every array it computes too
        alone = self.prefill_chunk_bytes(chunk.num_tokens, chunk.context_len, chunk.computes_logits,
                                         chunk.samples, chunk.gathers)
        attention = self.decode_bytes(context_lens, samples) + alone / self.layer_factor
        return int(max(rows, attention))

    def chunk_plan_phases(self, chunk: PrefillChunkPlan) -> tuple[TransientTerms, ...]:
        """`chunk_phases` of a planned chunk."""
        return self.chunk_phases(chunk.num_tokens, chunk.context_len, chunk.computes_logits, chunk.samples,
                                 chunk.gathers)

    def packed_bytes(self, chunks: Sequence[PrefillChunkPlan]) -> int:
        """One forward of several rows' prompt chunks (engine/model/layers/chunk_path.py `forward_packed`):
        its norms, projections, MLP and head run over all their tokens at once, each chunk's RoPE and
        attention over its own row. Bounded by the chunks' own forwards added stage by stage (every term of
        a chunk's formula grows with its tokens, its row's keys or its logits, or is a per-forward constant,
        then counted once per chunk) and PACK_ROWS more rows of the queries' size a token
        (`pack_rows_bytes`). One chunk: `prefill_chunk_bytes`."""
        if len(chunks) == 1:
            return _largest(self.chunk_plan_phases(chunks[0]), self.coefficients)
        return self.summed_pack_bytes(add_phases([self.chunk_plan_phases(c) for c in chunks]),
                                      sum(c.num_tokens for c in chunks))

    def summed_pack_bytes(self, phases: Sequence[TransientTerms], num_tokens: int) -> int:
        """`packed_bytes` from its chunks' stages already added (`add_phases`) and its tokens."""
        return _largest(phases, self.coefficients) + self.pack_rows_bytes(num_tokens)

    def pack_rows_bytes(self, num_tokens: int) -> int:
        """What a packed forward holds beyond its chunks' own forwards: PACK_ROWS arrays of the queries'
        size (H * d) per token and layer in flight (its rows' rotated keys and values kept for their
        attention, the outputs' layout copies and concatenation)."""
        s = self.shape
        return PACK_ROWS * self.layer_factor * num_tokens * s.num_heads * s.head_dim * s.dtype_bytes

    def step_transient_bytes(self, plan: StepPlan, mixed: bool = False) -> int:
        """Decode and each forward of prompt chunks (one chunk, or several packed: `plan.packs`) are
        evaluated one after another: the peak is their max. `mixed`: the decode rows run with the first
        chunk (engine/model/layers/mixed.py), one forward (`mixed_bytes`) whose chunk is a pack of its own."""
        groups = pack_groups(plan.prefill_chunks, plan.packs)
        chunks = [self.packed_bytes(g) for g in groups]
        if mixed and chunks and plan.decode_context_lens:
            if len(groups[0]) != 1:
                raise ValueError(f"packs={plan.packs}: a mixed forward's chunk is a pack of its own")
            first = self.mixed_bytes(plan.prefill_chunks[0], plan.decode_context_lens, plan.decode_samples)
            return max([first] + chunks[1:])
        return max([self.decode_bytes(plan.decode_context_lens, plan.decode_samples)] + chunks)

    def floor_transient_bytes(self, prefill_chunk_size: int, max_model_len: int) -> int:
        """The smallest step that still makes progress, whatever the state: one row's decode, or one
        prompt chunk of at most FLOOR_CHUNK_TOKENS tokens (sampled, ending its prompt), at max_model_len
        keys. The KV budget leaves this much beside a full pool (`kv_budget_bytes`), so every step the
        scheduler sizes to the free memory (Scheduler.schedule) has at least this room. A one-token
        chunk is a forward of another kind (its scores are decode's), so both sizes are taken."""
        n = max_model_len
        chunk = max(1, min(prefill_chunk_size, FLOOR_CHUNK_TOKENS, n))
        return max(self.decode_bytes([n], samples=1),
                   self.prefill_chunk_bytes(chunk, n, samples=True),
                   self.prefill_chunk_bytes(1, n, samples=True))

    def transient_bound_bytes(self, max_num_seqs: int, prefill_chunk_size: int, max_model_len: int) -> int:
        """Largest transient of any step the scheduler can produce under this configuration.

        Both formulas grow with every argument; a chunk attends to at most max_model_len keys and a
        decode step has at most max_num_seqs rows of at most max_model_len keys each. Forwards never
        overlap on the device (engine/model/work.py finish); two pipelined decodes whose arrays can be
        alive together (StepOptions.launch_ahead) and a step mixing its decode rows into a chunk's forward
        are run only within this bound (Scheduler.fits, Scheduler.schedule).
        """
        chunk = min(prefill_chunk_size, max_model_len)
        return max(
            self.prefill_chunk_bytes(chunk, max_model_len, samples=True),
            self.decode_bytes([max_model_len] * max_num_seqs, samples=max_num_seqs),
        )


def add_phases(phases: Sequence[Sequence[TransientTerms]]) -> tuple[TransientTerms, ...]:
    """Forwards' stages (a model's chunks have the same stages) added stage by stage."""
    return tuple(sum(stage, TransientTerms()) for stage in zip(*phases))


def _largest(phases: Sequence[TransientTerms], coefficients: TransientCoefficients) -> int:
    """The transient of a forward run in `phases` one after another: the largest phase's."""
    return int(max(p.bytes(coefficients) for p in phases))
