"""OpenAI protocol logic, pure: API request -> engine inputs, engine increments -> responses and chunks.

No Ray and no FastAPI here, so all of it is unit-tested with a tokenizer alone. Every check of a
request happens here, before any engine work: prompt length against the model, max_tokens against the
cap and the context, n against its cap, token ids against the vocabulary.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from engine import SamplingParams

from deployments.errors import BadRequestError, EngineError
from deployments.messages import GenerateOutput
from deployments.ingress.schemas import (
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
    ChunkChoice, CompletionChoice, CompletionChunk, CompletionRequest, CompletionResponse, DeltaMessage,
    PromptTokensDetails, Usage,
)


SEED_MODULUS = 1 << 64


@dataclass(frozen=True)
class Limits:
    """What a request may ask for; max_model_len comes from the engine, the caps from AppArgs."""

    max_model_len: int
    vocab_size: int
    max_tokens_cap: Optional[int] = None
    max_n: int = 8


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request: one engine request (SamplingParams) per choice."""

    request_id: str
    kind: str  # "chat" | "completion"
    model: str
    created: int
    prompt_token_ids: list[int]
    samplings: tuple[SamplingParams, ...]
    include_usage: bool = False
    received_ns: int = 0  # time.monotonic_ns() when the ingress got it (telemetry; 0: unknown)


def new_request_id(kind: str) -> str:
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex}"


def check_text(text: str, param: str) -> str:
    """Refuse text that is not valid Unicode (a lone surrogate such as "\\ud800" from a JSON escape):
    tokenizers raise TypeError on it, deep in the stack."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequestError(f"{param}: invalid Unicode at character {e.start} (a lone surrogate)",
                              param=param) from None
    return text


def chat_prompt_ids(tokenizer: Any, req: ChatCompletionRequest) -> list[int]:
    """Token ids of the conversation through the model's chat template."""
    messages = [{"role": m.role, "content": check_text(m.text(), f"messages.{i}.content")}
                for i, m in enumerate(req.messages)]
    if not getattr(tokenizer, "has_chat_template", True):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return list(tokenizer.encode(text))
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # jinja templates raise on conversations they do not accept
        raise BadRequestError(f"the chat template rejected the messages: {e}", param="messages") from None
    return list(ids)


def completion_prompt_ids(tokenizer: Any, req: CompletionRequest, limits: Limits) -> list[int]:
    if isinstance(req.prompt, str):
        return list(tokenizer.encode(check_text(req.prompt, "prompt")))
    bad = [t for t in req.prompt if not 0 <= t < limits.vocab_size]
    if bad:
        raise BadRequestError(
            f"prompt token ids must be in [0, {limits.vocab_size}), got {bad[:5]}", param="prompt"
        )
    return list(req.prompt)


def choose_max_tokens(requested: Optional[int], num_prompt_tokens: int, limits: Limits,
                      prompt_param: str) -> int:
    """The request's max_tokens, checked; when unset, what is left of the context (capped)."""
    room = limits.max_model_len - num_prompt_tokens
    if room < 1:
        raise BadRequestError(
            f"This model's maximum context length is {limits.max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for output.",
            param=prompt_param, code="context_length_exceeded",
        )
    cap = limits.max_tokens_cap
    if requested is None:
        return min(room, cap) if cap is not None else room
    if cap is not None and requested > cap:
        raise BadRequestError(f"max_tokens={requested} is over this server's cap of {cap}",
                              param="max_tokens")
    if requested > room:
        raise BadRequestError(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, "
            f"{requested} for the completion).",
            param="max_tokens", code="context_length_exceeded",
        )
    return requested


