"""Decode attention read straight from the KV pool (paged attention), on MLX's CUDA backend.

Without it a one-query forward (decode, or a 1-token prompt chunk) gathers, per layer, every row's K
and V out of the pool into a contiguous `[B, H_kv, L_max, D]` copy, then calls MLX's attention with a
`[B, 1, 1, L_max]` mask. On CUDA that mask rules out MLX's fused decode kernel: attention falls back to
a dozen separate operations per layer. With it, per layer and forward: two kernels (one where each
row fits one span, below), reading each row's keys and values where they lie in the pool, through the
rows' block table (the idea of vLLM's PagedAttention, with the split over the sequence of flash-decoding):

1. `partial`: one thread block per (row, KV head, span of `PAGED_PARTIAL_KEYS` keys of the row, within
   one pool block): the softmax statistics (max, sum) and the unnormalised output of the GQA group's
   queries over that span's keys;
2. `combine`: one thread block per (row, query head): the blocks' partials merged into the output;
   where every row of the call fits one span of the first kernel (many rows: long spans), that kernel
   writes the output itself instead (`split_attention.direct`), one launch a layer fewer.

Where the head size allows (engine/model/kernels/split_attention.py `supports`), the first kernel is
the long-span one of that module instead: spans of up to 1024 keys with 16-byte loads and an online
softmax per warp, as many keys per span as still give the device about four blocks per multiprocessor.

The engine's own layer loops (engine/model/layers/decode_path.py, mixed.py, chunk_path.py) call the
kernel explicitly, through their `ForwardView` (engine/model/forward_view.py), for their one-query
forwards; forwards through mlx-lm's modules gather (the runner enables the kernel only where its loops
run the model). `ReferenceAttention` computes the same thing with MLX operations (gather, mask, MLX
attention): the CPU tests run the engine's paged path with it, scripts/bench_decode_attention.py checks
the kernel against it on a GPU, and `self_check` does so on a small case before the runner uses the
kernel (a device or MLX version it fails on falls back to gathering, with a warning).
"""

from __future__ import annotations

import logging
from typing import Optional

import mlx.core as mx

from engine.core.memory.model import PAGED_PARTIAL_KEYS
from engine.model.kernels import mma_attention, split_attention
from engine.model.kernels.constants import device_constant

logger = logging.getLogger(__name__)

_HEADER = """
__device__ __forceinline__ float pa_warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
  return v;
}
__device__ __forceinline__ float pa_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}
// a span with no keys: a zero partial, max -inf and sum 0 (the combine skips it)
template <int NREP, int D, int THREADS>
__device__ __forceinline__ void pa_empty_span(float* part_out, float* stats_out, int tid) {
  for (int i = tid; i < NREP * D; i += THREADS) part_out[i] = 0.0f;
  if (tid < NREP) { stats_out[2 * tid] = -__int_as_float(0x7f800000); stats_out[2 * tid + 1] = 0.0f; }
}
"""

