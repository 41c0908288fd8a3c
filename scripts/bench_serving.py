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
import asyncio
import dataclasses
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (MLX_LM_SERVER_DEFAULTS, MemoryWindow, emit, environment, free_memory,  # noqa: E402
                          load_bench_model, mlx_lm_generator, mlx_lm_step, random_prompts)


# --------------------------------------------------------------------------- records and summary
@dataclasses.dataclass
class RequestRecord:
    index: int
    sent_s: float  # from the start of the run
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    num_output_tokens: int = 0
    error: Optional[str] = None
    status: Optional[int] = None

    @property
    def ttft_s(self) -> Optional[float]:
        return self.token_times_s[0] - self.sent_s if self.token_times_s else None

    @property
    def tpot_s(self) -> Optional[float]:
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    # every gap between two tokens of a request: their median is steadier than TPOT's mean on a busy host
    gaps = [b - a for r in ok for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    out_tokens = sum(r.num_output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            key = str(r.status) if r.status is not None else r.error.split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    return dict(
        num_requests=len(records), num_ok=len(ok), errors=errors, wall_s=wall_s,
        ttft_mean_s=statistics.fmean(ttft) if ttft else None, ttft_p50_s=percentile(ttft, 0.5),
        ttft_p95_s=percentile(ttft, 0.95), tpot_mean_s=statistics.fmean(tpot) if tpot else None,
        itl_p50_s=percentile(gaps, 0.5),
        output_tokens=out_tokens, output_tok_per_s=out_tokens / wall_s if wall_s > 0 else None,
        first_error=next((r.error for r in records if r.error), None),
    )


def arrival_times(n: int, rate: Optional[float], seed: int) -> list[float]:
    """All at 0 (closed loop), or a Poisson process of `rate` requests/s."""
    if not rate:
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# --------------------------------------------------------------------------- in-process drivers
class LoopDriver:
    """A synchronous serving loop (as a server's engine thread runs): admit arrived requests while fewer
    than `concurrency` are in flight, run one step, time-stamp every token."""

    def __init__(self, prompts: list[list[int]], arrivals: list[float], concurrency: int):
        self.prompts, self.arrivals, self.concurrency = prompts, arrivals, concurrency

    def run(self, add: Callable[[int, list[int]], None], step: Callable[[], list[tuple[int, bool]]]) -> tuple:
        n = len(self.prompts)
        records = [RequestRecord(i, 0.0) for i in range(n)]
        pending, in_flight, done = 0, 0, 0
        t0 = time.perf_counter()
        while done < n:
            now = time.perf_counter() - t0
            while pending < n and in_flight < self.concurrency and self.arrivals[pending] <= now:
                records[pending].sent_s = now
                add(pending, self.prompts[pending])
                pending += 1
                in_flight += 1
            if in_flight == 0:
                time.sleep(max(0.0, self.arrivals[pending] - now))
                continue
            events = step()
            now = time.perf_counter() - t0
            for index, finished in events:
                rec = records[index]
                rec.token_times_s.append(now)
                rec.num_output_tokens += 1
                if finished:
                    in_flight -= 1
                    done += 1
        return records, time.perf_counter() - t0


def run_engine_sync(lm, prompts, arrivals, args, breakdown: bool = True, sampling_for=None, **overrides) -> dict:
    """The bare Engine.step loop; with a per-step time breakdown (schedule / forwards / the rest).
    `overrides`: `make_engine`'s (engine_sync_nopipe: async_decode=False; engine_sync_gather:
    execution={"paged_attention": False}; engine_sync_unfused, engine_sync_modules, engine_sync_uncompiled:
    options=RunnerOptions(fuse_projections / layer_loops / compiled_decode=False))."""
    from engine.core.types import SamplingParams

    engine = make_engine(lm, prompts, args, **overrides)
    tracer = StepTracer(args.trace_steps) if args.trace_steps and breakdown else None
    # seconds, from the step records: the scheduler's plans, the graph builds of steps without prompt
    # chunks ("decode") and with ("prefill"), the host's time before each step's first launch
    timers = {"schedule": 0.0, "decode": 0.0, "prefill": 0.0, "forward_build": 0.0}
    # (rows, step_s, decode graph build_s, host time before the step's first launch, schedule_s)
    decode_steps: list[tuple] = []
    sampling = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)

    def add(i, prompt):  # sampling_for(i): request i's SamplingParams (bench_constrained.py)
        engine.add_request(str(i), prompt, sampling_for(i) if sampling_for else sampling)

    first_steps = []  # the first steps: when each ran (from the first's start) and what it computed

    def step():
        t = time.perf_counter()
        record = engine.step()
        outs = record.outputs
        dt = time.perf_counter() - t
        if tracer is not None:
            tracer.observe(record)
        # the host's time before the device had work: scheduling and the graph build
        first_launch_s = record.forwards[0].launch_s if record.forwards else 0.0
        build_s = sum(f.build_duration_s for f in record.forwards)
        timers["forward_build"] += first_launch_s
        timers["schedule"] += record.schedule_s
        timers["prefill" if record.prefill_chunks else "decode"] += build_s
        if len(first_steps) < 8 and record.plan is not None:
            first_steps.append({"start_s": t, "duration_s": round(dt, 4),
                                "prefill_chunks": len(record.prefill_chunks),
                                "decode_rows": record.num_decode_tokens})
        if not record.prefill_chunks and outs:
            decode_steps.append((len(outs), dt, build_s, first_launch_s, record.schedule_s))
        return [(int(o.request_id), o.finished) for o in outs if o.new_token_ids]

    with MemoryWindow() as mem:
        records, wall = LoopDriver(prompts, arrivals, args.concurrency_now).run(add, step)
    result = summarize(records, wall)
    result.update(mem.result())
    result["num_steps"] = engine.stats().num_steps
    result["max_num_batched_tokens"] = engine.config.max_num_batched_tokens  # resolved for the device
    first_start = first_steps[0]["start_s"] if first_steps else 0.0
    for record in first_steps:
        record["start_s"] = round(record["start_s"] - first_start, 4)
    result["first_steps"] = first_steps
    result["first_token_s"] = sorted(round(r.ttft_s, 4) for r in records if r.ttft_s is not None)
    result["tpot_by_request_s"] = [r.tpot_s for r in records]
    if tracer is not None:
        result["step_trace_ms"] = tracer.steps
    if breakdown and decode_steps:
        n = len(decode_steps)

        def mean(i):
            return sum(s[i] for s in decode_steps) / n

        # A decode-only step = schedule + the decode's graph build (runner_decode, its record's forwards)
        # + launch, evaluation and sampling + the rest (scheduler update, output processing).
        # "graph_build" is the host's time before the step's first launch, which includes its schedule.
        result["breakdown"] = dict(
            timers_s=timers, num_decode_only_steps=n, decode_rows_mean=mean(0),
            decode_step_mean_s=mean(1), runner_decode_mean_s=mean(2), graph_build_mean_s=mean(3),
            schedule_mean_s=mean(4), eval_and_sample_mean_s=mean(2) - mean(3),
            outside_runner_mean_s=mean(1) - mean(2),
        )
    return result


class StepTracer:
    """Where the first steps' host time goes, step by step (--trace-steps), from each step's record:
    milliseconds in the scheduler's plan, building the forwards' graphs, launching them, waiting for
    them, and the whole step."""

    def __init__(self, num_steps: int):
        self.num_steps, self.steps = num_steps, []

    def observe(self, record) -> None:
        if len(self.steps) >= self.num_steps:
            return
        forwards = record.forwards
        spent = {"schedule": record.schedule_s, "build": sum(f.build_duration_s for f in forwards),
                 "launch": sum(f.launched_s - f.launch_s for f in forwards),
                 "wait": sum(f.waited_s - f.wait_s for f in forwards if f.wait_s is not None and f.waited_s is not None)}
        spent = {k: v for k, v in spent.items() if v}
        spent["step"] = record.duration_s
        self.steps.append({k: round(v * 1000, 2) for k, v in spent.items()})


def run_engine_sync_thread(lm, prompts, arrivals, args, breakdown: bool = True) -> dict:
    """engine_sync in a thread of its own, warmed there by the same load first (to tell what a thread
    costs from what AsyncEngine costs)."""
    import threading

    result: dict = {}
    vocab = lm.config["vocab_size"]

    def body():
        run_engine_sync(lm, [[(t + 1) % vocab for t in p] for p in prompts], arrivals, args, False)
        result.update(run_engine_sync(lm, prompts, arrivals, args, breakdown))

    thread = threading.Thread(target=body, name="bench-engine")
    thread.start()
    thread.join()
    return result


def run_engine_sync_asyncio(lm, prompts, arrivals, args, breakdown: bool = True) -> dict:
    """engine_sync_thread while the main thread runs an asyncio event loop that waits for it (what
    AsyncEngine's caller does), to tell the loop's cost from AsyncEngine's own."""
    return asyncio.run(asyncio.to_thread(run_engine_sync_thread, lm, prompts, arrivals, args, breakdown))


def run_engine_async(lm, prompts, arrivals, args, **overrides) -> dict:
    """AsyncEngine (what the replica runs): one asyncio task per request, tokens time-stamped as
    the consumer receives them. The same load (other tokens) runs untimed first through the same
    AsyncEngine, then its prefix-cache entries are evicted, so the timed pass finds the KV pool at the
    size this load needs (`pool_grew_in_timed_pass` says whether it still grew). Why: MLX keeps a
    stream, command encoder, CUDA graphs and cuDNN attention graphs per thread, so a warm-up in another
    thread (the bench's own warm-up runs, or another AsyncEngine's) does not warm this one's; and
    cuDNN's attention graphs are keyed by the K/V strides, which for a prompt chunk read as a view of
    the pool include the pool's size, so a pool growth makes the next prompt chunks build theirs again
    (docs/benchmarks.md). The bare-loop backends build a fresh engine per pass in the same thread,
    whose pool grows to the same sizes every pass."""
    from engine.async_engine import AsyncEngine
    from engine.core.types import SamplingParams

    # Built in its thread, as the replica's; no built-in warm-up (the same-shape pass below replaces it)
    aengine = AsyncEngine(lambda: make_engine(lm, prompts, args, **overrides), warmup=args.async_warmup)
    engine = aengine.engine
    tracer = StepTracer(args.trace_steps) if args.trace_steps else None
    sampling = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    steps = []  # the first steps: when each ran (from the run's start) and what it computed
    clock = {"t0_ns": time.time_ns()}

    def on_step(record):
        if tracer is not None:
            tracer.observe(record)
        if len(steps) < 8:
            steps.append({"start_s": round((record.start_time_ns - clock["t0_ns"]) / 1e9, 4),
                          "duration_s": round(record.duration_s, 4),
                          "prefill_chunks": len(record.prefill_chunks), "decode_rows": record.num_decode_tokens})

    aengine.on_step = on_step

    async def main(prompts):
        sem = asyncio.Semaphore(args.concurrency_now)
        t0 = time.perf_counter()
        clock["t0_ns"] = time.time_ns()
        records = [RequestRecord(i, 0.0) for i in range(len(prompts))]

        async def one(i):
            await asyncio.sleep(arrivals[i])
            async with sem:
                rec = records[i]
                rec.sent_s = time.perf_counter() - t0
                try:
                    async for out in aengine.generate(str(i), prompts[i], sampling):
                        if out.error:
                            rec.error = out.error
                        if out.new_token_ids:
                            now = time.perf_counter() - t0
                            rec.token_times_s.extend([now] * len(out.new_token_ids))
                            rec.num_output_tokens += len(out.new_token_ids)
                except Exception as exc:  # noqa: BLE001 - reported per request
                    rec.error = f"{type(exc).__name__}: {exc}"

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return records, time.perf_counter() - t0

    try:
        vocab = lm.config["vocab_size"]
        asyncio.run(main([[(t + 1) % vocab for t in p] for p in prompts]))  # warm this engine's thread
        # The prefix cache keeps the warm pass's blocks; let them go (the engine thread is idle), so the
        # timed pass finds the pool at the size this load needs instead of growing it.
        engine.reset_prefix_cache()
        pool_before = engine.stats().kv_allocated_bytes
        warm_steps = list(steps)
        steps.clear()
        if tracer is not None:
            warm_trace, tracer.steps = tracer.steps, []
        with MemoryWindow() as mem:
            records, wall = asyncio.run(main(prompts))
        result = summarize(records, wall)
        result.update(mem.result())
        result["first_steps"] = steps
        result["warm_pass_first_steps"] = warm_steps
        result["pool_grew_in_timed_pass"] = engine.stats().kv_allocated_bytes != pool_before
        result["max_num_batched_tokens"] = engine.config.max_num_batched_tokens  # resolved for the device
        if tracer is not None:
            result["step_trace_ms"], result["warm_pass_step_trace_ms"] = tracer.steps, warm_trace
        result["first_token_s"] = sorted(round(r.ttft_s, 4) for r in records if r.ttft_s is not None)
    finally:
        aengine.shutdown()
    return result


def run_mlx_lm(lm, prompts, arrivals, args, settings: dict = MLX_LM_SERVER_DEFAULTS) -> dict:
    """mlx-lm's BatchGenerator with mlx_lm.server's defaults, driven as the server's loop drives it."""
    gen = mlx_lm_generator(lm.model, args.output_tokens, settings)
    uid_to_index: dict[int, int] = {}

    def add(i, prompt):
        (uid,) = gen.insert([prompt], max_tokens=[args.output_tokens])
        uid_to_index[uid] = i

    def step():
        return [(uid_to_index[r.uid], r.finish_reason is not None) for r in mlx_lm_step(gen)]

    with MemoryWindow() as mem:
        records, wall = LoopDriver(prompts, arrivals, args.concurrency_now).run(add, step)
    result = summarize(records, wall)
    result.update(mem.result())
    result["settings"] = settings
    c = gen._counters if hasattr(gen, "_counters") else None
    if c is not None and getattr(c, "generation_steps", 0):
        result["decode_step_mean_s"] = c.decode_time / c.generation_steps
        result["prompt_time_s"] = c.prompt_time
    gen.close()
    return result


def make_engine(lm, prompts, args, options=None, async_decode: bool = True, grammar_compiler=None, **overrides):
    """This engine at its default config (max_num_seqs raised to the concurrency if that is larger),
    with a memory limit that admits every request. `options`: a RunnerOptions (None: the defaults);
    `async_decode`: False runs decode steps one after another; `overrides`: EngineConfig fields."""
    from engine.config import EngineConfig
    from engine.core.types import StepOptions
    from engine.engine import Engine
    from engine.model.runner import RunnerOptions

    options = options or RunnerOptions()
    from bench_common import memory_model_for

    memory = memory_model_for(lm)
    need = max(len(p) for p in prompts) + args.output_tokens
    model_max = lm.config.get("max_position_embeddings") or 4096
    kv = sum(memory.kv_bytes(len(p) + args.output_tokens) for p in prompts)
    seqs = max(16, args.concurrency_now)
    bound = memory.transient_bound_bytes(seqs, 512, min(model_max, max(need, model_max)))
    limit = int((lm.weights_bytes + bound + kv) * 1.25) + (1 << 30)
    fields = dict(model=lm.name, dtype=lm.dtype, memory_limit_bytes=limit,
                  max_model_len=None if need <= model_max else need)
    if seqs > 16:  # the step budget stays the engine's default for the device (raised to seqs if smaller)
        fields.update(max_num_seqs=seqs)
    if args.engine_config:
        fields.update(json.loads(args.engine_config))
    fields.update(overrides)
    return Engine(lm.model, lm.tokenizer, EngineConfig(**fields), lm.config, runner_options=options,
                  step_options=StepOptions(async_decode=async_decode), grammar_compiler=grammar_compiler)


def engine_only(args) -> dict:
    from engine.model.runner import RunnerOptions

    lm = load_bench_model(args.model, args.dtype, args.layers, args.init, args.seed)
    result = dict(bench="serving_engine_only", argv=sys.argv[1:], model=args.model, dtype=lm.dtype,
                  prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, rate=args.rate,
                  weights_bytes=lm.weights_bytes, environment=environment(), runs={})
    backends = [b for b in args.backends.split(",") if b]
    runners = {"engine": run_engine_async, "engine_sync": run_engine_sync, "mlx_lm": run_mlx_lm,
               "engine_sync_nopipe": (lambda *a, **k: run_engine_sync(*a, **k, async_decode=False)),
               "engine_sync_gather": (lambda *a, **k: run_engine_sync(*a, **k, execution={"paged_attention": False})),
               "engine_sync_unfused": (lambda *a, **k: run_engine_sync(*a, **k, options=RunnerOptions(
                   fuse_projections=False))),
               "engine_sync_modules": (lambda *a, **k: run_engine_sync(*a, **k, options=RunnerOptions(layer_loops=False))),
               "engine_sync_uncompiled": (lambda *a, **k: run_engine_sync(*a, **k, options=RunnerOptions(
                   compiled_decode=False))),
               "engine_uncompiled": (lambda *a, **k: run_engine_async(*a, **k, options=RunnerOptions(
                   compiled_decode=False))),
               "engine_sync_thread": run_engine_sync_thread, "engine_sync_asyncio": run_engine_sync_asyncio}
    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    # Warm-up: every backend once per concurrency on other prompts of the same lengths (kernels,
    # and on CUDA the attention graphs of every shape the timed run meets, are built here).
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
    return result


def _passes(runs: dict, backend: str, c) -> list:
    """Every timed pass of `backend` at concurrency `c`, in pass order (the keys' #repeat suffix)."""
    out, rep = [], 0
    while (r := runs.get(f"{backend}@{c}" + (f"#{rep}" if rep else ""))) is not None:
        out.append(r)
        rep += 1
    return out


def compare(runs: dict, concurrencies, ours: str, theirs: str) -> dict:
    """`ours` against `theirs` per concurrency: the ratio of their medians over the timed passes (with
    --repeat, passes alternate backends, so drift of the machine falls on both), and each pass's ratio
    (the two ran one after the other). The targets are judged on the medians."""
    import statistics

    out = {}
    for c in concurrencies:
        pairs = [(a, b) for a, b in zip(_passes(runs, ours, c), _passes(runs, theirs, c))
                 if a.get("ttft_mean_s") and b.get("ttft_mean_s")]
        if not pairs:
            continue
        med = {k: [statistics.median(p[i][k] or 0 for p in pairs) for i in (0, 1)]
               for k in ("ttft_mean_s", "output_tok_per_s")}
        ttft, tok = med["ttft_mean_s"][0] / med["ttft_mean_s"][1], med["output_tok_per_s"][0] / (med["output_tok_per_s"][1] or 1)
        out[str(c)] = dict(
            passes=len(pairs), ttft_ratio=ttft, tok_per_s_ratio=tok,
            ttft_ratio_per_pass=[a["ttft_mean_s"] / b["ttft_mean_s"] for a, b in pairs],
            tok_per_s_ratio_per_pass=[(a["output_tok_per_s"] or 0) / (b["output_tok_per_s"] or 1) for a, b in pairs],
            engine_ttft_le_mlx_lm=ttft <= 1.0, engine_tok_per_s_ge_1_2x_mlx_lm=tok >= 1.2,
        )
    return out


def fmt(x, nd=3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


# --------------------------------------------------------------------------- CLI
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
                   "engine_sync_modules (forwards through mlx-lm's modules, layer_loops=false), "
                   "engine_sync_uncompiled and engine_uncompiled (the decode loop's layers built in Python, "
                   "compiled_decode=false), engine_sync_thread (engine_sync in a "
                   "thread of its own), mlx_lm")
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
    p.add_argument("--switch-interval", type=float, default=None,
                   help="sys.setswitchinterval for this process (how long a thread holds the GIL when "
                   "another waits for it; Python's default 0.005 s)")
    args = p.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    if args.start_app and not args.url:
        args.url = "http://127.0.0.1:8100"  # not serve.yaml's 8000, which a running app may hold
    if not (args.engine_only or args.url or args.compare_mlx_lm):
        p.error("give --url, --start-app, --compare-mlx-lm or --engine-only")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.engine_only and args.constrained_fraction is not None:
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
