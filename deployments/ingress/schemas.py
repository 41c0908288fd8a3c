"""Pydantic models of the OpenAI-compatible API: requests, responses, stream chunks, model list.

The HTTP routes and the Python handle API take and return these same models. Nothing is silently
ignored: a request field this server does not know is refused (400 naming it), as OpenAI does; the
informational fields the official client sends (user, metadata, store, ...) are accepted. Messages of
the history may carry fields of a previous response (refusal, annotations): those are ignored.
Tool and logprob models: schemas_tools.py.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from deployments.ingress.schemas_tools import (ChatTool, ChoiceLogprobs, CompletionLogprobs, DeltaToolCall,
                                               MessageToolCall, NamedToolChoice, ResponseFormat, ToolCall)

FinishReasonStr = Literal["stop", "length", "tool_calls"]
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit


class _Request(BaseModel):
    # strict: JSON true is not the integer 1, "5" is not a number, 5.0 is not a token count (ints are
    # still accepted where a float is expected).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="Send a last chunk with the usage of the request.")
    include_obfuscation: Optional[bool] = Field(None, description="Accepted: chunks carry no padding.")


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
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0,
                                    description="Subtracted from the logits of tokens already in the output.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0,
                                     description="Subtracted once per occurrence of a token in the output.")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description=(
        "Divides positive and multiplies negative logits of tokens in the prompt or output; 1 disables."))
    min_p: float = Field(0.0, ge=0.0, le=1.0,
                         description="Drop tokens less likely than min_p times the most likely one.")
    logit_bias: Optional[dict[str, float]] = Field(
        None, description="Token id (as a string) -> bias in [-100, 100] added to its logit.")
    response_format: Optional[ResponseFormat] = Field(
        None, description="text, json_object or json_schema: the output is constrained to it.")
    user: Optional[str] = Field(None, description="Informational: accepted, not used.")
    metadata: Optional[dict[str, str]] = Field(None, description="Informational: accepted, not used.")
    store: Optional[bool] = Field(None, description="Informational: accepted, nothing is stored.")
    service_tier: Optional[str] = Field(None, description="Informational: accepted, not used.")
    prompt_cache_key: Optional[str] = Field(None, description="Informational: the prefix cache is automatic.")
    safety_identifier: Optional[str] = Field(None, description="Informational: accepted, not used.")

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(v)}")
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
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
    logprobs: Optional[int] = Field(None, ge=0, le=20,
                                    description="Logprobs of each token and of this many most likely ones.")
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

    @field_validator("echo", "best_of", "suffix")
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
    # a previous response's message sent back as history may carry refusal, annotations, ...
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextContentPart]]] = Field(None, description="Text of the message.")
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = Field(None, description="An assistant's tool calls.")
    tool_call_id: Optional[str] = Field(None, description="The call a tool message answers.")

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
    logprobs: bool = Field(False, description="Return the logprob of each output token.")
    top_logprobs: Optional[int] = Field(None, ge=0, le=20,
                                        description="And of this many most likely tokens (needs logprobs).")
    tools: Optional[list[ChatTool]] = Field(None, description="Functions the model may call.")
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = Field(
        None, description="none, auto (default with tools), required, or a named function.")
    parallel_tool_calls: Optional[bool] = Field(
        None, description="auto: the model may make several calls; a forced choice makes one.")

    @model_validator(mode="after")
    def _consistent(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must be unique, got {names}")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, "
                             f"which is not in tools {names}")
        if self.tool_choice in ("auto", "required") and not names:
            raise ValueError(f"tool_choice={self.tool_choice!r} needs tools")
        return self

    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named" (OpenAI's default: auto with tools, else none)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

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
    logprobs: Optional[CompletionLogprobs] = None


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


class _OmitsNoToolCalls(_Response):
    """OpenAI leaves tool_calls out of a message that has none."""

    @model_serializer(mode="wrap")
    def _omit(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class AssistantMessage(_OmitsNoToolCalls):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    finish_reason: Optional[FinishReasonStr] = None
    logprobs: Optional[ChoiceLogprobs] = None


class ChatCompletionResponse(_ResponseMeta):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(_OmitsNoToolCalls):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    finish_reason: Optional[FinishReasonStr] = None
    logprobs: Optional[ChoiceLogprobs] = None


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
