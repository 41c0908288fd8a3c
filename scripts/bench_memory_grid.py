"""Calibration grid of the memory model: measured transient of single prefill chunks (c tokens at
context n) and of batched decode steps (B rows of context n), through this engine, plus a fit.

    python scripts/bench_memory_grid.py --model llama-8b --dtype bfloat16 --variants --out grid.json
    python scripts/bench_memory_grid.py --fit scripts/data/cuda_memory_grid_h200.json   # here, on CPU

Measure mode runs the engine on one prompt per chunk size (every chunk of it is one grid point:
(c, c), (c, 2c), ... (c, n), the last one with logits), then B prompts decoding together for each
B in --decode-rows (rows aborted one group at a time). `--variants` adds 2-layer random llamas of
other shapes (the per-layer transient does not depend on the layer count), so every term of the
formula varies independently and the coefficients can be separated. Every point carries the raw term
values of engine/memory.py's formulas, so fitting is a linear problem.

Fit mode: non-negative least squares of measured bytes on the terms, then scaled up so that no
point is under-predicted (the engine needs an upper bound), printed as a TransientCoefficients.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (LLAMA_8B, LLAMA_TEST, DTYPES, LoadedModel, build_random_llama,  # noqa: E402
                          emit, environment, free_memory, load_bench_model, random_prompts)
from bench_prefill_memory import Meter, StepRecorder, make_engine  # noqa: E402

import mlx.core as mx  # noqa: E402

PREFILL_TERMS = ("prefill_scores", "prefill_mask", "prefill_gather", "prefill_mlp", "prefill_hidden",
                 "prefill_logits", "decode_scores")
DECODE_TERMS = ("decode_gather", "decode_scores", "decode_logits", "decode_mlp", "decode_hidden")

# 2-layer variants: each changes some of heads / hidden / MLP / vocabulary against the 8B shape.
VARIANTS = {
    "8b-2layers": dict(LLAMA_8B, num_hidden_layers=2),
    "d2048-h16-i8192-v32k": dict(LLAMA_8B, num_hidden_layers=2, hidden_size=2048, num_attention_heads=16,
                                 num_key_value_heads=4, head_dim=128, intermediate_size=8192, vocab_size=32000),
    "d4096-h64-i4096": dict(LLAMA_8B, num_hidden_layers=2, num_attention_heads=64, num_key_value_heads=8,
                            head_dim=64, intermediate_size=4096),
}
TEST_VARIANTS = {
    "test-2layers": dict(LLAMA_TEST, num_hidden_layers=2),
    "test-wide-mlp": dict(LLAMA_TEST, num_hidden_layers=2, intermediate_size=2048, vocab_size=32000),
}


def shape_of(config: dict, dtype_bytes: int) -> dict:
    h = config["num_attention_heads"]
    return dict(H=h, Hkv=config.get("num_key_value_heads") or h, d=config.get("head_dim") or config["hidden_size"] // h,
                D=config["hidden_size"], I=config["intermediate_size"], V=config["vocab_size"],
                L=config["num_hidden_layers"], s=dtype_bytes)


def prefill_terms(sh: dict, c: int, n: int, logits: bool) -> dict:
    return dict(prefill_scores=4 * sh["H"] * c * n if c > 1 else 0, prefill_mask=c * n,
                prefill_gather=n * sh["Hkv"] * (2 * sh["d"] * sh["s"] + 4),
                prefill_mlp=c * sh["I"] * sh["s"], prefill_hidden=c * sh["D"] * sh["s"],
                prefill_logits=4 * sh["V"] * int(logits), decode_scores=4 * sh["H"] * n if c == 1 else 0)


def decode_terms(sh: dict, b: int, n: int) -> dict:
    # a linear fit: the engine's max(layers, logits) is fitted as a sum (points where the layers dominate)
    return dict(decode_gather=b * n * sh["Hkv"] * (2 * sh["d"] * sh["s"] + 4),
                decode_scores=4 * b * sh["H"] * n, decode_logits=4 * b * sh["V"],
                decode_mlp=b * sh["I"] * sh["s"], decode_hidden=b * sh["D"] * sh["s"])


def run_steps(engine, recorder, meter, until) -> list[dict]:
    """Step the engine until `until()`; one record per step (predicted, measured, time, plan)."""
    out = []
    while not until():
        meter.begin(engine.runner.kv_allocated_bytes)
        t = time.perf_counter()
        outputs = engine.step()
        mx.synchronize()
        dt = time.perf_counter() - t
        whole = meter.end(engine.runner.kv_allocated_bytes)
        for o in outputs:
            if o.error:
                raise RuntimeError(f"{o.request_id}: {o.error}")
        own = getattr(engine, "last_step_memory", None)
        plan = recorder.plans[-1]
        out.append(dict(step_s=dt, measured=own.measured_bytes if own is not None else whole,
                        whole_step_measured=whole, predicted=plan.predicted_transient_bytes,
                        decodes=len(plan.decodes), context_lens=None,
                        chunks=[(c.num_tokens, c.start + c.num_tokens, c.completes_prompt) for c in plan.prefills],
                        outputs=len(outputs)))
    return out


def prefill_grid(lm: LoadedModel, chunks: list[int], length: int, shape: dict, label: str) -> list[dict]:
    from engine.request import SamplingParams

    points = []
    for c in chunks:
        prompt = random_prompts([length], lm.config["vocab_size"], seed=c)[0]
        engine = make_engine(lm, [length], 4, chunk=c, max_num_batched_tokens=max(c, 2048))
        recorder = StepRecorder(engine)
        meter = Meter()
        engine.add_request("g", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        steps = run_steps(engine, recorder, meter,
                          lambda: engine.scheduler.requests.get("g") is None
                          or engine.scheduler.requests["g"].num_output_tokens >= 1)
        meter.result(0, None, [0.0], 0.0)
        for st in steps:
            if st["decodes"] or len(st["chunks"]) != 1:
                continue
            cc, n, logits = st["chunks"][0]
            points.append(dict(kind="prefill", variant=label, c=cc, n=n, logits=logits, B=1,
                               measured=st["measured"], predicted=st["predicted"], step_s=st["step_s"],
                               whole_step_measured=st["whole_step_measured"],
                               terms=prefill_terms(shape, cc, n, logits)))
        engine.abort("g")
        engine = recorder = None  # the next engine starts from nothing alive but the weights
        free_memory()
    return points


def decode_grid(lm: LoadedModel, rows: list[int], contexts: list[int], shape: dict, label: str,
                steps_per_point: int = 3) -> list[dict]:
    from engine.request import SamplingParams

    points = []
    rows = sorted(rows, reverse=True)
    for n in contexts:
        b_max = rows[0]
        prompts = random_prompts([n] * b_max, lm.config["vocab_size"], seed=n)
        # Rows that finish their prompt first decode while the others prefill: room for those tokens.
        max_tokens = steps_per_point * (len(rows) + 1) + (n * b_max) // 256 + 8
        engine = make_engine(lm, [n] * b_max, max_tokens, max_num_seqs=max(16, b_max))
        recorder = StepRecorder(engine)
        meter = Meter()
        ids = [f"d{i}" for i in range(b_max)]
        for rid, p in zip(ids, prompts):
            engine.add_request(rid, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        run_steps(engine, recorder, meter,
                  lambda: all(engine.scheduler.requests[i].num_output_tokens >= 1 for i in ids))
        alive = list(ids)
        for b in rows:
            for rid in alive[b:]:
                engine.abort(rid)
            alive = [i for i in alive[:b] if i in engine.scheduler.requests]
            if len(alive) < b:
                raise RuntimeError(f"decode grid: rows finished early ({len(alive)} < {b})")
            free_memory()
            done = [0]

            def until():
                done[0] += 1
                return done[0] > steps_per_point

            for st in run_steps(engine, recorder, meter, until):
                if st["chunks"] or st["decodes"] != b:
                    continue
                ctx = max(engine.scheduler.requests[i].num_tokens for i in alive) - 1
                points.append(dict(kind="decode", variant=label, B=b, n=ctx, c=1, logits=True,
                                   measured=st["measured"], predicted=st["predicted"], step_s=st["step_s"],
                                   whole_step_measured=st["whole_step_measured"],
                                   terms=decode_terms(shape, b, ctx)))
        meter.result(0, None, [0.0], 0.0)
        for rid in alive:
            engine.abort(rid)
        engine = recorder = None
        free_memory()
    return points


def measure(args) -> dict:
    lm = load_bench_model(args.model, args.dtype, args.layers, args.init, args.seed)
    chunks = [int(x) for x in args.chunks.split(",")]
    rows = [int(x) for x in args.decode_rows.split(",")]
    contexts = [int(x) for x in args.decode_contexts.split(",")]
    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    result = dict(bench="memory_grid", argv=sys.argv[1:], model=args.model, dtype=lm.dtype,
                  environment=environment(), points=[], shapes={})
    models = [(args.model, lm)]
    if args.variants:
        table = VARIANTS if args.model == "llama-8b" else TEST_VARIANTS
        for name, cfg in table.items():
            models.append((name, cfg))
    # Warm-up (kernels compile on first use): a short prefill and a 2-row decode.
    prefill_grid(lm, [min(chunks)], min(chunks) * 2, shape_of(lm.config, DTYPES[lm.dtype].size), "warmup")
    decode_grid(lm, [2], [min(contexts)], shape_of(lm.config, DTYPES[lm.dtype].size), "warmup", 1)
    for label, m in models:
        t = time.perf_counter()
        if isinstance(m, dict):
            model = build_random_llama(m, lm.dtype, args.init, args.seed)
            from mlx.utils import tree_flatten

            params = tree_flatten(model.parameters())
            m = LoadedModel(label, model, lm.tokenizer, m, lm.dtype, None,
                            sum(p.nbytes for _, p in params), sum(p.size for _, p in params), 0.0)
        sh = shape_of(m.config, DTYPES[m.dtype].size)
        result["shapes"][label] = sh
        for _ in range(args.repeat - 1):  # earlier passes build each shape's kernels: time the last
            prefill_grid(m, chunks, args.prefill_length, sh, label)
        pts = prefill_grid(m, chunks, args.prefill_length, sh, label)
        pts += decode_grid(m, rows, contexts, sh, label)
        result["points"] += pts
        log(f"{label}: {len(pts)} points in {time.perf_counter() - t:.1f} s")
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
        if m is not lm:
            del m
        free_memory()
    worst = max(result["points"], key=lambda p: p["measured"] / max(p["predicted"], 1))
    result["worst_under_prediction"] = dict(worst, ratio_measured_over_predicted=worst["measured"] / max(worst["predicted"], 1))
    return result


# --------------------------------------------------------------------------- fit
def nnls(a, b, iters: int = 5000):
    """Non-negative least squares (projected gradient on the column-scaled problem; numpy only)."""
    import numpy as np

    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    x_a = a / scale
    x = np.clip(np.linalg.lstsq(x_a, b, rcond=None)[0], 0, None)
    step = 1.0 / (np.linalg.norm(x_a, 2) ** 2)
    for _ in range(iters):
        x = np.clip(x - step * (x_a.T @ (x_a @ x - b)), 0, None)
    return x / scale


def layer_scaled_terms(p: dict, sh: dict) -> dict:
    """Terms of a CUDA-shaped formula: every per-layer activation counted for all L layers (measured
    on the H200: MLX frees a buffer when the GPU has run the kernels that read it, and the host
    encodes the whole forward ahead, so each layer's intermediates are alive together), plus the
    contiguous K/V copy each layer's attention makes of its [1, H_kv, n, d] slices."""
    L, s = sh["L"], sh["s"]
    if p["kind"] == "prefill":
        c, n = p["c"], p["n"]
        return dict(L_mlp=L * c * sh["I"] * s, L_hidden=L * c * sh["D"] * s,
                    L_kv_copy=L * 2 * n * sh["Hkv"] * sh["d"] * s, logits=4 * sh["V"] * int(p["logits"]))
    b, n = p["B"], p["n"]
    return dict(L_gather=L * 2 * b * n * sh["Hkv"] * sh["d"] * s if b > 1 else 0,
                L_kv_copy=L * 2 * n * sh["Hkv"] * sh["d"] * s if b == 1 else 0,
                L_mlp=L * b * sh["I"] * s, logits=4 * b * sh["V"])


def _fit_rows(sel: list[dict], names: list[str], key) -> dict:
    import numpy as np

    a = np.array([[key(p).get(t, 0) for t in names] for p in sel], dtype=float)
    b = np.array([p["measured"] for p in sel], dtype=float)
    w = 1.0 / b  # relative error: small chunks count as much as big ones
    x = nnls(a * w[:, None], b * w)
    pred = a @ x
    margin = max(float(np.max(b / np.maximum(pred, 1))), 1.0)  # scaled up: never under-predict
    x_up = x * margin
    ratio = (a @ x_up) / b
    base_pred = np.array([p["predicted"] for p in sel], dtype=float)
    return dict(num_points=len(sel), coefficients={n: round(float(v), 4) for n, v in zip(names, x_up)},
                raw_fit=[float(v) for v in x], margin=margin,
                fitted_over_measured=dict(min=float(ratio.min()), median=float(np.median(ratio)),
                                          max=float(ratio.max())),
                engine_cpu_coefficients_over_measured=dict(
                    min=float((base_pred / b).min()), median=float(np.median(base_pred / b)),
                    max=float((base_pred / b).max())))


def fit(path: str, variants: str = "", layer_scaled: bool = False, base: str = "CPU_COEFFICIENTS") -> dict:
    """Fit the engine's formula (per model: its terms have no layer count) or, with `layer_scaled`,
    the layer-aware formula above across every variant."""
    from engine import memory as mem

    data = json.loads(Path(path).read_text())
    keep = set(v for v in variants.split(",") if v)
    pts = [p for p in data["points"] if p["variant"] != "warmup" and p["measured"] > 0
           and (not keep or p["variant"] in keep)]
    out: dict = {"variants": sorted({p["variant"] for p in pts}), "layer_scaled": layer_scaled}
    fitted = dataclasses.asdict(getattr(mem, base))
    for kind, terms in (("prefill", PREFILL_TERMS), ("decode", DECODE_TERMS)):
        sel = [p for p in pts if p["kind"] == kind]
        if not sel:
            continue
        if layer_scaled:
            key = (lambda p: layer_scaled_terms(p, data["shapes"][p["variant"]]))
            names = [t for t in key(sel[0])]
        else:
            key = (lambda p: p["terms"])
            names = [t for t in terms if any(p["terms"].get(t) for p in sel)]
        names = [t for t in names if any(key(p).get(t) for p in sel)]
        out[kind] = _fit_rows(sel, names, key)
        if not layer_scaled:
            fitted.update(out[kind]["coefficients"])
    if not layer_scaled:
        out["coefficients"] = fitted
        out["python"] = "TransientCoefficients(" + ", ".join(f"{k}={v}" for k, v in fitted.items()) + ")"
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit", default=None, help="fit coefficients to a grid JSON (no measuring)")
    p.add_argument("--fit-variants", default="", help="--fit: only these variants (comma-separated)")
    p.add_argument("--layer-scaled", action="store_true", help="--fit: the layer-aware CUDA formula")
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--init", choices=["normal", "zeros"], default="normal")
    p.add_argument("--chunks", default="128,256,512,1024,2048")
    p.add_argument("--prefill-length", type=int, default=8192, help="one prompt per chunk size, this long")
    p.add_argument("--decode-rows", default="16,8,4,2,1")
    p.add_argument("--decode-contexts", default="1024,4096,8192")
    p.add_argument("--variants", action="store_true", help="also 2-layer models of other shapes")
    p.add_argument("--repeat", type=int, default=1, help="prefill passes per model (the last is kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    result = fit(args.fit, args.fit_variants, args.layer_scaled) if args.fit else measure(args)
    emit(result, args.json, None if args.fit else args.out)


if __name__ == "__main__":
    main()
