"""Device time of a decode step's embedding lookup on MLX, by rows: the 8B llama's table (128,256 x
4,096 bf16, 1 GB) read at B token ids, as the engine's decode forward does (`weight[tokens[:, None]]`,
mlx.nn.Embedding), as `mx.take` of the flat ids, with ids the host writes at each call (MLX's CUDA
backend keeps host-made arrays in managed memory), and (CUDA) as a plain copy kernel.

Why: Nsight Compute put this one gather at 0.40-0.52 ms of a 64-row decode step's 8.3 ms of kernels
(docs/decode.md, "The device's time in a 64-row decode"), where 64 rows of 8 KB should take
microseconds. Each variant: `--calls` lookups of different ids evaluated together, after a warm-up;
microseconds a call, best of 3. On the H200 (`scripts/data/h200_i25_decode.json`, key
`graphs_ncu_embed_s25`) every variant took 11-21 us a call and the gather 5 us in Nsight Compute alone:
the step's 0.52 ms was the profiled range's first kernel, not the lookup.

    python3 scripts/bench_decode_small_ops.py --rows 1,16,64,128 --json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from bench_common import emit, environment, per_call_us  # noqa: E402

VOCAB, HIDDEN = 128256, 4096

# one thread a 16-byte piece of a row: the lookup as a plain copy kernel
ROWS_SOURCE = r"""
  const unsigned int per_row = w_shape[1] / 8;
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= ids_shape[0] * per_row) return;
  const unsigned int r = i / per_row, c = i % per_row;
  reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(w + (size_t)ids[r] * w_shape[1])[c];
"""
_rows_kernel = None


def rows_kernel(w: mx.array, ids: mx.array) -> mx.array:
    global _rows_kernel
    if _rows_kernel is None:
        _rows_kernel = mx.fast.cuda_kernel(name="embed_rows", input_names=["w", "ids"], output_names=["out"],
                                           source=ROWS_SOURCE)
    n = ids.shape[0] * w.shape[1] // 8
    return _rows_kernel(inputs=[w, ids], grid=(n, 1, 1), threadgroup=(256, 1, 1),
                        output_shapes=[(ids.shape[0], 1, w.shape[1])], output_dtypes=[w.dtype])[0]


VARIANTS = {
    "index_2d": lambda w, ids, values: w[ids[:, None]],  # mlx.nn.Embedding with the engine's [B, 1] ids
    "take_flat": lambda w, ids, values: mx.take(w, ids, axis=0)[:, None],
    # the ids written by the host at each call (mx.array of a list, as a step's first decode takes them):
    # MLX's CUDA backend puts host-made arrays in managed memory, which the device then reads
    "index_2d_host_ids": lambda w, ids, values: w[mx.array(values, mx.uint32)[:, None]],
}
if mx.cuda.is_available():
    VARIANTS["copy_kernel"] = lambda w, ids, values: rows_kernel(w, ids)


def lookup_us(fn, w: mx.array, ids: list, calls: int) -> float:
    """Microseconds a lookup, each call with its own ids (their lists read before the timing: the
    host-made variant's)."""
    values = [i.tolist() for i in ids]
    return per_call_us(lambda i: fn(w, ids[i], values[i]), calls)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,64,128")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--vocab", type=int, default=VOCAB, help="the table's rows (a CPU check: a small one)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out")
    args = p.parse_args(argv)
    w = (mx.random.normal((args.vocab, HIDDEN), key=mx.random.key(0)) * 0.02).astype(mx.bfloat16)
    mx.eval(w)
    cases = {}
    for rows in (int(r) for r in args.rows.split(",")):
        # uint32 ids, as the previous decode's argmax gives them
        ids = [mx.random.randint(0, args.vocab, (rows,), key=mx.random.key(1 + c)).astype(mx.uint32)
               for c in range(max(args.calls, 3))]
        mx.eval(ids)
        want = w[ids[0][:, None]]
        case = {}
        for name, fn in VARIANTS.items():
            if not mx.array_equal(fn(w, ids[0], ids[0].tolist()), want).item():
                raise AssertionError(f"{name} differs from the reference lookup at {rows} rows")
            case[name] = lookup_us(fn, w, ids, args.calls)
        cases[f"rows_{rows}"] = case
        print(rows, case, flush=True)
    result = dict(bench="decode_small_ops", argv=list(argv if argv is not None else sys.argv[1:]),
                  environment=environment(), table=[args.vocab, HIDDEN], us_per_call=cases)
    emit(result, args.json, args.out)
    return result


if __name__ == "__main__":
    main()
