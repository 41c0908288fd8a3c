#!/usr/bin/env python3
"""The paged decode attention kernel (engine/model/kernels/paged_attention.py) against its MLX reference, and its
time against the gather + masked attention it replaces. Needs MLX's CUDA backend. Prints JSON.

    python scripts/check_paged_attention.py --out paged.json

Correctness: for each dtype and case (B rows with the given KV lengths, blocks scattered at random
in the pool), the largest absolute difference between the kernel's output and `ReferenceAttention`'s
(gather through the block table, mask, MLX attention), and the largest output magnitude.
Time (Llama-3-8B attention shape, `--layers` layers a step, B rows of `--context` keys): per step,
`gather_ms` (each layer: gather K and V, MLX attention with the `[B, 1, 1, L]` mask, what a decode did
before), `paged_ms` (each layer: the kernel), `empty_kernels_ms` (as many launches of a custom kernel
that does nothing: the floor of two kernels a layer) and `paged_<KEYS>x<THREADS>_ms` for `--variants`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench_common import emit, environment  # noqa: E402
from engine.model.kernels.paged_attention import CudaPagedAttention, ReferenceAttention  # noqa: E402

CASES = [[1], [255], [256], [257], [1, 700, 256, 3], [518] * 8, [8192], [8192, 100, 4000, 2049]]


def make_case(lengths, hq, hkv, d, block, dtype, rng, spare_blocks: int = 3):
    nb = [-(-n // block) for n in lengths]
    total = sum(nb) + spare_blocks
    order = rng.permutation(total)  # each row's blocks scattered over the pool
    table = np.zeros((len(lengths), max(nb)), np.int32)
    used = 0
    for b, n in enumerate(nb):
        table[b, :n] = order[used : used + n]
        used += n
    slots = total * block
    k_pool = mx.random.normal((hkv * slots, d)).astype(dtype)
    v_pool = mx.random.normal((hkv * slots, d)).astype(dtype)
    q = mx.random.normal((len(lengths), hq, 1, d)).astype(dtype)
    return q, k_pool, v_pool, mx.array(table), mx.array(lengths, mx.int32)


def check(args) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for dtype in (mx.bfloat16, mx.float32):
        kernel = CudaPagedAttention(args.kv_heads, args.block)
        ref = ReferenceAttention(args.kv_heads, args.block)
        for lengths in CASES:
            q, k, v, table, lens = make_case(lengths, args.heads, args.kv_heads, args.head_dim, args.block, dtype, rng)
            scale = args.head_dim ** -0.5
            got = kernel(q, k, v, table, lens, scale).astype(mx.float32)
            want = ref(q, k, v, table, lens, scale).astype(mx.float32)
            err = mx.abs(got - want).max().item()
            out.append({"dtype": str(dtype), "lengths": lengths, "max_abs_err": err,
                        "max_abs_out": mx.abs(want).max().item(), "finite": bool(mx.isfinite(got).all().item())})
            print(out[-1], file=sys.stderr, flush=True)
    return out


def timed(fn, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        mx.eval(fn())
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) / steps * 1000


_EMPTY = "  if (threadIdx.x == 0) out[blockIdx.x] = 0.0f;"


def bench(args) -> list[dict]:
    rng = np.random.default_rng(1)
    dtype = mx.bfloat16
    kernel = CudaPagedAttention(args.kv_heads, args.block)
    variants = {v: CudaPagedAttention(args.kv_heads, args.block, *map(int, v.split("x")))
                for v in args.variants.split(",") if v}
    empty = mx.fast.cuda_kernel(name="empty_kernel", input_names=["x"], output_names=["out"], source=_EMPTY)
    out = []
    for B in [int(x) for x in args.batches.split(",")]:
        q, k, v, table, lens = make_case([args.context] * B, args.heads, args.kv_heads, args.head_dim,
                                         args.block, dtype, rng, args.spare_blocks)
        ks, vs = [k] * args.layers, [v] * args.layers
        scale = args.head_dim ** -0.5
        hkv, slots, bs = args.kv_heads, k.shape[0] // args.kv_heads, args.block
        pos = np.arange(args.context)
        tab = np.array(table)
        read = mx.array(np.arange(hkv)[None, :, None] * slots
                        + (tab[:, pos // bs] * bs + pos % bs)[:, None, :], mx.int32)  # [B, H_kv, L]
        mask = mx.array(np.ones((B, 1, 1, args.context), bool)) if B > 1 else None

        def gather():
            return [mx.fast.scaled_dot_product_attention(q, ks[i][read], vs[i][read], scale=scale,
                                                         mask=mask) for i in range(args.layers)]

        def paged():
            return [kernel(q, ks[i], vs[i], table, lens, scale) for i in range(args.layers)]

        def launches_floor():  # as many launches of a kernel that does nothing, on the partial's grid
            nblocks = B * args.kv_heads * table.shape[1] * (args.block // kernel.keys_per_partial)
            return [empty(inputs=[q], grid=(nblocks * 128, 1, 1), threadgroup=(128, 1, 1),
                          output_shapes=[(nblocks,)], output_dtypes=[mx.float32])[0]
                    for _ in range(2 * args.layers)]

        row = {"batch": B, "context": args.context, "layers": args.layers, "pool_slots": slots,
               "gather_ms": round(timed(gather, args.steps, args.warmup), 3),
               "paged_ms": round(timed(paged, args.steps, args.warmup), 3),
               "empty_kernels_ms": round(timed(launches_floor, args.steps, args.warmup), 3)}
        for name, impl in variants.items():
            row[f"paged_{name}_ms"] = round(timed(
                lambda impl=impl: [impl(q, ks[i], vs[i], table, lens, scale) for i in range(args.layers)],
                args.steps, args.warmup), 3)
        out.append(row)
        print(row, file=sys.stderr, flush=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--context", type=int, default=518)
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--spare-blocks", type=int, default=3,
                   help="pool blocks besides the rows' (a larger pool spreads the rows' blocks wider)")
    p.add_argument("--variants", default="",
                   help="kernel variants to time besides the default, KEYSxTHREADS,... (e.g. 32x64,128x256)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = {"check": "paged_attention", "environment": environment(), "correctness": check(args),
              "time": bench(args)}
    emit(result, True, args.out)
    return result


if __name__ == "__main__":
    main()
