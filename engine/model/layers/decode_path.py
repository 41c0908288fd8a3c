"""The decode forward of llama-shaped models with fewer operations: the engine's own layer loop.

mlx-lm's layer, with the engine's fused projections and paged attention, runs per decode layer on MLX's
CUDA backend: RMSNorm, qkv matmul, RoPE (q), RoPE (k), copies of the strided q/k/v slices, 2 KV
scatters, 2 attention kernels, o matmul, add, RMSNorm, gate-up matmul, SwiGLU, down matmul, add; and
builds some 44 MLX operations in Python. With its CUDA kernels (`CudaOps`), this loop computes the same
thing with 12 kernels and 31 operations per layer:

- `rope_qkv`: one kernel takes the fused q/k/v product and writes q and k rotated (RoPE, MLX's
  formula) and v, each contiguous, in the layout the pool's scatter and the paged kernel read;
- `add_rms_norm`: one kernel adds a block's residual and normalizes the sum for what follows (the
  post-attention norm, the next layer's input norm, or the final norm), returning both: two kernels
  of mlx-lm's block become one, twice per layer.

Only decode forwards (one token per row) of models whose layers are mlx-lm's llama `TransformerBlock`
(llama, and the families that reuse it) with fused projections (engine/model/layers/fused.py) take it (`unsupported`
says why not); everything else runs mlx-lm's modules. A paged forward attends in the pool in place; a
gathering one (the CPU) attends over the rows' gathered KV with `ReferenceOps.attention` (on the CPU
engine/model/layers/cpu_math.py's). Every projection's weight
is bound once (engine/model/layers/bound.py). `ReferenceOps` computes the two steps with MLX operations exactly as
mlx-lm does: that is the engine's default decode on CUDA (`EngineConfig.layer_loops`), which builds an 8B
decode's graph in less host time than mlx-lm's modules (docs/benchmarks.md, session 8), and less again
with each layer's operations built from a compiled trace (`CompiledLayers`, `EngineConfig.compiled_decode`,
session 9); the CPU tests run this loop with it too, and `self_check` compares the CUDA kernels to it
before the runner uses them.

Measured on an H200 (docs/benchmarks.md, session 5): operations per 8B decode step 1412 -> 996, but
no consistent change of the step time (-8 % to +12 % by batch and run) and 5-7 % more serving tok/s
in one run of two; Nsight Compute shows the step bound by its kernels' GPU time, of which these two
kernels are not yet cheaper than MLX's own. So the kernels are off by default (`EngineConfig.decode_kernels`).
"""

from __future__ import annotations

import logging
import math
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu

from engine.model.layers import bound, cpu_math

logger = logging.getLogger(__name__)

_ROPE_QKV = """
  // grid: B * (H + 2 * HKV) blocks of D / 2 threads; block g = b * (H + 2 HKV) + head.
  constexpr int NH = H + 2 * HKV;
  constexpr int HALF = D / 2;
  const int g = blockIdx.x;
  const int b = g / NH;
  const int head = g % NH;
  const int i = threadIdx.x;
  const T* in = qkv + (size_t)g * D;
  if (head >= H + HKV) {
    T* o = v + ((size_t)b * HKV + (head - H - HKV)) * D;
    o[i] = in[i];
    o[i + HALF] = in[i + HALF];
    return;
  }
  T* o = head < H ? q + ((size_t)b * H + head) * D : k + ((size_t)b * HKV + (head - H)) * D;
  float inv_freq;
  if (FREQS) {
    inv_freq = 1.0 / freqs[i];
  } else {
    float d = static_cast<float>(i) / static_cast<float>(HALF);
    inv_freq = exp2(-d * params[1]);
  }
  float L = params[0] * static_cast<float>(offsets[b]);
  float theta = L * inv_freq;
  float c = cos(theta);
  float s = sin(theta);
  float x1 = static_cast<float>(in[i]);
  float x2 = static_cast<float>(in[i + HALF]);
  o[i] = static_cast<T>(x1 * c - x2 * s);
  o[i + HALF] = static_cast<T>(x1 * s + x2 * c);
"""

