#!/usr/bin/env python3
"""Fit the memory model's transient coefficients on this machine's MLX backend; print JSON.

Runs random workloads of several small random llamas through the real Engine, records every phase
(the batched decode forward, each prefill chunk) with the engine's own measurement (MLX peak over the
memory live before, less the KV it allocated), reports how the current coefficients (engine/core/memory/model.py CPU_COEFFICIENTS) do
(predicted / measured, min and max), and random-searches coefficients that bound every sample from
above with the smallest worst overestimate. The shipped CPU set is fitted on a grid instead
(scripts/bench_memory_grid.py --fit, engine/core/memory/coefficients.py); this checks it on random
workloads. Usage:
    python scripts/calibrate_memory.py [--quick] > coefficients.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, fields, replace

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama

from engine.config import EngineConfig
from engine.engine import Engine
from engine.core.memory.model import MemoryModel, ModelShape
from engine.core.memory.coefficients import CPU_COEFFICIENTS, TransientCoefficients
from engine.model.loader import load_model, resolve_model_path
from engine.model.runner import RunnerOptions
from engine.core.types import SamplingParams

SHAPES = [  # (heads, kv heads, hidden, mlp, vocab)
    (4, 2, 256, 512, 32000), (8, 2, 512, 1536, 8000), (9, 3, 576, 1536, 49152), (16, 4, 1024, 2816, 16000),
]


def build(h, kv, d, i, v, dtype):
    args = llama.ModelArgs(model_type="llama", hidden_size=d, num_hidden_layers=2, intermediate_size=i,
                           num_attention_heads=h, num_key_value_heads=kv, rms_norm_eps=1e-5, vocab_size=v)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    shape = ModelShape(2, d, h, kv, d // h, i, v, dtype.size)
    return model, shape


def predict(samples, coefficients: TransientCoefficients) -> np.ndarray:
    """The engine's own formulas (engine/core/memory/model.py) with candidate coefficients."""
    out = []
    for kind, shape, args in samples:
        model = MemoryModel(shape, coefficients=coefficients)
        out.append(model.prefill_chunk_bytes(*args) if kind == "prefill" else model.decode_bytes(args))
    return np.array(out, float)


def sample_shape(model, shape, tokenizer, rng, num_workloads):
    """Random workloads through a real Engine; every phase's measured transient is recorded."""
    prefill, decode = [], []
    model_config = {"hidden_size": shape.hidden_size, "num_hidden_layers": shape.num_layers,
                    "intermediate_size": shape.intermediate_size, "num_attention_heads": shape.num_heads,
                    "num_key_value_heads": shape.num_kv_heads, "vocab_size": shape.vocab_size,
                    "max_position_embeddings": 4096}
    for w in range(num_workloads):
        chunk = rng.choice([16, 32, 64, 128, 256, 512])
        # every other workload runs one request and one chunk at a time: each step one prompt chunk alone
        max_num_seqs = 1 if w % 2 else rng.randint(2, 12)
        # decode rows in their own forwards: steps of one part each (mixed forwards are predicted from
        # the same coefficients, engine/core/memory/model.py `mixed_bytes`)
        cfg = EngineConfig(model="tiny", prefill_chunk_size=chunk,
                           max_num_batched_tokens=chunk if max_num_seqs == 1 else chunk * 3,
                           max_num_seqs=max_num_seqs, memory_limit_bytes=8 << 30)
        # every read a gather: the formulas' full form
        engine = Engine(model, tokenizer, cfg, model_config,
                        runner_options=RunnerOptions(mixed_batches=False, read_slices=False))
        for i in range(rng.randint(2, 10)):
            prompt = [rng.randrange(3, shape.vocab_size) for _ in range(rng.randint(4, 1500))]
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=rng.randint(2, 16), ignore_eos=True))
        num_tokens: dict[str, int] = {}  # request id -> prompt + output tokens, from the step records
        finished: set[str] = set()
        while engine.has_unfinished():
            pool_bytes = engine.stats().kv_allocated_bytes
            record = engine.step()
            for out in record.outputs:
                num_tokens[out.request_id] = out.num_prompt_tokens + out.num_output_tokens
                if out.finished:
                    finished.add(out.request_id)
            if engine.stats().kv_allocated_bytes != pool_bytes or record.memory is None:
                continue  # the pool grew in this step: its copy is counted apart (kv_copy_bytes)
            # The engine measures a step as a whole: keep the steps of one part (one prompt chunk, or
            # the decode alone).
            plan, peak = record.plan, record.memory.measured_bytes
            if len(plan.prefills) == 1 and not plan.decodes:
                c = plan.prefills[0]
                prefill.append((("prefill", shape, (c.num_forward_tokens, c.start + c.num_forward_tokens, c.completes_prompt)), peak))
            elif plan.decodes and not plan.prefills and not finished.intersection(plan.decodes):
                lens = [num_tokens[i] - 1 for i in plan.decodes]  # KV after the forward
                decode.append((("decode", shape, lens), peak))
    return prefill, decode


