"""Per-request token sampling: greedy, temperature, top-k, top-p, min-p, with per-request seeded streams;
logit bias, presence / frequency / repetition penalties, a grammar's token mask, and logprobs.

Everything is per row, inside the batched forward: rows that ask for nothing special share one argmax,
the others are processed together in the same graph (sample_rows). Penalties are computed on the device from
each row's token counts, which the sampler updates lazily from its own sampled token, so a pipelined
decode built before the previous tokens are read back still penalizes them. A grammar's mask needs the
previous token on the host: a decode holding a constrained row builds its sampling at launch (runner
`defer_sampling`), after the engine gave the previous tokens to the grammars; the masks are computed
while the forward runs (on a host thread of their own where the host has cores to spare, so the
engine's thread launches the forward meanwhile) and applied on the device from their packed bits; the
pipeline goes on.

Order (vLLM's): logit bias, penalties, grammar mask -> logprobs -> temperature -> min-p, top-k, top-p.
Logprobs are the log-softmax of the logits after bias, penalties and the grammar mask, before temperature
and truncation: the distribution the sampler draws from at temperature 1, so a token the grammar
forbids never appears in top_logprobs and a forced token has logprob 0. (OpenAI's are the model's own.)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from engine.core.types import SamplingParams, TokenLogprob, TopLogprob, processed
from engine.model.grammar import GrammarMatcher, PendingMasks


@dataclass(frozen=True)
class _PendingLogprobs:
    """A sampled token's logprob arrays, computed with its forward and read back when it is committed."""

    chosen: mx.array  # []
    top_ids: Optional[mx.array]  # [k]
    top_logprobs: Optional[mx.array]  # [k]