_ADD_RMS_NORM = """
  // grid: one block of THREADS per row; h = x + r (rounded to T, as MLX's add), y = rms_norm(h) * w.
  // Each thread keeps its D / THREADS sums in registers (independent loads, one pass over h).
  constexpr int PER = D / THREADS;
  __shared__ float partial[32];
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const size_t base = (size_t)row * D;
  float hv[PER];
  float ss = 0.0f;
  #pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int i = tid + j * THREADS;
    T hb = static_cast<T>(static_cast<float>(x[base + i]) + static_cast<float>(r[base + i]));
    h[base + i] = hb;
    hv[j] = static_cast<float>(hb);
    ss += hv[j] * hv[j];
  }
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
  if (tid % 32 == 0) partial[tid / 32] = ss;
  __syncthreads();
  if (tid < 32) {
    float t = tid < THREADS / 32 ? partial[tid] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffff, t, o);
    if (tid == 0) partial[0] = t;
  }
  __syncthreads();
  const float inv = rsqrt(partial[0] / D + eps[0]);
  #pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int i = tid + j * THREADS;
    T normed = static_cast<T>(hv[j] * inv);
    y[base + i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
  }
"""


def norm_threads(hidden: int) -> Optional[int]:
    """Threads per row of `add_rms_norm` for this hidden size: the most of 256/128/64/32 that divides
    it with at most 64 values per thread (None: the kernel does not take it)."""
    for threads in (256, 128, 64, 32):
        if hidden % threads == 0 and hidden // threads <= 64:
            return threads
    return None


class RopeSpec:
    """What the rotation of one model needs (mlx-lm's nn.RoPE or Llama3RoPE, full, not traditional)."""

    def __init__(self, rope: nn.Module, head_dim: int):
        self.module = rope
        self.freqs: Optional[mx.array] = getattr(rope, "_freqs", None)
        self.scale = float(getattr(rope, "scale", 1.0)) if self.freqs is None else 1.0
        base = getattr(rope, "base", None)  # MLX keeps it as a float32 and takes log2 of that on the host
        self.log2_base = float(np.float32(math.log2(np.float32(base)))) if base is not None else 0.0
        self.head_dim = head_dim


class ReferenceOps:
    """The two steps with MLX operations, exactly mlx-lm's (CPU, and the kernels' oracle); and the
    layer loops' attention (of a gathered forward) and SwiGLU: MLX's and mlx-lm's, or with
    `cpu_math` engine/model/layers/cpu_math.py's (MLX's CPU backend: the same formulas with exp as a power)."""

    def __init__(self, cpu_math: bool = False):
        self.cpu_math = cpu_math

    def attention(self, queries, keys, values, scale: float, mask=None) -> mx.array:
        if self.cpu_math:
            return cpu_math.attention(queries, keys, values, scale, mask)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)

    def swiglu(self, gate: mx.array, up: mx.array) -> mx.array:
        return cpu_math.swiglu(gate, up) if self.cpu_math else swiglu(gate, up)

    def attend(self, view, i: int, q: mx.array, scale: float) -> mx.array:
        """Layer i's attention of `q` [B, H, Tq, d] over the KV `view` holds (its new keys written):
        in the pool in place where the view is paged, else over what it reads (a view of one row, or
        the rows' gathered KV) with `attention`, causal for several queries, else masked to each row's
        length (`view.mask`, None for one row)."""
        out = view.attend(i, q, scale)
        if out is None:
            keys, values = view.read(i)
            out = self.attention(q, keys, values, scale, "causal" if q.shape[2] > 1 else view.mask)
        return out

    def rope_qkv(self, qkv: mx.array, offsets: mx.array, rope: RopeSpec, heads: int, kv_heads: int):
        """qkv [B, 1, (H + 2 H_kv) d] -> q [B, H, 1, d], k and v [B, H_kv, 1, d] (q, k rotated)."""
        B, d = qkv.shape[0], rope.head_dim
        q, k, v = mx.split(qkv, [heads * d, (heads + kv_heads) * d], axis=-1)
        q = q.reshape(B, 1, heads, d).transpose(0, 2, 1, 3)
        k = k.reshape(B, 1, kv_heads, d).transpose(0, 2, 1, 3)
        v = v.reshape(B, 1, kv_heads, d).transpose(0, 2, 1, 3)
        return rope.module(q, offset=offsets), rope.module(k, offset=offsets), v

    def add_rms_norm(self, x: mx.array, r: mx.array, weight: mx.array, eps: float):
        h = x + r
        return h, mx.fast.rms_norm(h, weight, eps)


