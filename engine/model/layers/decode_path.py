"""The decode forward with fewer operations: the engine's own layer loop.

Per layer: RMSNorm, the fused q/k/v matmul (engine/model/layers/fused.py), q/k head norms and RoPE, the
KV write, attention, o, the residual add and norms, the MLP (from the fused gate/up matmul, or Qwen3-MoE's
experts), the add and the next RMSNorm: the same operations as mlx-lm's block of the family
(engine/model/layers/block.py), over weights bound once (engine/model/layers/bound.py), with no module
dispatch per layer. Attention: where the runner set a paged kernel (engine/model/kernels/
paged_attention.py, MLX's CUDA backend), this loop calls it explicitly on each row's KV in the pool (a
sliding layer's window is gathered; Gemma 2's soft-capped logits never take the kernel); else it
attends over the rows' gathered KV with `ReferenceOps.attention` (on the CPU engine/model/layers/
cpu_math.py's). The engine's layer loops (this one, mixed.py, chunk_path.py) are the only forwards that
read the pool in place: mlx-lm's modules attend over what the cache returns, a gathered copy.

Only decode forwards (one token per row) of models the layer loops bind with fused projections take it
(`unsupported` says why not); everything else runs mlx-lm's modules. It builds a decode's graph in less
host time than mlx-lm's modules, and less again with each layer's operations built from a compiled trace
(`CompiledLayers`, on CUDA): host time the GPU otherwise waits for (docs/benchmarks.md).
"""

from __future__ import annotations

import copy
import logging
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from engine.model.layers import block, bound
from engine.model.layers.ops import ReferenceOps, RopeSpec

logger = logging.getLogger(__name__)


def unsupported(model: nn.Module) -> Optional[str]:
    """Why this loop cannot run `model`'s decode (None: it can): it takes the blocks the layer loops bind
    (engine/model/layers/bound.py) with fused projections (q/k/v; gate/up of a dense MLP) and mlx-lm's
    RoPE or Llama3RoPE."""
    why = bound.unsupported(model)
    if why is not None:
        return why
    for layer in bound.language_model(model).model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if "qkv_proj" not in attn or ("gate_up_proj" not in mlp and "switch_mlp" not in mlp):
            return "projections not fused (engine/model/layers/fused.py)"
        rope = attn.rope
        if type(rope).__name__ not in ("RoPE", "Llama3RoPE"):
            return f"rotary embedding {type(rope).__name__}"
    return None


