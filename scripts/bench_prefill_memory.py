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
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (MLX_LM_SERVER_DEFAULTS, LoadedModel, PeakTracker, chunk_bytes, emit,  # noqa: E402
                          environment, free_memory, load_bench_model, memory_model_for, mlx_lm_generator,
                          prefill_flops, random_prompts, run_mlx_lm_burst)

import mlx.core as mx  # noqa: E402

WAYS = ("sequential", "engine", "mlx_lm", "naive_padded")
EXTRA_WAYS = {"engine_modules": dict(layer_loops=False), "engine_no_overlap": dict(overlap_steps=False)}


# --------------------------------------------------------------------------- measurement frame
class Meter:
    """Peak/active readings of one way. `baseline` is what was alive before (the weights)."""

    def __init__(self):
        free_memory()
        self.baseline = mx.get_active_memory()
        self.tracker = PeakTracker().__enter__()
        self.tracker.start()
        self.peak = 0
        self.stepwise = 0  # largest (peak - live before - KV added) of one forward / step
        self._before = (0, 0)
        self.t0 = time.perf_counter()

    def begin(self, kv_bytes: int) -> None:
        """Start one forward (or step) whose transient is measured on its own."""
        self.observe()
        self._before = (mx.get_active_memory(), kv_bytes)

    def end(self, kv_bytes: int) -> int:
        """End it: its peak over what was live before, less the KV it added."""
        active, kv = self._before
        transient = self.observe() - active - (kv_bytes - kv)
        self.stepwise = max(self.stepwise, transient)
        return transient

    def observe(self) -> int:
        """Fold in the peak since the last observe(); return that window's peak."""
        window = self.tracker.read()
        self.peak = max(self.peak, window)
        self.tracker.start()
        return window

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def result(self, kv_live_bytes: int, predicted: Optional[int], ttft: list[float], prefill_s: float,
               **extra) -> dict:
        self.observe()
        self.tracker.__exit__()
        over = self.peak - self.baseline
        return dict(
            peak_bytes=over, peak_over_weights_bytes=over, transient_peak_bytes=over - kv_live_bytes,
            stepwise_transient_bytes=self.stepwise or over - kv_live_bytes, kv_live_bytes=kv_live_bytes, predicted_peak_bytes=predicted, ttft_s=ttft,
            mean_ttft_s=sum(ttft) / len(ttft), prefill_s=prefill_s, **extra,
        )


# --------------------------------------------------------------------------- the ways
def run_sequential(lm: LoadedModel, prompts: list[list[int]], chunk: int, memory) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    model = lm.model
    meter = Meter()
    caches, ttft, predicted, chunks = [], [], 0, []

    def kv_bytes() -> int:
        return sum(c.nbytes for cache in caches for c in cache)

    for prompt in prompts:
        cache = make_prompt_cache(model)
        caches.append(cache)
        tokens = mx.array(prompt)
        body = len(prompt) - 1
        for start in range(0, body, chunk):
            end = min(start + chunk, body)
            meter.begin(kv_bytes())
            t = time.perf_counter()
            model(tokens[None, start:end], cache=cache)  # logits never evaluated: never computed
            mx.eval([c.state for c in cache])
            step_s = time.perf_counter() - t
            pred = chunk_bytes(memory, end - start, end, False)
            chunks.append(dict(tokens=end - start, context=end, predicted=pred, measured=meter.end(kv_bytes()),
                               step_s=round(step_s, 6)))
            predicted = max(predicted, pred)
        meter.begin(kv_bytes())
        t = time.perf_counter()
        logits = model(tokens[None, body:], cache=cache)  # [1, 1, V]
        mx.argmax(logits[0, -1]).item()
        step_s = time.perf_counter() - t
        pred = chunk_bytes(memory, 1, len(prompt), True)
        chunks.append(dict(tokens=1, context=len(prompt), predicted=pred, measured=meter.end(kv_bytes()),
                           step_s=round(step_s, 6)))
        predicted = max(predicted, pred)
        ttft.append(meter.elapsed())
    prefill_s = meter.elapsed()
    return meter.result(kv_bytes(), predicted, ttft, prefill_s, chunk=chunk, chunks=chunks)


