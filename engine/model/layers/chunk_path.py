"""The forward of a prompt chunk with less host work: the engine's own layer loop over weights bound once.

Building a forward's graph is host work the device waits for: MLX's CUDA backend lets the host run at
most some ten committed batches of operations ahead of the GPU (`mlx/transforms.cpp`,
`MAX_ACTIVE_TASKS`; `ExecutionConfig.max_ops_per_buffer` operations a batch), so launching a forward
returns only when most of it has run, and the next forward's graph is built while the device finishes
the last few layers: with mlx-lm's modules the device sat idle most of that build (docs/benchmarks.md).

This loop builds the same operations as mlx-lm's block of the family (RMSNorm, q/k/v, q/k head norms,
RoPE, the KV write and read through the `ForwardView`, MLX's attention (causal, or a sliding layer's
window mask; Gemma 2's soft-capped scores), o, the residual add and norms, the MLP: SwiGLU, GELU or
Qwen3-MoE's experts; engine/model/layers/block.py; on the CPU the attention and SwiGLU of
engine/model/layers/cpu_math.py, `RunnerOptions.cpu_math`) with:
- every projection's weight bound once (engine/model/layers/bound.py), so the same matmuls run on the same memory
  without a slice or transpose built per call;
- no module dispatch (attribute lookups, fused-product bookkeeping) per layer;
- in the last layer, only what the chunk's output needs: the keys and values of every position, and,
  when the chunk samples, the query, attention and MLP of its last position alone (a sequential
  prefill does the same work with a last one-token forward); nothing more for a chunk that samples
  nothing.

Models: mlx-lm's blocks of llama, mistral, qwen2, qwen3, phi3, qwen3_moe, gemma, gemma2 and gemma3_text
with float projections (engine/model/layers/bound.py `unsupported` says why not); others (quantized
weights) run mlx-lm's modules. Greedy output equals mlx-lm's (tests).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from engine.model.forward_view import GroupWrite
from engine.model.kv_pool import chunk_view
from engine.model.layers import block
from engine.model.layers.bound import BoundModel, unsupported
from engine.model.layers.ops import ReferenceOps


class ChunkPath:
    """Prompt-chunk forwards of a supported model (module docstring). Bind after any change of the
    model's weights (fusion, dtype): the views are of the weights as they are now."""

    def __init__(self, model, ops: Optional[ReferenceOps] = None, bound_model: Optional[BoundModel] = None):
        """`ops`: the attention and SwiGLU (ReferenceOps: MLX's, or engine/model/layers/cpu_math.py's);
        `bound_model`: the model's layers bound already (else bound here)."""
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"chunk path: {why}")
        self.bound = bound_model or BoundModel(model)
        self.layers = self.bound.layers
        self.ops = ops or ReferenceOps()
        self.heads, self.kv_heads, self.head_dim = self.bound.heads, self.bound.kv_heads, self.bound.head_dim

    def forward(self, tokens: mx.array, view, sample: bool, stages: Optional[list] = None,
                num_pad: int = 0) -> Optional[mx.array]:
        """tokens [1, T] -> the final-normed hidden state of the last position, [1, 1, D], if `sample`
        (else None: the forward only writes the KV of its T positions). `view`: a ForwardView of one
        row and T new tokens, whose KV it writes (and reads). `stages`: a list the forward appends, per
        layer, its KV write (the pool arrays), its rotated queries, its causal attention's blocks' outputs
        (engine/model/layers/cpu_math.py), its residual stream after the attention, its MLP's input norm
        (a sparse MLP's router and experts too, block.moe_mlp) and its residual stream after the MLP (but
        the last layer's), for a runner that evaluates them one by one (ModelRunner.stage_waits): the
        temporaries of a norm, the projections and RoPE (a few operations each on MLX's CPU backend) are
        then gone before the scores' or the MLP's exist, in every run. `num_pad`: the last tokens are a pad
        past the prompt's end (engine/core/chunk_grid.py): the sampled position is the one before them,
        which reads no pad key."""
        H, H_kv, d = self.heads, self.kv_heads, self.head_dim
        ops = self.ops
        T = tokens.shape[1]
        offset = view.offset
        h = self.bound.embed(tokens)  # [1, T, D]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = mx.fast.rms_norm(h, layer.in_w, layer.in_eps)
            k = layer.rope(layer.norm_k(layer.k(x).reshape(1, T, H_kv, d)).transpose(0, 2, 1, 3), offset=offset)
            v = layer.v(x).reshape(1, T, H_kv, d).transpose(0, 2, 1, 3)
            view.write(i, k, v)
            if stages is not None:  # the norm's, k's and v's temporaries gone before q's exist
                stages.append(view.written(i))
            at = 0  # the first position whose query this layer computes
            if i == last:
                if not sample:
                    return None
                if T > 1:  # the last real position's query, attention and MLP alone
                    at = T - 1 - num_pad
                    x, h = x[:, at:at + 1], h[:, at:at + 1]
            Tq = x.shape[1]
            q = layer.rope(layer.norm_q(layer.q(x).reshape(1, Tq, H, d)).transpose(0, 2, 1, 3),
                           offset=offset + at)
            if stages is not None:  # ... and q's before the scores'
                stages.append(q)
            out = ops.attend(view, i, q, layer.scale, stages=stages, softcap=layer.softcap,
                             drop_keys=num_pad if i == last else 0)
            h = self._rest_of_layer(layer, h, out.transpose(0, 2, 1, 3).reshape(1, Tq, H * d), stages, i == last)
            if i == last:
                return h

    def forward_packed(self, tokens: mx.array, views: list, samples: list[bool], pads: list[int],
                       stages: Optional[list] = None) -> Optional[mx.array]:
        """Several rows' prompt chunks as one forward: tokens [1, N] are the chunks one after another,
        chunk j of `views[j]` (a ForwardView of its own row and its tokens; no row twice) -> the
        final-normed hidden states of the last real position of each chunk that `samples`, [1, r, D] in
        chunk order (None if none does). The norms, projections and MLP run over all N tokens at once
        (larger matmuls: the point of packing). Consecutive chunks of as many tokens from the same
        position (`_groups`: a burst's first chunks) are one batch of rows for RoPE, the KV write and,
        from position 0 (their keys are their own) where the layer's window (if any) holds them all,
        MLX's causal attention; other chunks attend over
        their row in the pool one by one, as `forward` does. Every layer writes all chunks' KV before
        any reads it: a read holds the pool array, which MLX would copy for a later write.
        `pads`: each chunk's pad past its prompt's end (`forward`'s num_pad); `stages`: as `forward`'s."""
        H, H_kv, d = self.heads, self.kv_heads, self.head_dim
        ops, pool = self.ops, views[0].pool
        N = tokens.shape[1]
        groups = _groups(views)  # (first chunk, chunks, tokens each, position), in order
        writes = [GroupWrite(views[j:j + n]) for j, n, _, _ in groups]
        starts = [sum(v.num_new for v in views[:j]) for j in range(len(views))]
        sampled = [j for j, s in enumerate(samples) if s]
        ends = [starts[j] + views[j].num_new - 1 - pads[j] for j in sampled]  # the sampled positions
        h = self.bound.embed(tokens)  # [1, N, D]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = mx.fast.rms_norm(h, layer.in_w, layer.in_eps)
            k = layer.norm_k(layer.k(x).reshape(1, N, H_kv, d))
            v = layer.v(x).reshape(1, N, H_kv, d)
            rows = []  # per group: its rows' rotated keys and values [n, H_kv, T, d]
            for (j, n, T, offset), write in zip(groups, writes):
                a = starts[j]
                kg = layer.rope(k[:, a:a + n * T].reshape(n, T, H_kv, d).transpose(0, 2, 1, 3), offset=offset)
                vg = v[:, a:a + n * T].reshape(n, T, H_kv, d).transpose(0, 2, 1, 3)
                write.write(i, kg, vg)
                rows.append((kg, vg))
            if stages is not None:
                stages.append(views[-1].written(i))
            if i == last:
                if not sampled:
                    return None
                # the sampled positions' query, attention and MLP alone (as `forward`'s last layer)
                where = mx.array(ends)
                x, h = x[:, where], h[:, where]  # [1, r, D]
                q = layer.norm_q(layer.q(x).reshape(1, len(sampled), H, d))
                qs = [layer.rope(q[:, n:n + 1].transpose(0, 2, 1, 3), offset=views[j].offset + ends[n] - starts[j])
                      for n, j in enumerate(sampled)]
                if stages is not None:
                    stages.append(tuple(qs))
                outs = [ops.attend(views[j], i, qj, layer.scale, stages=stages, softcap=layer.softcap,
                                   drop_keys=pads[j]) for j, qj in zip(sampled, qs)]
            else:
                q = layer.norm_q(layer.q(x).reshape(1, N, H, d))
                qs = [layer.rope(q[:, starts[j]:starts[j] + n * T].reshape(n, T, H, d).transpose(0, 2, 1, 3),
                                 offset=offset) for j, n, T, offset in groups]
                if stages is not None:
                    stages.append(tuple(qs))
                window = pool.layer_windows[i]
                outs = []
                for (j, n, T, offset), qg, (kg, vg) in zip(groups, qs, rows):
                    if offset == 0 and (window is None or T <= window):  # causal over the rows' own keys
                        outs.append(ops.attention(qg, kg, vg, layer.scale, "causal", stages, layer.softcap))
                    else:
                        outs += [ops.attend(views[j + b], i, qg[b:b + 1], layer.scale, stages=stages,
                                            softcap=layer.softcap) for b in range(n)]
            outs = [o.transpose(0, 2, 1, 3).reshape(1, -1, H * d) for o in outs]
            out = mx.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]  # [1, N or r, H d]
            # the layer's writes in its own graph: a group's causal attention reads its rotated keys and
            # values, not the pool, so nothing read would otherwise run them until a later forward read
            # the pool (holding every layer's keys and values of the pack until then)
            out = mx.depends(out, [pool.keys[i], pool.values[i]])
            h = self._rest_of_layer(layer, h, out, stages, i == last)
            if i == last:
                return h

    def _rest_of_layer(self, layer, h: mx.array, attended: mx.array, stages: Optional[list], final: bool) -> mx.array:
        """A layer after its attention `attended` [1, n, H d]: the output projection, the residual add and
        norm, the MLP (appending `forward`'s stages: the residual, then the MLP's input norm, so its
        temporaries are gone before the MLP's; the MLP's own; the residual after it). Returns the
        residual stream [1, n, D], or the final-normed hidden states if `final`."""
        ops = self.ops
        h, x = block.after_attention(layer, h, layer.o(attended), ops.add_rms_norm)
        if stages is not None:
            stages += [h, x]
        m = block.mlp(layer, x, ops.swiglu, stages=stages)
        if final:
            return block.after_mlp(layer, h, m, self.bound.final_norm, ops.add_rms_norm)[1]
        h = block.after_mlp(layer, h, m, None, ops.add_rms_norm)[0]
        if stages is not None:
            stages.append(h)
        return h

    def warm_attention(self, shapes, dtype: mx.Dtype) -> None:
        """The first layer's attention of one prompt chunk per (tokens, context) of `shapes`, on zeros,
        its queries made as `forward` makes them and its keys a view of a pool array laid out as the
        pool's (kv_pool.chunk_view): MLX's CUDA backend builds a cuDNN graph per new shape and strides
        and keeps it for the calling thread, so the same thread's later chunks of these shapes find
        theirs built. For layers whose attention is causal over such a view (no sliding window)."""
        layer = self.layers[0]
        H, H_kv, d = self.heads, self.kv_heads, self.head_dim
        keys = mx.zeros((max(n for _, n in shapes) * H_kv, d), dtype)
        for tokens, context in shapes:
            x = mx.zeros((1, tokens, layer.in_w.shape[-1]), dtype)
            q = layer.rope(layer.norm_q(layer.q(x).reshape(1, tokens, H, d)).transpose(0, 2, 1, 3),
                           offset=context - tokens)
            kv = chunk_view(keys, H_kv, d, 0, context)
            mx.eval(self.ops.attention(q, kv, kv, layer.scale, "causal"))


def _groups(views: list) -> list[tuple[int, int, int, int]]:
    """Runs of consecutive one-row views computing as many tokens from the same position: (first view,
    views, tokens each, position) per run, in order."""
    groups: list[list[int]] = []
    for j, view in enumerate(views):
        if groups and (view.num_new, view.offset) == (groups[-1][2], groups[-1][3]):
            groups[-1][1] += 1
        else:
            groups.append([j, 1, view.num_new, view.offset])
    return [tuple(g) for g in groups]
