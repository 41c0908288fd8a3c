"""Where the KV pool's decode time goes: the per-layer KV ops of one decode step, alone, against the
contiguous layout mlx-lm's BatchKVCache uses. Prints one JSON object.

    python scripts/bench_kv_gather.py                       # Llama-3-8B shape, bf16, B = 1, 4, 8
    python scripts/bench_kv_gather.py --dtype float32 --layers 4 --steps 5      # a quick CPU check
    python scripts/bench_kv_gather.py --batches 1 --chunk 512 --context 4096    # a prefill chunk

Per step, for every layer, like engine/model/kv_pool.py's ForwardView:
- `pool`: scatter the B new keys and values into the `[H_kv * slots, D]` pool arrays, gather all rows'
  KV with a `[B, H_kv, L]` row index;
- `pool_slice` (B = 1 and `--chunk` > 1 only): the same scatter, then read the row, whose blocks are
  consecutive, as a slice view `pool.reshape(H_kv, slots, D)[None, :, s0:s0 + L]` (ForwardView's read
  of a prompt chunk of a row in consecutive blocks; one-query forwards always gather, engine/model/kv_pool.py);
- `contiguous`: write the new token into `[B, H_kv, L_cap, D]` with a slice update and read `[:, :, :L]`
  (mlx-lm's layout);
- `*_sdpa`: the same, then `mx.fast.scaled_dot_product_attention` of B single-token queries over it
  (with the `[B, 1, 1, L]` mask for the pool, as the engine passes it for B >= 2; causal for a chunk).
`--chunk T` writes T new tokens per step instead of one (a prefill chunk ending at the context; B = 1).
No weights: the differences are the KV layout's own cost per decode step.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--context", type=int, default=518)
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--chunk", type=int, default=1, help="new tokens per step (> 1: a prefill chunk, B = 1 only)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    return p.parse_args()


def timed(step, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        mx.eval(step())
    start = time.perf_counter()
    for _ in range(steps):
        mx.eval(step())
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    a = parse_args()
    dtype = getattr(mx, a.dtype)
    h, d, L = a.kv_heads, a.head_dim, a.context
    results = []
    for B in [int(x) for x in a.batches.split(",")]:
        blocks_per_row = -(-L // a.block)
        slots = B * blocks_per_row * a.block
        rng = np.random.default_rng(0)
        order = rng.permutation(B * blocks_per_row).reshape(B, blocks_per_row)  # rows own scattered blocks
        pos = np.arange(L)
        read_slots = order[:, pos // a.block] * a.block + pos % a.block  # [B, L]
        heads = np.arange(h)[:, None, None]
        read = mx.array((heads * slots + read_slots[None]).transpose(1, 0, 2), mx.int32)  # [B, H_kv, L]
        T = a.chunk
        if T > 1 and B > 1:
            raise SystemExit("--chunk > 1 needs --batches 1: the engine prefills one row per forward")
        write = mx.array((heads * slots + read_slots[None, :, -T:]).transpose(1, 0, 2).reshape(-1), mx.int32)
        # B = 1 in consecutive blocks (slots 0 .. L): written by the same scatter, read as a slice
        slice_write = mx.array((heads[:, 0] * slots + np.arange(L - T, L)[None]).reshape(-1), mx.int32)
        keys = [mx.random.normal((h * slots, d)).astype(dtype) for _ in range(a.layers)]
        values = [mx.random.normal((h * slots, d)).astype(dtype) for _ in range(a.layers)]
        cap = blocks_per_row * a.block
        ck = [mx.random.normal((B, h, cap, d)).astype(dtype) for _ in range(a.layers)]
        cv = [mx.random.normal((B, h, cap, d)).astype(dtype) for _ in range(a.layers)]
        new = mx.random.normal((B, h, T, d)).astype(dtype)
        q = mx.random.normal((B, a.heads, T, d)).astype(dtype)
        mask = mx.array(np.ones((B, 1, 1, L), bool)) if B > 1 else ("causal" if T > 1 else None)
        mx.eval(keys, values, ck, cv, new, q)
        scale = d ** -0.5

        def pool(attend: bool, view: bool = False):
            """The engine's KV ops: a scatter per K and V, then a gather (or, `view`, a slice of a
            row in consecutive blocks, as the engine reads prompt chunks)."""
            outs = []
            for i in range(a.layers):
                keys[i][slice_write if view else write] = new.reshape(-1, d)
                values[i][slice_write if view else write] = new.reshape(-1, d)
                if view:  # [1, H_kv, L, D], no copy
                    k, v = (x[i].reshape(h, slots, d)[None, :, :L, :] for x in (keys, values))
                else:
                    k, v = keys[i][read], values[i][read]
                outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
                            if attend else k + v)
            return outs

        def contiguous(attend: bool):
            outs = []
            for i in range(a.layers):
                ck[i][:, :, L - T:L, :] = new
                cv[i][:, :, L - T:L, :] = new
                k, v = ck[i][:, :, :L, :], cv[i][:, :, :L, :]
                outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask if T > 1 else None)
                            if attend else k + v)
            return outs

        row = {"batch": B, "context": L, "chunk": T, "layers": a.layers}
        variants = [("pool", pool, False), ("contiguous", contiguous, False),
                    ("pool_sdpa", pool, True), ("contiguous_sdpa", contiguous, True)]
        if B == 1 and T > 1:  # the engine reads only prompt chunks as views (engine/model/kv_pool.py slice_start)
            view = (lambda attend: pool(attend, view=True))
            variants += [("pool_slice", view, False), ("pool_slice_sdpa", view, True)]
        for name, fn, attend in variants:
            row[f"{name}_ms"] = round(timed(lambda: fn(attend), a.steps, a.warmup), 3)
        results.append(row)
        print(row, flush=True)
    text = json.dumps({"bench": "kv_gather", "device": str(mx.default_device()), "dtype": a.dtype,
                       "mlx": mx.__version__, "results": results}, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
