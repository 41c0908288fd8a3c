#!/usr/bin/env python3
"""How long MLX's CUDA backend takes to compile the paged decode kernel (NVRTC, at its first call): in a
fresh process, the first and the second call of the span kernel at each fixed span (8 KV heads, 32 query
heads, d 128, bf16, 4 rows of 300-2000 keys), then the whole self-check. Where the keys per span were a
template argument every span was an instance compiled at its first call; now they are an input
(engine/model/kernels/split_attention.py). GPU only; run it in a process of its own.

    python3 scripts/time_span_compiles.py --json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import emit  # noqa: E402  (imports the engine first: its MLX settings)

import mlx.core as mx  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)
    from engine.model.kernels.paged_attention import CudaPagedAttention, self_check
    from engine.model.kernels.split_attention import SPAN_CHOICES

    if mx.default_device() == mx.cpu:
        raise SystemExit("time_span_compiles.py: the kernel is MLX CUDA's; this device is the CPU")
    base = CudaPagedAttention(8, 256)
    slots = 8 * 256
    kp, vp = (mx.random.normal((slots * 8, 128)).astype(mx.bfloat16) for _ in range(2))
    q = mx.random.normal((4, 32, 1, 128)).astype(mx.bfloat16)
    table = mx.array([list(range(8))] * 4, mx.int32)
    lens = mx.array([2000, 1500, 700, 300], mx.int32)
    mx.eval(kp, vp, q, table, lens)
    out: dict = {}
    for keys in SPAN_CHOICES:
        impl = base.fixed_span(keys)
        times = []
        for _ in range(2):
            t = time.perf_counter()
            mx.eval(impl(q, kp, vp, table, lens, 0.088))
            times.append(time.perf_counter() - t)
        out[keys] = dict(first_s=round(times[0], 3), second_s=round(times[1], 5))
    t = time.perf_counter()
    self_check(base, 32, 128, mx.bfloat16)
    out["self_check_after_s"] = round(time.perf_counter() - t, 3)
    emit(out, args.json, args.out)
    return out


if __name__ == "__main__":
    main()