def make_samplings(req: Any, max_tokens: int, limits: Limits) -> tuple[SamplingParams, ...]:
    """One SamplingParams per choice; choice i of a seeded request uses seed + i."""
    if req.n > limits.max_n:
        raise BadRequestError(f"n={req.n} is over this server's cap of {limits.max_n}", param="n")
    for s in req.stop_strings():
        check_text(s, "stop")
    samplings = []
    for i in range(req.n):
        seed = None if req.seed is None else (req.seed + i) % SEED_MODULUS  # MLX keys take uint64
        try:
            samplings.append(SamplingParams(
                max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                seed=seed, stop=req.stop_strings(), stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
            ))
        except ValueError as e:  # SamplingParams names the field first: "stop='...': why"
            raise BadRequestError(str(e), param=str(e).split("=", 1)[0]) from None
    return tuple(samplings)


def prepare(req: Any, tokenizer: Any, limits: Limits, model: str) -> PreparedRequest:
    """Validate and tokenize a CompletionRequest or ChatCompletionRequest."""
    if isinstance(req, ChatCompletionRequest):
        kind, param, requested = "chat", "messages", req.requested_max_tokens()
        ids = chat_prompt_ids(tokenizer, req)
    else:
        kind, param, requested = "completion", "prompt", req.max_tokens
        ids = completion_prompt_ids(tokenizer, req, limits)
    if not ids:
        raise BadRequestError("the prompt has no tokens", param=param)
    if req.stream_options is not None and not req.stream:
        raise BadRequestError("stream_options is only allowed with stream=true", param="stream_options")
    max_tokens = choose_max_tokens(requested, len(ids), limits, param)
    return PreparedRequest(
        request_id=new_request_id(kind), kind=kind, model=model, created=int(time.time()),
        prompt_token_ids=ids, samplings=make_samplings(req, max_tokens, limits),
        include_usage=req.include_usage(),
    )


# ----------------------------------------------------------------------------- outputs


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text_parts: list[str] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: Optional[str] = None
    replica_id: Optional[str] = None


class Accumulator:
    """Folds the increments of the n choices of a request into texts and usage."""

    def __init__(self, n: int) -> None:
        self.choices = [ChoiceState() for _ in range(n)]

    def add(self, index: int, out: GenerateOutput) -> None:
        check_output(out)
        choice = self.choices[index]
        choice.text_parts.append(out.new_text)
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


def final_response(prepared: PreparedRequest, acc: Accumulator) -> Any:
    """The non-streaming response of a finished request."""
    common = dict(id=prepared.request_id, created=prepared.created, model=prepared.model,
                  usage=acc.usage(), system_fingerprint=acc.fingerprint())
    if prepared.kind == "chat":
        choices = [ChatChoice(index=i, message=AssistantMessage(content="".join(c.text_parts)),
                              finish_reason=c.finish_reason) for i, c in enumerate(acc.choices)]
        return ChatCompletionResponse(choices=choices, **common)
    choices = [CompletionChoice(index=i, text="".join(c.text_parts), finish_reason=c.finish_reason)
               for i, c in enumerate(acc.choices)]
    return CompletionResponse(choices=choices, **common)


def chunk_for(prepared: PreparedRequest, index: int, out: GenerateOutput, first: bool) -> Any:
    """The stream chunk carrying one increment of choice `index`."""
    check_output(out)
    reason = openai_finish_reason(out.finish_reason) if out.finished else None
    common = dict(id=prepared.request_id, created=prepared.created, model=prepared.model,
                  system_fingerprint=out.replica_id)
    if prepared.kind == "chat":
        delta = DeltaMessage(role="assistant" if first else None, content=out.new_text)
        return ChatCompletionChunk(choices=[ChunkChoice(index=index, delta=delta, finish_reason=reason)],
                                   **common)
    return CompletionChunk(choices=[CompletionChoice(index=index, text=out.new_text, finish_reason=reason)],
                           **common)


def usage_chunk(prepared: PreparedRequest, acc: Accumulator) -> Any:
    """The last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    common = dict(id=prepared.request_id, created=prepared.created, model=prepared.model, choices=[],
                  usage=acc.usage(), system_fingerprint=acc.fingerprint())
    if prepared.kind == "chat":
        return ChatCompletionChunk(**common)
    return CompletionChunk(**common)