class RequestSampler:
    """Sampling state of one request: its params, its own PRNG key stream (reproducible by seed), its
    token counts (penalties), its grammar matcher and its logprobs not yet read back."""

    def __init__(self, params: SamplingParams, default_seed: int, prompt_token_ids: Sequence[int] = (),
                 matcher: Optional[GrammarMatcher] = None):
        self.params = params
        seed = params.seed if params.seed is not None else default_seed
        self._key: Optional[mx.array] = None if params.greedy else mx.random.key(seed)
        self.matcher = matcher
        self._prompt_ids = list(prompt_token_ids) if params.repetition_penalty != 1.0 else []
        self._counts: Optional[mx.array] = None  # [V] float32: occurrences of each token in the output
        self._seen: Optional[mx.array] = None  # [V] bool: in the prompt (repetition penalty)
        self._bias: Optional[mx.array] = None  # [V] float32
        self._pending: deque[_PendingLogprobs] = deque()
        self.num_sampled = 0  # tokens sampled into a graph
        self.num_accepted = 0  # of those, read back and given to the matcher
        self._refused: Optional[RuntimeError] = None  # the grammar refused a token (a bug: the mask forbids it)

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    # --- host side: the engine calls these as it commits a token ---------------------------------
    def accept(self, token_id: int, index: int) -> bool:
        """Give the output's token `index` to the grammar, once (a pipelined decode gives it before its
        commit does); True if the grammar is now complete. RuntimeError if the grammar refused it."""
        if index == self.num_accepted:
            self.num_accepted += 1
            if self.matcher is not None:
                try:
                    self.matcher.accept(token_id)
                except RuntimeError as exc:
                    self._refused = exc
        if self._refused is not None:
            raise self._refused
        return self.matcher is not None and self.matcher.done

    def pop_logprobs(self, token_id: int) -> Optional[TokenLogprob]:
        """The logprobs of the oldest sampled token not yet read back, `token_id` (None: not asked for)."""
        if not self._pending:
            return None
        p = self._pending.popleft()
        if p.top_ids is None:
            return TokenLogprob(token_id, p.chosen.item())
        top = [TopLogprob(t, lp) for t, lp in zip(p.top_ids.tolist(), p.top_logprobs.tolist())
               if lp != -math.inf]
        top.sort(key=lambda t: -t.logprob)
        return TokenLogprob(token_id, p.chosen.item(), tuple(top))

    # --- graph side: sample_rows calls these -----------------------------------------------------
    def processed(self, row: mx.array) -> mx.array:
        """row [V] float32 -> the logits after the request's bias and penalties."""
        p, vocab = self.params, row.shape[-1]
        if p.logit_bias:
            if self._bias is None:
                ids = mx.array([b.token_id for b in p.logit_bias])
                self._bias = mx.zeros((vocab,), mx.float32).at[ids].add(mx.array([b.bias for b in p.logit_bias]))
            row = row + self._bias
        if p.has_penalties:
            counts = self._counts if self._counts is not None else mx.zeros((vocab,), mx.float32)
            if p.repetition_penalty != 1.0:
                if self._seen is None:
                    self._seen = mx.zeros((vocab,), mx.bool_)
                    if self._prompt_ids:
                        self._seen = mx.zeros((vocab,), mx.float32).at[mx.array(self._prompt_ids)].add(1.0) > 0
                seen = self._seen | (counts > 0)
                penalized = mx.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
                row = mx.where(seen, penalized, row)
            if p.frequency_penalty:
                row = row - p.frequency_penalty * counts
            if p.presence_penalty:
                row = row - p.presence_penalty * (counts > 0).astype(mx.float32)
        return row

    def draw(self, row: mx.array) -> mx.array:
        """A processed row [V] -> a token sampled at the request's temperature, min-p, top-k, top-p ([])."""
        p = self.params
        scaled = row / p.temperature
        scaled = scaled - mx.logsumexp(scaled)
        if p.min_p > 0:  # the most likely token has log-prob max(scaled)
            scaled = mx.where(scaled >= scaled.max() + math.log(p.min_p), scaled, -mx.inf)
        scaled = apply_top_k_top_p(scaled, p.top_k, p.top_p)
        return mx.random.categorical(scaled, key=self.next_key()).astype(mx.int32)

    def sampled(self, token: mx.array, logprobs: Optional[mx.array], vocab: int) -> list[mx.array]:
        """Note the row's sampled token ([], lazy): its counts (penalties) and its logprobs (from
        `logprobs` [V]). Returns the arrays to compute with the token (the logprobs read back later)."""
        p = self.params
        if p.has_penalties:  # lazy: the next forward of this row reads it, even before token is read back
            counts = self._counts if self._counts is not None else mx.zeros((vocab,), mx.float32)
            self._counts = counts.at[token].add(1.0)
        if logprobs is None:
            return []
        pending = _PendingLogprobs(logprobs[token], None, None)
        if p.logprobs:
            top_ids = mx.argpartition(-logprobs, p.logprobs - 1)[: p.logprobs]
            pending = _PendingLogprobs(pending.chosen, top_ids, logprobs[top_ids])
        self._pending.append(pending)
        return [a for a in (pending.chosen, pending.top_ids, pending.top_logprobs) if a is not None]


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


def sample_rows(logits: mx.array, samplers: list[RequestSampler],
                masks: Optional[PendingMasks] = None) -> mx.array:
    """logits: [B, V] (one row per request, same order as samplers) -> token ids [B], lazy.

    Nothing is evaluated here, so the engine can dispatch a step and build the next one while the
    device runs it. `masks`: the grammars' masks started by `DeferredSampling.start` (else computed
    here, on the host, from the matchers' state).
    The rows are processed as one batch (bias and penalties row by row, the grammars' masks and
    logprobs for all at once); the greedy ones share an argmax and the sampled ones are drawn one after
    another (their sort / cumsum temporaries may coexist: the memory model counts one set per row)."""
    masks = masks if masks is not None else start_grammar_masks(samplers, wait=True)
    words = masks.result() if masks is not None else None
    for s in samplers:
        s.num_sampled += 1
    if not any(processed(s.params) for s in samplers):  # what the memory model counts as sampled
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    # every row in one batch: plain greedy rows go through unchanged (no bias, an all-allowed mask), and
    # the greedy rows share one argmax without gathering them apart
    params = [s.params for s in samplers]
    x = logits if logits.dtype == mx.float32 else logits.astype(mx.float32)  # [B, V]
    if any(p.logit_bias or p.has_penalties for p in params):
        x = mx.stack([s.processed(x[i]) for i, s in enumerate(samplers)])
    if words is not None:  # bit t of a row's words: token t allowed (all set for rows without a grammar)
        x = _allowed_only(words, x)
    want = [p.logprobs is not None for p in params]
    logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True) if any(want) else None  # [B, V]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    groups: list[tuple[list[int], mx.array]] = []  # (rows, their tokens)
    if greedy:
        picked = x if len(greedy) == len(params) else x[mx.array(greedy)]
        groups.append((greedy, mx.argmax(picked, axis=-1)))
    groups += [([i], s.draw(x[i])[None]) for i, s in enumerate(samplers) if not s.params.greedy]
    order = [i for g, _ in groups for i in g]
    tokens = (groups[0][1] if len(groups) == 1 else mx.concatenate([t for _, t in groups])).astype(mx.int32)
    if order != list(range(len(samplers))):  # back to the rows' order
        position = {i: k for k, i in enumerate(order)}
        tokens = tokens[mx.array([position[i] for i in range(len(samplers))])]
    deps = []
    for i, s in enumerate(samplers):
        if want[i] or s.params.has_penalties:
            deps += s.sampled(tokens[i], logprobs[i] if want[i] else None, x.shape[-1])
    # computed with the tokens: the forward evaluates them, the engine reads them when it commits
    return mx.depends(tokens, deps) if deps else tokens


