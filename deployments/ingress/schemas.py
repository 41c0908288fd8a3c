"""Pydantic models of the OpenAI-compatible API: requests, responses, stream chunks, model list.

The HTTP routes and the Python handle API take and return these same models. Requests ignore unknown
fields (clients send many optional ones) but reject the features this server does not implement
(logprobs, echo, best_of > 1, penalties, tools) instead of silently ignoring them.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

FinishReasonStr = Literal["stop", "length"]


class _Request(BaseModel):
    # strict: JSON true is not the integer 1, "5" is not a number, 5.0 is not a token count (ints are
    # still accepted where a float is expected).
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="Send a last chunk with the usage of the request.")


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str = Field(..., min_length=1, description="The served model name (see GET /v1/models).")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy decoding.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens; 0 disables.")
    n: int = Field(1, ge=1, description="Choices to generate for the prompt.")
    stream: bool = Field(False, description="Stream server-sent events, ending with `data: [DONE]`.")
    stream_options: Optional[StreamOptions] = Field(None, description="Only with stream=true.")
    stop: Optional[Union[str, list[str]]] = Field(None, description="Up to 16 stop strings.")
    stop_token_ids: Optional[list[int]] = Field(None, description="Token ids that end the output.")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    seed: Optional[int] = Field(None, ge=-(1 << 63), lt=1 << 64,
                                description="Sampling seed (int64 or uint64); choice i of n uses seed + i.")
    presence_penalty: float = Field(0.0, description="Not supported: must be 0.")
    frequency_penalty: float = Field(0.0, description="Not supported: must be 0.")
    user: Optional[str] = Field(None, description="Accepted and ignored.")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("penalties are not supported; send 0 or omit the field")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: Optional[Union[str, list[str]]]) -> Optional[Union[str, list[str]]]:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(v)}")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(
        ..., description="One prompt: a string or a list of token ids (a batch of one is accepted)."
    )
    max_tokens: Optional[int] = Field(16, ge=1, description="Most tokens to generate (OpenAI default 16).")
    echo: bool = Field(False, description="Not supported: must be false.")
    logprobs: Optional[int] = Field(None, description="Not supported: must be null.")
    best_of: Optional[int] = Field(None, description="Not supported: must be null or 1.")
    suffix: Optional[str] = Field(None, description="Not supported: must be null.")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Union[str, list[int]]:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError(f"batched prompts are not supported: send one prompt, got {len(v)}")
            v = v[0]
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo", "logprobs", "best_of", "suffix")
    @classmethod
    def _unsupported(cls, v: Any, info) -> Any:
        allowed = {"echo": (False,), "best_of": (None, 1)}.get(info.field_name, (None,))
        if not any(v is a or (type(v) is int and v == a) for a in allowed):
            raise ValueError(f"{info.field_name}={v!r} is not supported by this server")
        return v


class TextContentPart(_Request):
    type: Literal["text"] = Field(..., description="Only text parts are supported.")
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextContentPart]]] = Field(None, description="Text of the message.")
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation so far.")
    max_tokens: Optional[int] = Field(None, ge=1, description="Most tokens to generate (deprecated name).")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="Most tokens to generate.")
    logprobs: bool = Field(False, description="Not supported: must be false.")
    tools: Optional[list[Any]] = Field(None, description="Not supported: must be null or empty.")
    response_format: Optional[dict[str, Any]] = Field(None, description="Only {'type': 'text'}.")

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError("logprobs are not supported by this server")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: Optional[list[Any]]) -> Optional[list[Any]]:
        if v:
            raise ValueError("tools are not supported by this server")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        if v is not None and v.get("type", "text") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ----------------------------------------------------------------------------- responses


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = Field(0, description="Prompt tokens whose KV came from the prefix cache.")


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionChoice(_Response):
    index: int
    text: str
    finish_reason: Optional[FinishReasonStr] = None
    logprobs: None = None


class _ResponseMeta(_Response):
    """What every completion / chat response and chunk carries besides its choices."""

    id: str
    created: int
    model: str
    system_fingerprint: Optional[str] = Field(None, description="Id of the engine replica that served it.")


class CompletionResponse(_ResponseMeta):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class CompletionChunk(CompletionResponse):
    """A streamed piece of a completion (OpenAI uses the same object name and shape)."""


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    finish_reason: Optional[FinishReasonStr] = None
    logprobs: None = None


class ChatCompletionResponse(_ResponseMeta):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(_Response):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    finish_reason: Optional[FinishReasonStr] = None
    logprobs: None = None


class ChatCompletionChunk(_ResponseMeta):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: Optional[Usage] = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mlx-serve"
    max_model_len: Optional[int] = Field(None, description="Longest prompt + output, when known.")


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthStatus(_Response):
    status: Literal["ok"] = "ok"
    num_replicas_checked: int = Field(1, description="Engine replicas that answered healthy.")