class DecodePath:
    """The decode forward of a supported model (module docstring) with `ops`."""

    def __init__(self, model: nn.Module, ops: ReferenceOps, compiled: bool = False,
                 bound_model: Optional[bound.BoundModel] = None):
        """`compiled`: with `ReferenceOps`, the layers' work around the KV write and attention runs as
        compiled functions (`CompiledLayers`) where traces can serve the layers (else, logged, not).
        `bound_model`: the model's layers bound already (else bound here)."""
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"decode path: {why}")
        self.bound = bound_model or bound.BoundModel(model)
        self.ops = ops
        self.heads, self.kv_heads, self.head_dim = self.bound.heads, self.bound.kv_heads, self.bound.head_dim
        self.layers = self.bound.layers
        self.ropes = [RopeSpec(layer.rope, self.head_dim) for layer in self.layers]
        self.compiled: Optional[CompiledLayers] = None
        if compiled and type(ops) is ReferenceOps:
            why = CompiledLayers.unsupported(self)
            if why is None:
                self.compiled = CompiledLayers(self)
            else:
                logger.info("decode layers not compiled (%s)", why)

    def forward(self, tokens: mx.array, view) -> mx.array:
        """tokens [B, 1] -> the final-normed hidden states [B, 1, D]; `view` a ForwardView
        (engine/model/kv_pool.py) whose KV it writes and reads (in place when paged, else gathered)."""
        offsets = view.rope_offsets()
        h = self.bound.embed(tokens)  # [B, 1, D]
        if self.compiled is not None:
            return self.compiled.forward(h, offsets, view)
        first = self.layers[0]
        y = mx.fast.rms_norm(h, first.in_w, first.in_eps)
        into_pool = self.rope_into_pool(view)
        for i, layer in enumerate(self.layers):
            if into_pool:
                out = self.attend_written(view, i, self.rope_write(view, i, layer.qkv(y), offsets))
            else:
                q, k, v = self.qkv_rope(layer, y, offsets, self.ropes[i])
                out = self.attend(view, i, q, k, v, layer.scale, layer.softcap)
            h, y = self.block_end(layer, h, out, self.next_norm(i))
        return y

    def writes_kv_in_rope(self, pool) -> bool:
        """Whether paged decodes of `pool` have their keys and values written into it by the fused q/k
        rope kernel (in place, `rope_write`) instead of a scatter: where the runner enabled it
        (`ops.rope_writes_kv`, for this path's ropes), the pool's paged attention reads it only after the
        write (a kernel taking the queries: PagedAttention.reads_pool_after_queries), and no layer slides
        a window (those layers gather, from the scattered KV)."""
        return (self.ops.rope_writes_kv and self.ops.qk_rope is not None and pool.paged is not None
                and pool.paged.reads_pool_after_queries and pool.window is None)

    def rope_into_pool(self, view) -> bool:
        """`writes_kv_in_rope` for this forward: a paged decode's."""
        return view.reads_paged and self.writes_kv_in_rope(view.pool)

    def rope_write(self, view, i: int, qkv: mx.array, offsets: mx.array) -> mx.array:
        """Layer i's q/k head norms and RoPE of its q/k/v product qkv [B, 1, (H + 2 H_kv) d], k and v
        written into the pool's rows in place -> q [B, H, 1, d] (qk_rope.CudaQKRope.rope_into_pool)."""
        return self.ops.qk_rope.rope_into_pool(qkv, offsets, self.ropes[i], self.heads, self.kv_heads,
                                               qk_norms(self.layers[i]), view.pool.keys[i], view.pool.values[i],
                                               view.write_rows)

    def attend_written(self, view, i: int, q: mx.array) -> mx.array:
        """Attention of layer i over the pool that `rope_write` wrote (it reads after the write: it takes
        the kernel's q) -> [B, H, 1, d]."""
        layer = self.layers[i]
        return self.ops.attend(view, i, q, layer.scale, softcap=layer.softcap)

    def qkv_rope(self, layer, y: mx.array, offsets: mx.array, rope: RopeSpec) -> tuple:
        """The layer's q, k, v of its normed input y [B, 1, D], its q/k head norms and RoPE applied."""
        return self.ops.rope_qkv(layer.qkv(y), offsets, rope, self.heads, self.kv_heads, qk_norms(layer))

    def attend(self, view, i: int, q: mx.array, k: mx.array, v: mx.array, scale: float,
               softcap: Optional[float] = None) -> mx.array:
        """Write layer i's new keys and values, then attend (`ReferenceOps.attend`) -> [B, H, 1, d]."""
        view.write(i, k, v)
        return self.ops.attend(view, i, q, scale, softcap=softcap)

    def block_end(self, layer, h: mx.array, out: mx.array, next_norm: tuple) -> tuple:
        """A layer after its attention (out [B, H, 1, d]): o, the residual add and the MLP's input norm,
        the MLP, the add and the next norm (`next_norm`: its (weight, eps)) -> (h, the next norm's
        output). `layer`: a BoundLayer (or one rebuilt from a compiled trace's inputs). Where the ops ask
        for it (`ReferenceOps.residual_matmul`), o's and down's products are added to the residual stream
        inside their matmuls (`residual_matmul`)."""
        B = h.shape[0]
        add_norm = self.ops.add_rms_norm
        out = out.reshape(B, 1, self.heads * self.head_dim)
        # one row keeps MLX's gemv (addmm takes cuBLASLt); a compiled trace is per batch size
        fuse = self.ops.residual_matmul and B > 1
        if fuse and fuses_attention_residual(layer):
            h = residual_matmul(h, out, layer.o)
            y = mx.fast.rms_norm(h, layer.post_w, layer.post_eps)
        else:
            h, y = block.after_attention(layer, h, layer.o(out), add_norm)
        if fuse and fuses_mlp_residual(layer):
            h = residual_matmul(h, block.mlp_hidden(layer, y, self.ops.swiglu), layer.down)
            return h, mx.fast.rms_norm(h, *next_norm)
        return block.after_mlp(layer, h, self.mlp(layer, y), next_norm, add_norm)

    def mlp(self, layer: bound.BoundLayer, y: mx.array, stages: Optional[list] = None) -> mx.array:
        """The MLP, a dense one from its fused gate/up product (block.mlp)."""
        return block.mlp(layer, y, self.ops.swiglu, fused=True, stages=stages)

    def next_norm(self, i: int) -> tuple:
        """(weight, eps) of the norm after layer i's block: the next layer's input norm, or the final."""
        if i + 1 < len(self.layers):
            return self.layers[i + 1].in_w, self.layers[i + 1].in_eps
        return self.bound.final_norm


