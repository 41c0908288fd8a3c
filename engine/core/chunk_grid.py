"""The grid prompt chunks end on, so their (tokens, context) shapes repeat from prompt to prompt. No mlx.

On MLX's CUDA backend attention builds a cuDNN graph on the host for every new (query, key) length pair
of a prompt chunk (docs/tight_burst.md). The scheduler (scheduler.py) therefore
- ends a chunk cut short of both its prompt's end and `prefill_chunk_size` (by the free memory or by the
  step's budget) on the grid (`aligned_chunk`);
- where `SchedulerConfig.pad_last_chunk`, computes a prompt's last chunk up to the grid past the prompt's
  end (`padded_ends`): the padded positions come after every real one, so causal attention keeps them
  out of the prompt's outputs; their KV lands in the row's own slots past the prompt, which decode
  overwrites before it reads them.
"""

from __future__ import annotations

# The default grid (ExecutionConfig.chunk_granule): a chunk ends on a multiple of this many tokens, or of
# a smaller power of two where this one would take more than a quarter of a cut chunk or reach past what a
# padded one may compute.
DEFAULT_CHUNK_GRANULE = 128


def aligned_chunk(start: int, num_tokens: int, granule: int = DEFAULT_CHUNK_GRANULE) -> int:
    """Tokens of a chunk of at most `num_tokens` (>= 1) from `start` that ends on a multiple of the
    largest power of two <= `granule` (a power of two) that keeps at least three quarters of it (never 0)."""
    grid = granule
    while True:
        tokens = (start + num_tokens) // grid * grid - start
        if 4 * tokens >= 3 * num_tokens or grid == 1:
            return tokens
        grid //= 2


def padded_ends(end: int, max_end: int, granule: int = DEFAULT_CHUNK_GRANULE) -> list[int]:
    """Where a prompt's last chunk, ending the prompt at `end`, may compute up to, most preferred first:
    `end` rounded up to a multiple of `granule` (a power of two), then of each smaller power of two, those that stay
    <= `max_end`; `end` itself last (no pad). A chunk that starts on the grid so gets both its tokens and
    its context on it."""
    ends = []
    grid = granule
    while grid > 1:
        padded = -(-end // grid) * grid
        if end < padded <= max_end and padded not in ends:
            ends.append(padded)
        grid //= 2
    return ends + [end]


def grid_shapes(granule: int, max_chunk_tokens: int, max_context: int, max_shapes: int) -> list[tuple[int, int]]:
    """The (tokens, context) pairs of prompt chunks on the grid, shortest context first, then fewest
    tokens, at most `max_shapes`: tokens a multiple of `granule` up to `max_chunk_tokens`, context a
    multiple of `granule` from the tokens up to `max_context`. A prompt's whole chunks and its chunks
    cut on the grid take these shapes (its last chunk only where it ends on the grid, or is padded)."""
    shapes: list[tuple[int, int]] = []
    for context in range(granule, max_context + 1, granule):
        for tokens in range(max(granule, 2), min(context, max_chunk_tokens) + 1, granule):  # 1 token: no view
            if len(shapes) == max_shapes:
                return shapes
            shapes.append((tokens, context))
    return shapes
