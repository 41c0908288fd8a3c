"""Per-request token sampling: greedy, temperature, top-k, top-p, with per-request seeded streams."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from engine.core.types import SamplingParams


class RequestSampler:
    """Sampling state of one request: its params and its own PRNG key stream (reproducible by seed)."""

    def __init__(self, params: SamplingParams, default_seed: int):
        self.params = params
        seed = params.seed if params.seed is not None else default_seed
        self._key: Optional[mx.array] = None if params.greedy else mx.random.key(seed)

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub


def apply_top_k_top_p(logprobs: mx.array, top_k: int, top_p: float) -> mx.array:
    """Mask (to -inf) tokens outside the top-k and outside the top-p nucleus. logprobs: [V]."""
    vocab = logprobs.shape[-1]
    if 0 < top_k < vocab:
        kth = mx.sort(logprobs)[vocab - top_k]
        logprobs = mx.where(logprobs >= kth, logprobs, -mx.inf)
    if top_p < 1.0:
        order = mx.argsort(-logprobs)  # descending
        sorted_probs = mx.exp(logprobs[order])
        cum = mx.cumsum(sorted_probs)
        keep_sorted = (cum - sorted_probs) < top_p  # keep tokens until the mass before them reaches p
        keep = mx.zeros((vocab,), mx.bool_)
        keep[order] = keep_sorted
        logprobs = mx.where(keep, logprobs, -mx.inf)
    return logprobs


def sample_rows(logits: mx.array, samplers: list[RequestSampler]) -> mx.array:
    """logits: [B, V] (one row per request, same order as samplers) -> token ids [B], lazy.

    Nothing is evaluated here, so the engine can dispatch a step and build the next one while the
    device runs it. Greedy rows share one argmax; sampling rows are built one after another (their
    sort / cumsum temporaries may coexist: the memory model counts one set per row)."""
    greedy_rows = [i for i, s in enumerate(samplers) if s.params.greedy]
    if len(greedy_rows) == len(samplers):
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    tokens: list[Optional[mx.array]] = [None] * len(samplers)
    if greedy_rows:
        picked = mx.argmax(logits[mx.array(greedy_rows)], axis=-1).astype(mx.int32)
        for j, i in enumerate(greedy_rows):
            tokens[i] = picked[j]
    for i, s in enumerate(samplers):
        if s.params.greedy:
            continue
        row = logits[i].astype(mx.float32) / s.params.temperature
        row = row - mx.logsumexp(row)
        row = apply_top_k_top_p(row, s.params.top_k, s.params.top_p)
        tokens[i] = mx.random.categorical(row, key=s.next_key()).astype(mx.int32)
    return mx.stack(tokens)
