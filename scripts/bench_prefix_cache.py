#!/usr/bin/env python3
"""TTFT of a long shared prefix + a short new suffix, with and without the prefix cache. Prints JSON.

    python scripts/bench_prefix_cache.py [--model default] [--prefix-tokens 4096] [--suffix-tokens 64]

One engine with the prefix cache: request A (prefix + suffix A) runs cold, then request B
(prefix + suffix B) hits the cache. A second engine without the cache runs B cold for comparison.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from engine.config import EngineConfig
from engine.engine import Engine
from engine.core.types import SamplingParams


def ttft(engine: Engine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while True:
        for out in engine.step().outputs:
            if out.request_id == request_id:
                return time.perf_counter() - start, out.num_cached_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    args = ap.parse_args()
    rng = random.Random(0)
    base = dict(model=args.model, max_model_len=args.prefix_tokens + args.suffix_tokens + 64)
    warm = Engine.from_config(EngineConfig(**base))
    vocab = warm.memory.shape.vocab_size
    prefix = [rng.randrange(100, vocab) for _ in range(args.prefix_tokens)]
    a = prefix + [rng.randrange(100, vocab) for _ in range(args.suffix_tokens)]
    b = prefix + [rng.randrange(100, vocab) for _ in range(args.suffix_tokens)]
    ttft(warm, "warmup", a[:64])  # first MLX calls compile / allocate
    cold_a, _ = ttft(warm, "a", a)
    cached_b, num_cached = ttft(warm, "b", b)
    cold = Engine.from_config(EngineConfig(prefix_cache_fraction=0.0, **base))
    ttft(cold, "warmup", a[:64])
    cold_b, _ = ttft(cold, "b", b)
    print(json.dumps({
        "model": args.model, "prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens,
        "ttft_cold_s": round(cold_b, 3), "ttft_cold_same_engine_s": round(cold_a, 3),
        "ttft_cached_s": round(cached_b, 3), "cached_tokens": num_cached,
        "speedup": round(cold_b / cached_b, 1),
    }))


if __name__ == "__main__":
    main()
