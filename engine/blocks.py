"""BlockAllocator: which fixed-size blocks of the KV pool are free. Plain Python, no mlx.

The pool (engine/kv.py) is `num_blocks * block_size` token slots per layer. A running request owns
the blocks of its whole reservation (the scheduler's `kv_tokens`, a multiple of the block size), a
prefix-cache entry owns the blocks of its tokens, and the rest are free. The pool grows, never
shrinks, and never past `max_blocks` (the KV budget): the scheduler keeps reserved + cached bytes
within that budget, so a request it admitted always finds its blocks once the pool has grown.
"""

from __future__ import annotations

import heapq
from typing import Optional


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockAllocator:
    def __init__(self, block_size: int, max_blocks: int):
        if block_size < 1 or max_blocks < 0:
            raise ValueError(f"block_size={block_size} must be >= 1 and max_blocks={max_blocks} >= 0")
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.num_blocks = 0  # blocks the pool holds now
        self._free: list[int] = []  # min-heap: the lowest blocks go first, so rows tend to be contiguous

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def growth_target(self, num_needed: int) -> Optional[int]:
        """Pool size (blocks) to grow to before `num_needed` more blocks can be allocated; None if
        they fit now. Doubles (capped at max_blocks) so growth copies happen O(log) times."""
        if num_needed <= self.num_free:
            return None
        needed = self.num_used + num_needed
        if needed > self.max_blocks:
            raise RuntimeError(f"KV pool: {needed} blocks needed, more than max_blocks={self.max_blocks} "
                               "(the scheduler admitted past the KV budget)")
        return min(self.max_blocks, max(needed, 2 * self.num_blocks))

    def grow(self, num_blocks: int) -> None:
        """The pool now holds `num_blocks` blocks (the caller resized the arrays)."""
        if num_blocks < self.num_blocks or num_blocks > self.max_blocks:
            raise ValueError(f"cannot grow {self.num_blocks} -> {num_blocks} blocks (max {self.max_blocks})")
        for block in range(self.num_blocks, num_blocks):
            heapq.heappush(self._free, block)
        self.num_blocks = num_blocks

    def allocate(self, num_blocks: int) -> Optional[list[int]]:
        if num_blocks > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(num_blocks)]

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            heapq.heappush(self._free, block)