def fit(samples, measured, start: TransientCoefficients, names, rng, iterations):
    """Random search over the named coefficients: every sample bounded, smallest worst overestimate."""
    y = np.maximum(np.array(measured, float), 1.0)
    best = start
    best_ratio = predict(samples, best) / y
    for _ in range(iterations):
        trial = replace(best, **{n: getattr(best, n) * float(np.exp(rng.gauss(0, 0.1))) for n in names})
        ratio = predict(samples, trial) / y
        scale = 1.0 / ratio.min()
        trial = replace(trial, **{n: getattr(trial, n) * scale for n in names})
        ratio = ratio * scale
        if ratio.max() < best_ratio.max() or best_ratio.min() < 1.0:
            best, best_ratio = trial, ratio
    return best, best_ratio


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="fewer workloads")
    ap.add_argument("--iterations", type=int, default=150, help="random-search steps per formula")
    ap.add_argument("--no-cache", action="store_true", help="mx.set_cache_limit(0) while measuring")
    args = ap.parse_args(argv)
    dtype = getattr(mx, args.dtype)
    if args.no_cache:
        mx.set_cache_limit(0)
    rng = random.Random(0)
    tokenizer = load_model(resolve_model_path("tiny", progress=False))[1]  # for detokenizing only
    prefill, decode = [], []
    for spec in SHAPES:
        model, shape = build(*spec, dtype)
        p, d = sample_shape(model, shape, tokenizer, rng, 4 if args.quick else 10)
        prefill += p
        decode += d
        print(f"measured shape {spec}", file=sys.stderr)
    current = CPU_COEFFICIENTS
    report = {"current": {}, "fitted": {}}
    fitted = current
    for kind, rows in (("prefill", prefill), ("decode", decode)):
        samples, measured = [r for r, _ in rows], [p for _, p in rows]
        ratio = predict(samples, current) / np.maximum(np.array(measured, float), 1.0)
        report["current"][kind] = {"min_ratio": round(float(ratio.min()), 3), "max_ratio": round(float(ratio.max()), 3)}
        names = [f.name for f in fields(TransientCoefficients)  # the fitted terms: those in use
                 if f.name.startswith(kind) and isinstance(getattr(fitted, f.name), float) and getattr(fitted, f.name)]
        fitted, ratio = fit(samples, measured, fitted, names, rng, args.iterations)
        report["fitted"][kind] = {"min_ratio": round(float(ratio.min()), 3), "max_ratio": round(float(ratio.max()), 3)}
    coefficients = {k: v if v is None else round(v, 3) for k, v in asdict(fitted).items()}
    print(json.dumps({"backend": str(mx.default_device()), "dtype": args.dtype, "coefficients": coefficients,
                      "predicted_over_measured": report,
                      "num_samples": {"prefill": len(prefill), "decode": len(decode)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
