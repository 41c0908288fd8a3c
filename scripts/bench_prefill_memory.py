"""Prefill of several prompts arriving together: peak memory, TTFT and time, four ways.

    python scripts/bench_prefill_memory.py --model default --lengths 1024,768,512,256 --json
    python scripts/bench_prefill_memory.py --model llama-8b --dtype bfloat16 \
        --lengths 8192,6144,4096,2048 --json          # on a GPU (docs/benchmarks.md)

Ways, each in this one process, with everything freed in between:
- sequential:   one prompt after another, `--chunk`-token chunks through mlx-lm's KVCache (each
                prompt's KV kept), prompt[:-1] in chunks then the last token, as mlx-lm's generate_step.
- engine:       this engine at its default config (memory limit set high enough to admit them all).
- mlx_lm:       mlx-lm's BatchGenerator with mlx_lm.server's defaults (decode_concurrency 32,
                prompt_concurrency 8, prefill_step_size 2048), run until every prompt has a token.
- naive_padded: one right-padded [B, max_len] forward with an explicit [B, 1, L, L] bool mask.
- engine_modules, engine_no_overlap (only when asked for in --ways): the engine with its forwards
                through mlx-lm's modules (`RunnerOptions(layer_loops=False)`), or waiting for every
                step's last forward before the next step (`overlap_steps=False`), to compare with its
                default in the same process.

Per way: peak_over_weights_bytes (peak - memory alive before the way, i.e. the weights),
transient_peak_bytes (that minus the KV alive at the end), predicted_peak_bytes (the engine's memory
model applied to the way's plan; for the batched ways the per-row formula times the rows, an
approximation), ttft_s per prompt from the start, prefill_s until every prompt has its first token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (LoadedModel, emit, environment, free_memory, load_bench_model, log,  # noqa: E402
                          memory_model_for, prefill_flops, random_prompts)
from bench_engine import ENGINE_OVERRIDES  # noqa: E402
from bench_prefill_ways import run_engine, run_mlx_lm, run_naive_padded, run_sequential  # noqa: E402

import mlx.core as mx  # noqa: E402

WAYS = ("sequential", "engine", "mlx_lm", "naive_padded")
EXTRA_WAYS = {"engine_modules": dict(layer_loops=False), "engine_no_overlap": dict(overlap_steps=False)}


def run_way(way: str, lm: LoadedModel, prompts, args, memory) -> dict:
    if way == "sequential":
        return run_sequential(lm, prompts, args.chunk or 512, memory)
    if way == "engine":
        return run_engine(lm, prompts, args.chunk, args.max_tokens)
    if way in EXTRA_WAYS:
        return run_engine(lm, prompts, args.chunk, args.max_tokens, **EXTRA_WAYS[way])
    if way == "mlx_lm":
        return run_mlx_lm(lm, prompts, memory, args.max_tokens)
    if way == "naive_padded":
        return run_naive_padded(lm, prompts, memory)
    raise ValueError(way)


def warmup_lengths(lengths: list[int], chunk: int) -> list[int]:
    """Shorter prompts (an eighth): the kernels compile on their first use, not while timed."""
    return [max(8 + i, n // 8) for i, n in enumerate(lengths)]


def targets(ways: dict) -> dict:
    """The issue's targets. Transients are compared two ways: the issue's whole-run definition (peak -
    weights - KV alive at the end, which subtracts KV that did not exist yet at the peak) and the
    step-wise one (each forward's peak over what was live before it, less the KV it added)."""
    t: dict = {}
    eng, seq, mlm = ways.get("engine"), ways.get("sequential"), ways.get("mlx_lm")
    if eng and seq:
        for key, name in (("transient_peak_bytes", ""), ("stepwise_transient_bytes", "_stepwise")):
            ratio = eng[key] / max(seq[key], 1)
            t[f"engine_over_sequential_transient{name}"] = ratio
            t[f"engine_transient_le_1_25x_sequential{name}"] = ratio <= 1.25
        t["engine_prefill_le_sequential"] = eng["prefill_s"] <= seq["prefill_s"]
        t["engine_over_sequential_prefill_s"] = eng["prefill_s"] / seq["prefill_s"]
        if "prefill_s_passes" in eng and "prefill_s_passes" in seq:  # --repeat: pass by pass, and medians
            t["engine_over_sequential_prefill_s_passes"] = [
                e / q for e, q in zip(eng["prefill_s_passes"], seq["prefill_s_passes"])]
            t["engine_over_sequential_prefill_s_median"] = eng["prefill_s_median"] / seq["prefill_s_median"]
            t["engine_prefill_le_sequential_median"] = eng["prefill_s_median"] <= seq["prefill_s_median"]
    for name in EXTRA_WAYS:  # not targets: variants of the engine, for comparison
        variant = ways.get(name)
        if variant and seq:
            t[f"{name}_over_sequential_prefill_s"] = variant["prefill_s"] / seq["prefill_s"]
            if "prefill_s_median" in variant and "prefill_s_median" in seq:
                t[f"{name}_over_sequential_prefill_s_median"] = variant["prefill_s_median"] / seq["prefill_s_median"]
    if eng:
        ratio = eng["predicted_peak_bytes"] / max(eng["stepwise_transient_bytes"], 1)
        t["prediction_over_measured"] = ratio  # max predicted step / max measured step (engine's own)
        t["prediction_within_1_0_to_1_2"] = 1.0 <= ratio <= 1.2
        t["prediction_over_measured_at_peak_step"] = eng["step_ratio_at_peak"]
        t["prediction_never_under"] = eng["underpredicted_steps"] == 0
    if eng and mlm:
        t["engine_mean_ttft_le_mlx_lm"] = eng["mean_ttft_s"] <= mlm["mean_ttft_s"]
        t["engine_over_mlx_lm_mean_ttft"] = eng["mean_ttft_s"] / mlm["mean_ttft_s"]
    return t


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="default | tiny | llama-8b | llama-test | PATH")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--lengths", default="8192,6144,4096,2048", help="prompt lengths, arriving together")
    p.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: the engine's, 512)")
    p.add_argument("--ways", default=",".join(WAYS), help=f"subset of {','.join(WAYS)}, run in this order")
    p.add_argument("--skip-naive", action="store_true", help="leave naive_padded out")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="max_tokens of each request in the engine / mlx-lm ways (large enough that no "
                        "request finishes, and frees its KV, before every prompt has its first token)")
    p.add_argument("--warmup", choices=["small", "full", "none"], default="small",
                   help="warm-up pass before timing: prompts an eighth as long (small) or the same "
                        "lengths (full: on CUDA every new attention shape builds kernels/graphs once)")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed passes of every way, interleaved (the first also measures memory); with more "
                        "than one, prefill_s_passes and medians, and the prefill target on the medians")
    p.add_argument("--layers", type=int, default=None, help="truncate a random llama shape's layers")
    p.add_argument("--init", choices=["normal", "zeros"], default="normal", help="random weights' init")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (H200 bf16: 790)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-config", default=None,
                   help="JSON of EngineConfig fields to override (e.g. memory_coefficients from a grid fit)")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.add_argument("--out", default=None, help="also write the result (rewritten after every way)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    ways = [w for w in args.ways.split(",") if w]
    unknown = set(ways) - set(WAYS) - set(EXTRA_WAYS)
    if unknown:
        raise SystemExit(f"unknown ways {sorted(unknown)}; choose from {WAYS + tuple(EXTRA_WAYS)}")
    if args.skip_naive:
        ways = [w for w in ways if w != "naive_padded"]
    lm = load_bench_model(args.model, args.dtype, args.layers, args.init, args.seed)
    ENGINE_OVERRIDES.update(json.loads(args.engine_config) if args.engine_config else {})
    # the other ways' predictions: their forwards run mlx-lm's modules, with MLX's attention
    memory = memory_model_for(lm, ENGINE_OVERRIDES.get("memory_coefficients"), cpu_math=False)
    prompts = random_prompts(lengths, lm.config["vocab_size"], args.seed)
    result: dict = dict(
        bench="prefill_memory", argv=sys.argv[1:] if argv is None else argv, model=args.model,
        dtype=lm.dtype, lengths=lengths, chunk=args.chunk or 512, weights_bytes=lm.weights_bytes,
        num_params=lm.num_params, model_build_s=lm.build_s, environment=environment(), ways={},
        flops=prefill_flops(lm.config, lengths),
    )
    log(f"model {args.model} {lm.dtype}: {lm.weights_bytes / 1e9:.2f} GB weights, built in {lm.build_s:.1f} s")
    if args.warmup != "none":
        warm_up(lm, ways, lengths, args, memory, result)
    for way in ways:
        measured_pass(lm, way, prompts, args, memory, result)
    for _ in range(args.repeat - 1):  # more timed passes, the ways interleaved (machine drift hits each)
        for way in ways:
            r = run_way(way, lm, prompts, args, memory)
            free_memory()
            passes = result["ways"][way].setdefault("passes", [])
            passes.append({k: r[k] for k in ("prefill_s", "mean_ttft_s", "stepwise_transient_bytes")})
            log(f"{way} again: prefill {r['prefill_s']:.3f} s, mean TTFT {r['mean_ttft_s']:.3f} s")
    if args.repeat > 1:
        for r in result["ways"].values():
            every = [r] + r["passes"]
            r["prefill_s_passes"] = [p["prefill_s"] for p in every]
            r["prefill_s_median"] = statistics.median(r["prefill_s_passes"])
            r["mean_ttft_s_median"] = statistics.median(p["mean_ttft_s"] for p in every)
    result["targets"] = targets(result["ways"])
    emit(result, args.json, args.out)
    return result


def warm_up(lm: LoadedModel, ways: list[str], lengths: list[int], args, memory, result: dict) -> None:
    """Every way once on other prompts (--warmup), into result["warmup"]."""
    wl = lengths if args.warmup == "full" else warmup_lengths(lengths, args.chunk or 512)
    wp = random_prompts(wl, lm.config["vocab_size"], args.seed + 1)
    result["warmup"] = {"lengths": wl, "ways": {}}
    for way in ways:
        t = time.perf_counter()
        w = run_way(way, lm, wp, args, memory)
        free_memory()
        result["warmup"]["ways"][way] = {k: w[k] for k in ("prefill_s", "mean_ttft_s", "transient_peak_bytes",
                                                           "stepwise_transient_bytes")}
        log(f"warm-up {way} {wl}: {time.perf_counter() - t:.1f} s (prefill {w['prefill_s']:.3f} s)")


def measured_pass(lm: LoadedModel, way: str, prompts: list[list[int]], args, memory, result: dict) -> None:
    """The first timed pass of a way, which also measures its memory, into result["ways"] (and --out)."""
    r = run_way(way, lm, prompts, args, memory)
    free_memory()
    r["leftover_active_bytes"] = mx.get_active_memory() - lm.weights_bytes
    if args.peak_tflops:
        r["tflops"] = result["flops"] / r["prefill_s"] / 1e12
        r["mfu"] = r["tflops"] / args.peak_tflops
    result["ways"][way] = r
    log(f"{way}: transient {r['transient_peak_bytes'] / 1e9:.3f} GB, step-wise "
        f"{r['stepwise_transient_bytes'] / 1e9:.3f} GB (peak over weights "
        f"{r['peak_over_weights_bytes'] / 1e9:.3f} GB, KV {r['kv_live_bytes'] / 1e9:.3f} GB), predicted "
        f"{'-' if r['predicted_peak_bytes'] is None else round(r['predicted_peak_bytes'] / 1e9, 3)} GB, "
        f"prefill {r['prefill_s']:.3f} s, mean TTFT {r['mean_ttft_s']:.3f} s")
    result["targets"] = targets(result["ways"])
    if args.out:  # a later way may kill the process (MLX aborts on a failed allocation)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
