"""The paged decode attention's first kernel on tensor cores (bf16 `mma.sync`), for query groups of up
to 8 heads and head sizes up to 128.

The tiled kernel (engine/model/kernels/split_attention.py) computes each score on CUDA cores with one
key's dims spread over 16 lanes: every key costs shuffle reductions, two exponentials per query head
on each of those lanes and a rescale of the accumulators, so on an H200 it is bound by issuing
instructions (Nsight Compute: 0.6-0.74 instructions a cycle per scheduler, a third of the card's
bandwidth). Here each warp takes 16 keys of a tile and runs the GQA group's queries as the rows of an
m16n8k16 fragment (rows past the group's heads are zero): Q K^T in 2 x D / 16 tensor-core operations,
the online softmax once per tile of 16 keys (each lane holds 4 scores of one query head; its quad
shares the row), then P V with the scores' fragments reused as P's (the FlashAttention-2 layout) in
2 x D / 8 operations: P as its bf16 rounding plus the rest, so that it keeps about 16 bits (one bf16
P took the 8B's and SmolLM2's greedy tokens off mlx-lm's sooner than the float P of the CUDA-core
kernels on an H200). Keys and values reach shared memory as the tiled kernel's do (16-byte `cp.async`,
the next tile in flight), in rows padded by 8 elements so that fragment loads hit distinct banks; keys
past the span's end are zero-filled (their P is 0, and 0 x NaN would not be). The warps' states merge
as the span kernels' do, into the same partials, so the same `combine` kernel finishes them.
"""

from __future__ import annotations

from engine.model.kernels import split_attention

THREADS = 64  # 2 warps: a tile of 32 keys, double-buffered with padded rows, stays within 48 KB
MAX_GROUP = 8  # query heads of a group: the fragment's rows 0-7 (8-15 stay zero)
MAX_HEAD_DIM = 128  # the output fragments (D / 8 x 4 floats a lane) within the registers
# Its spans (split_attention.span_keys): about one block per multiprocessor. A span's keys cost little
# here, so longer spans (fewer partials to combine) won: on an H200 at 16 rows x 600 keys 1,024-key
# spans took 25.6 us and the 128 that four blocks a multiprocessor give 40.9, at 64-128 rows the same
# within 5 % (h200_i25_decode.json `mma_attention_kernel`).
BLOCKS_PER_SM = 1

HEADER = split_attention.TILED_HEADER + r"""
// Q K^T or P V on tensor cores: D (16 x 8, f32) += A (16 x 16, bf16; rows 8-15 zero) B (16 x 8, bf16)
__device__ __forceinline__ void pa_mma_bf16(float* c, unsigned a0, unsigned a2, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
}
// two floats as bf16x2, `lo` in the low half (the fragment's lower column)
__device__ __forceinline__ unsigned pa_pack_bf16(float lo, float hi) {
  unsigned d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
// a tile of TK keys (positions first.. of the row; those at n or past it zero-filled) into rows of DP
template <typename T, int D, int TK, int DP, int THREADS, int BLOCK, int HKV>
__device__ __forceinline__ void pa_load_tile_padded(T* sk, T* sv, const T* k_pool, const T* v_pool,
                                                    const int* row_table, int h, int first, int n, int tid) {
  constexpr int PARTS = D / 8;  // 16-byte copies a key's row
  constexpr int KEYS_PER_PASS = THREADS / PARTS;
  const int part = tid % PARTS;
  for (int kk = tid / PARTS; kk < TK; kk += KEYS_PER_PASS) {
    const int k = first + kk;
    const bool ok = k < n;
    const size_t row = ok ? ((size_t)row_table[k / BLOCK] * BLOCK + k % BLOCK) * HKV + h : 0;  // token-major
    const int bytes = ok ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(pa_smem(sk + kk * DP + part * 8)), "l"(k_pool + row * D + part * 8), "r"(bytes));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(pa_smem(sv + kk * DP + part * 8)), "l"(v_pool + row * D + part * 8), "r"(bytes));
  }
  asm volatile("cp.async.commit_group;" ::);
}
"""

_MERGE = split_attention.SPAN_PARTIAL[split_attention.SPAN_PARTIAL.index("  __syncthreads();\n  for (int i = tid"):]