# grid: B * HKV * NP thread blocks of THREADS (NW = THREADS / 32 warps), NP = NB * (BLOCK / CH); block
# g = ((b * HKV) + h) * NP + j covers positions [j * CH, (j + 1) * CH) of row b, which lie in pool block
# table[b, j * CH / BLOCK] (rows slot * HKV + h: the pool is token-major, engine/model/kv_pool.py). Short
# spans of keys give many small blocks: a decode's attention is a few MB per layer, so the kernel's time
# is its longest dependent chain, not bandwidth.
# Lane i of a warp holds dims [i * DPL, (i + 1) * DPL) of the queries, keys and values (lanes past D / DPL
# idle when D < 32 * DPL); warp w takes keys w, w + NW, ... and loads all of their keys and values before
# using any (2 * KPW independent loads in flight per lane).
_PARTIAL = """
  constexpr int DPL = D <= 32 ? 1 : D <= 64 ? 2 : D <= 128 ? 4 : 8;  // D % DPL == 0 for D % 8 == 0
  constexpr int NW = THREADS / 32;
  constexpr int KPW = CH / NW;
  constexpr int SUBS = BLOCK / CH;
  struct alignas(sizeof(T) * DPL) Vec { T v[DPL]; };
  const float NEG_INF = -__int_as_float(0x7f800000);
  __shared__ float ps[NREP][CH];
  __shared__ float red[NW][NREP][D];
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const bool active = lane * DPL < D;
  const int NB = table_shape[1];
  const int NP = NB * SUBS;
  const int g = blockIdx.x;
  const int j = g % NP;
  const int b = g / (NP * HKV);
  const int h = (g / NP) % HKV;
  const int n = min(CH, lengths[b] - j * CH);  // keys in this span (<= 0: none)
  float* part_out = part + (size_t)g * NREP * D;
  float* stats_out = stats + (size_t)g * NREP * 2;
  if (n <= 0) {
    pa_empty_span<NREP, D, THREADS>(part_out, stats_out, tid);
    return;
  }
  const size_t base = (size_t)table[b * NB + j / SUBS] * BLOCK + (size_t)(j % SUBS) * CH;  // the span's first slot
  const float sc = scale[0];
  float qr[NREP][DPL];
  #pragma unroll
  for (int r = 0; r < NREP; ++r) {
    #pragma unroll
    for (int e = 0; e < DPL; ++e) qr[r][e] = 0.0f;
    if (active) {  // scalar loads: q may be a view at any element offset
      const T* qp = q + ((size_t)(b * HKV + h) * NREP + r) * D + lane * DPL;
      #pragma unroll
      for (int e = 0; e < DPL; ++e) qr[r][e] = static_cast<float>(qp[e]) * sc;
    }
  }
  Vec kv[KPW];
  Vec vv[KPW];
  #pragma unroll
  for (int i = 0; i < KPW; ++i) {
    #pragma unroll
    for (int e = 0; e < DPL; ++e) { kv[i].v[e] = static_cast<T>(0.0f); vv[i].v[e] = static_cast<T>(0.0f); }
    const int k = warp + i * NW;
    if (k < n && active) {  // V's loads go out with K's: one memory round trip for the whole block
      kv[i] = *reinterpret_cast<const Vec*>(k_pool + ((base + k) * HKV + h) * D + lane * DPL);
      vv[i] = *reinterpret_cast<const Vec*>(v_pool + ((base + k) * HKV + h) * D + lane * DPL);
    }
  }
  #pragma unroll
  for (int i = 0; i < KPW; ++i) {
    const int k = warp + i * NW;
    if (k < n) {  // uniform over the warp
      float s[NREP];
      #pragma unroll
      for (int r = 0; r < NREP; ++r) {
        s[r] = 0.0f;
        #pragma unroll
        for (int e = 0; e < DPL; ++e) s[r] += qr[r][e] * static_cast<float>(kv[i].v[e]);
      }
      #pragma unroll
      for (int r = 0; r < NREP; ++r) s[r] = pa_warp_sum(s[r]);
      if (lane == 0) {
        #pragma unroll
        for (int r = 0; r < NREP; ++r) ps[r][k] = s[r];
      }
    }
  }
  __syncthreads();
  for (int r = warp; r < NREP; r += NW) {
    float m = NEG_INF;
    for (int k = lane; k < n; k += 32) m = fmaxf(m, ps[r][k]);
    m = pa_warp_max(m);
    float l = 0.0f;
    for (int k = lane; k < n; k += 32) {
      const float p = __expf(ps[r][k] - m);
      ps[r][k] = p;
      l += p;
    }
    l = pa_warp_sum(l);
    if (lane == 0) { stats_out[2 * r] = m; stats_out[2 * r + 1] = l; }
  }
  __syncthreads();
  float acc[NREP][DPL];
  #pragma unroll
  for (int r = 0; r < NREP; ++r) {
    #pragma unroll
    for (int e = 0; e < DPL; ++e) acc[r][e] = 0.0f;
  }
  #pragma unroll
  for (int i = 0; i < KPW; ++i) {
    const int k = warp + i * NW;
    if (k < n) {
      #pragma unroll
      for (int r = 0; r < NREP; ++r) {
        const float p = ps[r][k];
        #pragma unroll
        for (int e = 0; e < DPL; ++e) acc[r][e] += p * static_cast<float>(vv[i].v[e]);
      }
    }
  }
  #pragma unroll
  for (int r = 0; r < NREP; ++r) {
    #pragma unroll
    for (int e = 0; e < DPL; ++e) {
      if (active) red[warp][r][lane * DPL + e] = acc[r][e];
    }
  }
  __syncthreads();
  for (int i = tid; i < NREP * D; i += THREADS) {
    float sum = 0.0f;
    #pragma unroll
    for (int w = 0; w < NW; ++w) sum += red[w][i / D][i % D];
    part_out[i] = sum;
  }
"""

