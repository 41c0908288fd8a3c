"""OpenAI protocol logic, pure: engine increments -> responses and stream chunks (content, tool calls,
logprobs, usage). Requests -> engine inputs: protocol.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from engine import TokenLogprob

from deployments.errors import EngineError
from deployments.ingress import logprobs as lp
from deployments.ingress.protocol import PreparedRequest
from deployments.ingress.schemas import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChunkChoice, CompletionChoice,
    CompletionChunk, CompletionResponse, DeltaMessage, PromptTokensDetails, Usage,
)
from deployments.ingress.tools import ToolFormat, ToolStream, parse_output, tool_format
from deployments.messages import GenerateOutput


@dataclass(frozen=True)
class OutputContext:
    """What turns engine outputs into responses for one tokenizer: its tool-call format, token texts."""

    tool_format: ToolFormat
    token_texts: lp.TokenTexts

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> "OutputContext":
        return cls(tool_format(tokenizer), lp.TokenTexts(tokenizer))


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: Optional[str] = None
    replica_id: Optional[str] = None


class Accumulator:
    """Folds the increments of the n choices of a request into texts and usage. A stream sends each
    increment's text and logprobs as they come: its accumulator (keep_content=False) keeps only the usage."""

    def __init__(self, n: int, keep_content: bool = True) -> None:
        self.choices = [ChoiceState() for _ in range(n)]
        self._keep_content = keep_content

    def add(self, index: int, out: GenerateOutput) -> None:
        check_output(out)
        choice = self.choices[index]
        if self._keep_content:
            choice.text_parts.append(out.new_text)
            choice.logprobs.extend(out.new_logprobs)
        choice.num_prompt_tokens = out.num_prompt_tokens
        choice.num_output_tokens = out.num_output_tokens
        choice.num_cached_tokens = out.num_cached_tokens
        choice.replica_id = choice.replica_id or out.replica_id
        if out.finished:
            choice.finish_reason = openai_finish_reason(out.finish_reason)

    def usage(self) -> Usage:
        prompt = max((c.num_prompt_tokens for c in self.choices), default=0)
        completion = sum(c.num_output_tokens for c in self.choices)
        cached = max((c.num_cached_tokens for c in self.choices), default=0)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def fingerprint(self) -> Optional[str]:
        return next((c.replica_id for c in self.choices if c.replica_id), None)


def check_output(out: GenerateOutput) -> None:
    """Raise EngineError for an increment that reports a failure."""
    if out.error is not None or out.finish_reason == "error":
        raise EngineError(f"the engine failed on request {out.request_id}: {out.error or 'unknown error'}")


def openai_finish_reason(reason: Optional[str]) -> Optional[str]:
    if reason is None:
        return None
    if reason in ("stop", "length"):
        return reason
    if reason == "abort":
        raise EngineError("the request was aborted by the engine", code="aborted")
    raise EngineError(f"the engine finished the request with reason {reason!r}")


def _chat_choice(prepared: PreparedRequest, index: int, c: ChoiceState, ctx: OutputContext) -> ChatChoice:
    text, reason = "".join(c.text_parts), c.finish_reason
    message = AssistantMessage(content=text)
    if prepared.tool_plan is not None:
        content, calls = parse_output(prepared.tool_plan, ctx.tool_format, text)
        message = AssistantMessage(content=content, tool_calls=calls or None)
        if calls and reason == "stop":
            reason = "tool_calls"
    return ChatChoice(index=index, message=message, finish_reason=reason,
                      logprobs=lp.maybe(c.logprobs, prepared.logprobs, ctx.token_texts, chat=True))


def final_response(prepared: PreparedRequest, acc: Accumulator, ctx: OutputContext) -> Any:
    """The non-streaming response of a finished request."""
    common = dict(id=prepared.request_id, created=prepared.created, model=prepared.model,
                  usage=acc.usage(), system_fingerprint=acc.fingerprint())
    if prepared.kind == "chat":
        return ChatCompletionResponse(choices=[_chat_choice(prepared, i, c, ctx) for i, c in enumerate(acc.choices)],
                                      **common)
    choices = [CompletionChoice(index=i, text="".join(c.text_parts), finish_reason=c.finish_reason,
                                logprobs=lp.maybe(c.logprobs, prepared.logprobs, ctx.token_texts, chat=False))
               for i, c in enumerate(acc.choices)]
    return CompletionResponse(choices=choices, **common)


class StreamChunks:
    """The stream chunks of one request: each increment of choice `index` -> one chunk or None (text a
    tool call still holds back)."""

    def __init__(self, prepared: PreparedRequest, ctx: OutputContext) -> None:
        self._prepared, self._ctx = prepared, ctx
        n = len(prepared.samplings)
        self._started = [False] * n
        self._offsets = [0] * n  # characters of each completion choice so far (text_offset)
        plan = prepared.tool_plan
        self._tools = [ToolStream(plan, ctx.tool_format) if plan is not None else None for _ in range(n)]

    def chunk(self, index: int, out: GenerateOutput) -> Any:
        check_output(out)
        p, ctx = self._prepared, self._ctx
        reason = openai_finish_reason(out.finish_reason) if out.finished else None
        common = dict(id=p.request_id, created=p.created, model=p.model, system_fingerprint=out.replica_id)
        if p.kind != "chat":
            logprobs = lp.maybe(out.new_logprobs, p.logprobs, ctx.token_texts, chat=False, offset=self._offsets[index])
            self._offsets[index] += len(out.new_text)
            return CompletionChunk(choices=[CompletionChoice(index=index, text=out.new_text, finish_reason=reason,
                                                             logprobs=logprobs)], **common)
        content, calls = out.new_text, None
        tools = self._tools[index]
        if tools is not None:
            content, calls = tools.feed(out.new_text, out.finished)
            if tools.num_calls and reason == "stop":
                reason = "tool_calls"
        logprobs = lp.maybe(out.new_logprobs, p.logprobs, ctx.token_texts, chat=True)
        first = not self._started[index]
        if tools is not None and not (first or content or calls or reason or (logprobs and logprobs.content)):
            return None
        self._started[index] = True
        delta = DeltaMessage(role="assistant" if first else None, content=content, tool_calls=calls or None)
        return ChatCompletionChunk(choices=[ChunkChoice(index=index, delta=delta, finish_reason=reason,
                                                        logprobs=logprobs)], **common)


def usage_chunk(prepared: PreparedRequest, acc: Accumulator) -> Any:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    common = dict(id=prepared.request_id, created=prepared.created, model=prepared.model, choices=[],
                  usage=acc.usage(), system_fingerprint=acc.fingerprint())
    if prepared.kind == "chat":
        return ChatCompletionChunk(**common)
    return CompletionChunk(**common)
