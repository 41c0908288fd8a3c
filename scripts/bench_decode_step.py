"""Decode step time and MLX graph size per step, at a fixed context, for B = 1, 4, 8 rows.

For each model (the tiny test llama, the default SmolLM2-135M) and each batch size B, an Engine admits
B requests with `--prompt-tokens` random prompt tokens, prefills them, runs `--warmup` decode steps,
then times `--steps` decode-only steps (`Engine.step()`, scheduling and sampling included).
`ops_per_step` is the number of operations in the lazy graph of one decode forward (hidden states,
LM head excluded), counted from `mx.export_to_dot`; `ops_per_layer` divides the part that grows with
the layer count by it. Prints one JSON object.

    python scripts/bench_decode_step.py                          # tiny and default, B = 1, 4, 8
    python scripts/bench_decode_step.py --models tiny --batches 1,8 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.request import SamplingParams  # noqa: E402


def count_ops(outputs: mx.array) -> int:
    """Operation nodes of the (unevaluated) graph of `outputs`: DOT nodes that are not leaf arrays."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, outputs)
        text = f.read()
    # export_to_dot draws primitives as rectangles and arrays as ovals
    return sum(1 for line in text.splitlines() if "shape=rectangle" in line or "shape=box" in line)


class OpCounter:
    """Wraps runner._forward: counts the ops of the next decode forward's graph."""

    def __init__(self, runner):
        self.runner = runner
        self.original = runner._forward
        self.armed = False
        self.count = None

    def __call__(self, tokens, cache):
        hidden = self.original(tokens, cache)
        if self.armed and tokens.shape[1] == 1:
            self.count = count_ops(hidden)
            self.armed = False
        return hidden


def bench_one(model: str, batch: int, args) -> dict:
    cfg = EngineConfig(model=model, max_num_seqs=max(batch, 1), prefill_chunk_size=512,
                       max_num_batched_tokens=max(2048, batch), memory_limit_bytes=args.memory_limit,
                       prefix_cache_fraction=0.0, cache_dir=os.environ.get("MLX_SERVE_CACHE"))
    engine = Engine.from_config(cfg)
    rng = random.Random(0)
    vocab = engine.memory.shape.vocab_size
    total_steps = args.warmup + args.steps + 2
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=total_steps + 4, ignore_eos=True))
    while any(r.is_prefilling for r in engine.scheduler.requests.values()) or engine.scheduler.num_waiting:
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    counter = OpCounter(engine.runner)
    engine.runner._forward = counter
    counter.armed = True
    engine.step()  # counted, not timed (exporting the graph takes time)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        assert len(outs) == batch, "every step must be a decode of all rows"
    num_layers = engine.memory.shape.num_layers
    times.sort()
    return {
        "model": model, "batch": batch, "num_layers": num_layers,
        "context_tokens": args.prompt_tokens + args.warmup + 1,
        "step_ms_mean": round(1000 * sum(times) / len(times), 3),
        "step_ms_median": round(1000 * times[len(times) // 2], 3),
        "ms_per_token": round(1000 * sum(times) / len(times) / batch, 3),
        "ops_per_step": counter.count,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,default")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--memory-limit", type=int, default=4 << 30)
    args = p.parse_args()
    results = []
    for model in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            results.append(bench_one(model, batch, args))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    # ops that grow with B: the difference between batch sizes, per layer
    by_model = {}
    for r in results:
        by_model.setdefault(r["model"], []).append(r)
    for rows in by_model.values():
        base = rows[0]
        for r in rows:
            if base["ops_per_step"] is not None and r["ops_per_step"] is not None:
                r["extra_ops_per_layer_vs_b%d" % base["batch"]] = round(
                    (r["ops_per_step"] - base["ops_per_step"]) / r["num_layers"], 2)
    print(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__,
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