# grid: B * HKV * NREP thread blocks of D threads; block (b, h, r) is query head h * NREP + r of row b.
_COMBINE = """
  const int NB = stats_shape[2];
  const int bq = blockIdx.x;  // (b * HKV + h) * NREP + r
  const int r = bq % NREP;
  const int bh = bq / NREP;   // b * HKV + h
  const int d = threadIdx.x;
  float M = -__int_as_float(0x7f800000);
  for (int j = 0; j < NB; ++j) M = fmaxf(M, stats[((size_t)(bh * NB + j) * NREP + r) * 2]);
  float L = 0.0f, acc = 0.0f;
  for (int j = 0; j < NB; ++j) {
    const size_t i = (size_t)(bh * NB + j) * NREP + r;
    const float l = stats[2 * i + 1];
    if (l > 0.0f) {
      const float w = __expf(stats[2 * i] - M);
      L += l * w;
      acc += part[i * D + d] * w;
    }
  }
  out[(size_t)bq * D + d] = static_cast<T>(acc / L);
"""

_THREADS = 128  # 4 warps, 16 keys each
_CH = PAGED_PARTIAL_KEYS


class PagedAttention:
    """Attention of one query per row over its KV in the pool. `__call__(queries [B, H, 1, D], k_pool,
    v_pool [slots * H_kv, D] (token-major), table [B, NB] int32 (the rows' first NB pool blocks), lengths
    [B] int32 (keys per row, each >= 1: a decode row holds at least its own key; NB = ceil(max(lengths) /
    block_size)), scale) -> [B, H, 1, D]`."""

    # Whether every read of the pool is inside a kernel that takes the queries, so it runs after whatever
    # produced them: a pool written in place by the kernel that makes the queries
    # (decode_path.DecodePath.rope_into_pool) may be read only so. MLX operations reading the pool
    # (ReferenceAttention's gather) have no such order.
    reads_pool_after_queries = False

    def __init__(self, num_kv_heads: int, block_size: int):
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size

    def kind(self, head_dim: int, dtype, num_rep: int) -> str:
        """Which computation a call of this shape runs (ExecutionPaths.attention_kernel)."""
        return "reference"