def run_naive_padded(lm: LoadedModel, prompts: list[list[int]], memory) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    model = lm.model
    backbone = model.model
    lengths = [len(p) for p in prompts]
    b, L = len(prompts), max(lengths)
    meter = Meter()
    tokens = mx.array([p + [0] * (L - len(p)) for p in prompts])  # [B, L] right-padded
    pos = mx.arange(L)
    valid = pos[None, :] < mx.array(lengths)[:, None]  # [B, L] real keys
    mask = (pos[:, None] >= pos[None, :])[None] & valid[:, None, :]  # [B, L, L] causal & real
    mask = mask[:, None]  # [B, 1, L, L]
    cache = make_prompt_cache(model)
    h = backbone.embed_tokens(tokens)
    for layer, c in zip(backbone.layers, cache):
        h = layer(h, mask, c)
    h = backbone.norm(h)
    last = h[mx.arange(b), mx.array(lengths) - 1]  # [B, D]: each row's last real position
    head = backbone.embed_tokens.as_linear if getattr(model.args, "tie_word_embeddings", False) \
        else model.lm_head
    next_tokens = mx.argmax(head(last), axis=-1)
    mx.eval(next_tokens, [c.state for c in cache])
    next_tokens.tolist()
    prefill_s = meter.elapsed()
    kv = sum(c.nbytes for c in cache)
    predicted = b * chunk_bytes(memory, L, L, True)  # per-row formula x rows: an approximation
    return meter.result(kv, predicted, [prefill_s] * b, prefill_s, predicted_kind="per_row_formula_x_rows")


def mlx_lm_plan_bytes(memory, lengths: list[int], batch: int, step: int) -> int:
    """The memory model over BatchGenerator's plan: each step pads its rows to the longest chunk;
    per-row formula x rows (the formula was fitted for one row, so this is an approximation)."""
    remaining = [n - 1 for n in lengths[:batch]]  # the last token is a segment of its own
    done, peak = 0, 0
    while any(r > 0 for r in remaining):
        active = [r for r in remaining if r > 0]
        t = min(max(active), step)
        done += t
        peak = max(peak, len(active) * chunk_bytes(memory, t, done, False))
        remaining = [max(r - step, 0) for r in remaining]
    return peak


def run_mlx_lm(lm: LoadedModel, prompts: list[list[int]], memory, max_tokens: int,
               settings: dict = MLX_LM_SERVER_DEFAULTS) -> dict:
    meter = Meter()
    gen = mlx_lm_generator(lm.model, max_tokens, settings)
    run = run_mlx_lm_burst(gen, prompts, [max_tokens] * len(prompts), "first_token", meter.elapsed,
                           before_step=lambda: meter.begin(gen.prompt_cache_nbytes),
                           after_step=lambda: meter.end(gen.prompt_cache_nbytes))
    prefill_s = meter.elapsed()
    kv = gen.prompt_cache_nbytes
    predicted = mlx_lm_plan_bytes(memory, [len(p) for p in prompts], settings["prefill_batch_size"],
                                  settings["prefill_step_size"])
    result = meter.result(kv, predicted, [run.first_token_s[u] for u in run.uids], prefill_s, settings=settings,
                          num_calls=run.num_steps, predicted_kind="per_row_formula_x_rows")
    gen.close()
    return result


def engine_memory_limit(lm: LoadedModel, lengths: list[int], max_tokens: int, config) -> int:
    """Weights + the configuration's transient bound + every prompt's KV, with room to spare."""
    memory = memory_model_for(lm, config.memory_coefficients)
    model_max = lm.config.get("max_position_embeddings") or 4096
    kv = sum(memory.kv_bytes(n + max_tokens) for n in lengths)
    bound = memory.transient_bound_bytes(config.max_num_seqs, config.prefill_chunk_size,
                                         min(config.max_model_len or model_max, model_max))
    return int((lm.weights_bytes + bound + kv) * 1.25) + (1 << 30)


ENGINE_OVERRIDES: dict = {}  # --engine-config


def make_engine(lm: LoadedModel, lengths: list[int], max_tokens: int, chunk: Optional[int] = None,
                layer_loops: bool = True, async_decode: bool = True, overlap_steps: Optional[bool] = None,
                read_slices: bool = True, mixed_batches: bool = True, mix_beyond_bound: bool = False,
                **overrides):
    """This engine at its default config around the already loaded model. `layer_loops`,
    `read_slices`, `mixed_batches` (RunnerOptions'), `async_decode`, `overlap_steps` (None: the
    engine's choice), `mix_beyond_bound` (StepOptions'): its ways to compare, chosen at construction;
    `overrides`: EngineConfig fields."""
    from engine.config import EngineConfig
    from engine.core.types import StepOptions
    from engine.engine import Engine
    from engine.model.runner import RunnerOptions

    model_max = lm.config.get("max_position_embeddings") or 4096
    need = max(lengths) + max_tokens
    max_model_len = None if need <= model_max else need
    fields = dict(model=lm.name, dtype=lm.dtype, max_model_len=max_model_len, **ENGINE_OVERRIDES)
    if chunk:
        fields["prefill_chunk_size"] = chunk
    fields.update(overrides)
    limit = engine_memory_limit(lm, lengths, max_tokens, EngineConfig(**fields))
    engine = Engine(lm.model, lm.tokenizer, EngineConfig(memory_limit_bytes=limit, **fields), lm.config,
                    runner_options=RunnerOptions(layer_loops=layer_loops, read_slices=read_slices,
                                                 mixed_batches=mixed_batches),
                    step_options=StepOptions(async_decode=async_decode, overlap_steps=overlap_steps,
                                             mix_beyond_bound=mix_beyond_bound))
    return engine


