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

# Block g = ((b * HKV) + h) * NS + j covers positions [j * CH, (j + 1) * CH) of row b (each key's pool
# block looked up in the row's table); lane = sub * LPK + dl holds dims [dl * 8, dl * 8 + 8) of keys
# warp * KPI + sub + i * NW * KPI, U of them loaded before any is used.
SPAN_PARTIAL = """
  constexpr int VEC = 8;
  constexpr int LPK = D / VEC;
  constexpr int KPI = 32 / LPK;
  constexpr int NW = THREADS / 32;
  constexpr int STRIDE = NW * KPI;
  constexpr int U = 4;
  struct alignas(16) Vec { T v[VEC]; };
  const float NEG_INF = -__int_as_float(0x7f800000);
  __shared__ float sm_m[NW][NREP];
  __shared__ float sm_l[NW][NREP];
  __shared__ float sm_acc[NW][NREP][D];
  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int sub = lane / LPK;
  const int dl = lane % LPK;
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
  const size_t S = k_pool_shape[0] / HKV;
  const int* row_table = table + (size_t)b * NB;
  const float sc = scale[0];
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
  for (int w0 = warp * KPI; w0 < n; w0 += STRIDE * U) {  // uniform over the warp: its shuffles need every lane
    Vec kv[U], vv[U];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = w0 + sub + u * STRIDE;
      if (k < n) {
        const int p = j * CH + k;
        const size_t row = (size_t)h * S + (size_t)row_table[p / BLOCK] * BLOCK + p % BLOCK;
        kv[u] = *reinterpret_cast<const Vec*>(k_pool + row * D + dl * VEC);
        vv[u] = *reinterpret_cast<const Vec*>(v_pool + row * D + dl * VEC);
      }
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool valid = w0 + sub + u * STRIDE < n;
      float s[NREP];
      #pragma unroll
      for (int r = 0; r < NREP; ++r) {
        s[r] = 0.0f;
        if (valid) {
          #pragma unroll
          for (int e = 0; e < VEC; ++e) s[r] += qr[r][e] * static_cast<float>(kv[u].v[e]);
        }
      }
      #pragma unroll
      for (int r = 0; r < NREP; ++r) {
        #pragma unroll
        for (int o = LPK / 2; o > 0; o >>= 1) s[r] += __shfl_xor_sync(0xffffffff, s[r], o);
      }
      if (valid) {
        #pragma unroll
        for (int r = 0; r < NREP; ++r) {
          const float mn = fmaxf(m[r], s[r]);
          const float c = __expf(m[r] - mn);
          const float pr = __expf(s[r] - mn);
          l[r] = l[r] * c + pr;
          #pragma unroll
          for (int e = 0; e < VEC; ++e) acc[r][e] = acc[r][e] * c + pr * static_cast<float>(vv[u].v[e]);
          m[r] = mn;
        }
      }
    }
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

SPAN_THREADS = 128


def supports(head_dim: int) -> bool:
    """Whether one key's row splits into 16-byte loads over a divisor of a warp's lanes."""
    return head_dim % 8 == 0 and 32 % (head_dim // 8) == 0


# multiprocessors of the GPU the span is sized for (an H100 / H200): on a smaller GPU the spans come out
# shorter than needed, which costs partials, not correctness
DEVICE_SMS = 132


def span_keys(num_rows: int, num_kv_heads: int, max_len: int, num_sms: int = DEVICE_SMS) -> int:
    """Keys per span: the longest power of two (64 to 1024) that still gives the device about four
    thread blocks per multiprocessor, so long rows split over several blocks and many rows keep one
    or two each."""
    keys = 1024
    while keys > 64 and num_rows * num_kv_heads * -(-max_len // keys) < 4 * num_sms:
        keys //= 2
    return keys
