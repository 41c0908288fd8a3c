"""Logprobs in OpenAI's shapes: chat's `logprobs.content` and completions' `logprobs` (token strings,
their UTF-8 bytes, top alternatives). Which distribution they come from: engine/model/sampling.py."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from engine import TokenLogprob

from deployments.ingress.schemas_tools import ChatTokenLogprob, ChoiceLogprobs, CompletionLogprobs, TopLogprobEntry


class TokenTexts:
    """Token id -> its bytes and text. A byte-level BPE token can be part of a UTF-8 character, so its
    bytes come from llguidance's view of the tokenizer (made on first use: ~0.5 s), not from decode."""

    def __init__(self, tokenizer: Any):
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self._ll: Any = None
        self._cache: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        if token_id not in self._cache:
            if self._ll is None:
                import llguidance.hf

                self._ll = llguidance.hf.from_tokenizer(self._hf)
            self._cache[token_id] = self._ll.decode_bytes([token_id])
        return self._cache[token_id]

    def text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")


def _entry(texts: TokenTexts, token_id: int, logprob: float) -> TopLogprobEntry:
    return TopLogprobEntry(token=texts.text(token_id), logprob=logprob, bytes=list(texts.token_bytes(token_id)))


def chat_logprobs(items: Sequence[TokenLogprob], texts: TokenTexts) -> ChoiceLogprobs:
    content = []
    for lp in items:
        top = [_entry(texts, t.token_id, t.logprob) for t in lp.top]
        chosen = _entry(texts, lp.token_id, lp.logprob)
        content.append(ChatTokenLogprob(token=chosen.token, logprob=chosen.logprob, bytes=chosen.bytes,
                                        top_logprobs=top))
    return ChoiceLogprobs(content=content)


def completion_logprobs(items: Sequence[TokenLogprob], texts: TokenTexts, top: bool,
                        offset: int = 0) -> CompletionLogprobs:
    """`offset`: characters of the choice's text before these tokens (text_offset counts from there)."""
    out = CompletionLogprobs()
    for lp in items:
        token = texts.text(lp.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        if top:
            out.top_logprobs.append({texts.text(t.token_id): t.logprob for t in lp.top})
        out.text_offset.append(offset)
        offset += len(token)
    if not top:
        out.top_logprobs.clear()
    return out


def maybe(items: Sequence[TokenLogprob], asked: Optional[int], texts: TokenTexts, chat: bool,
          offset: int = 0) -> Any:
    """The choice's logprobs object, or None when the request did not ask for logprobs."""
    if asked is None:
        return None
    if chat:
        return chat_logprobs(items, texts)
    return completion_logprobs(items, texts, top=asked > 0, offset=offset)