def residual_matmul(h: mx.array, x: mx.array, proj: bound.Projection) -> mx.array:
    """h + x @ W^T as one matmul (`mx.addmm`: cuBLASLt adds h to the product before rounding it, one kernel
    where `h + proj(x)` takes two). h [B, 1, D], x [B, 1, K] -> [B, 1, D]."""
    B = h.shape[0]
    return mx.addmm(h.reshape(B, -1), x.reshape(B, -1), proj.weight_t).reshape(h.shape)


def _plain_add(layer: bound.BoundLayer, proj: bound.Projection) -> bool:
    """Whether the layer adds `proj`'s product to its residual stream plainly (no clip) and `proj` has no
    bias: what `residual_matmul` computes."""
    return layer.add is mx.add and proj.bias is None


def fuses_attention_residual(layer: bound.BoundLayer) -> bool:
    """Whether `residual_matmul` serves the layer's attention branch: o's product added as it is (no
    Gemma output norm), plainly."""
    return layer.attn_out_norm is None and _plain_add(layer, layer.o)


def fuses_mlp_residual(layer: bound.BoundLayer) -> bool:
    """Whether it serves the MLP branch: a dense MLP from the fused gate/up product, down's product added
    as it is, plainly."""
    return layer.mlp_out_norm is None and layer.moe is None and layer.gate_up is not None \
        and _plain_add(layer, layer.down)


def takes_residual_matmul(path: Optional[DecodePath]) -> bool:
    """Whether some layer of the decode loop takes `residual_matmul` (not Gemma 2/3's, every branch
    normed): where the runner enables it, for the memory model and ExecutionPaths to read. Set before
    the first decode: compiled layers read it when they trace."""
    return path is not None and any(fuses_attention_residual(layer) or fuses_mlp_residual(layer)
                                    for layer in path.layers)


def qk_norms(layer: bound.BoundLayer) -> Optional[tuple]:
    """The layer's query and key head norms for `ReferenceOps.rope_qkv` (None: it has none)."""
    return None if layer.q_norm is None else (layer.q_norm, layer.k_norm)


