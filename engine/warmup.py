"""Prompt-chunk shapes computed at startup (ExecutionConfig.warm_chunk_shapes).

On MLX's CUDA backend a prompt chunk's attention builds a cuDNN graph on the host for each new pair of
(query tokens, key length), some 60 ms against a repeated chunk's 15 (docs/benchmarks.md), and keeps
the graphs in an LRU cache (engine/config.py CUDA_CACHE_DEFAULTS sizes it). A burst of new prompts
meets many such pairs at once. The scheduler ends cut chunks on the chunk grid and, with
pad_last_chunk, pads a prompt's last chunk to it (engine/core/chunk_grid.py), so the pairs a server
meets are those of the grid: this computes one chunk of each, over a scratch row whose KV is garbage
(no output is read), before the engine serves.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

WARMUP_REQUEST_ID = "__warm_chunk_shapes__"


@dataclass(frozen=True)
class WarmupReport:
    num_shapes: int  # (tokens, context) pairs computed
    max_context: int  # the longest context warmed (the scratch row's length)
    seconds: float


def grid_shapes(granule: int, chunk_size: int, max_len: int) -> list[tuple[int, int]]:
    """(start, tokens) of every chunk on the grid: tokens a multiple of `granule` up to `chunk_size`,
    starting at a multiple of `granule`, ending by `max_len`; shortest contexts first (the ones every
    prompt meets), so a cache smaller than the grid keeps those."""
    sizes = range(granule, min(chunk_size, max_len) + 1, granule)
    return sorted(((start, tokens) for tokens in sizes for start in range(0, max_len - tokens + 1, granule)),
                  key=lambda s: (s[0] + s[1], s[1]))


def warm_chunk_shapes(engine, max_shapes: int) -> WarmupReport:
    """Compute the grid's chunks (`grid_shapes`, at most `max_shapes` of them) over a scratch row of as
    many tokens as the KV budget and max_model_len allow, then give its KV back."""
    started = time.perf_counter()
    config, kv, runner = engine.config, engine.kv, engine.runner
    granule = config.execution.chunk_granule
    # a KV budget short of max_model_len tokens: the contexts it holds
    fits = kv.free_bytes // kv.block_bytes * kv.block_size
    max_len = min(engine.max_model_len, fits) // granule * granule
    if max_len < granule or kv.allocate(WARMUP_REQUEST_ID, max_len) is None:
        logger.warning("chunk-shape warm-up skipped: no KV for a %d-token row", granule)
        return WarmupReport(0, 0, time.perf_counter() - started)
    shapes = grid_shapes(granule, config.prefill_chunk_size, max_len)[:max_shapes]
    try:
        (row,) = kv.place_admitted()
        if kv.num_pool_blocks > runner.num_pool_blocks:
            runner.grow_pool(kv.num_pool_blocks)
        runner.add_row(WARMUP_REQUEST_ID, row.block_ids, engine.scratch_sampler(), ring=row.ring)
        for start, tokens in shapes:
            runner.warm_chunk(WARMUP_REQUEST_ID, start, tokens)
    finally:
        runner.drop_row(WARMUP_REQUEST_ID)
        kv.free(WARMUP_REQUEST_ID)
    report = WarmupReport(len(shapes), max_len, time.perf_counter() - started)
    logger.info("chunk-shape warm-up: %d shapes up to %d tokens of context in %.1f s", report.num_shapes,
                report.max_context, report.seconds)
    return report