class StepRecorder:
    """Steps the engine and keeps each step's record (engine.core.types.StepRecord): its plan, the
    prompt chunks it read as views of the pool, its forwards' times and its memory; and each request's
    progress as the records' outputs tell it (the engine's public step records, not its scheduler)."""

    def __init__(self, engine):
        self.engine = engine
        self.records: list = []
        self.num_tokens: dict[str, int] = {}  # request id -> prompt + output tokens so far
        self.num_output_tokens: dict[str, int] = {}
        self.finished: set[str] = set()

    def step(self):
        record = self.engine.step()
        self.records.append(record)
        for out in record.outputs:
            self._observe(out)
        return record

    def abort(self, request_id: str) -> None:
        out = self.engine.abort(request_id)
        if out is not None:
            self._observe(out)

    def _observe(self, out) -> None:
        self.num_tokens[out.request_id] = out.num_prompt_tokens + out.num_output_tokens
        self.num_output_tokens[out.request_id] = out.num_output_tokens
        if out.finished:
            self.finished.add(out.request_id)


def run_engine(lm: LoadedModel, prompts: list[list[int]], chunk: Optional[int], max_tokens: int,
               **overrides) -> dict:
    from engine.core.types import SamplingParams

    lengths = [len(p) for p in prompts]
    engine = make_engine(lm, lengths, max_tokens, chunk, **overrides)
    recorder = StepRecorder(engine)
    meter = Meter()  # after the engine exists: the engine allocates nothing until its first step
    ids = [f"p{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    first: dict[str, float] = {}
    steps = []
    while len(first) < len(prompts):
        meter.begin(engine.stats().kv_allocated_bytes)
        t = time.perf_counter()
        record = recorder.step()
        outputs = record.outputs
        step_s = time.perf_counter() - t
        # (launch, launched, wait, waited) of each forward, seconds from the step's start
        forwards = [tuple(None if t is None else round(t, 5)
                          for t in (f.launch_s, f.launched_s, f.wait_s, f.waited_s)) for f in record.forwards]
        whole_step = meter.end(engine.stats().kv_allocated_bytes)  # across the engine's per-forward resets
        now = meter.elapsed()
        for out in outputs:
            if out.error:
                raise RuntimeError(f"engine request {out.request_id} failed: {out.error}")
            first.setdefault(out.request_id, now)
        plan = record.plan
        # The engine's own figure is per forward (KV of rows allocated later in the step not
        # subtracted); the whole-step one is the fallback for engines that expose none.
        # The engine's record pairs its measurement with its prediction: with overlapped steps
        # (StepExecutor.overlap_steps) a step's record also holds the previous step's deferred forward,
        # measured and predicted (the plan's prediction is this step's alone).
        own = record.memory  # None: the step failed or scheduled nothing
        measured = own.measured_bytes if own is not None else whole_step
        predicted = own.predicted_bytes if own is not None else plan.predicted_transient_bytes
        steps.append(dict(
            step_s=round(step_s, 6), predicted=predicted, plan_predicted=plan.predicted_transient_bytes,
            measured=measured,
            whole_step_measured=whole_step,
            decodes=len(plan.decodes), chunks=[(c.num_forward_tokens, c.start + c.num_forward_tokens) for c in plan.prefills],
            mixed=getattr(plan, "mixed", False),
            # (launch, launched, wait, waited) of each forward, seconds from the step's start
            forwards_s=forwards,
        ))
        if not engine.has_unfinished():
            break
    prefill_s = meter.elapsed()
    meter.stepwise = max(s["measured"] for s in steps)
    stats = engine.stats()
    kv = stats.kv_allocated_bytes
    result = meter.result(kv, stats.max_predicted_transient_bytes, [first[i] for i in ids], prefill_s,
                          config=engine.config.model_dump(), steps=steps,
                          engine_stats=dataclasses.asdict(stats))
    peak_step = max(steps, key=lambda s: s["measured"])
    result["peak_step"] = peak_step
    result["memory_coefficients"] = getattr(engine, "memory_coefficients_source", None)
    result["step_ratio_min"] = min(s["predicted"] / s["measured"] for s in steps if s["measured"] > 0)
    result["step_ratio_at_peak"] = peak_step["predicted"] / max(peak_step["measured"], 1)
    result["underpredicted_steps"] = sum(1 for s in steps if s["predicted"] < s["measured"])
    for rid in ids:
        engine.abort(rid)
    del engine, recorder
    return result


# --------------------------------------------------------------------------- driver
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
    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    log(f"model {args.model} {lm.dtype}: {lm.weights_bytes / 1e9:.2f} GB weights, built in {lm.build_s:.1f} s")
    if args.warmup != "none":
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
    for way in ways:
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


if __name__ == "__main__":
    main()