class CompiledLayers:
    """A decode forward's layers as compiled functions: MLX's counterpart of the CUDA graphs vLLM
    captures for decode. `mx.compile` traces each once per batch size, then builds its operations from
    the trace in C++ with no Python per operation. Per layer the host makes one call for everything
    between the layer's attention and the next layer's KV write (`DecodePath.block_end`, then the next
    layer's q/k/v and `ReferenceOps.rope_qkv`: the same functions the Python loop calls), where
    `DecodePath.forward` builds some 25 operations in Python. The KV write and the paged attention stay
    outside: a compiled write would return a new pool array instead of writing the pool in place (and
    the attention's traces would be per batch size and block count). The weights are the functions'
    inputs, so one trace serves every layer of one structure (`_structure`: its norms' epsilons and
    presence, its projections' biases, MLP activation, the next layer's RoPE): a model whose layers
    alternate (Gemma 3's sliding and global RoPE bases) has one trace per kind. The engine compiles on
    MLX's CUDA backend, where the graph's host time is what a decode step waits for (docs/benchmarks.md)."""

    def __init__(self, path: DecodePath):
        self.path = path
        layers = path.layers
        self._qkv = [_qkv_arrays(layer) for layer in layers]
        self._end = [_end_arrays(layer) for layer in layers]
        self._first = mx.compile(self._first_fn)
        self._first_product = mx.compile(self._first_product_fn)
        self._traces: dict = {}  # structure -> its compiled function
        self._product_traces: dict = {}  # structure -> the same ending at the next layer's q/k/v product
        self._steps = []  # per layer: its compiled block end (and the next layer's q/k/v)
        self._product_steps = []  # the same ending at the next layer's q/k/v product (`DecodePath.rope_write`)
        for i, layer in enumerate(layers):
            nxt = i + 1 < len(layers)
            key = (_end_key(layer), path.next_norm(i)[1]) + ((_qkv_key(layers[i + 1], path.ropes[i + 1]),)
                                                              if nxt else ())
            fn = self._middle_fn(layer, layers[i + 1], path.ropes[i + 1]) if nxt else self._last_fn(layer)
            if key not in self._traces:
                self._traces[key] = mx.compile(fn)
                if nxt:
                    self._product_traces[key] = mx.compile(self._middle_product_fn(layer, layers[i + 1]))
            self._steps.append(self._traces[key])
            self._product_steps.append(self._product_traces.get(key))

    def _first_fn(self, h, offsets, in_w, *ws):
        path, layer = self.path, self.path.layers[0]
        return path.qkv_rope(_with_qkv(layer, ws), mx.fast.rms_norm(h, in_w, layer.in_eps), offsets, path.ropes[0])

    def _first_product_fn(self, h, in_w, *ws):
        layer = self.path.layers[0]
        return _with_qkv(layer, ws).qkv(mx.fast.rms_norm(h, in_w, layer.in_eps))

    def _middle_product_fn(self, layer, nxt):
        path, num_end = self.path, len(_end_arrays(layer))

        def middle(h, out, next_w, *ws):
            h, y = path.block_end(_with_end(layer, ws[:num_end]), h, out, (next_w, nxt.in_eps))
            return h, _with_qkv(nxt, ws[num_end:]).qkv(y)

        return middle

    def _middle_fn(self, layer, nxt, rope):
        path, num_end = self.path, len(_end_arrays(layer))

        def middle(h, out, offsets, next_w, *ws):
            h, y = path.block_end(_with_end(layer, ws[:num_end]), h, out, (next_w, nxt.in_eps))
            return (h, *path.qkv_rope(_with_qkv(nxt, ws[num_end:]), y, offsets, rope))

        return middle

    def _last_fn(self, layer):
        path = self.path

        def last(h, out, next_w, *ws):
            return path.block_end(_with_end(layer, ws), h, out, (next_w, path.bound.final_norm[1]))[1]

        return last

    @staticmethod
    def unsupported(path: DecodePath) -> Optional[str]:
        """Why traces cannot serve the layers (None: they can): a sparse MLP's experts are modules, not
        a trace's inputs."""
        if any(layer.moe is not None for layer in path.layers):
            return "sparse MLP (its experts' weights are not a trace's inputs)"
        return None

    def forward(self, h: mx.array, offsets: mx.array, view) -> mx.array:
        """h [B, 1, D] (the embedded tokens), offsets [B] -> the final-normed hidden states; `view` as
        `DecodePath.forward`'s."""
        layers, path = self.path.layers, self.path
        last = len(layers) - 1
        if path.rope_into_pool(view):  # the traces end at the q/k/v product; the rope kernel writes the pool
            qkv = self._first_product(h, layers[0].in_w, *self._qkv[0])
            for i, layer in enumerate(layers):
                out = path.attend_written(view, i, path.rope_write(view, i, qkv, offsets))
                next_w = path.next_norm(i)[0]
                if i == last:
                    return self._steps[i](h, out, next_w, *self._end[i])
                h, qkv = self._product_steps[i](h, out, next_w, *self._end[i], *self._qkv[i + 1])
        q, k, v = self._first(h, offsets, layers[0].in_w, *self._qkv[0])
        for i, layer in enumerate(layers):
            out = path.attend(view, i, q, k, v, layer.scale, layer.softcap)  # [B, H, 1, d]
            next_w = path.next_norm(i)[0]
            if i == last:
                return self._steps[i](h, out, next_w, *self._end[i])
            h, q, k, v = self._steps[i](h, out, offsets, next_w, *self._end[i], *self._qkv[i + 1])


