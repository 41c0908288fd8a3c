"""Chained block hashes of token ids: how the admission controller learns which prefixes a replica caches.

Both sides use this one module, so they can never disagree: the engine hashes every prefix-cache entry
when it is inserted (engine/prefix_cache.py), the replica reports a bounded summary of those hashes with
its heartbeat, and the ingress hashes each prompt before asking the controller for a replica
(deployments/admission_state.py prefers the replica holding the longest prefix).

Hash k covers token_ids[:k * BLOCK_TOKENS] (it chains hash k - 1 with block k), so a replica holding
hash k holds that whole prefix, and matching is a set lookup per block. Only full blocks are hashed.
blake2b, not `hash()`: the values must be the same in every process and on every Python. Pure: no mlx,
no ray.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Container, Iterable, Sequence
from typing import Optional

BLOCK_TOKENS = 64  # tokens per hashed block; a constant so the engine and the ingress always agree
MAX_SUMMARY_HASHES = 4096  # most hashes a replica ever sends (AdmissionConfig.max_prefix_hashes <= this)
_DIGEST_BYTES = 8


def block_hashes(token_ids: Sequence[int], max_blocks: Optional[int] = None) -> tuple[int, ...]:
    """Hash of every full block prefix: element k - 1 covers token_ids[:k * BLOCK_TOKENS]."""
    num_blocks = len(token_ids) // BLOCK_TOKENS
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
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
