"""The paged decode attention's first kernel, over long spans of keys with an online softmax.

`CudaPagedAttention` (engine/model/kernels/paged_attention.py) runs one thread block per (row, KV head,
span of keys) and merges the spans' partials in a second kernel. Its first kernel, `SPAN_PARTIAL`
here, takes a span of `CH` keys (hundreds: a decode row's whole context in a few blocks) and gives
each warp's lanes 16-byte loads: `LPK = D / 8` lanes hold one key's row (8 elements each), so a warp
reads `32 / LPK` keys per load, several loads in flight, and keeps a running softmax (max, sum,
weighted values) per query head of the GQA group, as flash-decoding does. The warps' states merge in
shared memory into the span's partial (unnormalised output, max, sum): the same contract as the
short-span kernel, so the same `combine` kernel finishes both. Head sizes whose `D / 8` does not
divide 32 use the short-span kernel (`supports`).
"""

from __future__ import annotations

# Every span kernel (these two and mma_attention's): block g's row b, KV head h and span j, its keys n
# (none: an empty partial); _QUERY_SETUP: the lanes' parts of the queries (scaled) with the running max,
# sum and accumulator per query head.
# The keys per span, CH, are an input, not a template argument: each template instance is a compile
# (NVRTC, 1.6-3.1 s each on an H200) that MLX keeps for the process only, and CH varies with the batch.
BLOCK_SETUP = """
  const int CH = span[0];
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int NB = table_shape[1];
  const int NS = (NB * BLOCK + CH - 1) / CH;
  const int g = blockIdx.x;
  const int j = g % NS;
  const int b = g / (NS * HKV);
  const int h = (g / NS) % HKV;
  const int n = min(CH, lengths[b] - j * CH);
  float* part_out = part + (size_t)g * NREP * D;
  float* stats_out = stats + (size_t)g * NREP * 2;
  if (n <= 0) {
    pa_empty_span<NREP, D, THREADS>(part_out, stats_out, tid);  // engine/model/kernels/paged_attention.py's header
    return;
  }
"""

# the span kernels' lanes: lane = sub * LPK + dl holds dims [dl * VEC, dl * VEC + VEC) of one key of its group
LANE_SPLIT = """
  const int sub = lane / LPK;
  const int dl = lane % LPK;
"""

_QUERY_SETUP = """
  float qr[NREP][VEC];
  #pragma unroll
  for (int r = 0; r < NREP; ++r) {
    const T* qp = q + ((size_t)(b * HKV + h) * NREP + r) * D + dl * VEC;
    #pragma unroll
    for (int e = 0; e < VEC; ++e) qr[r][e] = static_cast<float>(qp[e]) * sc;
  }
  float m[NREP], l[NREP], acc[NREP][VEC];
  #pragma unroll
  for (int r = 0; r < NREP; ++r) {
    m[r] = NEG_INF; l[r] = 0.0f;
    #pragma unroll
    for (int e = 0; e < VEC; ++e) acc[r][e] = 0.0f;
  }
"""

def _key_update(k: str, v: str, guarded: bool) -> str:
    """Both span kernels' step for one key per lane group: the GQA group's scores against the key `k`
    (a register vector; `guarded`: none where `valid` is false, for registers a load may have skipped),
    summed over the key's lanes, then the online softmax's update of the running max, sum and
    accumulator with the values `v` (valid keys only)."""
    dot = "#pragma unroll\n{i}for (int e = 0; e < VEC; ++e) s[r] += qr[r][e] * static_cast<float>(" + k + ".v[e]);"
    score = ("        if (valid) {\n          " + dot.format(i="          ") + "\n        }\n" if guarded
             else "        " + dot.format(i="        ") + "\n")
    return f"""      float s[NREP];
      #pragma unroll
      for (int r = 0; r < NREP; ++r) {{
        s[r] = 0.0f;
{score}      }}
      #pragma unroll
      for (int r = 0; r < NREP; ++r) {{
        #pragma unroll
        for (int o = LPK / 2; o > 0; o >>= 1) s[r] += __shfl_xor_sync(0xffffffff, s[r], o);
      }}
      if (valid) {{
        #pragma unroll
        for (int r = 0; r < NREP; ++r) {{
          const float mn = fmaxf(m[r], s[r]);
          const float c = __expf(m[r] - mn);
          const float pr = __expf(s[r] - mn);
          l[r] = l[r] * c + pr;
          #pragma unroll
          for (int e = 0; e < VEC; ++e) acc[r][e] = acc[r][e] * c + pr * static_cast<float>({v}.v[e]);
          m[r] = mn;
        }}
      }}
"""


