"""A burst of requests of random lengths under a memory limit a little above the weights: peak memory
against the limit, KV's share of the headroom, wall time and refusals, this engine beside mlx-lm.

    python scripts/bench_tight_burst.py --model tiny --headroom-mb 300 --json          # CPU
    python scripts/bench_tight_burst.py --model llama-8b --dtype bfloat16 --headroom-gb 3,6,12 \
        --max-num-seqs 64 --max-model-len 8448 --json                                  # a GPU

Every request arrives at once (`--num-requests`, prompts of `--min-prompt`..`--max-prompt` random
tokens, `--min-new`..`--max-new` new tokens each, EOS ignored, greedy). Ways, one after another in this
process:
- engine: this engine with `memory_limit_bytes` = what is alive before it (the weights) + the headroom;
  run until every request finished. Per step (`--steps`) its record: the plan's free memory for the
  transient (`free_transient_bytes`), the step's token budget, its chunks ([tokens, context, read as a
  view, pad]) and decode rows, predicted and measured transient, its duration and its forwards' timings;
  the run's peak (MLX's, across the engine's own peak resets) against the limit; `num_chunk_shapes`
  (distinct (tokens, context) pairs its prompt chunks' forwards ran, a padded last chunk's pad included:
  `--pad-last-chunk`) and how many of them no earlier run of the process had
  (`num_new_chunk_shapes`: on MLX's CUDA backend the first forward of a pair builds its attention graph).
- mlx_lm: mlx-lm's BatchGenerator with mlx_lm.server's defaults on the same burst (no memory limit:
  its peak is what the burst needs there).

--replay: no model runs; the burst goes through the Scheduler alone with the engine's CUDA memory model of
a random shape, for each of `--granules` x `--pad-last-chunk` (tight_burst_replay.py).

headroom = limit - weights; kv_share_of_headroom = the engine's KV budget / headroom (what admission
may reserve); kv_peak_share_of_headroom = the largest KV pool it allocated / headroom.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (MLX_LM_SERVER_DEFAULTS, MemoryWindow, PeakTracker, emit, environment,  # noqa: E402
                          free_memory, load_bench_model, log, mlx_lm_generator, random_prompts, run_mlx_lm_burst)

import mlx.core as mx  # noqa: E402


def burst(args, vocab_size: int, max_len: int) -> tuple[list[list[int]], list[int]]:
    """Prompts and max_tokens of the burst (lengths clipped so prompt + new tokens fit `max_len`)."""
    rng = random.Random(args.seed)
    new = [rng.randint(args.min_new, args.max_new) for _ in range(args.num_requests)]
    lengths = [min(rng.randint(args.min_prompt, args.max_prompt), max_len - m) for m in new]
    return random_prompts(lengths, vocab_size, args.seed), new


def step_entry(record, kv_allocated: int) -> dict:
    """One step's record: what it ran (chunks as [tokens, context, read as a view], decode rows and their
    longest context, mixed), what it was sized to, predicted / measured transient and its timings."""
    plan, memory = record.plan, record.memory
    return dict(
        predicted=memory.predicted_bytes, measured=memory.measured_bytes,
        free_transient_bytes=plan.free_transient_bytes, step_budget_tokens=plan.step_budget_tokens,
        memory_limited=plan.memory_limited, tokens=plan.num_batched_tokens, decodes=len(plan.decodes),
        chunks=len(plan.prefills), kv_allocated_bytes=kv_allocated, pipelined=memory.pipelined,
        # the shape each chunk's forward ran (a padded last chunk's pad included) and its pad
        chunk_shapes=[[c.num_forward_tokens, c.start + c.num_forward_tokens, int(c.request_id in record.slice_reads),
                       c.num_pad_tokens] for c in plan.prefills],
        mixed=plan.mixed, duration_s=round(record.duration_s, 5), schedule_s=round(record.schedule_s, 5),
        # per forward: seconds from the step's start to its launch and to the end of its wait (None: left
        # running into the next step)
        forwards=[[round(f.launch_s, 5), None if f.waited_s is None else round(f.waited_s, 5)]
                  for f in record.forwards])


def step_summary(steps: list[dict], seen_shapes: Optional[set]) -> dict:
    """A run's steps in numbers: cut by memory, forwards, chunk shapes (those new to the process:
    `seen_shapes`, updated), predicted against measured and against the free memory."""
    ratios = sorted(s["predicted"] / s["measured"] for s in steps if s["measured"] > 0)
    shapes = {(c[0], c[1]) for s in steps for c in s["chunk_shapes"] if c[0] > 1}
    new_shapes = shapes - (seen_shapes if seen_shapes is not None else set())
    if seen_shapes is not None:
        seen_shapes |= shapes
    return dict(
        num_steps=len(steps), num_memory_limited_steps=sum(s["memory_limited"] for s in steps),
        num_forwards=sum(len(s["forwards"]) for s in steps), num_chunks=sum(s["chunks"] for s in steps),
        num_chunk_shapes=len(shapes), num_new_chunk_shapes=len(new_shapes),
        num_padded_chunks=sum(c[3] > 0 for s in steps for c in s["chunk_shapes"]),
        num_pad_tokens=sum(c[3] for s in steps for c in s["chunk_shapes"]),
        max_predicted_bytes=max((s["predicted"] for s in steps), default=0),
        max_measured_bytes=max((s["measured"] for s in steps), default=0),
        num_underpredicted_steps=sum(s["measured"] > s["predicted"] for s in steps),
        # each such step's whole record (and its index), kept without --steps: what ran over its prediction
        underpredicted_steps=[dict(index=i, **s) for i, s in enumerate(steps) if s["measured"] > s["predicted"]],
        num_steps_predicted_over_free=sum(s["free_transient_bytes"] is not None
                                          and s["predicted"] > s["free_transient_bytes"] for s in steps),
        step_ratio_min=ratios[0] if ratios else None,
        step_ratio_median=ratios[len(ratios) // 2] if ratios else None)


def build_engine(lm, limit: int, args, budget: Optional[int]):
    """The engine under `limit` bytes (ValueError if that leaves no KV); `budget`: max_num_batched_tokens
    (None: the engine's default for the device)."""
    from bench_engine import runner_options
    from engine.config import EngineConfig
    from engine.engine import Engine

    fields = dict(model=lm.name, dtype=lm.dtype, memory_limit_bytes=limit, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_model_len, **json.loads(args.engine_config or "{}"))
    execution = dict(fields.get("execution", {}))
    if args.pad_last_chunk != "auto":
        execution["pad_last_chunk"] = args.pad_last_chunk == "on"
    if args.chunk_granule is not None:
        execution["chunk_granule"] = args.chunk_granule
    if execution:
        fields["execution"] = execution
    if budget:
        fields["max_num_batched_tokens"] = budget
    return Engine(lm.model, lm.tokenizer, EngineConfig(**fields), lm.config, runner_options=runner_options())


def engine_warm_up(lm, headroom: int, args) -> Optional[dict]:
    """What a replica runs before it serves (its engine's start, then engine/warmup.py), on an engine
    `headroom` bytes above the weights: seconds of each and the warm-up's steps (None: that limit
    leaves no KV)."""
    from engine.warmup import warm_up

    free_memory()
    t = time.perf_counter()
    try:
        engine = build_engine(lm, mx.get_active_memory() + headroom, args, None)
    except ValueError:
        return None
    build_s = time.perf_counter() - t
    warmup = warm_up(engine)
    del engine
    free_memory()
    return dict(build_s=round(build_s, 2), warmup_s=round(warmup.seconds, 2),
                steps=[dataclasses.asdict(s) for s in warmup.steps])


def run_engine(lm, prompts, new_tokens, headroom: int, args, budget: Optional[int] = None,
               seen_shapes: Optional[set] = None) -> dict:
    """`seen_shapes`: (chunk tokens, context) pairs earlier runs of this process computed (updated): on
    MLX's CUDA backend a pair's first forward builds its attention graph, so a run's new pairs cost it."""
    from engine.core.types import SamplingParams

    free_memory()
    baseline = mx.get_active_memory()  # the weights (and nothing else of this process's)
    limit = baseline + headroom
    try:
        engine = build_engine(lm, limit, args, budget)
    except ValueError as exc:  # the limit leaves no KV at all: every request is refused
        return dict(memory_limit_bytes=limit, weights_bytes=baseline, headroom_bytes=headroom,
                    engine_error=str(exc), num_requests=len(prompts), num_refused=len(prompts),
                    kv_share_of_headroom=0.0)
    stats0 = engine.stats()
    refused, steps, failed = [], [], 0
    with PeakTracker() as tracker:
        tracker.start()
        t0 = time.perf_counter()
        for i, (prompt, m) in enumerate(zip(prompts, new_tokens)):
            try:
                engine.add_request(f"b{i}", prompt, SamplingParams(max_tokens=m, ignore_eos=True))
            except ValueError as exc:
                refused.append(f"b{i}: {exc}")
        num_done = 0
        max_kv = 0
        first: dict[str, float] = {}
        while engine.has_unfinished():
            record = engine.step()
            now = time.perf_counter() - t0
            for o in record.outputs:
                first.setdefault(o.request_id, now)
            num_done += sum(o.finished for o in record.outputs)
            failed += sum(o.error is not None for o in record.outputs)
            kv_allocated = engine.stats().kv_allocated_bytes
            max_kv = max(max_kv, kv_allocated)
            if record.plan is None or record.memory is None:
                continue
            steps.append(step_entry(record, kv_allocated))
        wall_s = time.perf_counter() - t0
        peak = tracker.read()
    result = dict(
        memory_limit_bytes=limit, weights_bytes=baseline, headroom_bytes=headroom,
        peak_bytes=peak, peak_over_limit=peak / limit, peak_le_limit=peak <= limit,
        peak_over_weights_bytes=peak - baseline,
        kv_budget_bytes=stats0.kv_budget_bytes, kv_share_of_headroom=stats0.kv_budget_bytes / headroom,
        kv_peak_bytes=max_kv, kv_peak_share_of_headroom=max_kv / headroom,
        transient_bound_bytes=stats0.transient_bound_bytes,
        floor_transient_bytes=getattr(stats0, "floor_transient_bytes", None),
        wall_s=wall_s, mean_ttft_s=sum(first.values()) / max(len(first), 1),
        max_num_batched_tokens=engine.config.max_num_batched_tokens, num_requests=len(prompts),
        num_refused=len(refused), refused=refused[:5],
        num_failed=failed, num_finished=num_done, output_tokens=sum(new_tokens),
        prompt_tokens=sum(len(p) for p in prompts), **step_summary(steps, seen_shapes),
        config=engine.config.model_dump(), execution_paths=dataclasses.asdict(engine.execution_paths()),
        steps=steps if args.steps else None,
    )
    del engine
    free_memory()
    return result


def run_mlx_lm(lm, prompts, new_tokens) -> dict:
    with MemoryWindow() as window:
        t0 = time.perf_counter()
        gen = mlx_lm_generator(lm.model, max(new_tokens))
        run_mlx_lm_burst(gen, prompts, new_tokens, "finished", time.perf_counter)
        wall_s = time.perf_counter() - t0
    gen.close()
    del gen
    free_memory()
    return dict(**window.result(), wall_s=wall_s, settings=MLX_LM_SERVER_DEFAULTS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny | default | llama-8b | llama-test | PATH")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--layers", type=int, default=None, help="truncate a random llama shape's layers")
    p.add_argument("--headroom-mb", default=None, help="memory limits above the weights, MB (comma-separated)")
    p.add_argument("--headroom-gb", default=None, help="the same in GB")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--min-prompt", type=int, default=50)
    p.add_argument("--max-prompt", type=int, default=8000)
    p.add_argument("--min-new", type=int, default=8)
    p.add_argument("--max-new", type=int, default=200)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the engine's max_model_len (default: the model's); prompts are clipped to fit it")
    p.add_argument("--engine-config", default=None, help="JSON of further EngineConfig fields")
    p.add_argument("--pad-last-chunk", default="auto",
                   help="ExecutionConfig.pad_last_chunk: auto (the engine's default) | on | off; --replay: "
                        "a comma-separated list of on / off")
    p.add_argument("--chunk-granule", type=int, default=None,
                   help="ExecutionConfig.chunk_granule (default: the engine's)")
    p.add_argument("--replay", action="store_true",
                   help="replay the burst through the Scheduler alone (tight_burst_replay.py): no model runs")
    p.add_argument("--granules", default="128", help="--replay: chunk granules (comma-separated)")
    p.add_argument("--timings", default=None,
                   help="FILE:KEY of a recorded run with --steps (a key of FILE, or KEY/HEADROOM): where each "
                        "engine run's time went (tight_burst_replay.step_timings); no model runs")
    p.add_argument("--weights-bytes", type=int, default=None,
                   help="--replay: the weights' bytes (recorded by a GPU run; the headroom is above them)")
    p.add_argument("--budgets", default="",
                   help="max_num_batched_tokens values to run each headroom with (comma-separated; default: "
                        "the engine's; --replay: the first)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the unmeasured warm-up first: the engine's own (engine/warmup.py, what a replica runs at "
                        "start), then a small burst (kernels compile on their first use)")
    p.add_argument("--ways", default="engine,mlx_lm", help="some of engine,mlx_lm")
    p.add_argument("--steps", action="store_true", help="keep every step's record in the JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    pads = args.pad_last_chunk.split(",")
    if any(v not in ("auto", "on", "off") for v in pads) or (len(pads) > 1 and not args.replay):
        p.error(f"--pad-last-chunk={args.pad_last_chunk}: one of auto, on, off (a list of on / off with --replay)")
    return args


def main_replay(args, headrooms: list[int]) -> dict:
    """--replay: the burst's prompts as the model run draws them, through tight_burst_replay.replay."""
    from bench_common import RANDOM_SHAPES
    from tight_burst_replay import replay

    config = RANDOM_SHAPES[args.model]
    model_max = config.get("max_position_embeddings") or 4096
    max_len = min(args.max_model_len or model_max, model_max)
    args.max_model_len = max_len
    prompts, new_tokens = burst(args, config["vocab_size"], max_len)
    result = dict(bench="tight_burst_replay", argv=sys.argv[1:], model=args.model, dtype=args.dtype,
                  **replay(args, prompts, new_tokens, headrooms, args.weights_bytes))
    for name, runs in result["variants"].items():
        log(name + ": " + ", ".join(
            f"{h / 1e9:g} GB {r['num_new_chunk_shapes']}/{r['num_chunk_shapes']} new/shapes, {r['num_steps']} steps "
            f"({r['num_memory_limited_steps']} cut), {r['num_chunk_tokens']} chunk tokens" for h, r in
            ((int(k), v) for k, v in runs.items())))
    emit(result, args.json, args.out)
    return result


def main_timings(args) -> dict:
    """--timings FILE:KEY: tight_burst_replay.step_timings of each engine run recorded there."""
    from tight_burst_replay import step_timings

    path, _, key = args.timings.partition(":")
    data = json.loads(Path(path).read_text())
    for part in key.split("/") if key else []:
        data = data[part]
    runs = data.get("engine", {"": data}) if "steps" not in data else {"": data}
    result = {headroom: dict(wall_s=round(r["wall_s"], 2), **step_timings(r["steps"])) for headroom, r in runs.items()
              if r.get("steps")}
    emit(result, args.json, args.out)
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.headroom_gb:
        headrooms = [int(float(x) * 1e9) for x in args.headroom_gb.split(",")]
    else:
        headrooms = [int(float(x) * 1e6) for x in (args.headroom_mb or "300").split(",")]
    if args.replay:
        return main_replay(args, headrooms)
    if args.timings:
        return main_timings(args)
    lm = load_bench_model(args.model, args.dtype, args.layers)
    model_max = lm.config.get("max_position_embeddings") or 4096
    max_len = min(args.max_model_len or model_max, model_max)
    prompts, new_tokens = burst(args, lm.config["vocab_size"], max_len)
    result = dict(bench="tight_burst", argv=sys.argv[1:] if argv is None else argv, model=args.model,
                  dtype=lm.dtype, weights_bytes=lm.weights_bytes, environment=environment(),
                  prompt_lengths=[len(p) for p in prompts], new_tokens=new_tokens, engine={}, mlx_lm=None)
    ways = set(args.ways.split(","))
    budgets = [int(b) for b in args.budgets.split(",") if b] or [None]
    seen: set = set()  # chunk shapes this process has run (run_engine)
    if "engine" in ways and not args.no_warmup:
        t = time.perf_counter()
        result["engine_start"] = engine_warm_up(lm, max(headrooms), args)
        small = [p[: max(8, len(p) // 8)] for p in prompts[:6]]
        run_engine(lm, small, [min(8, m) for m in new_tokens[:6]], max(headrooms), args, seen_shapes=seen)
        log(f"warm-up: {time.perf_counter() - t:.1f} s")
    for headroom, budget in [(h, b) for h in headrooms for b in budgets]:
        if "engine" in ways:
            r = run_engine(lm, prompts, new_tokens, headroom, args, budget, seen_shapes=seen)
            result["engine"][str(headroom) if budget is None else f"{headroom}/{budget}"] = r
            if "engine_error" in r:
                log(f"engine, headroom {headroom / 1e6:.0f} MB: {r['engine_error']}")
                continue
            log(f"engine, headroom {headroom / 1e6:.0f} MB, budget {r['max_num_batched_tokens']}: mean TTFT "
                f"{r['mean_ttft_s']:.2f} s, peak {r['peak_over_limit']:.3f} of the limit, KV "
                f"{r['kv_share_of_headroom']:.3f} of the headroom (pool peak {r['kv_peak_share_of_headroom']:.3f}), "
                f"{r['wall_s']:.2f} s, {r['num_refused']} refused, {r['num_finished']} finished, "
                f"{r['num_underpredicted_steps']} steps under-predicted, {r['num_memory_limited_steps']} of "
                f"{r['num_steps']} steps cut by memory, {r['num_forwards']} forwards, "
                f"{r['num_new_chunk_shapes']} of {r['num_chunk_shapes']} chunk shapes new to the process, "
                f"{r['num_padded_chunks']} chunks padded, {r['execution_paths']['num_warmed_chunk_shapes']} shapes "
                f"warmed at start in {r['execution_paths']['warmup_s']:.1f} s")
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    if "mlx_lm" in ways:
        result["mlx_lm"] = run_mlx_lm(lm, prompts, new_tokens)
        log(f"mlx_lm: peak over weights {result['mlx_lm']['peak_over_weights_bytes'] / 1e6:.0f} MB, "
            f"{result['mlx_lm']['wall_s']:.2f} s")
    emit(result, args.json, args.out)
    return result


if __name__ == "__main__":
    main()
