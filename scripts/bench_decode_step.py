"""Decode step time and MLX graph size per step, at a fixed context, for B = 1, 4, 8 rows.

For each model (`tiny`, `default` SmolLM2-135M, or a random shape of scripts/bench_common.py such as
`llama-8b`) and each batch size B, an Engine admits B requests with `--prompt-tokens` random prompt
tokens, prefills them, runs `--warmup` decode steps, then times `--steps` decode-only steps
(`Engine.step()`: scheduling, forward, LM head and sampling). `ops_per_step` is the number of
operations in the lazy graph of one decode forward (up to the final hidden states, LM head and
sampling excluded), counted from `mx.export_to_dot`; `graph_build_ms_mean` the Python time spent
building that graph (`ModelRunner._forward`, no computation); `extra_ops_per_layer_vs_b1` is how many more per
layer than at the first batch size. Prints one JSON object (and each result as it comes, on stderr).

    python scripts/bench_decode_step.py                          # tiny and default, B = 1, 4, 8
    python scripts/bench_decode_step.py --models tiny --batches 1,8 --steps 5
    python3 scripts/bench_decode_step.py --models llama-8b --dtype bfloat16 --prompt-tokens 512 \
        --warmup 5 --steps 20 --out decode.json                  # on a GPU (scripts/gpu_bench.sh)
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import mlx.core as mx  # noqa: E402

from bench_common import environment, free_memory, load_bench_model, memory_model_for  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.core.types import SamplingParams  # noqa: E402


def op_types(outputs: mx.array) -> dict[str, int]:
    """Operation nodes of the (unevaluated) graph of `outputs` by primitive: DOT nodes that are not
    leaf arrays."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, outputs)
        text = f.read()
    # export_to_dot draws primitives as rectangles (labelled with the primitive) and arrays as ovals
    ops = [line for line in text.splitlines() if "shape=rectangle" in line or "shape=box" in line]
    names = [re.search(r'label ?= ?"?([A-Za-z_]+)', line) for line in ops]
    return dict(collections.Counter(m.group(1) if m else "?" for m in names).most_common())


def count_ops(outputs: mx.array) -> int:
    return sum(op_types(outputs).values())


class OpCounter:
    """Wraps runner._decode_forward: times the Python graph build of every decode forward, and counts
    the ops of the next one's graph when armed."""

    def __init__(self, runner):
        self.original = runner._decode_forward
        self.armed = False
        self.count = None
        self.types = None
        self.build_s: list[float] = []

    def __call__(self, tokens, view):
        t0 = time.perf_counter()
        hidden = self.original(tokens, view)
        self.build_s.append(time.perf_counter() - t0)
        if self.armed and tokens.shape[1] == 1:
            self.types = op_types(hidden)
            self.count = sum(self.types.values())
            self.armed = False
        return hidden


def make_engine(lm, batch: int, max_len: int, async_decode: bool = True, paged: bool = True,
                fuse: bool = True, kernels: bool = False) -> Engine:
    """The default engine config sized for B rows of `max_len` tokens, with room for them."""
    memory = memory_model_for(lm)
    seqs, chunk = max(batch, 1), 512
    kv = batch * memory.kv_bytes(max_len)
    bound = memory.transient_bound_bytes(seqs, chunk, max_len)
    limit = int(1.5 * (lm.weights_bytes + bound + kv)) + (256 << 20)
    cfg = EngineConfig(model=lm.name, dtype=lm.dtype, max_num_seqs=seqs, prefill_chunk_size=chunk,
                       max_num_batched_tokens=max(2048, seqs), memory_limit_bytes=limit,
                       max_model_len=max_len, prefix_cache_fraction=0.0, async_decode=async_decode,
                       paged_attention=paged, fuse_projections=fuse, decode_kernels=kernels)
    return Engine(lm.model, lm.tokenizer, cfg, lm.config)


class LaunchTimer:
    """Wraps runner.launch: the host time of starting each forward (MLX encodes and submits its
    kernels on the calling thread, so this is the CPU cost the device may wait on)."""

    def __init__(self, runner):
        self.original = runner.launch
        self.seconds: list[float] = []

    def __call__(self, forward):
        t0 = time.perf_counter()
        self.original(forward)
        self.seconds.append(time.perf_counter() - t0)


