"""A candidate decode GEMM of the engine's own against MLX's matmul (cuBLASLt) on a GPU: Y = X W^T for a
decode's few rows X [M, K] (M <= 128) and a projection's weights W [N, K], bf16, float accumulation.

Why (docs/decode.md, "The host sets the step"): MLX's CUDA backend spends about 19 us of host time on
every cuBLASLt matmul at the engine's 8 operations a graph (descriptors, the heuristic query and a stream
capture at every call) against 3-5 us for a plain kernel, and a decode step of an 8B llama has 129 of
them: 2.4 ms of a host-bound step. A `mx.fast.cuda_kernel` is a plain kernel node. Whether it is worth
it depends on the device time it costs: cuBLASLt reads the weights at about 82 % of the card's copy rate.

The kernel ("swap AB"): W's rows are the tensor cores' A operand (16 output features a fragment), X's
rows the B operand (8 tokens a fragment), so no shared memory is needed: each lane reads 16 contiguous
bytes of a W row and of an X row per 32 keys (K permuted within each 32, the same for both operands,
which leaves the dot products unchanged), W through the non-allocating read-only path (read once), X
through L1 (every warp of a block reads the same X). A block's warps take neighbouring features; the
grid's second dimension splits K, its float partials summed by a second kernel (one split: the bf16
output directly).

    python3 scripts/bench_decode_gemm.py --rows 1,4,16,64,128 --json

Per (projection, rows): the largest error against `x @ w.T` relative to its largest value, device time
per call of both (50 calls in one graph), and host encode per call of both (`async_eval` of 64
independent products); `--sweep` times every plan the kernel can take, `--chain-rows` a 32-layer chain of
the four layer products (dependent, as in a forward) with each matmul.

Measured on the H200 (`scripts/data/h200_i25_decode.json`, key `decode_gemm_s25`; docs/decode.md, "A decode
GEMM of the engine's own"): it loses to cuBLASLt at the engine's row counts (2x at 64 rows for gate/up and
down) and its encode is no cheaper, so the engine does not use it; the script stays as the measurement.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from bench_common import emit, environment, per_call_us  # noqa: E402

HEADER = r"""
__device__ __forceinline__ void dg_mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                       unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint4 dg_stream(const void* p) {  // read once: no L1 allocation
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
"""

# Template: T (bf16), NT (8-token fragments: ceil(M / 8)), MT (16-feature fragments a warp), WARPS, U
# (32-key steps whose W loads go out together). WRITE: the T output `out` [M, N] (one split), or the float
# partials `part` [gridDim.y, M, N] (GEMM_OUT / GEMM_PART).
# Needs K % (32 * U * gridDim.y) == 0 and N % (16 * MT) == 0, row-contiguous x and w.
GEMM = r"""
  constexpr int TF = 16 * MT;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = w_shape[0];
  const int f0 = (blockIdx.x * WARPS + warp) * TF;
  if (f0 >= N) return;
  const int span = K / gridDim.y;
  const int kb = blockIdx.y * span;
  const uint4* wp[MT][2];
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    wp[mt][0] = reinterpret_cast<const uint4*>(w + (size_t)(f0 + mt * 16 + g) * K + kb + 8 * t);
    wp[mt][1] = reinterpret_cast<const uint4*>(w + (size_t)(f0 + mt * 16 + g + 8) * K + kb + 8 * t);
  }
  const uint4* xp[NT];
  bool xok[NT];
  #pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int tok = nt * 8 + g;
    xok[nt] = tok < M;
    xp[nt] = reinterpret_cast<const uint4*>(x + (size_t)(xok[nt] ? tok : 0) * K + kb + 8 * t);
  }
  float acc[MT][NT][4];
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) { acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f; }
  }
  const int steps = span / 32;  // a multiple of U
  for (int s0 = 0; s0 < steps; s0 += U) {
    uint4 wa[U][MT][2];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      #pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        wa[u][mt][0] = dg_stream(wp[mt][0] + (s0 + u) * 4);
        wa[u][mt][1] = dg_stream(wp[mt][1] + (s0 + u) * 4);
      }
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 xv = xok[nt] ? __ldg(xp[nt] + (s0 + u) * 4) : make_uint4(0u, 0u, 0u, 0u);
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          // this lane's keys 8t..8t+7 of the 32: words x, y the first 16-key product, z, w the second
          dg_mma(acc[mt][nt], wa[u][mt][0].x, wa[u][mt][1].x, wa[u][mt][0].y, wa[u][mt][1].y, xv.x, xv.y);
          dg_mma(acc[mt][nt], wa[u][mt][0].z, wa[u][mt][1].z, wa[u][mt][0].w, wa[u][mt][1].w, xv.z, xv.w);
        }
      }
    }
  }
  // D fragment: features g, g + 8 (rows), tokens 2t, 2t + 1 (columns)
  #pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      #pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int f = f0 + mt * 16 + g + (i >= 2 ? 8 : 0);
        const int tok = nt * 8 + 2 * t + (i & 1);
        if (tok < M) WRITE;
      }
    }
  }
