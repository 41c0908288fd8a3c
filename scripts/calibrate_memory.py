#!/usr/bin/env python3
"""Fit the memory model's transient coefficients on this machine's MLX backend; print JSON.

Runs random workloads of several small random llamas through the real Engine, records every phase
(the batched decode forward, each prefill chunk) with the engine's own measurement (MLX peak over the
memory live before, less the KV it allocated), fits each formula's coefficients by relative least squares, and scales them so
every sample is bounded from above. Usage:
    python scripts/calibrate_memory.py [--quick] > coefficients.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama

from engine.config import EngineConfig
from engine.engine import Engine
from engine.memory import FLOAT32_BYTES, ModelShape
from engine.models import load_model, resolve_model_path
from engine.request import SamplingParams
from engine.runner import PrefillWork

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


def prefill_features(s: ModelShape, c, n, logits):
    """(hidden, [attention parts], mlp, logits) terms of MemoryModel.prefill_chunk_bytes, unscaled."""
    heads = s.num_heads * (c if c > 1 else 1)
    return [c * s.hidden_size * s.dtype_bytes, FLOAT32_BYTES * heads * n, c * n,
            c * s.intermediate_size * s.dtype_bytes, FLOAT32_BYTES * s.vocab_size * logits]


def decode_features(s: ModelShape, b, n):
    gather = 2 * b * s.num_kv_heads * n * s.head_dim * s.dtype_bytes if b > 1 else 0
    return [b * s.hidden_size * s.dtype_bytes, gather, FLOAT32_BYTES * b * s.num_heads * n,
            b * s.intermediate_size * s.dtype_bytes, FLOAT32_BYTES * b * s.vocab_size]


def predict(x, coef):
    """The max-form of engine/memory.py: hidden + max(attention, mlp, logits). x, coef: [5]."""
    return coef[0] * x[:, 0] + np.maximum.reduce([coef[1] * x[:, 1] + coef[2] * x[:, 2],
                                                  coef[3] * x[:, 3], coef[4] * x[:, 4]])


def sample_shape(model, shape, tokenizer, rng, num_workloads):
    """Random workloads through a real Engine; every phase's measured transient is recorded."""
    prefill, decode = [], []
    model_config = {"hidden_size": shape.hidden_size, "num_hidden_layers": shape.num_layers,
                    "intermediate_size": shape.intermediate_size, "num_attention_heads": shape.num_heads,
                    "num_key_value_heads": shape.num_kv_heads, "vocab_size": shape.vocab_size,
                    "max_position_embeddings": 4096}
    for _ in range(num_workloads):
        chunk = rng.choice([16, 32, 64, 128, 256, 512])
        cfg = EngineConfig(model="tiny", prefill_chunk_size=chunk, max_num_batched_tokens=chunk * 3,
                           max_num_seqs=rng.randint(2, 12), memory_limit_bytes=8 << 30)
        engine = Engine(model, tokenizer, cfg, model_config)
        measured = engine._measured

        def record(fn, work, measured=measured, engine=engine):
            result, peak = measured(fn, work)
            if isinstance(work, PrefillWork):
                c = len(work.token_ids)
                prefill.append((prefill_features(shape, c, work.start + c, work.sample), peak))
            elif work:
                n = max(engine.runner.rows[w.request_id].offset for w in work)
                decode.append((decode_features(shape, len(work), n), peak))
            return result, peak

        engine._measured = record
        for i in range(rng.randint(2, 10)):
            prompt = [rng.randrange(3, shape.vocab_size) for _ in range(rng.randint(4, 1500))]
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=rng.randint(2, 16), ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    return prefill, decode


def fit(samples, rng, iterations=4000):
    """Random search for the coefficients with the smallest worst overestimate, as an upper bound."""
    x = np.array([f for f, _ in samples], float)
    y = np.array([max(p, 1) for _, p in samples], float)
    best, best_max = None, np.inf
    coef = np.ones(5)
    for i in range(iterations):
        trial = coef * np.exp(np.array([rng.gauss(0, 0.3) for _ in range(5)])) if best is not None else coef
        ratio = predict(x, trial) / y
        trial = trial / ratio.min()  # scale so that no sample is underestimated
        worst = float((predict(x, trial) / y).max())
        if worst < best_max:
            best, best_max = trial, worst
        coef = best
    return [round(float(v) * 1.02, 3) for v in best], round(best_max * 1.02, 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--quick", action="store_true", help="fewer workloads")
    ap.add_argument("--dump", help="write the raw samples (features, measured bytes) to this JSON file")
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
    if args.dump:
        with open(args.dump, "w") as f:
            json.dump({"prefill": prefill, "decode": decode}, f)
    pc, pmax = fit(prefill, rng)
    dc, dmax = fit(decode, rng)
    coefficients = dict(
        prefill_hidden=pc[0], prefill_scores=pc[1], prefill_mask=pc[2], prefill_mlp=pc[3], prefill_logits=pc[4],
        decode_hidden=dc[0], decode_gather=dc[1], decode_scores=dc[2], decode_mlp=dc[3], decode_logits=dc[4],
    )
    print(json.dumps({"backend": str(mx.default_device()), "dtype": args.dtype, "coefficients": coefficients,
                      "max_overestimate": {"prefill": round(pmax, 3), "decode": round(dmax, 3)},
                      "num_samples": {"prefill": len(prefill), "decode": len(decode)}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