def decoding_engine(lm, batch: int, prompt_tokens: int, decode_steps: int, async_decode: bool = True,
                    paged: bool = True, fuse: bool = True, kernels: bool = False) -> Engine:
    """An engine whose `batch` random prompts of `prompt_tokens` have prefilled: every later step is a
    decode of all rows, for at least `decode_steps` steps."""
    engine = make_engine(lm, batch, prompt_tokens + decode_steps + 4, async_decode, paged, fuse, kernels)
    rng = random.Random(0)
    vocab = engine.memory.shape.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_tokens)]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=decode_steps + 4, ignore_eos=True))
    while any(r.is_prefilling for r in engine.scheduler.requests.values()) or engine.scheduler.num_waiting:
        engine.step()
    return engine


def bench_one(lm, batch: int, args, async_decode: bool = True, paged: bool = True, fuse: bool = True,
              kernels: bool = False) -> dict:
    engine = decoding_engine(lm, batch, args.prompt_tokens, args.warmup + args.steps + 2, async_decode,
                             paged, fuse, kernels)
    for _ in range(args.warmup):
        engine.step()
    counter = OpCounter(engine.runner)
    engine.runner._decode_forward = counter
    counter.armed = True
    engine.step()  # counted, not timed (exporting the graph takes time)
    counter.build_s.clear()
    launches = LaunchTimer(engine.runner)
    engine.runner.launch = launches
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        assert len(outs) == batch, "every step must be a decode of all rows"
    num_layers = engine.memory.shape.num_layers
    times.sort()
    return {
        "model": lm.name, "dtype": lm.dtype, "batch": batch, "async_decode": async_decode,
        "paged_attention": engine.runner.pool.paged is not None, "fused_projections": engine.runner.fused,
        "decode_kernels": engine.runner.decode_path is not None,
        "num_layers": num_layers,
        "context_tokens": args.prompt_tokens + args.warmup + 1,
        "step_ms_mean": round(1000 * sum(times) / len(times), 3),
        "step_ms_median": round(1000 * times[len(times) // 2], 3),
        "ms_per_token": round(1000 * sum(times) / len(times) / batch, 3),
        "graph_build_ms_mean": round(1000 * sum(counter.build_s) / len(counter.build_s), 3),
        "launch_ms_mean": round(1000 * sum(launches.seconds) / max(len(launches.seconds), 1), 3),
        "ops_per_step": counter.count,
        "op_types": counter.types,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--async-decode", default="1,0",
                   help="1: pipelined decode (the default engine), 0: synchronous steps; both by default")
    p.add_argument("--paged-attention", default="1",
                   help="1: the engine's default (the paged kernel where MLX runs on CUDA), 0: decode gathers; "
                   "'1,0' runs both")
    p.add_argument("--fuse-projections", default="1",
                   help="1: the engine's default (decode computes q/k/v and gate/up as one matmul each), 0: "
                   "one matmul per projection; '1,0' runs both")
    p.add_argument("--decode-kernels", default="0",
                   help="1: the engine's own decode layer loop and kernels (engine/model/layers/decode_path.py, where MLX runs "
                   "on CUDA), 0: mlx-lm's modules (the engine's default); '1,0' runs both")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    results = []
    for name in args.models.split(","):
        lm = load_bench_model(name, args.dtype)
        runs = [(int(b), m, pg, fu, kn) for kn in args.decode_kernels.split(",") for fu in args.fuse_projections.split(",")
                for pg in args.paged_attention.split(",") for m in args.async_decode.split(",")
                for b in args.batches.split(",")]
        for batch, mode, paged, fuse, kernels in runs:
            results.append(bench_one(lm, batch, args, mode == "1", paged == "1", fuse == "1", kernels == "1"))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
            free_memory()
        del lm
        free_memory()
    # ops that grow with B: the difference between batch sizes, per layer
    by_model = {}
    for r in results:
        by_model.setdefault(r["model"], []).append(r)
    for key, rows in list(by_model.items()):  # per model and mode
        del by_model[key]
        for r in rows:
            by_model.setdefault((key, r["async_decode"], r["paged_attention"], r["fused_projections"],
                                 r["decode_kernels"]), []).append(r)
    for rows in by_model.values():
        base = rows[0]
        for r in rows:
            if base["ops_per_step"] is not None and r["ops_per_step"] is not None:
                r["extra_ops_per_layer_vs_b%d" % base["batch"]] = round(
                    (r["ops_per_step"] - base["ops_per_step"]) / r["num_layers"], 2)
    text = json.dumps({"bench": "decode_step", "argv": sys.argv[1:], "environment": environment(),
                       "results": results}, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
