"""Serving load: N concurrent streams, TTFT / TPOT / aggregate output tok/s, over HTTP or in-process.

HTTP (any OpenAI-compatible /v1/completions endpoint, streaming):
    python scripts/bench_serving.py --url http://127.0.0.1:8000 --concurrency 8 --prompt-tokens 256 \
        --output-tokens 64 --num-requests 16 [--rate 2.0] [--compare-mlx-lm] --json
    python scripts/bench_serving.py --start-app --compare-mlx-lm ...   # starts `serve run config/serve.yaml`
    ... --start-app --compare-mlx-lm --repeat 3   # 3 passes, each server started afresh for each, in
                                                  # alternating order; the ratios are of the medians

In-process (no HTTP): this engine (AsyncEngine, and the bare Engine.step loop with a per-step time
breakdown) against mlx-lm's BatchGenerator with mlx_lm.server's defaults, same prompts, same load:
    python scripts/bench_serving.py --engine-only --model default --concurrency 1,8 \
        --prompt-tokens 256 --output-tokens 32 --json
The cost of grammar-constrained decoding (bench_constrained.py): the same streams all free, then with a
fraction constrained by a JSON schema:
    python scripts/bench_serving.py --engine-only --constrained-fraction 0.5 --model tiny --concurrency 8 --json

Every request gets exactly --output-tokens tokens (EOS ignored: `ignore_eos` for this server,
`logit_bias` against the EOS ids for mlx_lm.server; in-process, neither side stops at EOS). Prompts are
random tokens (in-process) or random words counted with the model's tokenizer (HTTP), unique per
request so no prefix cache helps either side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, environment, free_memory, load_bench_model, log, random_prompts  # noqa: E402
from bench_serving_drivers import backend_runners  # noqa: E402
from bench_serving_stats import arrival_times, compare, fmt  # noqa: E402


def engine_only(args) -> dict:
    lm = load_bench_model(args.model, args.dtype, args.layers, args.init, args.seed)
    result = dict(bench="serving_engine_only", argv=sys.argv[1:], model=args.model, dtype=lm.dtype,
                  prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, rate=args.rate,
                  weights_bytes=lm.weights_bytes, environment=environment(), runs={})
    backends = [b for b in args.backends.split(",") if b]
    runners = backend_runners()
    warm_up(lm, backends, runners, args, result)
    for rep, conc in [(r, c) for r in range(args.repeat) for c in args.concurrency]:
        args.concurrency_now = conc
        n = args.num_requests or conc
        prompts = random_prompts([args.prompt_tokens] * n, lm.config["vocab_size"], args.seed + conc)
        arrivals = arrival_times(n, args.rate, args.seed)
        for backend in backends:
            r = runners[backend](lm, prompts, arrivals, args)
            free_memory()
            r["concurrency"], r["backend"], r["repeat"] = conc, backend, rep
            result["runs"][f"{backend}@{conc}" + (f"#{rep}" if rep else "")] = r
            log(f"{backend} x{conc}: TTFT mean {fmt(r['ttft_mean_s'])} s, TPOT {fmt(r['tpot_mean_s'])} s, "
                f"{fmt(r['output_tok_per_s'], 1)} tok/s, peak over weights "
                f"{r['peak_over_weights_bytes'] / 1e9:.3f} GB, errors {r['errors']}")
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    result["comparison"] = compare(result["runs"], args.concurrency, "engine", "mlx_lm")
    result["comparisons"] = {b: compare(result["runs"], args.concurrency, b, "mlx_lm")
                             for b in backends if b != "mlx_lm"}
    if "mlx_lm_wide" in backends:
        result["comparison_wide"] = compare(result["runs"], args.concurrency, "engine", "mlx_lm_wide")
    return result


def warm_up(lm, backends: list[str], runners: dict, args, result: dict) -> None:
    """Every backend once per concurrency on other prompts of the same lengths (kernels, and on CUDA the
    attention graphs of every shape the timed run meets, are built here), into result["warmup_runs"]."""
    for conc in (args.concurrency if args.warmup == "full" else [max(args.concurrency)]):
        for backend in backends:
            args.concurrency_now = conc
            wp = random_prompts([args.prompt_tokens] * conc, lm.config["vocab_size"], args.seed + 99)
            saved = args.output_tokens
            if args.warmup != "full":
                args.output_tokens = min(8, saved)
            t = time.perf_counter()
            fn = runners[backend]
            w = fn(lm, wp, [0.0] * conc, args) if not backend.startswith("engine_sync") else fn(lm, wp, [0.0] * conc, args, False)
            args.output_tokens = saved
            free_memory()
            result.setdefault("warmup_runs", {})[f"{backend}@{conc}"] = {
                k: w.get(k) for k in ("ttft_mean_s", "tpot_mean_s", "output_tok_per_s")}
            log(f"warm-up {backend} x{conc}: {time.perf_counter() - t:.1f} s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_mode_arguments(p)
    add_load_arguments(p)
    args = p.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    if args.start_app and not args.url:
        args.url = "http://127.0.0.1:8100"  # not serve.yaml's 8000, which a running app may hold
    if not (args.engine_only or args.url or args.compare_mlx_lm or args.trace_summary):
        p.error("give --url, --start-app, --compare-mlx-lm or --engine-only")
    return args


def add_mode_arguments(p: argparse.ArgumentParser) -> None:
    """Which servers or in-process backends run the load."""
    p.add_argument("--url", default=None, help="OpenAI-compatible server (e.g. http://127.0.0.1:8000)")
    p.add_argument("--start-app", action="store_true",
                   help="start our app (serve run on a copy of --app-config, port from --url, default 8100)")
    p.add_argument("--app-config", default="config/serve.yaml")
    p.add_argument("--compare-mlx-lm", action="store_true",
                   help="also start mlx_lm.server on --model's folder and run the same load")
    p.add_argument("--mlx-lm-port", type=int, default=8089)
    p.add_argument("--engine-only", action="store_true", help="in-process, no HTTP")
    p.add_argument("--constrained-fraction", type=float, default=None,
                   help="--engine-only: TPOT with this fraction of the streams constrained by a JSON schema "
                   "against all free (scripts/bench_constrained.py)")
    p.add_argument("--backends", default="engine,engine_sync,mlx_lm",
                   help="--engine-only: engine (AsyncEngine), engine_sync (Engine.step loop), engine_sync_nopipe "
                   "(the same without pipelined decode, async_decode=false), engine_sync_gather (decode gathers "
                   "the KV instead of the CUDA paged-attention kernel, execution.paged_attention=false), "
                   "engine_sync_unfused (one matmul per projection, RunnerOptions.fuse_projections=false), "
                   "engine_sync_modules (forwards through mlx-lm's modules, layer_loops=false), engine_sync_span (the paged "
                   "kernel's untiled span variant, RunnerOptions tiled_attention and mma_attention false), engine_tiled (its tiled kernel "
                   "instead of the tensor-core one, RunnerOptions.mma_attention=false), engine_no_launch_thread (pipelined "
                   "decodes encoded on the engine thread, StepOptions.launch_thread=false), engine_no_launch_ahead (each "
                   "pipelined decode launched once the one before has ended, StepOptions.launch_ahead=false), engine_sync_fused_rope and "
                   "engine_fused_rope (decode's q/k norms and RoPE in one CUDA kernel, RunnerOptions.fused_rope; CUDA's default), "
                   "engine_no_fused_rope (them as separate kernels), engine_no_fused_residual (decode's residual "
                   "adds as kernels of their own, RunnerOptions.fused_residual off), engine_unpacked_step_inputs (a paged "
                   "decode's host-made inputs as arrays of their own, RunnerOptions.pack_step_inputs off), engine_scatter_kv "
                   "(a paged decode's KV scattered into the pool, not written by the rope kernel: "
                   "RunnerOptions.rope_writes_kv off), "
                   "engine_sync_uncompiled and engine_uncompiled (the decode loop's layers built in Python, "
                   "compiled_decode=false), engine_sync_thread (engine_sync in a "
                   "thread of its own), engine_packed and engine_packed2048 (packs of up to 8192 / 2048 prompt tokens, long "
                   "prompts' chunks included), engine_unpacked (no packs, execution.max_packed_tokens=0), mlx_lm, mlx_lm_wide (mlx_lm with its completion batch raised to the "
                   "concurrency)")


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    """The model, the load, its passes and the output."""
    p.add_argument("--model", default="default", help="default | tiny | llama-8b | llama-test | PATH")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--init", choices=["normal", "zeros"], default="normal")
    p.add_argument("--engine-config", default=None, help="JSON of EngineConfig fields to override")
    p.add_argument("--concurrency", default="8", help="streams in flight, one run per value: 1,8")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=None, help="per run (default: the concurrency)")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--log-dir", default="/tmp/bench_serving_logs")
    p.add_argument("--warmup", choices=["full", "small"], default="full",
                   help="--engine-only warm-up: the same lengths at every concurrency (full) or short "
                        "requests at the largest one (small)")
    p.add_argument("--repeat", type=int, default=1,
                   help="timed passes over the concurrencies; over HTTP each pass starts every server afresh, "
                   "in alternating order, and the comparison is of the medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.add_argument("--out", default=None, help="also write the result to this file")
    p.add_argument("--async-warmup", type=int, choices=[0, 1], default=0,
                   help="--engine-only engine: AsyncEngine's own short warm-up before the same-shape pass (1) or not")
    p.add_argument("--trace-steps", type=int, default=0,
                   help="--engine-only: record where the host time of the first N steps goes (engine_sync, engine)")
    p.add_argument("--trace-summary", default=None, metavar="FILE:KEY",
                   help="no run: the median pipelined decode step (traced steps whose decode a launch thread "
                   "encoded) of each run of a recorded result (KEY: a key of FILE, '/' between levels)")
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for this process (how long a thread holds the GIL when "
                   "another waits for it; Python's default 0.005 s)")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.trace_summary:
        from bench_serving_stats import trace_summary

        path, _, key = args.trace_summary.partition(":")
        data = json.loads(Path(path).read_text())
        for part in ([key] if key in data else key.split("/")) if key else []:  # keys may hold a "/"
            data = data[part]
        result = trace_summary(data.get("result", data))
    elif args.engine_only and args.constrained_fraction is not None:
        from bench_constrained import constrained_cost

        result = constrained_cost(args)
    elif args.engine_only:
        result = engine_only(args)
    else:
        from bench_http import http_mode

        result = http_mode(args)
    emit(result, args.json, args.out)
    return result


if __name__ == "__main__":
    main()
