"""What MLX's backend costs the host per operation: chains of one kind of operation whose device work is
tiny (128-wide rows), timed from `mx.async_eval`'s call to its return (the encode: MLX's C++ per
operation, and on CUDA the graph nodes it adds and the graphs it commits) and to the device's finish.
A decode step of an 8B llama is some 600 operations; where the host's time per step sets the step
(docs/decode.md), this is the price of each. On CUDA, run it under each MLX_MAX_OPS_PER_BUFFER of
interest (the engine's 8, MLX's own 100 on Hopper) and with MLX_USE_CUDA_GRAPHS=0:

    MLX_MAX_OPS_PER_BUFFER=8 python3 scripts/bench_mlx_host_cost.py --json

Matmuls of 2 rows or more go to cuBLASLt (MLX asks for its heuristic and captures the call into a graph
of its own each time); one row takes MLX's gemv kernel. The `real_*` cases are the 8B's decode
projections (device-bound: their total is device time). A custom kernel is timed on CUDA only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from bench_common import emit, environment  # noqa: E402

WIDTH = 128


def _median(values: list) -> float:
    return sorted(values)[len(values) // 2]


def chain(op, x: mx.array, n: int, reps: int) -> dict:
    """Microseconds per operation of `n` chained `op`s: building the graph (Python), encoding it
    (async_eval's call) and until the device is done."""
    def build():
        y = x
        for _ in range(n):
            y = op(y)
        return y

    for _ in range(3):
        mx.eval(build())
    built, encoded, total = [], [], []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        y = build()
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        mx.eval(y)
        t3 = time.perf_counter()
        built.append(t1 - t0), encoded.append(t2 - t1), total.append(t3 - t1)
    us = lambda v: round(_median(v) * 1e6 / n, 2)  # noqa: E731
    return {"build_us": us(built), "encode_us": us(encoded), "total_us": us(total)}


def independent(make, n: int, reps: int) -> dict:
    """Microseconds per operation of `n` independent products of `make()`: encode, and until done."""
    for _ in range(2):
        mx.eval([make() for _ in range(n)])
    encoded, total = [], []
    for _ in range(reps):
        mx.synchronize()
        ys = [make() for _ in range(n)]
        t1 = time.perf_counter()
        mx.async_eval(ys)
        t2 = time.perf_counter()
        mx.eval(ys)
        t3 = time.perf_counter()
        encoded.append(t2 - t1), total.append(t3 - t1)
    us = lambda v: round(_median(v) * 1e6 / n, 2)  # noqa: E731
    return {"encode_us": us(encoded), "total_us": us(total)}


def cases(rows: list, real: bool) -> dict:
    dt = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    out = {}
    w = (mx.random.normal((WIDTH, WIDTH)) * 0.05).astype(dt)
    for m in rows:
        x = mx.random.normal((m, WIDTH)).astype(dt)
        out[f"matmul [{m},{WIDTH}]x[{WIDTH},{WIDTH}]^T"] = chain(lambda y: y @ w.T, x, 256, 7)
    x = mx.random.normal((64, WIDTH)).astype(dt)
    weight = mx.ones((WIDTH,), dt)
    out["add"] = chain(lambda y: y + 1, x, 256, 7)
    out["compiled a*y+b"] = chain(mx.compile(lambda y: y * 0.5 + 1), x, 256, 7)
    out["rms_norm"] = chain(lambda y: mx.fast.rms_norm(y, weight, 1e-5), x, 256, 7)
    try:
        kernel = mx.fast.cuda_kernel(name="host_cost_copy", input_names=["inp"], output_names=["out"],
                                     source="const int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
                                            "if (i < N) out[i] = inp[i];\n")
    except RuntimeError as exc:  # no CUDA backend
        out["custom_kernel"] = f"skipped: {exc}"
    else:
        out["custom_kernel"] = chain(lambda y: kernel(inputs=[y], template=[("N", y.size)], grid=(y.size, 1, 1),
                                                      threadgroup=(128, 1, 1), output_shapes=[y.shape],
                                                      output_dtypes=[y.dtype])[0], x, 256, 7)
    if real:  # the 8B's decode projections (fused q/k/v, o, fused gate/up, down)
        for name, n, k in (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)):
            wr = (mx.random.normal((n, k)) * 0.02).astype(dt)
            for m in rows:
                xr = mx.random.normal((m, k)).astype(dt)
                mx.eval(xr, wr)
                out[f"real_{name}_M{m}"] = independent(lambda: xr @ wr.T, 32, 5)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,2,64,128", help="matmul rows (M) to time")
    p.add_argument("--real", action="store_true", help="also the 8B's decode projections (GPU memory: ~1 GB)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = dict(bench="mlx_host_cost", argv=list(argv if argv is not None else sys.argv[1:]),
                  environment=environment(),
                  mlx_env={k: v for k, v in os.environ.items() if k.startswith("MLX_")},
                  cases=cases([int(r) for r in args.rows.split(",")], args.real))
    emit(result, args.json, args.out)
    return result


if __name__ == "__main__":
    main()