def start_grammar_masks(samplers: list[RequestSampler], wait: bool = False) -> Optional[PendingMasks]:
    """The [B, ceil(V / 32)] uint32 words of the rows' grammars (MaskWorker.start): bit t of a row set if
    its grammar allows token t (all set for rows without one); `wait`: computed now, on this thread.
    None if no row has a grammar. The matchers are not to be touched until the result is read."""
    matchers = [s.matcher for s in samplers]
    constrained = [m for m in matchers if m is not None]
    if not constrained:
        return None
    for s in samplers:
        if s.matcher is not None and s.num_accepted != s.num_sampled:  # the engine defers such rows' sampling
            raise RuntimeError("a grammar's mask needs the previous token: it was not read back")
    return constrained[0].masks.start(matchers, wait=wait)


class DeferredSampling:
    """A decode's sampling, built once its forward is launched (runner `defer_sampling`): a grammar's
    mask needs the row's previous token, which the engine reads back just before. `start` sets the masks
    computing (on the grammars' host thread, where the host has cores to spare) before the forward is
    launched; `build` waits for them and builds the sampling (the device runs the forward meanwhile)."""

    def __init__(self, logits: mx.array, samplers: list[RequestSampler]):
        self.logits = logits
        self.samplers = samplers
        self._masks: Optional[PendingMasks] = None

    def start(self) -> None:
        self._masks = start_grammar_masks(self.samplers)

    def build(self) -> mx.array:
        return sample_rows(self.logits, self.samplers, self._masks)

    def cancel(self) -> None:
        """Wait for the masks, unused (the launch failed): the matchers are the engine's again."""
        if self._masks is not None:
            self._masks.wait()


def _allowed_only(words: np.ndarray, x: mx.array) -> mx.array:
    """words [B, W] uint32, x [B, V] (V <= 32 W) -> x in float32, -inf where the token's bit is clear.
    On a GPU the bits expand on the device (the host unpacks nothing and sends V / 8 bytes a row); on
    the CPU, where host and device share the cores, numpy's unpacking costs less than the expansion."""
    if mx.default_device() == mx.cpu:
        allowed = np.unpackbits(words.view(np.uint8), axis=1, count=x.shape[-1], bitorder="little")
        return _select(mx.array(allowed.view(np.bool_)), x)
    return _expand_and_select(mx.array(words), x)


# Compiled: MLX fuses the cast, the expansion of the bits and the select; traced once a batch size.
@mx.compile
def _expand_and_select(words: mx.array, x: mx.array) -> mx.array:
    b, vocab = x.shape
    bits = ((words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1).reshape(b, -1)[:, :vocab]
    return mx.where(bits.astype(mx.bool_), x.astype(mx.float32), -mx.inf)


@mx.compile
def _select(allowed: mx.array, x: mx.array) -> mx.array:
    return mx.where(allowed, x.astype(mx.float32), -mx.inf)