class CudaOps(ReferenceOps):
    """The two CUDA kernels (module docstring)."""

    def __init__(self):
        super().__init__()
        self._rope = mx.fast.cuda_kernel(
            name="rope_qkv", input_names=["qkv", "offsets", "params", "freqs"], output_names=["q", "k", "v"],
            source=_ROPE_QKV)
        self._norm = mx.fast.cuda_kernel(
            name="add_rms_norm", input_names=["x", "r", "w", "eps"], output_names=["h", "y"],
            source=_ADD_RMS_NORM)
        self._arrays: dict = {}  # per model: the rotation's [scale, log2 base] and eps as arrays

    def _const(self, key, values) -> mx.array:
        if key not in self._arrays:
            self._arrays[key] = mx.array(values, mx.float32)
        return self._arrays[key]

    def rope_qkv(self, qkv, offsets, rope, heads, kv_heads):
        B, d = qkv.shape[0], rope.head_dim
        params = self._const(("rope", rope.scale, rope.log2_base), [rope.scale, rope.log2_base])
        freqs = rope.freqs if rope.freqs is not None else params
        template = [("T", qkv.dtype), ("D", d), ("H", heads), ("HKV", kv_heads), ("FREQS", rope.freqs is not None)]
        return self._rope(
            inputs=[qkv, offsets, params, freqs], template=template,
            grid=(B * (heads + 2 * kv_heads) * (d // 2), 1, 1), threadgroup=(d // 2, 1, 1),
            output_shapes=[(B, heads, 1, d), (B, kv_heads, 1, d), (B, kv_heads, 1, d)],
            output_dtypes=[qkv.dtype] * 3)

    def add_rms_norm(self, x, r, weight, eps):
        hidden = x.shape[-1]
        rows, threads = x.size // hidden, norm_threads(hidden)
        h, y = self._norm(
            inputs=[x, r, weight, self._const(("eps", eps), [eps])],
            template=[("T", x.dtype), ("D", hidden), ("THREADS", threads)],
            grid=(rows * threads, 1, 1), threadgroup=(threads, 1, 1),
            output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype])
        return h, y


def unsupported(model: nn.Module, kernels: bool = True) -> Optional[str]:
    """Why this loop cannot run `model`'s decode (None: it can); `kernels`: with the CUDA kernels, which
    take only full, non-traditional RoPE and some hidden sizes (`ReferenceOps` takes any of mlx-lm's
    RoPE and RMSNorm)."""
    why = bound.unsupported(model)
    if why is not None:
        return why
    backbone = model.model
    for layer in backbone.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if "qkv_proj" not in attn or "gate_up_proj" not in mlp:
            return "projections not fused (engine/model/layers/fused.py)"
        rope = attn.rope
        if type(rope).__name__ not in ("RoPE", "Llama3RoPE") or (kernels and rope.traditional):
            return f"rotary embedding {type(rope).__name__} (traditional={getattr(rope, 'traditional', None)})"
        head_dim = attn.o_proj.weight.shape[1] // attn.n_heads
        if kernels and (rope.dims != head_dim or head_dim % 2 or head_dim > 2048):
            return f"partial rotary embedding ({rope.dims} of {head_dim} dims)"
    if kernels and norm_threads(backbone.norm.weight.shape[0]) is None:
        return f"hidden size {backbone.norm.weight.shape[0]} is not a multiple of 32 up to 16384"
    return None


class DecodePath:
    """The decode forward of a supported model (module docstring) with `ops`' two steps."""

    def __init__(self, model: nn.Module, ops: ReferenceOps, compiled: bool = False):
        """`compiled`: with `ReferenceOps`, the layers' work around the KV write and attention runs as
        compiled functions (`CompiledLayers`) where one trace serves every layer (else, logged, not)."""
        why = unsupported(model, kernels=isinstance(ops, CudaOps))
        if why is not None:
            raise ValueError(f"decode path: {why}")
        self.backbone = model.model
        self.ops = ops
        attn = self.backbone.layers[0].self_attn
        self.heads, self.kv_heads = attn.n_heads, attn.n_kv_heads
        self.head_dim = attn.o_proj.weight.shape[1] // attn.n_heads
        self.ropes = [RopeSpec(layer.self_attn.rope, self.head_dim) for layer in self.backbone.layers]
        self.layers = bound.bind_layers(self.backbone.layers)
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
        offsets = view.offset if isinstance(view.offset, mx.array) else mx.array([view.offset])
        offsets = offsets.astype(mx.int32)
        h = self.backbone.embed_tokens(tokens)  # [B, 1, D]
        if self.compiled is not None:
            return self.compiled.forward(h, offsets, view)
        first = self.layers[0]
        y = mx.fast.rms_norm(h, first.in_w, first.in_eps)
        for i, layer in enumerate(self.layers):
            q, k, v = self.ops.rope_qkv(layer.qkv(y), offsets, self.ropes[i], self.heads, self.kv_heads)
            out = self.attend(view, i, q, k, v, layer.scale)
            h, y = self.block_end(h, out, layer.o, layer.post_w, layer.post_eps, layer.gate_up, layer.down,
                                  layer.up_start, *self.next_norm(i))
        return y

    def attend(self, view, i: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Write layer i's new keys and values, then attend (`ReferenceOps.attend`) -> [B, H, 1, d]."""
        view.write(i, k, v)
        return self.ops.attend(view, i, q, scale)

    def block_end(self, h, out, o, post_w, post_eps, gate_up, down, up_start: int, next_w, next_eps):
        """A layer after its attention (out [B, H, 1, d]): o, the residual add and the post-attention
        norm, the MLP, the add and the next norm -> (h, the next norm's output). The projections are
        callables (bound, or their arrays in a compiled trace)."""
        B = h.shape[0]
        h, y = self.ops.add_rms_norm(h, o(out.reshape(B, 1, self.heads * self.head_dim)), post_w, post_eps)
        return self.ops.add_rms_norm(h, swiglu_mlp(y, gate_up, down, up_start, self.ops.swiglu), next_w, next_eps)

    def mlp(self, layer: bound.BoundLayer, y: mx.array) -> mx.array:
        """The MLP from its fused gate/up product, as engine/model/layers/fused.py's parts compute it."""
        return swiglu_mlp(y, layer.gate_up, layer.down, layer.up_start, self.ops.swiglu)

    def next_norm(self, i: int) -> tuple:
        """(weight, eps) of the norm after layer i's block: the next layer's input norm, or the final."""
        if i + 1 < len(self.layers):
            return self.layers[i + 1].in_w, self.layers[i + 1].in_eps
        return self.backbone.norm.weight, self.backbone.norm.eps


def swiglu_mlp(y: mx.array, gate_up, down, up_start: int, act=swiglu) -> mx.array:
    """down(act(gate, up)) from the fused gate/up product (columns [0, up_start) gate, the rest up);
    `act` a SwiGLU (mlx-lm's, or `ReferenceOps.swiglu`)."""
    product = gate_up(y)
    return down(act(product[..., :up_start], product[..., up_start:]))


class CompiledLayers:
    """A decode forward's layers as three compiled functions: MLX's counterpart of the CUDA graphs vLLM
    captures for decode. `mx.compile` traces each once per batch size, then builds its operations from
    the trace in C++ with no Python per operation. Per layer the host makes one call for everything
    between the layer's attention and the next layer's KV write (`DecodePath.block_end`, then the next
    layer's q/k/v and `ReferenceOps.rope_qkv`: the same functions the Python loop calls), where
    `DecodePath.forward` builds some 25 operations in Python. The KV write and the paged attention stay
    outside: a compiled write would return a new pool array instead of writing the pool in place (and
    the attention's traces would be per batch size and block count). The weights are the functions'
    inputs, so one trace serves every layer (`unsupported`: one RoPE, one epsilon, one bias structure).

    Measured on H200 hosts (8B, bf16; docs/benchmarks.md, session 9): a B = 8 decode's graph builds in
    2.05 instead of 2.54 ms (1.31 instead of 1.58 ms on another host), and in the bare step loop at 8
    streams a decode step took 8.5, 11.8 and 9.2 ms against 10.5, 12.8 and 11.6 ms built in Python."""

    def __init__(self, path: DecodePath):
        self.path = path
        layers = path.layers
        rope, eps, up_start = path.ropes[0], layers[0].in_eps, layers[0].up_start
        counts = [len(p.arrays()) for p in (layers[0].o, layers[0].gate_up, layers[0].down)]
        ends = [sum(counts[:j + 1]) for j in range(3)]  # where o's, gate/up's and down's arrays end

        def projection(ws):  # a projection of its bound arrays (W^T, and the bias if any)
            return lambda x: bound.project(x, *ws)

        def qkv_rope(y, offsets, ws):
            return path.ops.rope_qkv(bound.project(y, *ws), offsets, rope, path.heads, path.kv_heads)

        def block_end(h, out, post_w, next_w, ws):
            return path.block_end(h, out, projection(ws[:ends[0]]), post_w, eps, projection(ws[ends[0]:ends[1]]),
                                  projection(ws[ends[1]:ends[2]]), up_start, next_w, eps)

        def first(h, offsets, in_w, *ws):
            return qkv_rope(mx.fast.rms_norm(h, in_w, eps), offsets, ws)

        def middle(h, out, offsets, post_w, next_w, *ws):
            h, y = block_end(h, out, post_w, next_w, ws[:ends[2]])
            return (h, *qkv_rope(y, offsets, ws[ends[2]:]))

        def last(h, out, post_w, next_w, *ws):
            return block_end(h, out, post_w, next_w, ws)[1]

        self._first, self._middle, self._last = mx.compile(first), mx.compile(middle), mx.compile(last)
        self._qkv = [tuple(layer.qkv.arrays()) for layer in layers]
        self._end = [(layer.post_w, path.next_norm(i)[0], *layer.o.arrays(), *layer.gate_up.arrays(),
                      *layer.down.arrays()) for i, layer in enumerate(layers)]

    @staticmethod
    def unsupported(path: DecodePath) -> Optional[str]:
        """Why one trace cannot serve every layer (None: it can): the trace holds one RoPE, one epsilon
        and one projection structure (with or without biases)."""
        layers = path.layers
        ropes = {(type(r.module), r.module.dims, r.module.traditional, r.scale, r.log2_base) for r in path.ropes}
        first_freqs = path.ropes[0].freqs
        if len(ropes) != 1 or any(r.freqs is not None and not mx.array_equal(r.freqs, first_freqs).item()
                                  for r in path.ropes):
            return "the layers' rotary embeddings differ"
        eps = {path.backbone.norm.eps} | {x for layer in layers for x in (layer.in_eps, layer.post_eps)}
        if len(eps) != 1:
            return "the norms' epsilons differ"
        if len({tuple(len(p.arrays()) for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
                for layer in layers}) != 1:
            return "the layers' projections differ in their biases"
        return None

    def forward(self, h: mx.array, offsets: mx.array, view) -> mx.array:
        """h [B, 1, D] (the embedded tokens), offsets [B] -> the final-normed hidden states; `view` as
        `DecodePath.forward`'s."""
        layers = self.path.layers
        q, k, v = self._first(h, offsets, layers[0].in_w, *self._qkv[0])
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            out = self.path.attend(view, i, q, k, v, layer.scale)  # [B, H, 1, d]
            if i == last:
                return self._last(h, out, *self._end[i])
            h, q, k, v = self._middle(h, out, offsets, *self._end[i], *self._qkv[i + 1])


def self_check(ops: ReferenceOps, model: nn.Module, dtype) -> None:
    """Run `ops`' kernels on a small case of this model's shapes against `ReferenceOps`; raise if they
    fail or disagree (the runner then keeps mlx-lm's modules)."""
    path = DecodePath(model, ReferenceOps())
    ref = path.ops
    heads, kv_heads, d = path.heads, path.kv_heads, path.head_dim
    qkv = mx.random.normal((3, 1, (heads + 2 * kv_heads) * d), key=mx.random.key(4)).astype(dtype)
    offsets = mx.array([0, 257, 70000], mx.int32)
    tolerance = 1e-4 if dtype == mx.float32 else 3e-2
    for rope in (path.ropes[0], path.ropes[-1]):
        got = ops.rope_qkv(qkv, offsets, rope, heads, kv_heads)
        want = ref.rope_qkv(qkv, offsets, rope, heads, kv_heads)
        for name, g, w in zip("qkv", got, want):
            err = mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max().item()
            if g.shape != w.shape or not err <= tolerance * max(1.0, mx.abs(w).max().item()):
                raise RuntimeError(f"rope_qkv: {name} differs from mx.fast.rope by {err}")
    D = path.backbone.norm.weight.shape[0]
    x = mx.random.normal((3, 1, D), key=mx.random.key(5)).astype(dtype)
    r = mx.random.normal((3, 1, D), key=mx.random.key(6)).astype(dtype)
    w = path.backbone.norm.weight
    for g, want in zip(ops.add_rms_norm(x, r, w, 1e-5), ref.add_rms_norm(x, r, w, 1e-5)):
        err = mx.abs(g.astype(mx.float32) - want.astype(mx.float32)).max().item()
        if not err <= tolerance * max(1.0, mx.abs(want).max().item()):
            raise RuntimeError(f"add_rms_norm differs from MLX's add and rms_norm by {err}")