PARTIAL = """
  constexpr int NW = THREADS / 32;
  constexpr int TK = 16 * NW;  // each warp takes 16 keys of a tile
  constexpr int DP = D + 8;
  constexpr int KS = D / 16;  // k-steps of a score fragment
  constexpr int ND = D / 8;   // n-blocks of the output
  static_assert(sizeof(T) == 2 && NREP <= 8 && D % 16 == 0 && D <= 128 && THREADS % (D / 8) == 0,
                "mma attention: mma_attention.supports");
  const float NEG_INF = -__int_as_float(0x7f800000);
  __shared__ __align__(16) T sk[2][TK * DP];
  __shared__ __align__(16) T sv[2][TK * DP];
  __shared__ float sm_m[NW][NREP];
  __shared__ float sm_l[NW][NREP];
  static_assert(NW * NREP * D * sizeof(float) <= sizeof(sk), "mma attention: the merge fits the key tiles");
  float (*sm_acc)[NREP][D] = reinterpret_cast<float (*)[NREP][D]>(&sk[0][0]);
""" + split_attention.BLOCK_SETUP + """  const int* row_table = table + (size_t)b * NB;
  const int span0 = j * CH;
  const float sc = scale[0];
  const int gr = lane >> 2;  // the fragments' row of this lane: query head gr of the group, if gr < NREP
  const int tq = lane & 3;   // its pair of columns in each 8
  const bool live = gr < NREP;
  unsigned qa[KS][2];  // the queries' A fragments (bf16, unscaled), rows 0-7
  {
    const T* qp = q + ((size_t)(b * HKV + h) * NREP + (live ? gr : 0)) * D + 2 * tq;
    #pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      qa[ks][0] = live ? *reinterpret_cast<const unsigned*>(qp + ks * 16) : 0u;
      qa[ks][1] = live ? *reinterpret_cast<const unsigned*>(qp + ks * 16 + 8) : 0u;
    }
  }
  float o[ND][4];
  #pragma unroll
  for (int i = 0; i < ND; ++i) { o[i][0] = 0.0f; o[i][1] = 0.0f; o[i][2] = 0.0f; o[i][3] = 0.0f; }
  float m = NEG_INF, l = 0.0f;
  const int NT = (n + TK - 1) / TK;
  pa_load_tile_padded<T, D, TK, DP, THREADS, BLOCK, HKV>(sk[0], sv[0], k_pool, v_pool, row_table, h, span0,
                                                         span0 + n, tid);
  for (int t = 0; t < NT; ++t) {
    if (t + 1 < NT) {
      pa_load_tile_padded<T, D, TK, DP, THREADS, BLOCK, HKV>(sk[(t + 1) & 1], sv[(t + 1) & 1], k_pool, v_pool,
                                                             row_table, h, span0 + (t + 1) * TK, span0 + n, tid);
      asm volatile("cp.async.wait_group 1;" ::);
    } else {
      asm volatile("cp.async.wait_group 0;" ::);
    }
    __syncthreads();
    const T* tk = sk[t & 1] + warp * 16 * DP;
    const int k0 = t * TK + warp * 16;  // the warp's first key of the tile, from the span's start
    float s[2][2];  // scores of query head gr: keys k0 + nb * 8 + 2 * tq + e
    #pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const T* kr = tk + (nb * 8 + gr) * DP + 2 * tq;
      #pragma unroll
      for (int ks = 0; ks < KS; ++ks)
        pa_mma_bf16(c, qa[ks][0], qa[ks][1], *reinterpret_cast<const unsigned*>(kr + ks * 16),
                    *reinterpret_cast<const unsigned*>(kr + ks * 16 + 8));
      #pragma unroll
      for (int e = 0; e < 2; ++e) s[nb][e] = k0 + nb * 8 + 2 * tq + e < n ? c[e] * sc : NEG_INF;
    }
    // the online softmax over the warp's 16 keys: the row's max and sum over its quad's lanes
    float tmax = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffff, tmax, 1));
    tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffff, tmax, 2));
    const float mn = fmaxf(m, tmax);
    const bool any = mn != NEG_INF;
    const float cs = any ? __expf(m - mn) : 1.0f;
    float p[2][2], ps = 0.0f;
    #pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      #pragma unroll
      for (int e = 0; e < 2; ++e) { p[nb][e] = any ? __expf(s[nb][e] - mn) : 0.0f; ps += p[nb][e]; }
    }
    ps += __shfl_xor_sync(0xffffffff, ps, 1);
    ps += __shfl_xor_sync(0xffffffff, ps, 2);
    l = l * cs + ps;
    m = mn;
    // P V: the score fragments are P's A fragment (keys 2 tq, 2 tq + 1 and 8 more); V^T's from 16-bit loads.
    // P is split into its bf16 rounding and the rest (a second bf16 fragment): (P_hi + P_lo) V keeps P to
    // about 16 bits, as the CUDA-core kernels' float P, and matches the sum l taken of the float P
    const unsigned pa0 = pa_pack_bf16(p[0][0], p[0][1]);
    const unsigned pa2 = pa_pack_bf16(p[1][0], p[1][1]);
    const unsigned pl0 = pa_pack_bf16(p[0][0] - __uint_as_float(pa0 << 16),
                                      p[0][1] - __uint_as_float(pa0 & 0xffff0000u));
    const unsigned pl2 = pa_pack_bf16(p[1][0] - __uint_as_float(pa2 << 16),
                                      p[1][1] - __uint_as_float(pa2 & 0xffff0000u));
    const unsigned short* vr =
        reinterpret_cast<const unsigned short*>(sv[t & 1] + warp * 16 * DP) + 2 * tq * DP + gr;
    #pragma unroll
    for (int nd = 0; nd < ND; ++nd) {
      o[nd][0] *= cs;
      o[nd][1] *= cs;
      const unsigned short* vp = vr + nd * 8;
      const unsigned b0 = (unsigned)vp[0] | ((unsigned)vp[DP] << 16);
      const unsigned b1 = (unsigned)vp[8 * DP] | ((unsigned)vp[9 * DP] << 16);
      pa_mma_bf16(o[nd], pa0, pa2, b0, b1);
      pa_mma_bf16(o[nd], pl0, pl2, b0, b1);
    }
    __syncthreads();  // every warp is done with this buffer before the load of tile t + 2 overwrites it
  }
  // the warps' states for the merge (the key tiles are free: the loop's last __syncthreads)
  if (live) {
    #pragma unroll
    for (int nd = 0; nd < ND; ++nd) {
      sm_acc[warp][gr][nd * 8 + 2 * tq] = o[nd][0];
      sm_acc[warp][gr][nd * 8 + 2 * tq + 1] = o[nd][1];
    }
    if (tq == 0) { sm_m[warp][gr] = m; sm_l[warp][gr] = l; }
  }
""" + _MERGE


def supports(head_dim: int, num_rep: int, is_bfloat16: bool) -> bool:
    """bf16 KV, query groups of up to MAX_GROUP heads, head sizes a multiple of 16 up to MAX_HEAD_DIM
    whose 16-byte row parts divide the block's threads."""
    return (is_bfloat16 and 1 <= num_rep <= MAX_GROUP and head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM
            and THREADS % (head_dim // 8) == 0)
