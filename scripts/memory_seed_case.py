#!/usr/bin/env python3
"""The seed case of docs/memory_cuda.md, computed by the memory model: 4 concurrent 8192-token prompts on a
Llama-3-8B shape (bf16) at the engine's default configuration. Prints JSON.

    python scripts/memory_seed_case.py [--lengths 8192,8192,8192,8192]
    python scripts/memory_seed_case.py --backend cuda --max-ops-per-buffer 8 --max-model-len 131072
        [--no-shape-calibration | --coefficients FIT_JSON]

The coefficients are the engine's for `--backend` (the CPU set by default; on CUDA decodes are paged,
and the 8B's shipped shape calibration applies unless `--no-shape-calibration`); `--coefficients`
puts a `bench_memory_grid.py --fit --json` output's coefficients over them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from engine.config import EngineConfig
from engine.core.memory.model import MemoryModel, ModelShape, PrefillChunkPlan
from engine.core.memory.coefficients import coefficients_for, with_overrides

LLAMA3_8B = ModelShape(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                       intermediate_size=14336, vocab_size=128256, dtype_bytes=2,
                       weights_bytes=8_030_261_248 * 2)


def chunk_terms(m: MemoryModel, c: int, n: int) -> dict:
    """Each term of MemoryModel.prefill_chunk_bytes for a sampled last chunk (see docs/memory.md)."""
    s, k = m.shape, m.coefficients
    return {
        "scores": int(k.prefill_scores * 4 * s.num_heads * c * n),
        "mask": int(k.prefill_mask * c * n),
        "kv_gather": int(k.prefill_gather * n * s.num_kv_heads * (2 * s.head_dim * s.dtype_bytes + 4)),
        "mlp": int(k.prefill_mlp * c * s.intermediate_size * s.dtype_bytes),
        "hidden": int(k.prefill_hidden * c * s.hidden_size * s.dtype_bytes),
        "logits_and_sampling": int((k.prefill_logits + k.sampling) * 4 * s.vocab_size),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8192,8192,8192,8192")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "metal"])
    ap.add_argument("--max-ops-per-buffer", type=int, default=None, help="EngineConfig.execution.max_ops_per_buffer (the engine's default on CUDA: 8)")
    ap.add_argument("--no-shape-calibration", action="store_true", help="the backend's set for all shapes")
    ap.add_argument("--coefficients", default=None, metavar="FIT_JSON", help="a fit's coefficients on top")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    cfg = EngineConfig()
    coefficients, source = coefficients_for(args.backend, args.max_ops_per_buffer,
                                            None if args.no_shape_calibration else LLAMA3_8B)
    if args.coefficients:
        fit = json.loads(Path(args.coefficients).read_text().strip().splitlines()[-1])["coefficients"]
        coefficients, source = with_overrides(coefficients, fit), f"{source} with {args.coefficients}"
    # on CUDA the engine's decodes run the fused q/k rope kernel by default (RunnerOptions.fused_rope)
    m = MemoryModel(LLAMA3_8B, coefficients=coefficients, paged_decode=args.backend == "cuda",
                    fused_decode=args.backend == "cuda")
    chunk, budget = cfg.prefill_chunk_size, cfg.resolved_max_num_batched_tokens(args.backend)
    last = PrefillChunkPlan(chunk, args.max_model_len, True)
    worst_chunk = m.prefill_chunk_bytes(last.num_tokens, last.context_len, True, samples=True)
    naive_scores = 4 * LLAMA3_8B.num_heads * max(lengths) ** 2 * len(lengths)  # one [B,H,L,L] fp32 tensor
    kv = sum(m.kv_bytes(n) for n in lengths)
    print(json.dumps({
        "coefficients": source,
        "config": {"prefill_chunk_size": chunk, "max_num_batched_tokens": budget,
                   "max_num_seqs": cfg.max_num_seqs, "max_model_len": args.max_model_len},
        "kv_bytes_per_token": m.kv_bytes_per_token,
        "kv_bytes_all_prompts": kv,
        "chunks_per_step": budget // chunk,
        "steps_to_prefill_all": -(-sum(lengths) // budget),
        "worst_chunk_transient_bytes": worst_chunk,
        "worst_chunk_terms_bytes": chunk_terms(m, chunk, args.max_model_len),
        "transient_bound_bytes": m.transient_bound_bytes(cfg.max_num_seqs, chunk, args.max_model_len),
        "decode_transient_at_bound_bytes": m.decode_bytes([args.max_model_len] * cfg.max_num_seqs, samples=True),
        "naive_unchunked_scores_bytes": naive_scores,
        "weights_bytes": LLAMA3_8B.weights_bytes,
        "peak_bytes_predicted": LLAMA3_8B.weights_bytes + kv + m.transient_bound_bytes(
            cfg.max_num_seqs, chunk, args.max_model_len),
    }, indent=1))


if __name__ == "__main__":
    main()