"""

GEMM_OUT = GEMM.replace("WRITE", "out[(size_t)tok * N + f] = static_cast<T>(acc[mt][nt][i])")
GEMM_PART = GEMM.replace("WRITE", "part[((size_t)blockIdx.y * M + tok) * N + f] = acc[mt][nt][i]")

# part [SPLIT, M, N] float -> out [M, N] T: one thread an element
REDUCE = r"""
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t n = (size_t)part_shape[1] * part_shape[2];
  if (i >= n) return;
  float s = 0.0f;
  #pragma unroll
  for (int j = 0; j < SPLIT; ++j) s += part[j * n + i];
  out[i] = static_cast<T>(s);
"""

WARPS = 4
SMS = 132
FILL = SMS * 7 // 8  # blocks that count as a block a multiprocessor (one wave, a few idle)


class DecodeGemm:
    """x [M, K] @ w[N, K]^T with the kernels above; `plan` picks the fragments and the K split."""

    def __init__(self):
        self._direct = mx.fast.cuda_kernel(name="decode_gemm", input_names=["x", "w"], output_names=["out"],
                                           source=GEMM_OUT, header=HEADER)
        self._split = mx.fast.cuda_kernel(name="decode_gemm_split", input_names=["x", "w"],
                                          output_names=["part"], source=GEMM_PART, header=HEADER)
        self._reduce = mx.fast.cuda_kernel(name="decode_gemm_reduce", input_names=["part"], output_names=["out"],
                                           source=REDUCE)

    @staticmethod
    def plan(m: int, n: int, k: int) -> dict:
        """Fragments (NT tokens, MT features a warp), W loads in flight (U steps) and the K split: two
        feature fragments a warp where that still gives the card a block a multiprocessor, and as few K
        splits as still do (each split's float partials are M x N x 4 bytes written and read again)."""
        nt = -(-m // 8)
        mt = 2 if nt <= 8 and -(-n // (WARPS * 32)) >= FILL else 1
        u = 4 if mt == 2 else 8  # about 32 KB of W in flight a multiprocessor either way
        blocks = -(-n // (WARPS * 16 * mt))
        split = 1
        while blocks * split < FILL and k % (32 * u * split * 2) == 0 and split < 16:
            split *= 2
        return dict(NT=nt, MT=mt, U=u, SPLIT=split, blocks=blocks)

    def __call__(self, x: mx.array, w: mx.array, plan: Optional[dict] = None) -> mx.array:
        m, k = x.shape
        n = w.shape[0]
        p = plan or self.plan(m, n, k)
        if n % (16 * p["MT"]) or k % (32 * p["U"] * p["SPLIT"]):
            raise ValueError(f"decode_gemm: shape {m}x{k} @ {n}x{k}^T not supported")
        template = [("T", x.dtype), ("NT", p["NT"]), ("MT", p["MT"]), ("WARPS", WARPS), ("U", p["U"])]
        grid = (p["blocks"] * WARPS * 32, p["SPLIT"], 1)
        if p["SPLIT"] == 1:
            return self._direct(inputs=[x, w], template=template, grid=grid, threadgroup=(WARPS * 32, 1, 1),
                                output_shapes=[(m, n)], output_dtypes=[x.dtype])[0]
        part = self._split(inputs=[x, w], template=template, grid=grid, threadgroup=(WARPS * 32, 1, 1),
                           output_shapes=[(p["SPLIT"], m, n)], output_dtypes=[mx.float32])[0]
        return self._reduce(inputs=[part], template=[("T", x.dtype), ("SPLIT", p["SPLIT"])],
                            grid=(m * n, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(m, n)],
                            output_dtypes=[x.dtype])[0]


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "head": (128256, 4096)}  # the 8B llama's decode products (N, K)


def device_us(fn, calls: int = 50) -> float:
    """Microseconds a call: `calls` products evaluated together, after a warm-up."""
    return per_call_us(lambda i: fn(), calls)


def encode_us(fn, calls: int = 64) -> float:
    """Microseconds of async_eval a call (the host's encode)."""
    times = []
    for _ in range(5):
        mx.synchronize()
        ys = [fn() for _ in range(calls)]
        t0 = time.perf_counter()
        mx.async_eval(ys)
        times.append(time.perf_counter() - t0)
        mx.eval(ys)
    return round(sorted(times)[2] * 1e6 / calls, 2)


def sweep(gemm: DecodeGemm, x: mx.array, w: mx.array) -> dict:
    """Device time of each plan the kernel can take for this product."""
    m, k = x.shape
    n = w.shape[0]
    nt = -(-m // 8)
    out = {}
    for mt in (1, 2):
        if mt == 2 and nt > 8:
            continue
        for u in (2, 4, 8):
            for split in (1, 2, 4, 8, 16):
                if n % (16 * mt * WARPS) or k % (32 * u * split):
                    continue
                plan = dict(NT=nt, MT=mt, U=u, SPLIT=split, blocks=-(-n // (WARPS * 16 * mt)))
                try:
                    out[f"MT{mt}_U{u}_S{split}"] = device_us(lambda: gemm(x, w, plan), calls=30)
                except Exception as e:  # a plan the compiler refuses
                    out[f"MT{mt}_U{u}_S{split}"] = repr(e)[:200]
    return out


def chain(gemm: DecodeGemm, m: int, layers: int) -> dict:
    """A decode step's products without the rest: per layer q/k/v, o, gate/up, down on 8 weight sets in
    turn, each product's input a slice of the last one's output (dependent, as in a forward), built and
    evaluated as one graph; plain and with each layer compiled, MLX's matmul against the kernel.
    Milliseconds a step (build + encode + device), best of 5."""
    ws = []
    for i in range(8):
        ws.append({name: (mx.random.normal(SHAPES[name], key=mx.random.key(10 + 4 * i + j)) * 0.02)
                   .astype(mx.bfloat16) for j, name in enumerate(("qkv", "o", "gate_up", "down"))})
    mx.eval(ws)

    heads_width, inter = SHAPES["o"][1], SHAPES["down"][1]  # q's columns of q/k/v; gate's of gate/up

    def layer(mm, x, qkv, o, gate_up, down):
        a = mm(x, qkv)[:, :heads_width]
        h = mm(a, o) + x
        g = mm(h, gate_up)
        return mm(g[:, :inter] * g[:, inter:], down) + h

    mlx_mm = lambda a, w: a @ w.T
    kern_mm = lambda a, w: gemm(a, w)
    out = {}
    for label, mm in (("mlx", mlx_mm), ("kernel", kern_mm)):
        for compiled in (False, True):
            fn = mx.compile(lambda x, *w, mm=mm: layer(mm, x, *w)) if compiled else (lambda x, *w, mm=mm: layer(mm, x, *w))
            x0 = (mx.random.normal((m, SHAPES["o"][0]), key=mx.random.key(3)) * 0.1).astype(mx.bfloat16)
            mx.eval(x0)

            def step():
                x = x0
                for i in range(layers):
                    w = ws[i % 8]
                    x = fn(x, w["qkv"], w["o"], w["gate_up"], w["down"])
                    x = x * 0.01  # keep the values small
                return x
            times = []
            for r in range(7):
                mx.synchronize()
                t0 = time.perf_counter()
                mx.eval(step())
                times.append(time.perf_counter() - t0)
            out[f"{label}{'_compiled' if compiled else ''}_ms"] = round(min(times[2:]) * 1e3, 3)
    print("chain", m, out, flush=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,16,64,128")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--sweep", action="store_true", help="also time other fragments, loads and K splits")
    p.add_argument("--chain-rows", default="", help="rows of a decode-like chain of layers (e.g. 64,128)")
    p.add_argument("--chain-layers", type=int, default=32)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    gemm = DecodeGemm()
    cases = {}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = (mx.random.normal((n, k), key=mx.random.key(1)) * 0.02).astype(mx.bfloat16)
        for m in (int(r) for r in args.rows.split(",")):
            x = mx.random.normal((m, k), key=mx.random.key(2)).astype(mx.bfloat16)
            mx.eval(w, x)
            want = (x @ w.T).astype(mx.float32)
            got = gemm(x, w).astype(mx.float32)
            err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
            case = dict(plan=DecodeGemm.plan(m, n, k), rel_err=err,
                        device_us=dict(mlx=device_us(lambda: x @ w.T), kernel=device_us(lambda: gemm(x, w))),
                        encode_us=dict(mlx=encode_us(lambda: x @ w.T), kernel=encode_us(lambda: gemm(x, w))))
            case["weights_tb_per_s"] = {kk: round(n * k * 2 / v / 1e6, 2) for kk, v in case["device_us"].items()}
            if args.sweep:
                case["sweep"] = sweep(gemm, x, w)
            cases[f"{name}_M{m}"] = case
            print(name, m, case, flush=True)
    if args.chain_rows:
        result_chain = {f"M{m}": chain(gemm, m, args.chain_layers) for m in map(int, args.chain_rows.split(","))}
    else:
        result_chain = {}
    result = dict(bench="decode_gemm", argv=list(argv if argv is not None else sys.argv[1:]),
                  environment=environment(), cases=cases, chain=result_chain)
    emit(result, args.json, args.out)
    return result


if __name__ == "__main__":
    main()
