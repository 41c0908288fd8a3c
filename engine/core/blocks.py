"""BlockAllocator: which fixed-size blocks of the KV pool are free. Plain Python, no mlx.

The pool (engine/model/kv_pool.py) is `num_blocks * block_size` token slots per layer. A running request owns
the blocks of its whole reservation (the scheduler's `kv_tokens`, a multiple of the block size), a
prefix-cache entry owns the blocks of its tokens, and the rest are free. The pool grows, never
shrinks, and never past `max_blocks` (the KV budget): the KV manager (kv_manager.py) keeps reserved +
cached bytes within that budget, so a request it admitted always finds its blocks once the pool has grown.

`allocate` hands out the lowest run of consecutive free blocks when there is one long enough: a row
whose blocks are consecutive is read as a slice of the pool instead of a gather (engine/model/kv_pool.py).
"""

from __future__ import annotations

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
        self._free: list[int] = []  # sorted ascending, so runs of consecutive blocks are found in one scan

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
        self._free.extend(range(self.num_blocks, num_blocks))  # all above every free block: stays sorted
        self.num_blocks = num_blocks

    def allocate(self, num_blocks: int) -> Optional[list[int]]:
        """The lowest run of `num_blocks` consecutive free blocks, else the lowest free blocks; None if
        fewer are free. One scan of the free list: O(free blocks)."""
        if num_blocks > len(self._free):
            return None
        start = self._find_run(num_blocks)
        if start is None:
            start = 0  # fragmented: the lowest free blocks, whatever their gaps
        taken = self._free[start:start + num_blocks]
        del self._free[start:start + num_blocks]
        return taken

    def _find_run(self, num_blocks: int) -> Optional[int]:
        """Index in the free list where the lowest run of `num_blocks` consecutive blocks starts."""
        if num_blocks <= 1:
            return 0
        free = self._free
        run_start = 0
        for i in range(1, len(free)):
            if free[i] != free[i - 1] + 1:
                run_start = i
            elif i - run_start + 1 == num_blocks:
                return run_start
        return None

    def free(self, blocks: list[int]) -> None:
        # Timsort merges the two sorted runs in linear time
        self._free = sorted(self._free + list(blocks))