def _qkv_arrays(layer: bound.BoundLayer) -> tuple:
    """The arrays of a layer's q/k/v work: the fused projection's, then its q and k head norms' weights."""
    norms = () if layer.q_norm is None else (layer.q_norm[0], layer.k_norm[0])
    return tuple(layer.qkv.arrays()) + norms


def _end_arrays(layer: bound.BoundLayer) -> tuple:
    """The arrays of a layer's block end: the MLP's input norm's, the output norms' (Gemma 2/3), o's,
    gate/up's and down's."""
    norms = tuple(n[0] for n in (layer.attn_out_norm, layer.mlp_out_norm) if n is not None)
    return (layer.post_w,) + norms + tuple(layer.o.arrays() + layer.gate_up.arrays() + layer.down.arrays())


def _qkv_key(layer: bound.BoundLayer, rope: RopeSpec) -> tuple:
    norms = None if layer.q_norm is None else (layer.q_norm[1], layer.k_norm[1])
    return (len(layer.qkv.arrays()), norms, rope.key())


def _end_key(layer: bound.BoundLayer) -> tuple:
    eps = tuple(None if n is None else n[1] for n in (layer.attn_out_norm, layer.mlp_out_norm))
    return (layer.post_eps, eps, layer.spec, layer.up_start,
            tuple(len(p.arrays()) for p in (layer.o, layer.gate_up, layer.down)))


def _with_qkv(layer: bound.BoundLayer, ws: tuple) -> bound.BoundLayer:
    """A copy of `layer` whose q/k/v work reads `ws` (`_qkv_arrays`' order): a trace's inputs."""
    out = copy.copy(layer)
    n = len(layer.qkv.arrays())
    out.qkv = bound.Projection.of(*ws[:n])
    if layer.q_norm is not None:
        out.q_norm, out.k_norm = (ws[n], layer.q_norm[1]), (ws[n + 1], layer.k_norm[1])
    return out


def _with_end(layer: bound.BoundLayer, ws: tuple) -> bound.BoundLayer:
    """A copy of `layer` whose block end reads `ws` (`_end_arrays`' order)."""
    out = copy.copy(layer)
    out.post_w, i = ws[0], 1
    if layer.attn_out_norm is not None:
        out.attn_out_norm, i = (ws[i], layer.attn_out_norm[1]), i + 1
    if layer.mlp_out_norm is not None:
        out.mlp_out_norm, i = (ws[i], layer.mlp_out_norm[1]), i + 1
    for name in ("o", "gate_up", "down"):
        n = len(getattr(layer, name).arrays())
        setattr(out, name, bound.Projection.of(*ws[i:i + n]))
        i += n
    return out
