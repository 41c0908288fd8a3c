"""bench_prefill_memory.py's ways of prefilling prompts that arrive together: one after another through
mlx-lm's KVCache (`run_sequential`), one padded forward (`run_naive_padded`), mlx-lm's BatchGenerator
(`run_mlx_lm`) and this engine (`run_engine`); each measured by its own Meter."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import mlx.core as mx

from bench_common import (MLX_LM_SERVER_DEFAULTS, LoadedModel, chunk_bytes, mlx_lm_generator,
                          run_mlx_lm_burst)
from bench_engine import Meter, StepRecorder, make_engine


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
        whole_step = meter.end(engine.stats().kv_allocated_bytes)  # across the engine's per-forward resets
        now = meter.elapsed()
        for out in outputs:
            if out.error:
                raise RuntimeError(f"engine request {out.request_id} failed: {out.error}")
            first.setdefault(out.request_id, now)
        steps.append(step_entry(record, step_s, whole_step))
        if not engine.has_unfinished():
            break
    prefill_s = meter.elapsed()
    result = engine_result(engine, meter, steps, [first[i] for i in ids], prefill_s)
    for rid in ids:
        engine.abort(rid)
    del engine, recorder
    return result


def step_entry(record, step_s: float, whole_step: int) -> dict:
    """What `run_engine` keeps of a step's record: its time, prediction and measure, what it computed."""
    plan = record.plan
    # (launch, launched, wait, waited) of each forward, seconds from the step's start
    forwards = [tuple(None if t is None else round(t, 5)
                      for t in (f.launch_s, f.launched_s, f.wait_s, f.waited_s)) for f in record.forwards]
    # The engine's own figure is per forward (KV of rows allocated later in the step not
    # subtracted); the whole-step one is the fallback for engines that expose none.
    # The engine's record pairs its measurement with its prediction: with overlapped steps
    # (StepExecutor.overlap_steps) a step's record also holds the previous step's deferred forward,
    # measured and predicted (the plan's prediction is this step's alone).
    own = record.memory  # None: the step failed or scheduled nothing
    measured = own.measured_bytes if own is not None else whole_step
    predicted = own.predicted_bytes if own is not None else plan.predicted_transient_bytes
    return dict(
        step_s=round(step_s, 6), predicted=predicted, plan_predicted=plan.predicted_transient_bytes,
        measured=measured,
        whole_step_measured=whole_step,
        decodes=len(plan.decodes), chunks=[(c.num_forward_tokens, c.start + c.num_forward_tokens) for c in plan.prefills],
        mixed=getattr(plan, "mixed", False),
        forwards_s=forwards,
    )


def engine_result(engine, meter: Meter, steps: list[dict], ttft: list[float], prefill_s: float) -> dict:
    """The engine way's result: the Meter's, the engine's stats and config, its steps and their
    predicted / measured."""
    meter.stepwise = max(s["measured"] for s in steps)
    stats = engine.stats()
    kv = stats.kv_allocated_bytes
    result = meter.result(kv, stats.max_predicted_transient_bytes, ttft, prefill_s,
                          config=engine.config.model_dump(), steps=steps,
                          engine_stats=dataclasses.asdict(stats))
    peak_step = max(steps, key=lambda s: s["measured"])
    result["peak_step"] = peak_step
    result["memory_coefficients"] = getattr(engine, "memory_coefficients_source", None)
    # whether a prompt's last chunk (or every chunk) read as a view copies its KV (a replay's MemoryModel
    # needs it)
    result["copies_viewed_kv"] = engine.memory.copies_viewed_kv
    result["copies_every_view"] = engine.memory.copies_every_view
    result["fused_decode"] = engine.memory.fused_decode  # decodes through the fused q/k rope kernel
    result["chunk_loop"] = engine.execution_paths().chunk_loop  # the engine's loops, or mlx-lm's modules
    result["step_ratio_min"] = min(s["predicted"] / s["measured"] for s in steps if s["measured"] > 0)
    result["step_ratio_at_peak"] = peak_step["predicted"] / max(peak_step["measured"], 1)
    result["underpredicted_steps"] = sum(1 for s in steps if s["predicted"] < s["measured"])
    return result