class ReferenceAttention(PagedAttention):
    """The same computation with MLX operations: gather the rows' KV through the table, mask the
    positions past each row's length, MLX's attention (the CPU tests' stand-in for the kernel, and
    the kernel's oracle)."""

    def __call__(self, queries, k_pool, v_pool, table, lengths, scale: float):
        hkv, bs = self.num_kv_heads, self.block_size
        pos = mx.arange(table.shape[1] * bs)
        slots = table[:, pos // bs] * bs + pos % bs  # [B, L]
        rows = slots[:, None, :] * hkv + mx.arange(hkv)[None, :, None]  # [B, H_kv, L], token-major
        mask = (pos[None] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, L]
        return mx.fast.scaled_dot_product_attention(
            queries, k_pool[rows], v_pool[rows], scale=scale, mask=mask)


class CudaPagedAttention(PagedAttention):
    """The two CUDA kernels (module docstring)."""

    reads_pool_after_queries = True  # the kernels take the queries and read the pool themselves

    def __init__(self, num_kv_heads: int, block_size: int, keys_per_partial: int = _CH, threads: int = _THREADS,
                 spans: bool = True, keys_per_span: Optional[int] = None, span_loads: int = 0,
                 span_threads: int = 0, tiled: bool = True, mma: bool = True):
        """`keys_per_partial` and `threads`: the short-span kernel's; `spans`: where the head size allows,
        the long-span kernel (engine/model/kernels/split_attention.py) with as many keys per span as
        still fill the device (fewer partials than the memory model's PAGED_PARTIAL_KEYS spans count);
        `keys_per_span`, `span_loads`, `span_threads` fix its span, loads in flight and threads (timing
        variants, scripts/bench_decode_attention.py; 0 or None: split_attention's); `tiled`: where
        split_attention.tiled_supports allows, the span kernel that stages its keys through shared
        memory (docs/decode.md); `mma`: where mma_attention.supports allows (bf16, groups of up to 8
        heads, head sizes up to 128), the span kernel on tensor cores instead."""
        super().__init__(num_kv_heads, block_size)
        self.spans, self.keys_per_span, self.tiled, self.mma = spans, keys_per_span, tiled, mma
        self.span_loads = span_loads or split_attention.SPAN_LOADS
        self.span_threads = span_threads or split_attention.SPAN_THREADS
        if block_size % keys_per_partial or keys_per_partial % (threads // 32):
            raise ValueError(f"keys_per_partial={keys_per_partial} must divide block_size={block_size} "
                             f"and be a multiple of threads / 32 = {threads // 32}")
        self.keys_per_partial, self.threads = keys_per_partial, threads
        self._scales: dict[float, mx.array] = {}  # the kernel takes the scale as a [1] array
        self._spans: dict[int, mx.array] = {}  # and the span kernels their keys per span
        self._calls: dict[tuple, tuple] = {}  # a call's shapes -> its kernels' arguments (`_plan`)
        self._partial = mx.fast.cuda_kernel(
            name="pool_attention_partial",
            input_names=["q", "k_pool", "v_pool", "table", "lengths", "scale"],
            output_names=["part", "stats"], source=_PARTIAL, header=_HEADER)
        self._span_partial = mx.fast.cuda_kernel(
            name="pool_attention_span", input_names=["q", "k_pool", "v_pool", "table", "lengths", "scale", "span"],
            output_names=["part", "stats"], source=split_attention.SPAN_PARTIAL, header=_HEADER)
        self._tiled_partial = mx.fast.cuda_kernel(
            name="pool_attention_tiled", input_names=["q", "k_pool", "v_pool", "table", "lengths", "scale", "span"],
            output_names=["part", "stats"], source=split_attention.TILED_PARTIAL,
            header=_HEADER + split_attention.TILED_HEADER)
        self._mma_partial = mx.fast.cuda_kernel(
            name="pool_attention_mma", input_names=["q", "k_pool", "v_pool", "table", "lengths", "scale", "span"],
            output_names=["part", "stats"], source=mma_attention.PARTIAL, header=_HEADER + mma_attention.HEADER)
        self._combine = mx.fast.cuda_kernel(
            name="pool_attention_combine", input_names=["part", "stats"], output_names=["out"],
            source=_COMBINE)
        # The span kernels writing the output where every row fits one span (split_attention.direct)
        span_inputs = ["q", "k_pool", "v_pool", "table", "lengths", "scale", "span"]
        self._direct = {kernel: mx.fast.cuda_kernel(name=f"pool_attention_{name}_direct", input_names=span_inputs,
                                                    output_names=["out"], source=split_attention.direct(source),
                                                    header=header)
                        for kernel, name, source, header in (
                            (self._span_partial, "span", split_attention.SPAN_PARTIAL, _HEADER),
                            (self._tiled_partial, "tiled", split_attention.TILED_PARTIAL,
                             _HEADER + split_attention.TILED_HEADER),
                            (self._mma_partial, "mma", mma_attention.PARTIAL, _HEADER + mma_attention.HEADER))}

    def fixed_span(self, keys: int) -> "CudaPagedAttention":
        """The same kernels with `keys` keys per span of the long-span kernels (the self-check runs each
        span `split_attention.span_keys` picks)."""
        return CudaPagedAttention(self.num_kv_heads, self.block_size, self.keys_per_partial, self.threads,
                                  spans=True, keys_per_span=keys, span_loads=self.span_loads,
                                  span_threads=self.span_threads, tiled=self.tiled, mma=self.mma)

    def kind(self, head_dim: int, dtype, num_rep: int) -> str:
        """The first kernel a call of this shape runs: "mma" (tensor cores), "tiled", "span" or "short"."""
        if not (self.spans and split_attention.supports(head_dim)):
            return "short"
        if self.mma and mma_attention.supports(head_dim, num_rep, dtype == mx.bfloat16):
            return "mma"
        if self.tiled and split_attention.tiled_supports(head_dim, dtype.size, num_rep, self.span_threads):
            return "tiled"
        return "span"

    def __call__(self, queries, k_pool, v_pool, table, lengths, scale: float):
        B, hq, _, d = queries.shape
        key = (B, hq, d, queries.dtype, table.shape[1], scale)
        call = self._calls.get(key)
        if call is None:  # a forward's layers share one: the host builds 32+ of these calls per decode step
            if len(self._calls) >= 4096:  # (batch, blocks) pairs of a long-running server: keep it small
                self._calls.clear()
            call = self._calls[key] = self._plan(B, hq, d, queries.dtype, table.shape[1], scale)
        kernel, extra, template, grid, threads, shapes, combine = call
        if combine is None:  # one span a row: the kernel writes the output (split_attention.direct)
            (out,) = kernel(inputs=[queries, k_pool, v_pool, table, lengths, *extra], template=template, grid=grid,
                            threadgroup=(threads, 1, 1), output_shapes=shapes, output_dtypes=[queries.dtype])
            return out
        part, stats = kernel(
            inputs=[queries, k_pool, v_pool, table, lengths, *extra], template=template,
            grid=grid, threadgroup=(threads, 1, 1), output_shapes=shapes, output_dtypes=[mx.float32, mx.float32])
        (out,) = self._combine(inputs=[part, stats], **combine)
        return out

    def _plan(self, B: int, hq: int, d: int, dtype, num_blocks: int, scale: float) -> tuple:
        """The two kernels' arguments of a call with these shapes: (first kernel, its inputs after the
        lengths, template, grid, threads, output shapes, the combine's arguments but its inputs); where a
        span kernel covers each row in one span, that kernel's direct variant alone (combine None)."""
        if scale not in self._scales:
            self._scales[scale] = device_constant([scale], mx.float32)
        extra = [self._scales[scale]]
        hkv, nrep = self.num_kv_heads, hq // self.num_kv_heads
        kind = self.kind(d, dtype, nrep)
        span, tiled, mma = kind != "short", kind == "tiled", kind == "mma"
        template = [("T", dtype), ("D", d), ("NREP", nrep), ("HKV", hkv), ("BLOCK", self.block_size)]
        if span:  # keys per span an input (split_attention's BLOCK_SETUP says why)
            threads, kernel = self.span_threads, self._tiled_partial if tiled else self._span_partial
            if mma:
                threads, kernel = mma_attention.THREADS, self._mma_partial
            ch = self.keys_per_span or split_attention.span_keys(
                B, hkv, num_blocks * self.block_size, blocks_per_sm=mma_attention.BLOCKS_PER_SM if mma else 4)
            np_ = -(-num_blocks * self.block_size // ch)
            if ch not in self._spans:
                self._spans[ch] = device_constant([ch], mx.int32)
            extra.append(self._spans[ch])
            template += [("THREADS", threads)] + ([] if tiled or mma else [("U", self.span_loads)])
        else:
            ch, threads, kernel = self.keys_per_partial, self.threads, self._partial
            np_ = num_blocks * (self.block_size // ch)
            template += [("CH", ch), ("THREADS", threads)]
        grid = (B * hkv * np_ * threads, 1, 1)
        if span and np_ == 1:
            return self._direct[kernel], extra, template, grid, threads, [(B, hq, 1, d)], None
        combine = dict(template=[("T", dtype), ("D", d), ("NREP", nrep)], grid=(B * hq * d, 1, 1),
                       threadgroup=(d, 1, 1), output_shapes=[(B, hq, 1, d)], output_dtypes=[dtype])
        return (kernel, extra, template, grid, threads,
                [(B, hkv, np_, nrep, d), (B, hkv, np_, nrep, 2)], combine)


def self_check(impl: PagedAttention, num_heads: int, head_dim: int, dtype) -> None:
    """Run `impl` on two cases of this model's attention shape against `ReferenceAttention` and raise if
    it fails or disagrees: two short rows (one across a block boundary, blocks out of order), and two
    rows of several blocks out of order (the long-span kernel at every span `split_attention.span_keys`
    picks too: with 256-token blocks the 512- and 1024-key spans put each of the first case's rows in one
    span, the direct variant). The runner calls it before using the kernel, so a GPU or MLX version it
    does not work on falls back to gathering instead of failing every decode. It also compiles the
    kernels (at their first call: NVRTC, seconds each) before the engine serves."""
    bs = impl.block_size
    spans = isinstance(impl, CudaPagedAttention) and impl.spans
    impls = [impl] + ([impl.fixed_span(keys) for keys in split_attention.SPAN_CHOICES] if spans else [])
    cases = (([bs + 3, 5], [[2, 0], [1, 0]], 3), ([4 * bs + 7, 2 * bs - 1], [[5, 1, 3, 0, 2], [4, 2, 0, 0, 0]], 6))
    for kernel in impls:
        for lengths, table, num_blocks in cases:
            _check_case(kernel, num_heads, head_dim, dtype, lengths, table, num_blocks)


def first_passing(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype, tiled: bool = True,
                  mma: bool = True) -> tuple[Optional["CudaPagedAttention"], Optional[str]]:
    """The first of the tensor-core, tiled and span kernels (as `mma` and `tiled` allow) that serves this
    shape and passes `self_check` here: (it, None); else (None, why the last one failed), each failure
    logged. A variant that runs the same kernel as one tried before (mma or tiled not for this shape) is
    not checked again."""
    why_not, tried = None, set()
    for m, t in ((mma, tiled), (False, tiled), (False, False)):
        kind = f"mma={m}, tiled={t}"
        try:
            kernel = CudaPagedAttention(num_kv_heads, block_size, tiled=t, mma=m)
            kind = kernel.kind(head_dim, dtype, num_heads // num_kv_heads)
            if kind in tried:
                continue
            tried.add(kind)
            self_check(kernel, num_heads, head_dim, dtype)
            return kernel, None
        except Exception as exc:  # noqa: BLE001 - any failure means: do without it
            why_not = f"{type(exc).__name__}: {exc}"
            logger.warning("paged decode attention (%s kernel) failed its self-check: %s", kind, why_not)
    return None, why_not


def _check_case(impl: PagedAttention, num_heads: int, head_dim: int, dtype, lengths: list, table: list,
                num_blocks: int) -> None:
    hkv, bs = impl.num_kv_heads, impl.block_size
    slots = num_blocks * bs
    k_pool = mx.random.normal((slots * hkv, head_dim), key=mx.random.key(1)).astype(dtype)
    v_pool = mx.random.normal((slots * hkv, head_dim), key=mx.random.key(2)).astype(dtype)
    queries = mx.random.normal((len(lengths), num_heads, 1, head_dim), key=mx.random.key(3)).astype(dtype)
    table, lens = mx.array(table, mx.int32), mx.array(lengths, mx.int32)
    scale = head_dim ** -0.5
    got = impl(queries, k_pool, v_pool, table, lens, scale).astype(mx.float32)
    want = ReferenceAttention(hkv, bs)(queries, k_pool, v_pool, table, lens, scale).astype(mx.float32)
    err = mx.abs(got - want).max().item()
    tolerance = 1e-3 if dtype == mx.float32 else 5e-2
    if not err <= tolerance:  # NaN fails too
        raise RuntimeError(f"paged attention kernel differs from the reference by {err} (> {tolerance}) "
                           f"on rows of {lengths} keys")


def unsupported(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype) -> Optional[str]:
    """Why the kernel cannot serve this attention shape (None: it can)."""
    if num_heads % num_kv_heads:
        return f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    if head_dim % 8 or head_dim > 256:
        return f"head_dim {head_dim} is not a multiple of 8 up to 256"
    if block_size % _CH:
        return f"block_size {block_size} is not a multiple of {_CH}"
    if (num_heads // num_kv_heads) * (_CH + (_THREADS // 32) * head_dim) * 4 > 40_000:
        return "the kernel's shared memory would exceed 40 kB"
    if dtype not in (mx.bfloat16, mx.float16, mx.float32):
        return f"dtype {dtype} is not a float type"
    return None

