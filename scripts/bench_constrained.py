"""The cost of grammar-constrained decoding (`bench_serving.py --engine-only --constrained-fraction F`).

The same N streams (random prompts, exactly --output-tokens each), run twice through the engine's step
loop (bench_serving_drivers.run_engine_sync: pipelined decode on, as served): all free, then the first F x N
constrained by a JSON schema whose output never completes within --output-tokens (an array of at
least 10,000 records: strings, integers, booleans, the structure between them), so both runs decode the
same number of tokens. Reports TPOT of each run, of the free and the constrained rows of the second,
and the cost: TPOT(mixed) / TPOT(free) - 1, of the medians over --repeat alternating passes (after one
untimed warm-up pass); likewise of the median gap between two tokens of a stream (steadier on a busy
host), and of the CPU time of a step, the process's (all threads) and the engine
thread's alone (the host work each step waits for; the grammars' masks are computed on another thread).

A random-weight shape (llama-8b, llama-test) has no tokenizer: the grammar then uses SmolLM2's (the
embedded model's) over the shape's vocabulary; tokens past SmolLM2's are never allowed.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time

from bench_common import environment, free_memory, load_bench_model, log, random_prompts

SCHEMA = {"type": "array", "minItems": 10000, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "count", "ok"],
    "properties": {"name": {"type": "string", "maxLength": 24}, "count": {"type": "integer"},
                   "ok": {"type": "boolean"}}}}


def _with_grammar_tokenizer(lm) -> None:
    """Give a random shape's stand-in tokenizer the embedded model's HF tokenizer (for the grammar)."""
    if hasattr(lm.tokenizer, "_tokenizer"):
        return
    from engine.model.loader import load_model, resolve_model_path

    _, tokenizer = load_model(resolve_model_path("tiny"))
    lm.tokenizer._tokenizer = tokenizer._tokenizer
    lm.tokenizer.eos_token_ids = []


def _mean(values) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.fmean(values) if values else float("nan")


def _median_cost(result: dict, passes: dict[str, list[dict]], key: str, median_key: str, cost_key: str) -> dict:
    """Into `result`: the median of each run kind's `key` over its passes, and mixed / free - 1 of them."""
    median = {name: statistics.median(r[key] for r in runs) for name, runs in passes.items()}
    result[median_key], result[cost_key] = median, median["mixed"] / median["free"] - 1
    return median


def constrained_cost(args) -> dict:
    from bench_serving_drivers import run_engine_sync
    from bench_serving_stats import arrival_times
    from engine.core.types import Grammar, SamplingParams

    from engine.model.grammar import GrammarCompiler

    lm = load_bench_model(args.model, args.dtype, args.layers, args.init, args.seed)
    _with_grammar_tokenizer(lm)
    # one for every run (a server makes it once): its ~0.5 s is not the cost of a step
    compiler = GrammarCompiler(lm.tokenizer._tokenizer, lm.config["vocab_size"], list(lm.tokenizer.eos_token_ids) or [0])
    free = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True,
                                 grammar=Grammar("json_schema", json.dumps(SCHEMA)))
    result = dict(bench="constrained_decoding", argv=sys.argv[1:], model=args.model, dtype=lm.dtype,
                  prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                  constrained_fraction=args.constrained_fraction, schema=SCHEMA, environment=environment(), runs={})
    for conc in args.concurrency:
        args.concurrency_now = conc
        num_constrained = round(args.constrained_fraction * conc)
        prompts = random_prompts([args.prompt_tokens] * conc, lm.config["vocab_size"], args.seed + conc)
        arrivals = arrival_times(conc, None, args.seed)
        kinds = {"free": lambda i: free, "mixed": lambda i: constrained if i < num_constrained else free}
        passes: dict[str, list[dict]] = {name: [] for name in kinds}
        for rep in range(args.repeat + 1):  # pass 0 warms up (kernels, traces, the grammar's tokenizer)
            for name, sampling_for in kinds.items():  # alternating: a busy host slows both alike
                t, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
                r = run_engine_sync(lm, prompts, arrivals, args, breakdown=False, sampling_for=sampling_for,
                                    grammar_compiler=compiler)
                r["cpu_s_per_step"] = (time.process_time() - cpu) / r["num_steps"]  # this process, all threads
                # the engine's thread alone (this one): the host work a step waits for, where the device
                # computes on threads of its own (MLX's CPU backend) or is a GPU
                r["engine_thread_cpu_s_per_step"] = (time.thread_time() - own) / r["num_steps"]
                free_memory()
                if rep == 0:
                    log(f"warm-up {name} x{conc}: {time.perf_counter() - t:.1f} s")
                    continue
                tpots = r.pop("tpot_by_request_s")
                r["tpot_constrained_rows_s"] = _mean(tpots[:num_constrained]) if name == "mixed" else None
                r["tpot_free_rows_s"] = _mean(tpots[num_constrained:] if name == "mixed" else tpots)
                passes[name].append(r)
                log(f"{name} x{conc}: TPOT {r['tpot_mean_s'] * 1e3:.2f} ms (median gap {r['itl_p50_s'] * 1e3:.2f}), "
                    f"{r['output_tok_per_s']:.1f} tok/s, "
                    f"CPU {r['cpu_s_per_step'] * 1e3:.2f} ms a step, "
                    f"{r['engine_thread_cpu_s_per_step'] * 1e3:.2f} ms on the engine's thread")
        for name, runs in passes.items():
            result["runs"][f"{name}@{conc}"] = runs
        # on a CPU host shared with other work, the process's CPU time is steadier than wall time
        median = _median_cost(result, passes, "tpot_mean_s", f"tpot_median_s@{conc}", f"tpot_cost@{conc}")
        _median_cost(result, passes, "itl_p50_s", f"itl_p50_median_s@{conc}", f"itl_p50_cost@{conc}")
        _median_cost(result, passes, "cpu_s_per_step", f"cpu_s_per_step_median@{conc}", f"cpu_cost@{conc}")
        _median_cost(result, passes, "engine_thread_cpu_s_per_step", f"engine_thread_cpu_s_per_step_median@{conc}",
                     f"engine_thread_cpu_cost@{conc}")
        log(f"x{conc}: {num_constrained} constrained streams cost {100 * result[f'tpot_cost@{conc}']:.1f}% of "
            f"TPOT (medians of {args.repeat} passes: {median['free'] * 1e3:.2f} -> {median['mixed'] * 1e3:.2f} ms), "
            f"{100 * result[f'itl_p50_cost@{conc}']:.1f}% of the median gap between tokens, "
            f"{100 * result[f'cpu_cost@{conc}']:.1f}% of the CPU time of a step, "
            f"{100 * result[f'engine_thread_cpu_cost@{conc}']:.1f}% of the engine thread's")
    return result