# Block g = ((b * HKV) + h) * NS + j covers positions [j * CH, (j + 1) * CH) of row b (each key's pool
# block looked up in the row's table); lane = sub * LPK + dl holds dims [dl * 8, dl * 8 + 8) of keys
# warp * KPI + sub + i * NW * KPI, U of them loaded before any is used.
SPAN_PARTIAL = """
  constexpr int VEC = 8;
  constexpr int LPK = D / VEC;
  constexpr int KPI = 32 / LPK;
  constexpr int NW = THREADS / 32;
  constexpr int STRIDE = NW * KPI;
  struct alignas(16) Vec { T v[VEC]; };
  const float NEG_INF = -__int_as_float(0x7f800000);
  __shared__ float sm_m[NW][NREP];
  __shared__ float sm_l[NW][NREP];
  __shared__ float sm_acc[NW][NREP][D];
""" + BLOCK_SETUP + LANE_SPLIT + """  const int* row_table = table + (size_t)b * NB;
  const float sc = scale[0];
""" + _QUERY_SETUP + """  for (int w0 = warp * KPI; w0 < n; w0 += STRIDE * U) {  // uniform over the warp: its shuffles need every lane
    Vec kv[U], vv[U];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = w0 + sub + u * STRIDE;
      if (k < n) {
        const int p = j * CH + k;
        const size_t row = ((size_t)row_table[p / BLOCK] * BLOCK + p % BLOCK) * HKV + h;  // token-major
        kv[u] = *reinterpret_cast<const Vec*>(k_pool + row * D + dl * VEC);
        vv[u] = *reinterpret_cast<const Vec*>(v_pool + row * D + dl * VEC);
      }
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool valid = w0 + sub + u * STRIDE < n;
""" + _key_update("kv[u]", "vv[u]", guarded=True) + """    }
  }
  // the warp's KPI key groups into one state (lanes of the same dims), then the warps in shared memory
  #pragma unroll
  for (int o = LPK; o < 32; o <<= 1) {
    #pragma unroll
    for (int r = 0; r < NREP; ++r) {
      const float mo = __shfl_xor_sync(0xffffffff, m[r], o);
      const float lo = __shfl_xor_sync(0xffffffff, l[r], o);
      const float mn = fmaxf(m[r], mo);
      const float cs = m[r] == NEG_INF ? 0.0f : __expf(m[r] - mn);
      const float co = mo == NEG_INF ? 0.0f : __expf(mo - mn);
      l[r] = l[r] * cs + lo * co;
      #pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float ao = __shfl_xor_sync(0xffffffff, acc[r][e], o);
        acc[r][e] = acc[r][e] * cs + ao * co;
      }
      m[r] = mn;
    }
  }
  if (sub == 0) {
    #pragma unroll
    for (int r = 0; r < NREP; ++r) {
      if (dl == 0) { sm_m[warp][r] = m[r]; sm_l[warp][r] = l[r]; }
      #pragma unroll
      for (int e = 0; e < VEC; ++e) sm_acc[warp][r][dl * VEC + e] = acc[r][e];
    }
  }
  __syncthreads();
  for (int i = tid; i < NREP * D; i += THREADS) {
    const int r = i / D;
    float M = NEG_INF;
    #pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w][r]);
    float L = 0.0f, A = 0.0f;
    #pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float c = sm_m[w][r] == NEG_INF ? 0.0f : __expf(sm_m[w][r] - M);
      L += sm_l[w][r] * c;
      A += sm_acc[w][r][i % D] * c;
    }
    part_out[i] = A;
    if (i % D == 0) { stats_out[2 * r] = M; stats_out[2 * r + 1] = L; }
  }
"""

