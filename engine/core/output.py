"""Per-request output processing: incremental detokenization, stop tokens and stop strings."""

from __future__ import annotations

from typing import Optional

from engine.core.types import FinishReason, Request, RequestOutput, TokenLogprob


class TextStream:
    """Detokenizes one request's output and finds its stop strings.

    Text that could be the beginning of a stop string is held back until it is known not to be, so a
    streamed response never shows part of a stop string (vLLM behaves the same way).
    """

    def __init__(self, detokenizer, stop: tuple[str, ...]):
        self._detok = detokenizer
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._text = ""  # all text decoded so far
        self._emitted = 0  # characters of _text already returned

    def add(self, token_id: Optional[int], final: bool) -> tuple[str, bool]:
        """Feed one token (None: nothing new). Returns (new text, a stop string was hit)."""
        if token_id is not None:
            self._detok.add_token(token_id)
        if final:
            self._detok.finalize()
        self._text += self._detok.last_segment
        search_from = max(0, self._emitted - self._holdback)
        hits = [i for i in (self._text.find(s, search_from) for s in self._stop) if i >= 0]
        if hits:
            end, stopped = min(hits), True
        else:
            end, stopped = (len(self._text) if final else len(self._text) - self._holdback), False
        end = max(end, self._emitted)
        new, self._emitted = self._text[self._emitted : end], end
        return new, stopped

    @property
    def text(self) -> str:
        return self._text[: self._emitted]


def finish_reason_for(request: Request, token_id: int, eos_token_ids: set[int]) -> Optional[FinishReason]:
    """Why the request ends after sampling `token_id`, if it does (stop strings aside)."""
    params = request.sampling
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return FinishReason.STOP
    if request.num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    return None


def process_token(request: Request, stream: TextStream, eos_token_ids: set[int], grammar_done: bool = False,
                  logprob: Optional[TokenLogprob] = None) -> RequestOutput:
    """Turn the request's newest token into an output increment (finished or not). `grammar_done`:
    the request's grammar is complete (the token ends it); `logprob`: the token's, if asked for."""
    token_id = request.output_token_ids[-1]
    reason = finish_reason_for(request, token_id, eos_token_ids)
    # A stop token's own text is not part of the output (OpenAI and vLLM behave the same).
    shown = None if reason == FinishReason.STOP else token_id
    if reason is None and grammar_done:  # the token completes the grammar: shown, and the end
        reason = FinishReason.STOP
        if token_id in eos_token_ids:  # the grammar ended by taking EOS (ignore_eos): no EOS text
            shown = None
    new_text, stopped = stream.add(shown, final=reason is not None)
    if stopped:
        reason = FinishReason.STOP
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=[token_id],
        new_text=new_text,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens,
        finished=reason is not None,
        finish_reason=reason,
        num_cached_tokens=request.num_cached_tokens,
        new_logprobs=(logprob,) if logprob is not None and shown is not None else (),
    )
