#!/usr/bin/env python3
"""Greedy output of the engine against mlx-lm's own generation, on any device (prints JSON).

The tests check greedy equality on the CPU with the tiny model; this runs the same check where the
tests cannot, e.g. on a GPU with an 8B-shaped model: several prompts through the engine together
(chunked prefill, batched decode), once as configured by default (prompt chunks read as views of the
KV pool; on CUDA, decode attention by the paged kernel) and once with every read a gather, and each
prompt alone through mlx-lm's `generate_step`.

    python scripts/check_greedy.py --model llama-8b --dtype bfloat16 --lengths 300,700,1500,2100
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, environment, load_bench_model, random_prompts  # noqa: E402


def engine_tokens(lm, prompts, max_tokens: int, read_slices: bool, chunk: int, paths: dict = None,
                  launch_thread=None) -> list[list[int]]:
    """`read_slices` False: every read a gather (no views, no paged decode attention). `paths`: filled with which decode paths the engine took.
    `launch_thread`: StepOptions' (None: the engine's choice)."""
    from bench_engine import make_engine
    from engine.core.types import SamplingParams

    # no views, and no paged decode attention (a config choice: the memory model then predicts gathers)
    engine = make_engine(lm, [len(p) for p in prompts], max_tokens, chunk, read_slices=read_slices,
                         launch_thread=launch_thread,
                         **({} if read_slices else {"execution": {"paged_attention": False}}))
    if paths is not None:  # which code paths the runner built (the engine's read-only summary)
        taken = engine.execution_paths()
        paths.update(paged_attention=taken.paged_attention, decode_loop=taken.decode_loop,
                     compiled_decode=taken.compiled_decode, chunk_loop=taken.chunk_loop,
                     fused_rope=taken.fused_rope, fused_residual=taken.fused_residual,
                     pack_step_inputs=taken.pack_step_inputs, rope_writes_kv=taken.rope_writes_kv,
                     attention_kernel=taken.attention_kernel,
                     launch_thread=taken.launch_thread,
                     packed_chunks=getattr(engine.memory, "packed", False))
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [o.token_ids for o in outs]


def mlx_lm_tokens(lm, prompt, max_tokens: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), lm.model, max_tokens=max_tokens)]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--lengths", default="300,700,1500,2100")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    lm = load_bench_model(args.model, args.dtype)
    prompts = random_prompts([int(x) for x in args.lengths.split(",")], lm.config["vocab_size"], 7)
    paths: dict = {}
    slices = engine_tokens(lm, prompts, args.max_tokens, True, args.chunk, paths)
    gather = engine_tokens(lm, prompts, args.max_tokens, False, args.chunk)
    # the pipelined decodes encoded by the engine's thread when the default has a launch thread, and by one otherwise
    other_launch = engine_tokens(lm, prompts, args.max_tokens, True, args.chunk, launch_thread=not paths["launch_thread"])
    ref = [mlx_lm_tokens(lm, p, args.max_tokens) for p in prompts]

    def same_prefix(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    result = dict(check="greedy", model=args.model, dtype=lm.dtype, lengths=[len(p) for p in prompts],
                  max_tokens=args.max_tokens, environment=environment(), engine_decode=paths,
                  slices_equal_gather=[a == b for a, b in zip(slices, gather)],
                  other_launch_equal=[a == b for a, b in zip(slices, other_launch)],
                  engine_equal_mlx_lm=[a == b for a, b in zip(slices, ref)],
                  engine_mlx_lm_common_prefix=[same_prefix(a, b) for a, b in zip(slices, ref)],
                  engine=slices, engine_gather=gather, mlx_lm=ref)
    emit(result, True, args.out)
    return result


if __name__ == "__main__":
    main()