# The same span's keys staged through shared memory: the block copies tiles of TK keys (K and V,
# 16 bytes per copy, cp.async) into two buffers, the next tile's copies in flight while the warps
# compute on the current one from shared memory (no key rows held in registers: more blocks fit).
TILED_HEADER = """
__device__ __forceinline__ unsigned pa_smem(const void* p) {
  unsigned long long a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return static_cast<unsigned>(a);
}
template <typename T, int D, int TK, int THREADS, int BLOCK, int HKV>
__device__ __forceinline__ void pa_load_tile(T* sk, T* sv, const T* k_pool, const T* v_pool, const int* row_table,
                                             int h, int first, int n, int tid) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int LPK = D / VEC;
  constexpr int CHUNKS = TK * LPK;
  for (int c = tid; c < 2 * CHUNKS; c += THREADS) {
    const int which = c / CHUNKS;
    const int cc = c % CHUNKS;
    const int kk = cc / LPK;
    const int part = cc % LPK;
    const int k = first + kk;
    if (k < n) {
      const size_t row = ((size_t)row_table[k / BLOCK] * BLOCK + k % BLOCK) * HKV + h;  // token-major
      const T* src = (which ? v_pool : k_pool) + row * D + part * VEC;
      T* dst = (which ? sv : sk) + kk * D + part * VEC;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(pa_smem(dst)), "l"(src));
    }
  }
  asm volatile("cp.async.commit_group;" ::);
}
"""

TILED_PARTIAL = """
  constexpr int VEC = 16 / sizeof(T);
  constexpr int LPK = D / VEC;
  constexpr int KPI = 32 / LPK;
  constexpr int NW = THREADS / 32;
  constexpr int TK = 4096 / D;
  constexpr int ROUNDS = TK / (NW * KPI);
  static_assert(sizeof(T) == 2, "tiled attention: 2-byte elements (tiled_supports)");
  static_assert(ROUNDS >= 1 && ROUNDS * NW * KPI == TK, "tiled attention: whole rounds per tile (tiled_supports)");
  struct alignas(16) Vec { T v[VEC]; };
  const float NEG_INF = -__int_as_float(0x7f800000);
  __shared__ __align__(16) T sk[2][TK * D];
  __shared__ __align__(16) T sv[2][TK * D];
  __shared__ float sm_m[NW][NREP];
  __shared__ float sm_l[NW][NREP];
  // the warps' accumulators for the final merge live in the key tiles, free by then (the loop's last
  // __syncthreads): a block's shared memory is about its tiles, so groups of 8 heads at D = 128 fit 48 KB
  static_assert(NW * NREP * D * sizeof(float) <= sizeof(sk), "tiled attention: the merge fits the key tiles");
  float (*sm_acc)[NREP][D] = reinterpret_cast<float (*)[NREP][D]>(&sk[0][0]);
""" + BLOCK_SETUP + LANE_SPLIT + """  const int* row_table = table + (size_t)b * NB;
  const int span0 = j * CH;  // the span's first position: the tiles count keys from it
  const float sc = scale[0];
""" + _QUERY_SETUP + """  const int NT = (n + TK - 1) / TK;
  pa_load_tile<T, D, TK, THREADS, BLOCK, HKV>(sk[0], sv[0], k_pool, v_pool, row_table, h, span0, span0 + n, tid);
  for (int t = 0; t < NT; ++t) {
    if (t + 1 < NT) {
      pa_load_tile<T, D, TK, THREADS, BLOCK, HKV>(sk[(t + 1) & 1], sv[(t + 1) & 1], k_pool, v_pool, row_table,
                                                  h, span0 + (t + 1) * TK, span0 + n, tid);
      asm volatile("cp.async.wait_group 1;" ::);
    } else {
      asm volatile("cp.async.wait_group 0;" ::);
    }
    __syncthreads();
    const T* tk = sk[t & 1];
    const T* tv = sv[t & 1];
    #pragma unroll
    for (int rd = 0; rd < ROUNDS; ++rd) {
      const int kk = warp * KPI + sub + rd * NW * KPI;
      const bool valid = t * TK + kk < n;
      const Vec kvec = *reinterpret_cast<const Vec*>(tk + kk * D + dl * VEC);
      const Vec vvec = *reinterpret_cast<const Vec*>(tv + kk * D + dl * VEC);
""" + _key_update("kvec", "vvec", guarded=False) + """    }
    __syncthreads();  // every warp is done with this buffer before the load of tile t + 2 overwrites it
  }
""" + SPAN_PARTIAL[SPAN_PARTIAL.index("  // the warp's KPI key groups"):]

SPAN_THREADS = 128
SPAN_LOADS = 4  # keys each lane loads before using any (the kernel's U)


