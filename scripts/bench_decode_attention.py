"""The paged decode attention kernels on a GPU: each against MLX's attention over the gathered KV (max
error), and its time per call at decode batch sizes (`--rows`) and contexts (`--contexts`), with the
KV bytes it reads per second. The short-span kernel (64 keys per thread block) and the long-span one
(engine/model/kernels/split_attention.py) at its chosen span and at fixed spans (`--spans`).

    python3 scripts/bench_decode_attention.py --rows 16,64,128 --contexts 600,2000 --json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from bench_common import emit, environment  # noqa: E402
from engine.model.kernels.paged_attention import CudaPagedAttention, ReferenceAttention  # noqa: E402
from engine.model.kernels.mma_attention import BLOCKS_PER_SM  # noqa: E402
from engine.model.kernels.split_attention import span_keys  # noqa: E402


def case(rows: int, context: int, heads: int, kv_heads: int, head_dim: int, block: int, seed: int):
    """Random queries, a pool with the rows' blocks shuffled, lengths around `context`."""
    nb = -(-(context + context // 8) // block)
    blocks = rows * nb + 1
    key = mx.random.key(seed)
    k1, k2, k3, k4, k5 = mx.random.split(key, 5)
    k_pool = mx.random.normal((blocks * block * kv_heads, head_dim), key=k1).astype(mx.bfloat16)  # token-major
    v_pool = mx.random.normal((blocks * block * kv_heads, head_dim), key=k2).astype(mx.bfloat16)
    queries = mx.random.normal((rows, heads, 1, head_dim), key=k3).astype(mx.bfloat16)
    table = mx.random.permutation(blocks - 1, key=k4)[: rows * nb].reshape(rows, nb).astype(mx.int32) + 1
    lengths = mx.random.randint(context - context // 8, context + context // 8, (rows,), key=k5).astype(mx.int32)
    mx.eval(k_pool, v_pool, queries, table, lengths)
    return queries, k_pool, v_pool, table, lengths


def timed(fn, args, repeat: int) -> float:
    """Seconds per call: `repeat` calls built first, then evaluated together (the graph's Python build
    is not timed; MLX's encoding runs while the device computes), the best of three."""
    mx.eval(fn(*args))
    mx.synchronize()
    best = None
    for _ in range(3):
        outs = [fn(*args) for _ in range(repeat)]
        t = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        s = (time.perf_counter() - t) / repeat
        best = s if best is None else min(best, s)
    return best


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="8,16,64,128")
    p.add_argument("--contexts", default="600,2000")
    p.add_argument("--spans", default="64,128,256,512,1024", help="fixed spans of the long-span kernel to time")
    p.add_argument("--variants", default="", help="long-span kernel variants to time as SPAN:LOADS:THREADS, "
                   "comma-separated (keys per span, keys each lane loads before using any, threads per block)")
    p.add_argument("--tiled-variants", default="", help="tiled kernel variants to time as SPAN:THREADS, "
                   "comma-separated (SPAN 0: the chosen span)")
    p.add_argument("--mma-spans", default="0", help="spans of the tensor-core kernel to time (0: the chosen span)")
    p.add_argument("--shape", default="32,8,128", help="query heads, KV heads, head size")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--repeat", type=int, default=40)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)
    heads, kv_heads, head_dim = (int(x) for x in args.shape.split(","))
    scale = head_dim ** -0.5
    ref = ReferenceAttention(kv_heads, args.block_size)
    kernels = {"short_64": CudaPagedAttention(kv_heads, args.block_size, spans=False),
               "span_auto": CudaPagedAttention(kv_heads, args.block_size, tiled=False, mma=False),
               "tiled_auto": CudaPagedAttention(kv_heads, args.block_size, tiled=True, mma=False)}
    for s in (s for s in args.mma_spans.split(",") if s):
        kernels["mma_auto" if s == "0" else f"mma_{s}"] = CudaPagedAttention(kv_heads, args.block_size,
                                                                            keys_per_span=int(s) or None)
    for s in (s for s in args.spans.split(",") if s):
        kernels[f"span_{s}"] = CudaPagedAttention(kv_heads, args.block_size, keys_per_span=int(s), tiled=False,
                                                  mma=False)
        kernels[f"tiled_{s}"] = CudaPagedAttention(kv_heads, args.block_size, keys_per_span=int(s), tiled=True,
                                                   mma=False)
    for v in (v for v in args.variants.split(",") if v):
        span, loads, threads = (int(x) for x in v.split(":"))
        kernels[f"v{v}"] = CudaPagedAttention(kv_heads, args.block_size, keys_per_span=span,
                                              span_loads=loads, span_threads=threads, tiled=False, mma=False)
    for v in (v for v in args.tiled_variants.split(",") if v):
        span, threads = (int(x) for x in v.split(":"))
        kernels[f"tiled_v{v}"] = CudaPagedAttention(kv_heads, args.block_size, keys_per_span=span or None,
                                                    span_threads=threads, tiled=True, mma=False)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            q, kp, vp, table, lengths = case(rows, context, heads, kv_heads, head_dim, args.block_size, rows + context)
            want = ref(q, kp, vp, table, lengths, scale).astype(mx.float32)
            kv_bytes = 2 * kv_heads * head_dim * 2 * int(lengths.sum().item())
            row = dict(rows=rows, context=context, kv_bytes=kv_bytes,
                       auto_span=span_keys(rows, kv_heads, table.shape[1] * args.block_size),
                       mma_auto_span=span_keys(rows, kv_heads, table.shape[1] * args.block_size,
                                               blocks_per_sm=BLOCKS_PER_SM), kernels={})
            for name, kernel in kernels.items():
                try:
                    got = kernel(q, kp, vp, table, lengths, scale).astype(mx.float32)
                    err = mx.abs(got - want).max().item()
                    s = timed(kernel, (q, kp, vp, table, lengths, scale), args.repeat)
                except Exception as exc:  # a variant that does not build: recorded, the others go on
                    row["kernels"][name] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
                    continue
                row["kernels"][name] = dict(max_err=round(err, 5), us=round(1e6 * s, 2),
                                            tb_per_s=round(kv_bytes / s / 1e12, 3))
            results.append(row)
            print(rows, context, {k: (v.get("us"), v.get("max_err", v.get("error"))) for k, v in row["kernels"].items()},
                  flush=True)
    result = dict(bench="decode_attention", argv=sys.argv[1:] if argv is None else argv, shape=args.shape,
                  block_size=args.block_size, environment=environment(), results=results)
    emit(result, args.json, args.out)
    return result


if __name__ == "__main__":
    main()
