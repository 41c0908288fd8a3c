"""OpenAI protocol logic, pure: API request -> engine inputs (engine increments -> responses: responses.py).

No Ray and no FastAPI here, so all of it is unit-tested with a tokenizer alone. Every check of a
request happens here, before any engine work: prompt length against the model, max_tokens against the
cap and the context, n against its cap, token ids against the vocabulary.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from engine import Grammar, LogitBias, SamplingParams, check_grammar

from deployments.errors import BadRequestError
from deployments.ingress.schemas import ChatCompletionRequest, CompletionRequest
from deployments.ingress.tools import ToolPlan, forced_grammar, plan_for, template_messages, tool_format


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
    tool_plan: Optional[ToolPlan] = None  # the output is (or may hold) tool calls
    logprobs: Optional[int] = None  # top alternatives per token, when logprobs were asked for


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
    """Token ids of the conversation (with the tools, tools.py says how) through the model's chat template."""
    texts = [check_text(m.text(), f"messages.{i}.content") for i, m in enumerate(req.messages)]
    messages, tools = template_messages(req, tool_format(tokenizer), texts)
    if not getattr(tokenizer, "has_chat_template", True):
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return list(tokenizer.encode(text))
    extra = {"tools": tools} if tools else {}
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
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


def request_grammar(req: Any) -> Optional[Grammar]:
    """The grammar the output must follow: response_format's, or a forced tool choice's (400 if it
    cannot be compiled, naming llguidance's reason)."""
    fmt = req.response_format
    chat = isinstance(req, ChatCompletionRequest)
    if fmt is not None and fmt.type != "text":
        if chat and req.tool_mode() != "none":
            raise BadRequestError("response_format json_object / json_schema cannot be combined with tools "
                                  "unless tool_choice is 'none'", param="response_format")
        schema = (fmt.json_schema.json_schema if fmt.type == "json_schema" else None) or {"type": "object"}
        grammar, param = Grammar("json_schema", json.dumps(schema)), "response_format"
    elif chat and req.tool_mode() in ("named", "required"):
        grammar, param = forced_grammar(req), "tools"
    else:
        return None
    try:
        check_grammar(grammar)
    except ValueError as e:
        raise BadRequestError(str(e), param=param) from None
    return grammar


def requested_logprobs(req: Any) -> Optional[int]:
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def make_samplings(req: Any, max_tokens: int, limits: Limits) -> tuple[SamplingParams, ...]:
    """One SamplingParams per choice; choice i of a seeded request uses seed + i."""
    if req.n > limits.max_n:
        raise BadRequestError(f"n={req.n} is over this server's cap of {limits.max_n}", param="n")
    for s in req.stop_strings():
        check_text(s, "stop")
    bias = tuple(LogitBias(int(k), float(v)) for k, v in (req.logit_bias or {}).items())
    bad = [b.token_id for b in bias if b.token_id >= limits.vocab_size]
    if bad:
        raise BadRequestError(f"logit_bias token ids must be in [0, {limits.vocab_size}), got {bad[:5]}",
                              param="logit_bias")
    extra = dict(presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                 repetition_penalty=req.repetition_penalty, min_p=req.min_p, logit_bias=bias,
                 logprobs=requested_logprobs(req), grammar=request_grammar(req))
    samplings = []
    for i in range(req.n):
        seed = None if req.seed is None else (req.seed + i) % SEED_MODULUS  # MLX keys take uint64
        try:
            samplings.append(SamplingParams(
                max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                seed=seed, stop=req.stop_strings(), stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos, **extra,
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
        include_usage=req.include_usage(), tool_plan=plan_for(req) if kind == "chat" else None,
        logprobs=requested_logprobs(req),
    )