def supports(head_dim: int) -> bool:
    """Whether one key's row splits into 16-byte loads over a divisor of a warp's lanes."""
    return head_dim % 8 == 0 and 32 % (head_dim // 8) == 0


# CUDA's limit on a kernel's static shared memory
STATIC_SHARED_BYTES = 48 * 1024
TILE_ELEMENTS = 4096  # one tile of K (or V) in shared memory: 4096 / D keys (the kernel's TK)


def tiled_shared_bytes(head_dim: int, num_rep: int, threads: int) -> int:
    """The tiled kernel's static shared memory: two tiles each of K and V, and every warp's running max
    and sum per query head of the group (its accumulators reuse the key tiles for the final merge)."""
    return 2 * 2 * TILE_ELEMENTS * 2 + (threads // 32) * num_rep * 2 * 4


def tiled_supports(head_dim: int, dtype_bytes: int, num_rep: int, threads: int = SPAN_THREADS) -> bool:
    """The tiled kernel's shapes: 2-byte elements (8 per 16-byte copy), rows split over a divisor of a
    warp's lanes, a tile's keys (4096 / D) in whole rounds of the block's warps, the warps' accumulators
    within the key tiles (the final merge's; a query group of 16 heads at D = 128 is past them: the span
    kernel serves it) and its shared memory within CUDA's static limit."""
    if dtype_bytes != 2 or not supports(head_dim) or threads % 32 or head_dim > TILE_ELEMENTS:
        return False
    keys_per_round = threads // 32 * (32 // (head_dim // 8))
    tile_keys = TILE_ELEMENTS // head_dim
    merge_fits = (threads // 32) * num_rep * head_dim * 4 <= 2 * TILE_ELEMENTS * dtype_bytes
    return (tile_keys % keys_per_round == 0 and tile_keys >= keys_per_round and merge_fits
            and tiled_shared_bytes(head_dim, num_rep, threads) <= STATIC_SHARED_BYTES)


# multiprocessors of the GPU the span is sized for (an H100 / H200): on a smaller GPU the spans come out
# shorter than needed, which costs partials, not correctness
DEVICE_SMS = 132


SPAN_CHOICES = (64, 128, 256, 512, 1024)  # what span_keys picks from


def span_keys(num_rows: int, num_kv_heads: int, max_len: int, num_sms: int = DEVICE_SMS,
              blocks_per_sm: int = 4) -> int:
    """Keys per span: the longest of SPAN_CHOICES that still gives the device about `blocks_per_sm`
    thread blocks per multiprocessor, so long rows split over several blocks and many rows keep one or
    two each."""
    keys = SPAN_CHOICES[-1]
    while keys > SPAN_CHOICES[0] and num_rows * num_kv_heads * -(-max_len // keys) < blocks_per_sm * num_sms:
        keys //= 2
    return keys


# A row's keys in one span (a step of many rows: span_keys then picks spans as long as the rows): the span
# kernel's partial is already the row's attention, and a second kernel that only divides it by its sum
# is one more launch per layer. `direct` makes a span kernel (this module's, or mma_attention's, which
# share BLOCK_SETUP and the merge) write that quotient as the output [B, H, 1, D] itself, with the same
# float arithmetic as the combine's (whose weight for a lone span is exp(0) = 1).
_SPAN_OUTPUTS = """  float* part_out = part + (size_t)g * NREP * D;
  float* stats_out = stats + (size_t)g * NREP * 2;
  if (n <= 0) {
    pa_empty_span<NREP, D, THREADS>(part_out, stats_out, tid);  // engine/model/kernels/paged_attention.py's header
    return;
  }
"""
_MERGE_OUTPUTS = """    part_out[i] = A;
    if (i % D == 0) { stats_out[2 * r] = M; stats_out[2 * r + 1] = L; }
"""


def direct(source: str) -> str:
    """The span kernel `source` for calls whose rows each fit one span (its grid's block g is then row
    g / HKV's KV head g % HKV, and every row has a key): output `out` [B, H, 1, D] in T, no partials."""
    if source.count(_SPAN_OUTPUTS) != 1 or source.count(_MERGE_OUTPUTS) != 1:
        raise ValueError("not a span kernel's source (BLOCK_SETUP and the merge's outputs)")
    return (source.replace(_SPAN_OUTPUTS, "  T* out_row = out + (size_t)g * NREP * D;\n")
            .replace(_MERGE_OUTPUTS, "    out_row[i] = static_cast<T>(A / L);\n"))
