"""Host time to build one forward's graph (nothing evaluated while timed), the engine's ways against each
other: a prompt chunk through mlx-lm's modules or the engine's layer loop (engine/model/layers/chunk_path.py), and a
batched decode through mlx-lm's modules or the engine's decode loop (engine/model/layers/decode_path.py, MLX ops).

On MLX's CUDA backend the device waits for this time at every forward but the few layers of work the
host may queue ahead (engine/model/layers/chunk_path.py says why), so it is part of prefill and decode time.

    python scripts/bench_graph_build.py --model llama-8b --dtype bfloat16 --json   # on a GPU
    python scripts/bench_graph_build.py --model llama-test --json                  # CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit, environment, load_bench_model  # noqa: E402

import mlx.core as mx  # noqa: E402

from engine.core.types import SamplingParams  # noqa: E402
from engine.model.runner import DecodeWork, ModelRunner, PrefillWork  # noqa: E402
from engine.model.sampling import RequestSampler  # noqa: E402


def timed_builds(runner: ModelRunner, build, repeat: int) -> list[float]:
    """Seconds to build each of `repeat` forwards (each then run and finished, untimed)."""
    times = []
    for i in range(repeat):
        t = time.perf_counter()
        forward = build(i)
        times.append(time.perf_counter() - t)
        runner.launch(forward)
        forward.finish()
    return times


def summary(times: list[float], warmup: int) -> dict:
    timed = times[warmup:]
    return dict(median_ms=statistics.median(timed) * 1e3, min_ms=min(timed) * 1e3, n=len(timed))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-test", help="default | tiny | llama-8b | llama-test | PATH")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--chunk", type=int, default=512, help="prompt chunk tokens")
    p.add_argument("--chunks", type=int, default=12, help="chunks built (the first 2 not counted)")
    p.add_argument("--rows", type=int, default=8, help="decode rows")
    p.add_argument("--steps", type=int, default=12, help="decodes built (the first 2 not counted)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    lm = load_bench_model(args.model, args.dtype)
    cuda = mx.default_device() != mx.cpu
    result: dict = dict(bench="graph_build", argv=sys.argv[1:] if argv is None else argv, model=args.model,
                        dtype=lm.dtype, chunk=args.chunk, rows=args.rows, environment=environment(), ways={})
    context = args.chunk * args.chunks
    for name, kwargs in (("modules", dict(layer_loops=False)), ("engine_loops", dict(compiled_decode=False)),
                         ("engine_compiled", dict(compiled_decode=True))):
        runner = ModelRunner(lm.model, block_size=256, max_kv_tokens=context + 256 * (args.rows + 2),
                             paged_attention=cuda, **kwargs)
        runner.grow_pool(runner.blocks_for(context) + args.rows)
        runner.add_row("p", context, RequestSampler(SamplingParams(), 0))
        for r in range(args.rows):
            runner.add_row(f"d{r}", 256, RequestSampler(SamplingParams(), 0))
        prompt = list(range(1, args.chunk + 1))
        chunk = timed_builds(runner, lambda i: runner.prefill(PrefillWork("p", prompt, i * args.chunk, False)),
                             args.chunks)
        for r in range(args.rows):  # each decode row gets a 16-token prompt first
            f = runner.prefill(PrefillWork(f"d{r}", prompt[:16], 0, True))
            runner.launch(f)
            f.finish()
        decode_loop = runner.decode_path is not None and runner.paged_attention
        work = [DecodeWork(f"d{r}", 1) for r in range(args.rows)]
        decode = timed_builds(runner, lambda i: runner.decode(work), args.steps)
        result["ways"][name] = dict(chunk_build=summary(chunk, 2), decode_build=summary(decode, 2),
                                    chunk_path=runner.chunk_path is not None, decode_loop=decode_loop)
        print(f"{name}: chunk build {result['ways'][name]['chunk_build']['median_ms']:.2f} ms, decode build "
              f"{result['ways'][name]['decode_build']['median_ms']:.2f} ms", file=sys.stderr)
        del runner
    emit(result, args.json, args.out)
    return result


if __name__ == "__main__":
    main()
