"""Chained block hashes of token ids: how the admission controller learns which prefixes a replica caches.

Both sides use this one module, so they can never disagree: the engine hashes every prefix-cache entry
when it is inserted (engine/core/prefix_cache.py), the replica reports a bounded summary of those hashes with
its heartbeat, and the ingress hashes each prompt before asking the controller for a replica
(deployments/admission/state.py prefers the replica holding the longest prefix).

Hash k covers token_ids[:k * BLOCK_TOKENS] (it chains hash k - 1 with block k), so a replica holding
hash k holds that whole prefix, and matching is a set lookup per block. Only full blocks are hashed, at
most MAX_SUMMARY_HASHES of them. blake2b, not `hash()`: the values must be the same in every process and
on every Python. A collision (64 bits) can only misroute a request, never corrupt it: the engine's own
lookup compares token ids. Pure: no mlx, no ray.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Container, Iterable, Sequence

BLOCK_TOKENS = 64  # tokens per hashed block; a constant so the engine and the ingress always agree
MAX_SUMMARY_HASHES = 4096  # most hashes of one sequence, and most a replica sends (>= max_prefix_hashes)
_DIGEST_BYTES = 8


def block_hashes(token_ids: Sequence[int], max_blocks: int = MAX_SUMMARY_HASHES) -> tuple[int, ...]:
    """Hash of every full block prefix, at most `max_blocks`: element k - 1 covers
    token_ids[:k * BLOCK_TOKENS]."""
    num_blocks = min(len(token_ids) // BLOCK_TOKENS, max_blocks)
    data = struct.pack(f"<{num_blocks * BLOCK_TOKENS}Q", *token_ids[: num_blocks * BLOCK_TOKENS])
    block_bytes = BLOCK_TOKENS * 8
    hashes, previous = [], b""
    for k in range(num_blocks):
        digest = hashlib.blake2b(previous + data[k * block_bytes:(k + 1) * block_bytes],
                                 digest_size=_DIGEST_BYTES).digest()
        hashes.append(int.from_bytes(digest, "little"))
        previous = digest
    return tuple(hashes)


def summarize(chains: Iterable[Sequence[int]], max_hashes: int) -> tuple[int, ...]:
    """Distinct hashes of several entries' chains, in the order given (most recently used entry first,
    each entry's shorter prefixes first: those are the ones other prompts share), at most `max_hashes`."""
    seen: dict[int, None] = {}  # insertion-ordered set
    for chain in chains:
        for h in chain:
            if len(seen) >= max_hashes:
                return tuple(seen)
            seen.setdefault(h, None)
    return tuple(seen)


def matched_blocks(prompt_hashes: Sequence[int], held: Container[int]) -> int:
    """Blocks of the prompt's prefix that `held` covers: the largest k with hash k held, or 0."""
    for k in range(len(prompt_hashes), 0, -1):
        if prompt_hashes[k - 1] in held:
            return k
    return 0
