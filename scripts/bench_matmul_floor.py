#!/usr/bin/env python3
"""The floor of a decode step: only its matmuls, on MLX as configured (prints JSON).

A decode step of B rows of an 8B llama reads every weight once: per layer the fused q/k/v, o, fused
gate/up and down projections, then the LM head. This times those matmuls alone, `B x K @ K x N` with
distinct random weights per layer (so nothing stays in the GPU's L2), with nothing else in the graph,
and reports the time per step and the weight bytes read per second. Set beside bench_decode_step.py's
step time it says how much of a decode step is the matmuls and how much everything else.

    python scripts/bench_matmul_floor.py --batches 1,4,8 --out floor.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import LLAMA_8B, emit, environment  # noqa: E402

import mlx.core as mx  # noqa: E402


def layer_shapes(cfg: dict) -> list[tuple[int, int]]:
    """(N, K) of one layer's four decode matmuls (projections fused as the engine does)."""
    d, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or d // heads
    inter = cfg["intermediate_size"]
    return [((heads + 2 * kv) * head_dim, d), (d, heads * head_dim), (2 * inter, d), (d, inter)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--layers", type=int, default=None, help="default: the 8B's 32")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cfg = dict(LLAMA_8B)
    layers = args.layers or cfg["num_hidden_layers"]
    dtype = getattr(mx, args.dtype)
    shapes = layer_shapes(cfg) * layers + [(cfg["vocab_size"], cfg["hidden_size"])]
    weights = []
    for i, (n, k) in enumerate(shapes):
        weights.append(mx.random.normal((n, k), key=mx.random.key(i)).astype(dtype))
        mx.eval(weights[-1])
    weight_bytes = sum(w.nbytes for w in weights)
    results = []
    for b in [int(x) for x in args.batches.split(",")]:
        xs = {k: mx.random.normal((b, k), key=mx.random.key(10_000 + k)).astype(dtype) for _, k in shapes}
        mx.eval(list(xs.values()))

        def step():
            outs = [xs[w.shape[1]] @ w.T for w in weights]
            mx.eval(outs)

        for _ in range(args.warmup):
            step()
        mx.synchronize()
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            step()
            mx.synchronize()
            times.append(time.perf_counter() - t)
        times.sort()
        mean = sum(times) / len(times)
        results.append(dict(batch=b, matmuls=len(weights), step_ms_mean=round(1000 * mean, 3),
                            step_ms_median=round(1000 * times[len(times) // 2], 3),
                            weight_tb_per_s=round(weight_bytes / mean / 1e12, 3)))
        print(results[-1], file=sys.stderr, flush=True)
    result = dict(bench="matmul_floor", argv=sys.argv[1:] if argv is None else argv, layers=layers, dtype=args.dtype,
                  weight_bytes=weight_bytes, environment=environment(), results=results)
    emit(result, True, args.out)
    return result


if __name__ == "__main__":
    main()
