"""MLX's CPU exp against its power, and engine/model/layers/cpu_math.py's attention and SwiGLU against MLX's; JSON.

    python scripts/bench_cpu_math.py --json          # on the CPU (LD_PRELOAD OpenBLAS as docs/benchmarks.md)

Per case: the best of `--repeat` evaluations in ms, and for attention the peak memory over the inputs as
a multiple of the float32 scores ([B, H, T, L] x 4 bytes), also with a causal chunk's queries in one
block instead of cpu_math.QUERY_BLOCKS, and the largest difference from MLX's output. Shapes: SmolLM2-135M's heads (9 query, 3 KV, 64 wide), prompt chunks of 256 and 512 tokens
at a context of 512 and 1024, and a decode of 8 rows over 550 keys (a boolean mask per row).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, environment  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.models.activations import swiglu  # noqa: E402

from engine.model.layers import cpu_math  # noqa: E402


def best_ms(fn, repeat: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return round(min(times) * 1e3, 3)


def peak_over(fn) -> int:
    mx.eval(fn())
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(fn())
    return mx.get_peak_memory() - base


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    key = mx.random.key(0)
    x = mx.random.normal((512, 1536), key=key) * 4
    up = mx.random.normal((512, 1536), key=mx.random.key(1))
    mx.eval(x, up)
    n = x.size
    result = {"bench": "cpu_math", "argv": sys.argv[1:] if argv is None else argv, "environment": environment()}
    exp_ms, power_ms = best_ms(lambda: mx.exp(x), args.repeat), best_ms(lambda: cpu_math.exp(x), args.repeat)
    result["exp"] = {"elements": n, "mx_exp_ms": exp_ms, "power_ms": power_ms,
                     "mx_exp_ns_per_element": round(exp_ms * 1e6 / n, 2),
                     "power_ns_per_element": round(power_ms * 1e6 / n, 2)}
    result["swiglu"] = {"shape": list(x.shape), "mlx_lm_ms": best_ms(lambda: swiglu(x, up), args.repeat),
                        "cpu_math_ms": best_ms(lambda: cpu_math.swiglu(x, up), args.repeat),
                        "max_abs_diff": mx.abs(swiglu(x, up) - cpu_math.swiglu(x, up)).max().item()}
    cases = []
    H, H_kv, d, scale = 9, 3, 64, 0.125
    for B, T, L, mask in ((1, 256, 512, "causal"), (1, 512, 512, "causal"), (1, 512, 1024, "causal"),
                          (8, 1, 550, "rows")):
        ks = mx.random.split(mx.random.key(T + L), 3)
        q = mx.random.normal((B, H, T, d), key=ks[0])
        k = mx.random.normal((B, H_kv, L, d), key=ks[1])
        v = mx.random.normal((B, H_kv, L, d), key=ks[2])
        m = mask
        if mask == "rows":  # each row's own length, as a gathered decode's mask
            m = (mx.arange(L)[None] < mx.array([L - 37 * b for b in range(B)])[:, None])[:, None, None, :]
        mx.eval(q, k, v)
        ours = lambda: cpu_math.attention(q, k, v, scale, m)  # noqa: E731
        one_block = lambda: cpu_math.attention(q, k, v, scale, m, blocks=1)  # noqa: E731
        theirs = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=m)  # noqa: E731
        scores = 4 * B * H * T * L
        cases.append({
            "batch": B, "queries": T, "keys": L, "mask": mask,
            "mlx_ms": best_ms(theirs, args.repeat), "cpu_math_ms": best_ms(ours, args.repeat),
            "mlx_peak_over_scores": round(peak_over(theirs) / scores, 3),
            "cpu_math_peak_over_scores": round(peak_over(ours) / scores, 3),
            "cpu_math_one_block_peak_over_scores": round(peak_over(one_block) / scores, 3),
            "max_abs_diff": mx.abs(ours() - theirs()).max().item(),
        })
    result["attention"] = cases
    for c in cases:
        print(f"attention B={c['batch']} T={c['queries']} L={c['keys']}: MLX {c['mlx_ms']} ms, cpu_math "
              f"{c['cpu_math_ms']} ms; peak {c['mlx_peak_over_scores']} / {c['cpu_math_peak_over_scores']} "
              f"(one block {c['cpu_math_one_block_peak_over_scores']}) x scores", file=sys.stderr)
    print(f"exp {result['exp']['mx_exp_ns_per_element']} ns/element, power "
          f"{result['exp']['power_ns_per_element']} ns/element", file=sys.stderr)
    emit(result, args.json, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
