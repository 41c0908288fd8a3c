"""The engine's prefill time for one prompt with the KV pool's two reads: every layer's KV gathered
(`KVPool.read_slices = False`) against a slice view of the row's consecutive blocks (the default).
Prints one JSON object (engine/model/kv_pool.py explains the two reads).

    python scripts/bench_prefill_read.py                         # default model (SmolLM2-135M), fp32, 1024 tokens
    python scripts/bench_prefill_read.py --model llama-test --prompt-tokens 2048 --repeat 5

Each repeat is one request (max_tokens = 1, no prefix cache) run through `Engine.step` until it
finishes: its prompt's chunked prefill and the first token. The two reads alternate, after one
warm-up request each, so drift on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "scripts"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_common import emit, environment, load_bench_model, random_prompts  # noqa: E402
from bench_decode_step import make_engine  # noqa: E402
from engine.core.types import SamplingParams  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    return p.parse_args()


def prefill_s(engine, request_id: str, prompt: list[int]) -> float:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    a = parse_args()
    lm = load_bench_model(a.model, a.dtype)
    engine = make_engine(lm, 1, a.prompt_tokens + 1)
    pool = engine.runner.pool
    times: dict[str, list[float]] = {"gather": [], "slice": []}
    for i in range(a.repeat + 1):  # the first round warms up both reads
        for name in times:
            pool.read_slices = name == "slice"
            prompt = random_prompts([a.prompt_tokens], lm.config["vocab_size"], seed=i)[0]
            t = prefill_s(engine, f"{name}-{i}", prompt)
            if i:
                times[name].append(round(t, 4))
    summary = {name: {"median_s": statistics.median(ts), "min_s": min(ts), "runs_s": ts}
               for name, ts in times.items()}
    emit({"bench": "prefill_read", "model": lm.name, "dtype": lm.dtype, "prompt_tokens": a.prompt_tokens,
          "prefill_chunk_size": engine.config.prefill_chunk_size, "repeat": a.repeat,
          "gather_over_slice": round(summary["gather"]["median_s"] / summary["slice"]["median_s"], 3),
          "results": summary, "environment": environment()}, as_json=True, out_path=a.out)


if __name__ == "__main__":
    main()
