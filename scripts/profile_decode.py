"""Where a decode step's time goes: the engine's public step records of B rows decoding together.

Per pipelined decode step (engine/decode_pipeline.py: while decode k runs on the device the host builds
k+1's graph, waits for k, launches k+1, then commits k's tokens; launched ahead, StepOptions.launch_ahead,
k+1 is launched before the wait) the records give, in host seconds: the graph
build of the next forward, the wait for the running one, the launch (MLX encoding the graph into CUDA
graphs; the device starts on the first batches meanwhile) and the commit (scheduler update, detokenizing,
outputs). When the wait is near zero the host is the bottleneck: the device idles while the host works.
With a launch thread (StepOptions.launch_thread, CUDA's default) the launch is only its hand-over: the
thread encodes the decode while the engine thread commits and builds, and the wait has two parts, for the
thread to finish encoding (`wait_encode`) and then for the device (`wait_device`).

`--cuda-profile-step K` brackets the K-th decode step with cuProfilerStart/Stop, so that
`ncu --profile-from-start off` times exactly the kernels of the one forward launched in it (`--ncu-csv`
summarises such a log per kernel kind).

    python3 scripts/profile_decode.py --model llama-8b --dtype bfloat16 --rows 16,64,128 --json
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import emit, environment, load_bench_model, random_prompts  # noqa: E402
from bench_serving_stats import percentile  # noqa: E402


def _ms(values: list[float]) -> dict:
    """Median, 10th and 90th percentiles in ms (none for no values)."""
    if not values:
        return {}
    return {name: round(1000 * percentile(values, q), 3) for name, q in (("median", 0.5), ("p10", 0.1), ("p90", 0.9))}


def _anatomy(records: list) -> dict:
    """Medians of a pipelined decode step's parts, from its records' ForwardTiming (module docstring)."""
    parts = defaultdict(list)
    for r in records:
        parts["step"].append(r.duration_s)
        if len(r.forwards) != 1 or r.forwards[0].build_s is None:
            continue
        f = r.forwards[0]
        parts["build_next"].append(f.built_s - f.build_s)
        parts["wait_running"].append(f.launch_s - f.built_s)
        parts["launch_next"].append(f.launched_s - f.launch_s)
        parts["commit"].append(r.duration_s - f.launched_s)
        if f.prev_encoded_s is not None:  # a launch thread encoded the running decode: the wait's two parts
            parts["wait_encode"].append(max(0.0, f.prev_encoded_s - f.built_s))
            parts["wait_device"].append(f.launch_s - max(f.built_s, f.prev_encoded_s))
    return {k: _ms(v) for k, v in parts.items()}


def _cuda_profiler(start: bool) -> None:
    import mlx.core as mx

    mx.synchronize()
    lib = ctypes.CDLL("libcuda.so.1")
    (lib.cuProfilerStart if start else lib.cuProfilerStop)()


def profile_rows(lm, rows: int, prompt_tokens: int, steps: int, profile_step: int, overrides: dict,
                 launch_thread: Optional[bool] = None) -> dict:
    """`launch_thread`: StepOptions' (None: the engine's choice; off where a step is profiled, whose
    next decode the launch thread would encode after the step returned, past the profiled range)."""
    from bench_engine import make_engine
    from engine.core.types import SamplingParams

    max_tokens = steps + 16
    if profile_step >= 0:
        launch_thread = False
    engine = make_engine(lm, [prompt_tokens] * rows, max_tokens, max_num_seqs=max(rows, 64),
                         launch_thread=launch_thread, **overrides)
    for i, prompt in enumerate(random_prompts([prompt_tokens] * rows, lm.config["vocab_size"], rows)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    decodes, mixed, prefill_only = [], [], []
    num_steps = 0
    t0 = time.perf_counter()
    first_token_s, profiled = None, None
    while engine.has_unfinished():
        profiling = profile_step == num_steps
        if profiling:
            _cuda_profiler(True)
        record = engine.step()
        num_steps += 1
        if profiling:
            _cuda_profiler(False)
            profiled = _shape(record)
        plan = record.plan
        if plan is None:
            continue
        if first_token_s is None and record.outputs:
            first_token_s = time.perf_counter() - t0
        if plan.prefills:
            (mixed if plan.decodes else prefill_only).append(record)
        elif len(plan.decodes) == rows and record.pipelined:
            decodes.append(record)
    wall_s = time.perf_counter() - t0
    steady = decodes[4:]  # past the pipeline's start
    return dict(
        rows=rows, launch_thread=engine.execution_paths().launch_thread, prompt_tokens=prompt_tokens,
        wall_s=round(wall_s, 3), num_decode_steps=len(decodes),
        decode=_anatomy(steady), decode_tok_per_s=round(rows / statistics.median([r.duration_s for r in steady]), 1)
        if steady else None,
        prefill_steps=dict(count=len(prefill_only), step=_ms([r.duration_s for r in prefill_only]),
                           tokens=[r.num_prefill_tokens for r in prefill_only][:12]),
        mixed_steps=dict(count=len(mixed), step=_ms([r.duration_s for r in mixed])),
        first_output_s=round(first_token_s or 0.0, 3), output_tok_per_s=round(rows * max_tokens / wall_s, 1),
        profiled_step=profiled, steps=[_shape(r) for r in prefill_only + mixed][:40],
    )


def _shape(record) -> dict:
    """A step's shape and time: its prompt chunks' tokens, decode rows, pipelined or not."""
    return dict(chunks=[c.num_tokens for c in record.prefill_chunks], decode_rows=record.num_decode_tokens,
                pipelined=record.pipelined, ms=round(1000 * record.duration_s, 3),
                forwards=[round(1000 * ((f.waited_s or f.launched_s) - f.launch_s), 3) for f in record.forwards])


_KINDS = (("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90", "matmul", "gemv")),
          ("attention", ("pool_attention", "sdpa", "attention", "flash")),
          ("rope", ("rope",)), ("norm", ("rms",)), ("compiled", ("compiled", "fused")),
          ("copy", ("copy", "slice", "scatter", "gather")), ("reduce", ("reduce", "arg")))


def summarise_ncu(path: str) -> dict:
    """Per kernel kind: count and total GPU time (ns) of an `ncu --csv --metrics gpu__time_duration.sum` log."""
    lines = Path(path).read_text(errors="replace").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return dict(error="no ncu table", head=lines[:20])
    kinds, names = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name, value = row.get("Kernel Name", "?"), float(row["Metric Value"].replace(",", ""))
        scale = {"nsecond": 1, "usecond": 1e3, "msecond": 1e6}.get(row.get("Metric Unit", "nsecond"), 1)
        kind = next((k for k, keys in _KINDS if any(s in name.lower() for s in keys)), "other")
        for table, key in ((kinds, kind), (names, name[:90])):
            table[key][0] += 1
            table[key][1] += value * scale
    total = sum(v[1] for v in kinds.values())
    top = sorted(names.items(), key=lambda kv: -kv[1][1])[:25]
    return dict(num_kernels=sum(v[0] for v in kinds.values()), total_gpu_ms=round(total / 1e6, 3),
                kinds={k: dict(count=c, ms=round(t / 1e6, 3)) for k, (c, t) in sorted(kinds.items())},
                top_kernels=[dict(name=n, count=c, ms=round(t / 1e6, 4)) for n, (c, t) in top])


def gemm_tflops(model: str, prompt_tokens: int, gemm_ms: float) -> dict:
    """The rate of a step's matmuls counted as its prompt tokens' alone (2 x the layers' projection
    parameters a token; the decode rows' and the LM head's few products left out, so a floor)."""
    from bench_common import RANDOM_SHAPES, matmul_params

    flops = 2.0 * matmul_params(RANDOM_SHAPES[model]) * prompt_tokens
    return dict(model=model, prompt_tokens=prompt_tokens, gemm_ms=gemm_ms,
                tflops=round(flops / (gemm_ms * 1e-3) / 1e12, 1))


def decode_floors(config: dict, dtype_bytes: int, rows: int, context: int, bandwidth_tbs: float) -> dict:
    """The bytes a decode of `rows` rows with `context` keys each must read (every layer's projections
    and the LM head once, every row's KV once) and that read's time at `bandwidth_tbs`."""
    from bench_common import matmul_params

    h = config["num_attention_heads"]
    kv_per_token = (2 * config["num_hidden_layers"] * (config.get("num_key_value_heads") or h)
                    * (config.get("head_dim") or config["hidden_size"] // h) * dtype_bytes)
    weights = (matmul_params(config) + config["vocab_size"] * config["hidden_size"]) * dtype_bytes
    kv = rows * context * kv_per_token
    ms = lambda n: round(1e3 * n / (bandwidth_tbs * 1e12), 3)  # noqa: E731
    return dict(rows=rows, context=context, bandwidth_tbs=bandwidth_tbs, weights_bytes=weights, kv_bytes=kv,
                weights_ms=ms(weights), kv_ms=ms(kv), floor_ms=ms(weights + kv))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rows", default="16,64", help="comma-separated numbers of rows decoding together")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=48, help="decode steps per run")
    p.add_argument("--cuda-profile-step", type=int, default=-1,
                   help="bracket the engine's step of this index (from 0, in the first --rows value's run) with "
                   "cuProfilerStart/Stop, for ncu --profile-from-start off")
    p.add_argument("--engine-config", default="{}", help="EngineConfig fields as JSON")
    p.add_argument("--launch-thread", choices=("default", "on", "off", "both"), default="default",
                   help="pipelined decodes encoded on a thread of their own (StepOptions.launch_thread; "
                   "default: the engine's choice, on CUDA only); both: off, then on, for each row count")
    p.add_argument("--ncu-csv", help="only summarise this ncu CSV log")
    p.add_argument("--prompt-tokens-in-step", type=int, default=0,
                   help="--ncu-csv: the profiled step's prompt tokens, for its matmuls' TFLOP/s (--model's shape)")
    p.add_argument("--floors", help="only the bytes-read floor of a decode of ROWS:CONTEXT (--model a random shape)")
    p.add_argument("--bandwidth-tbs", type=float, default=4.3, help="--floors: the device's copy rate, TB/s")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.ncu_csv or args.floors:
        if args.ncu_csv:
            result = summarise_ncu(args.ncu_csv)
            if args.prompt_tokens_in_step and "kinds" in result:
                result["gemm_tflops"] = gemm_tflops(args.model, args.prompt_tokens_in_step,
                                                    result["kinds"]["gemm"]["ms"])
        else:
            from bench_common import RANDOM_SHAPES

            rows, context = (int(x) for x in args.floors.split(":"))
            result = decode_floors(RANDOM_SHAPES[args.model], 2 if args.dtype in ("bfloat16", "float16") else 4,
                                   rows, context, args.bandwidth_tbs)
        emit(result, args.json, args.out)
        return result
    import json

    lm = load_bench_model(args.model, args.dtype)
    overrides = json.loads(args.engine_config)
    runs = []
    modes = {"default": [None], "on": [True], "off": [False], "both": [False, True]}[args.launch_thread]
    for i, rows in enumerate(int(r) for r in args.rows.split(",")):
        for launch_thread in modes:
            runs.append(profile_rows(lm, rows, args.prompt_tokens, args.steps,
                                     args.cuda_profile_step if i == 0 else -1, overrides, launch_thread))
    result = dict(bench="profile_decode", argv=sys.argv[1:] if argv is None else argv, model=args.model,
                  dtype=lm.dtype, engine_config=overrides, environment=environment(), runs=runs)
    emit(result, args.json, args.out)
    return result


if __name__ == "__main__":
    main()
