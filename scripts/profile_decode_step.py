#!/usr/bin/env python3
"""One decode step of the engine between cudaProfilerStart / Stop, for Nsight Compute (prints JSON).

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv --log-file ncu.csv \\
        python3 scripts/profile_decode_step.py --model llama-8b --dtype bfloat16 --batch 4
    python3 scripts/profile_decode_step.py --summarize ncu.csv      # anywhere: kernel time by kernel

B rows of `--prompt-tokens` prefill, `--warmup` synchronous decode steps run, then exactly one
synchronous decode step runs inside the profiled range (so every kernel ncu reports is that step's),
timed on its own first without the profiler range. `--summarize` adds up ncu's per-kernel durations:
the GPU's busy time in the step, to set beside its wall time (the rest is the GPU waiting for the host).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import glob
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def cudart():
    """libcudart of the CUDA wheels MLX uses (for cudaProfilerStart / Stop); None where there is none
    (the step then runs unprofiled, e.g. on the CPU)."""
    patterns = ["/root/site/nvidia/cu13/lib/libcudart.so*", "/root/site/nvidia/*/lib/libcudart.so*"]
    try:
        import nvidia

        patterns += [f"{p}/*/lib/libcudart.so*" for p in nvidia.__path__]
    except ImportError:
        pass
    for path in [p for pattern in patterns for p in sorted(glob.glob(pattern))] + ["libcudart.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    print("no libcudart found: the step runs without a profiler range", file=sys.stderr)
    return None


def profile(args) -> dict:
    import mlx.core as mx
    from bench_common import emit, environment, load_bench_model
    from bench_decode_step import decoding_engine

    lm = load_bench_model(args.model, args.dtype)
    engine = decoding_engine(lm, args.batch, args.prompt_tokens, args.warmup + 2, async_decode=False,
                             kernels=bool(args.decode_kernels))
    walls = []
    for _ in range(args.warmup):
        t = time.perf_counter()
        engine.step()
        mx.synchronize()
        walls.append(time.perf_counter() - t)
    lib = cudart()
    if lib is not None:
        lib.cudaProfilerStart()
    t = time.perf_counter()
    outs = engine.step()
    mx.synchronize()
    profiled = time.perf_counter() - t
    if lib is not None:
        lib.cudaProfilerStop()
    assert len(outs) == args.batch
    result = dict(bench="profile_decode_step", model=args.model, dtype=lm.dtype, batch=args.batch,
                  decode_kernels=engine.runner.decode_path is not None,
                  paged_attention=engine.runner.paged_attention,
                  warm_step_ms=[round(1000 * w, 3) for w in walls[-5:]],
                  profiled_step_ms=round(1000 * profiled, 3), environment=environment())
    emit(result, True, args.out)
    return result


def summarize(path: str) -> dict:
    """ncu's CSV (one row per kernel launch and metric) -> total and per-kernel GPU time of the step."""
    lines = Path(path).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    by_name: dict = defaultdict(lambda: [0, 0.0])
    launches, total_ns = 0, 0.0
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = row.get("Metric Unit", "nsecond")
        value = float(row["Metric Value"].replace(",", ""))
        ns = value * {"nsecond": 1, "usecond": 1e3, "msecond": 1e6, "second": 1e9}.get(unit, 1)
        name = row["Kernel Name"].split("(")[0].split("<")[0]
        by_name[name][0] += 1
        by_name[name][1] += ns
        launches += 1
        total_ns += ns
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return dict(file=path, kernel_launches=launches, gpu_busy_ms=round(total_ns / 1e6, 3),
                by_kernel=[dict(kernel=k, launches=n, ms=round(ns / 1e6, 3)) for k, (n, ns) in top[:25]])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--summarize", default=None, help="an ncu --csv log of this script's run")
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--decode-kernels", type=int, choices=[0, 1], default=0,
                   help="1: the engine's own decode loop and kernels (engine/model/layers/decode_path.py; off by default)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.summarize:
        result = summarize(args.summarize)
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return result
    return profile(args)


if __name__ == "__main__":
    main()
