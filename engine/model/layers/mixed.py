"""One forward for a prompt chunk and the step's decodes together (vLLM's chunked prefill batches them
the same way).

Without it a step that has both runs the decode rows' forward and then the chunk's, and each reads
every weight of the model: on a GPU a decode forward is bound by that read (an 8B llama's 16 GB, some
5-8 ms on an H200), so every step that prefills while other rows decode paid a second weight read.
Here the chunk's T tokens and the B decode tokens go through the linear layers as one sequence of T + B
rows (the norms, q/k/v, o, MLP and the LM head read the weights once); only attention runs apart, each
part against its own rows' KV:
- the chunk: its row's keys through its `ForwardView` (a view of the pool, or a gathered copy), MLX's
  causal attention, as mlx-lm's attention module computes it;
- the decodes: RoPE at each row's own position, then the paged kernel (or, without it, mlx-lm's
  attention over the gathered rows with their mask), as `decode_path.DecodePath` computes it.
Both views write a layer's keys and values before either reads them (`ForwardView.write`).

Only models the engine's decode loop takes (`decode_path.unsupported(model)`: the blocks the layer
loops bind, with fused projections) are batched so; others run the two forwards.
The last layer computes the chunk's queries, attention and MLP for its sampled position only (none if
it samples nothing), as engine/model/layers/chunk_path.py does for a chunk alone. The memory model predicts the forward
with `MemoryModel.mixed_bytes` and runs models no deeper than its set's `mixed_min_layers` apart; the
scheduler mixes a step only when the prediction stays within the bound of separate forwards
(`SchedulerOutput.mixed`). Measured on an H200 (8B, docs/benchmarks.md, session 6): a mixed step's
transient is the chunk's plus 4 MB, and its time below that of the two forwards (51.6-60.0 ms against
58.7-63.9 ms with one decode row).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from engine.model.layers import block
from engine.model.layers.decode_path import DecodePath, qk_norms


class MixedForward:
    """The combined forward of a supported model (module docstring), with `path`'s model, RoPE specs
    and ops (`ReferenceOps`, or the decode path's CUDA kernels) for the decode rows."""

    def __init__(self, path: DecodePath):
        self.path = path

    def forward(self, tokens: mx.array, chunk_view, decode_view, sample: bool = True,
                stages: Optional[list] = None, num_pad: int = 0) -> mx.array:
        """tokens [T + B]: the chunk's T tokens, then one per decode row -> the final-normed hidden
        states of the rows that go on to the LM head, [1, (1 +) B, D]: the chunk's last position if it
        `sample`s, then the decode rows. `chunk_view`: one row, T new tokens; `decode_view`: B rows,
        one each. The last layer computes the other chunk positions' keys and values only (as
        engine/model/layers/chunk_path.py does for a chunk alone). `stages`, `num_pad` (the chunk's last
        tokens are a pad: it samples the position before them): as ChunkPath.forward's."""
        path = self.path
        ops = path.ops
        T = tokens.shape[0] - len(decode_view.rows)
        offsets = decode_view.rope_offsets()
        layers = path.layers  # engine/model/layers/bound.py: every projection bound once
        h = path.bound.embed(tokens[None])  # [1, T + B, D]
        y = mx.fast.rms_norm(h, layers[0].in_w, layers[0].in_eps)
        for i, layer in enumerate(layers):
            # chunk positions whose queries, attention, MLP this layer computes: all but in the last
            # layer, where only the sampled one's output is read (the one before a pad)
            last = i == len(layers) - 1
            Tq = int(sample) if last else T
            q_from = T - num_pad - Tq if last else 0
            out = self._attention(i, layer, y, chunk_view, decode_view, offsets, (T, Tq, q_from),
                                  num_pad if last else 0, stages)
            h = _query_rows(h, q_from, Tq, T)
            h, y = block.after_attention(layer, h, layer.o(out), ops.add_rms_norm)
            if stages is not None:
                stages += [h, y]
            h, y = block.after_mlp(layer, h, path.mlp(layer, y, stages), path.next_norm(i), ops.add_rms_norm)
            if stages is not None and i < len(layers) - 1:
                stages.append(h)
        return y

    def _attention(self, i: int, layer, y: mx.array, chunk_view, decode_view, offsets: mx.array,
                   rows: tuple, num_pad: int, stages: Optional[list]) -> mx.array:
        """Layer i's attention of the chunk's query rows and the decode rows -> [1, Tq + B, H d]; `rows`:
        (T, Tq, q_from): the chunk's tokens, its query rows and the first of them; `num_pad`: the pad's
        keys the last layer's query leaves out."""
        path, ops = self.path, self.path.ops
        H, H_kv, d = path.heads, path.kv_heads, path.head_dim
        T, Tq, q_from = rows
        B = len(decode_view.rows)
        # q, k and v apart (as mlx-lm's module computes a prompt chunk's): the chunk's rows of each
        # are then a contiguous array, where slices of one fused product would be copied per layer
        q = layer.q(_query_rows(y, q_from, Tq, T))  # [1, Tq + B, H d]
        k, v = layer.k(y), layer.v(y)  # [1, T + B, H_kv d]
        # the decode rows: [B, 1, ...] each at its own position
        dqkv = mx.concatenate([q[0, Tq:], k[0, T:], v[0, T:]], axis=-1)[:, None, :]
        dq, dk, dv = ops.rope_qkv(dqkv, offsets, path.ropes[i], H, H_kv, qk_norms(layer))
        # the chunk: mlx-lm's attention module, step by step
        k = layer.rope(layer.norm_k(k[:, :T].reshape(1, T, H_kv, d)).transpose(0, 2, 1, 3),
                       offset=chunk_view.offset)
        v = v[:, :T].reshape(1, T, H_kv, d).transpose(0, 2, 1, 3)
        decode_view.write(i, dk, dv)
        chunk_view.write(i, k, v)
        if stages is not None:  # both writes, then the queries (as ChunkPath.forward's stages)
            stages.append(chunk_view.written(i))
        parts = []
        if Tq:
            q = layer.rope(layer.norm_q(q[:, :Tq].reshape(1, Tq, H, d)).transpose(0, 2, 1, 3),
                           offset=chunk_view.offset + q_from)
            if stages is not None:
                stages.append(q)
            # the chunk's queries are its last Tq positions: causal, or (one query) every key
            parts.append(ops.attend(chunk_view, i, q, layer.scale, stages=stages,
                                    softcap=layer.softcap, drop_keys=num_pad
                                    ).transpose(0, 2, 1, 3))
            if stages is not None:
                # a runner that waits between stages (MLX's CPU backend): the rows' attention after
                # the chunk's (a stage too where it is one query, in the last layer), a stage of its
                # own: its gathered KV is made once the chunk's is gone (MemoryModel.mixed_phases)
                stages.append(parts[0])
                dq = mx.depends(dq, parts[0])
        rows = ops.attend(decode_view, i, dq, layer.scale, softcap=layer.softcap)  # [B, H, 1, d]
        if stages is not None:
            stages.append(rows)
        parts.append(rows.transpose(2, 0, 1, 3))  # [1, B, H, d]
        # one copy of both parts' outputs, [1, Tq + B, H, d], straight from their head-major layouts
        # (mlx-lm's module makes the same one copy of the chunk's alone)
        out = mx.concatenate(parts, axis=1).reshape(1, Tq + B, H * d)
        return out

def _query_rows(a: mx.array, first: int, num: int, T: int) -> mx.array:
    """a [1, T + B, ...] -> its rows whose queries a layer computes: the chunk's [first, first + num),
    then the B decode rows' (a itself where that is every row)."""
    if first + num == T:
        return a[:, first:] if first else a
    return mx.concatenate([a[:, first:first + num], a[:, T:]], axis=1)
