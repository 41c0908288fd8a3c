"""KVManager: the one owner of the engine's KV. Plain Python, no mlx.

It holds the KV budget, each running request's reservation, the pool's blocks (BlockAllocator) and the
prefix cache (whose entries hold block ids). The scheduler admits through it (`allocate`: a result, or
None when the request does not fit the budget beside the running ones and the cache's evictable
entries) and hands the block ids it placed to the runner in its plan; finishing a request gives its
blocks back or keeps its computed prefix in the cache (`free`).

A request's reservation is its whole life's KV (prompt + max_tokens - 1, in whole blocks), so a request
that was admitted never waits for KV again. Blocks are placed once per step for every request admitted
in it (`place_admitted`): the pool grows lazily, doubling and capped at the budget, and the plan says
how many blocks it must hold; the runner only resizes its arrays to that.
"""

from __future__ import annotations

from typing import Optional, Sequence

from engine.core.blocks import BlockAllocator, num_blocks_for
from engine.core.prefix_cache import PrefixCache, PrefixHit
from engine.core.types import NewRow, PrefixCopy


class KVManager:
    def __init__(self, block_size: int, kv_bytes_per_token: int, kv_budget_bytes: int,
                 prefix_cache_bytes: int = 0, num_rings: int = 0):
        """`num_rings`: a model's sliding-window layers keep each running request's KV in one of this
        many fixed rings (engine/model/kv_pool.py), outside the budget: each placed request gets one,
        given back when it finishes. Their KV of a prompt is not kept, so such a model has no prefix
        cache (`prefix_cache_bytes` must be 0)."""
        if block_size < 1 or kv_bytes_per_token < 1 or kv_budget_bytes < 0:
            raise ValueError(f"block_size={block_size} and kv_bytes_per_token={kv_bytes_per_token} must be "
                             f">= 1, kv_budget_bytes={kv_budget_bytes} >= 0")
        if not 0 <= prefix_cache_bytes <= kv_budget_bytes:
            raise ValueError(f"prefix_cache_bytes={prefix_cache_bytes} must be in [0, kv_budget_bytes="
                             f"{kv_budget_bytes}]")
        self.block_size = block_size
        self.block_bytes = block_size * kv_bytes_per_token
        self.kv_budget_bytes = kv_budget_bytes
        self.allocator = BlockAllocator(block_size, kv_budget_bytes // kv_bytes_per_token // block_size)
        # Evicted entries give their blocks back to the pool.
        self.prefix_cache = PrefixCache(prefix_cache_bytes, on_evict=self.allocator.free)
        self._reserved: dict[str, int] = {}  # request -> blocks reserved (admitted, not finished)
        self._blocks: dict[str, list[int]] = {}  # request -> its placed blocks
        self._admitted: list[str] = []  # reserved this step, blocks not placed yet
        self._hits: dict[str, PrefixHit] = {}  # waiting requests' pinned cache hits
        if num_rings and prefix_cache_bytes:
            raise ValueError(f"num_rings={num_rings}: sliding-window rings keep no prefix, so "
                             f"prefix_cache_bytes={prefix_cache_bytes} must be 0")
        self._free_rings = list(range(num_rings - 1, -1, -1))  # popped from the end: ring 0 first
        self._rings: dict[str, int] = {}  # request -> its ring

    # --- accounting -------------------------------------------------------------------------------
    @property
    def reserved_bytes(self) -> int:
        return sum(self._reserved.values()) * self.block_bytes

    @property
    def used_bytes(self) -> int:
        """KV blocks placed for running requests (equal to reserved once a step's blocks are placed)."""
        return sum(len(b) for b in self._blocks.values()) * self.block_bytes

    @property
    def cached_bytes(self) -> int:
        return self.prefix_cache.nbytes

    @property
    def free_bytes(self) -> int:
        """Budget neither reserved nor held by the prefix cache."""
        return self.kv_budget_bytes - self.reserved_bytes - self.cached_bytes

    @property
    def pool_bytes(self) -> int:
        """KV the pool holds once this step's blocks are placed (the runner's arrays: KV allocated)."""
        return self.allocator.num_blocks * self.block_bytes

    @property
    def num_pool_blocks(self) -> int:
        """Blocks the pool must hold for every block handed out so far."""
        return self.allocator.num_blocks

    def num_slots(self, request_id: str) -> int:
        """Token positions the request's placed blocks hold (0: none placed): a padded last prompt chunk
        (scheduler.py `_pad_tokens`) computes no position past them, so it needs no block of its own."""
        return len(self._blocks.get(request_id, ())) * self.block_size

    def consecutive(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's first `num_tokens` positions lie in consecutive placed blocks (the
        runner then reads them as a view of the pool, engine/model/kv_pool.py)."""
        blocks = self._blocks.get(request_id)
        if not blocks:
            return False
        num = num_blocks_for(num_tokens, self.block_size)
        return num <= len(blocks) and blocks[num - 1] - blocks[0] == num - 1 and all(
            b == blocks[0] + i for i, b in enumerate(blocks[:num]))

    # --- requests ---------------------------------------------------------------------------------
    def lookup_prefix(self, request_id: str, prompt_token_ids: Sequence[int]) -> int:
        """Prompt tokens whose KV the prefix cache holds (0: none); the entry stays pinned until the
        request's blocks are placed or it finishes."""
        if not self.prefix_cache.max_bytes:
            return 0
        hit = self.prefix_cache.lookup(prompt_token_ids)
        if hit is None:
            return 0
        self._hits[request_id] = hit
        return hit.num_tokens

    def fits_if_cache_evicted(self, num_tokens: int) -> bool:
        """Whether `num_tokens` of KV would fit with every prefix-cache entry evicted, pinned ones too."""
        return num_blocks_for(num_tokens, self.block_size) * self.block_bytes <= self.kv_budget_bytes - self.reserved_bytes

    def drop_prefix_hit(self, request_id: str) -> bool:
        """Let a waiting request's prefix-cache hit go (its entry unpinned, evictable); whether it had one."""
        hit = self._hits.pop(request_id, None)
        if hit is None:
            return False
        self.prefix_cache.unpin(hit)
        return True

    def allocate(self, request_id: str, num_tokens: int) -> Optional[int]:
        """Reserve KV for `num_tokens` tokens of a new request, evicting unpinned prefix-cache entries
        if that makes room; None if it does not fit the budget now."""
        if request_id in self._reserved:
            raise ValueError(f"request_id={request_id!r} already holds a reservation")
        num_blocks = num_blocks_for(num_tokens, self.block_size)
        need = num_blocks * self.block_bytes
        if need > self.free_bytes:
            self.prefix_cache.evict(need - self.free_bytes)
        if need > self.free_bytes:
            return None
        self._reserved[request_id] = num_blocks
        self._admitted.append(request_id)
        return num_blocks

    def place_admitted(self) -> tuple[NewRow, ...]:
        """Blocks for every request reserved since the last call, the pool grown once for all of them
        (so it doubles from its size at the step's start), and their prefix-cache hits' source blocks."""
        admitted, self._admitted = self._admitted, []
        target = self.allocator.growth_target(sum(self._reserved[i] for i in admitted))
        if target is not None:
            self.allocator.grow(target)
        rows = []
        for request_id in admitted:
            blocks = self.allocator.allocate(self._reserved[request_id])
            if blocks is None:  # the budget check in `allocate` makes this unreachable
                raise RuntimeError(f"{request_id}: no free KV blocks after the pool grew")
            self._blocks[request_id] = blocks
            hit = self._hits.pop(request_id, None)
            prefix = None if hit is None else PrefixCopy(self.prefix_cache.take(hit), hit.num_tokens)
            ring = self._take_ring(request_id)
            rows.append(NewRow(request_id, tuple(blocks), prefix, ring))
        return tuple(rows)

    def _take_ring(self, request_id: str) -> Optional[int]:
        if not self._free_rings and not self._rings:
            return None  # a model without rings
        if not self._free_rings:  # the scheduler runs at most num_rings requests: unreachable
            raise RuntimeError(f"{request_id}: every sliding-window ring is taken")
        self._rings[request_id] = self._free_rings.pop()
        return self._rings[request_id]

    def free(self, request_id: str, keep_token_ids: Sequence[int] = ()) -> None:
        """A request finished: its reservation goes; its blocks go back to the pool, or the blocks of
        `keep_token_ids` (the tokens whose KV it computed) into the prefix cache when it keeps them."""
        if request_id in self._rings:
            self._free_rings.append(self._rings.pop(request_id))
        hit = self._hits.pop(request_id, None)
        if hit is not None:  # never placed: let the entry go
            self.prefix_cache.unpin(hit)
        self._reserved.pop(request_id, None)
        if request_id in self._admitted:
            self._admitted.remove(request_id)
        blocks = self._blocks.pop(request_id, None)
        if not blocks:
            return
        if keep_token_ids and self.prefix_cache.max_bytes:
            keep = num_blocks_for(len(keep_token_ids), self.block_size)
            self.allocator.free(blocks[keep:])
            blocks = blocks[:keep]
            if self.prefix_cache.insert(keep_token_ids, blocks, keep * self.block_bytes):
                return
        self.allocator.free(blocks)
