"""Constrained decoding: a `Grammar` (JSON schema, Lark or regex) compiled by llguidance into a matcher
that gives, before each token, the set of tokens the grammar allows, and follows the sampled tokens.

Why llguidance (xgrammar and outlines-core were the alternatives): its wheel has no dependencies
(xgrammar's pulls torch and triton), it compiles a JSON schema lazily (no per-schema precompute over
the vocabulary, so a new schema per request costs well under a millisecond), a mask takes tens of
microseconds, it reads JSON schema, Lark (with embedded JSON schemas, which the forced tool calls use)
and regex, and it reports an invalid schema as a message, which the API returns as a 400.

The masks of a batch are computed while the device runs the forward (MaskWorker) and applied to the
logits in engine/model/sampling.py; no mlx here (numpy only).
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import numpy as np

from engine.core.types import Grammar

# Compact JSON, no free whitespace: a free-running model (or a random one) could otherwise emit
# whitespace until max_tokens and never close the object.
JSON_GRAMMAR_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
MIN_CORES_FOR_THREADS = 8  # below, the engine's thread computes a batch's masks, after the launch


def grammar_text(grammar: Grammar) -> str:
    """llguidance's grammar text for `grammar`. ValueError naming the problem (not checked against a
    tokenizer: see `check`)."""
    import llguidance

    if grammar.kind == "json_schema":
        try:
            schema = json.loads(grammar.source)
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_GRAMMAR_OPTIONS)
    if grammar.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(grammar.source)
    return llguidance.LLMatcher.grammar_from_regex(grammar.source)


def check_grammar(grammar: Grammar) -> None:
    """ValueError with llguidance's message (e.g. "Invalid type: objectx") if `grammar` cannot be
    compiled."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_text(grammar))
    if is_error:
        raise ValueError(f"the {grammar.kind.replace('_', ' ')} cannot be compiled: {messages[0]}")


class GrammarMatcher:
    """The state of one request's grammar: which tokens it allows next, and the tokens it has taken."""

    def __init__(self, matcher: Any, vocab_size: int, masks: "MaskWorker"):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.masks = masks  # computes the masks of a batch: its compiler's, shared by its matchers

    def accept(self, token_id: int) -> None:
        """Follow a sampled token. RuntimeError if the grammar refuses it (the mask makes that a bug)."""
        if not self._matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and allows no further token (the output is finished)."""
        return self._matcher.is_stopped()

    @property
    def live(self) -> bool:
        """It constrains the next token (not complete, not failed)."""
        return not (self._matcher.is_stopped() or self._matcher.is_error())


class PendingMasks:
    """A batch's masks (MaskWorker.start): computing on the worker's thread, or computed on the caller's
    when first asked for."""

    def __init__(self, future: Optional[Future] = None, compute: Optional[Callable[[], np.ndarray]] = None):
        self._future = future
        self._compute = compute
        self._words: Optional[np.ndarray] = None

    def result(self) -> np.ndarray:
        """[B, ceil(V / 32)] uint32; waits for the worker's thread (its error is raised here)."""
        if self._words is None:
            self._words = self._future.result() if self._future is not None else self._compute()
        return self._words

    def wait(self) -> None:
        """Wait for the worker's thread, if it computes them, without the result (nor its error)."""
        if self._future is not None:
            self._future.exception()


class MaskWorker:
    """Computes a batch's masks, [B, ceil(V / 32)] words whose bit t of row b is set if row b's grammar
    allows token t. On a host with cores to spare: one llguidance call for all rows into one buffer
    (its threads, the GIL released), made from a host thread of its own, so the engine's thread
    launches the forward meanwhile. On a small host the caller computes them, row after row, when it
    asks for them (after the launch: MLX's CPU work takes the cores, and a hand-over between threads
    waits for one)."""

    def __init__(self, num_threads: int):
        """`num_threads`: llguidance's threads (0: no threads, the caller's)."""
        import llguidance

        self._llguidance = llguidance.LLExecutor(num_threads) if num_threads else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks") if num_threads else None

    def start(self, matchers: list[Optional[GrammarMatcher]], wait: bool = False) -> PendingMasks:
        """The masks of `matchers` (all bits set for a row without a grammar (None) or one that is done),
        from their state now; `wait`: computed now, on the caller's thread (nothing to overlap). The
        matchers must not be touched until the result is read."""
        vocab = next(m.vocab_size for m in matchers if m is not None)
        words = np.full((len(matchers), (vocab + 31) // 32), -1, dtype=np.int32)
        live = [(m._matcher, i) for i, m in enumerate(matchers) if m is not None and m.live]
        if self._thread is None or wait or not live:
            pending = PendingMasks(compute=lambda: self._fill(live, words))
            if wait:
                pending.result()
            return pending
        entered = threading.Event()
        future = self._thread.submit(self._fill, live, words, entered)
        # The worker needs the GIL to enter llguidance's call, which then releases it: wait until it is
        # in, or the caller's next work (building and launching the forward) could hold the GIL
        # throughout and the masks would start only when the caller waits for them.
        entered.wait()
        return PendingMasks(future)

    def _fill(self, live: list, words: np.ndarray, entered: Optional[threading.Event] = None) -> np.ndarray:
        size = words.shape[1] * 4
        if entered is not None:
            entered.set()
        if self._llguidance is not None and live:
            self._llguidance.unsafe_compute_mask_ptr(live, words.ctypes.data, size, words.shape[0])
        else:
            for matcher, i in live:  # each call releases the GIL
                matcher.unsafe_compute_mask_ptr(words[i].ctypes.data, size)
        return words.view(np.uint32)


class GrammarCompiler:
    """Builds matchers for one tokenizer. Wrapping the tokenizer for llguidance takes ~0.5 s, so an
    engine makes one, on its first constrained request."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        import llguidance
        import llguidance.hf

        self.vocab_size = vocab_size
        # JSON slices: a JSON string of bounded length (maxLength) takes ~0.1 ms a mask with them, ~6 ms
        # with the general ones (SmolLM2's vocabulary); other grammars are as correct, if slower.
        self._tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                       eos_token=list(eos_token_ids),
                                                       slices=llguidance.LLTokenizer.json_slices())
        # llguidance's threads compute a batch's masks in parallel; on a small host they would take the
        # cores MLX's CPU work needs
        cores = os.cpu_count() or 1
        self._masks = MaskWorker(min(16, cores // 2) if cores >= MIN_CORES_FOR_THREADS else 0)

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A fresh matcher; ValueError naming the problem if the grammar cannot be compiled."""
        import llguidance

        # no validation pass first: the matcher reports the same errors (check_request validated it)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar_text(grammar), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the {grammar.kind.replace('_', ' ')} cannot be compiled: {matcher.get_error()}")
        return GrammarMatcher(matcher, self.vocab_size, self._masks)
