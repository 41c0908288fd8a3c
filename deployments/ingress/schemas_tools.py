"""Pydantic models of the OpenAI API's structured output, tool calls and logprobs (schemas.py uses them)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True,
                              serialize_by_alias=True)


class _Lenient(_Request):
    """History sent back as it came in a response: its unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)


class JsonSchemaFormat(_Request):
    name: str = Field("response", min_length=1, max_length=64, description="The schema's name.")
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(
        None, alias="schema", description="The JSON schema the output follows (absent: any JSON object).")
    strict: Optional[bool] = Field(None, description="The schema is always enforced, strict or not.")


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_with_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema must be given with type 'json_schema', and only then")
        return self


class FunctionDefinition(_Request):
    name: str = Field(..., pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="JSON schema of the arguments.")
    strict: Optional[bool] = Field(None, description="A forced call always follows the schema.")


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: ToolChoiceFunction


class MessageFunctionCall(_Lenient):
    name: str
    arguments: str = Field(..., description="The arguments as JSON text.")


class MessageToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: MessageFunctionCall


# ----------------------------------------------------------------------------- responses


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCallFunction(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class DeltaFunction(_Response):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(_Response):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunction


class TopLogprobEntry(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry] = Field(default_factory=list)


class ChoiceLogprobs(_Response):
    content: Optional[list[ChatTokenLogprob]] = None
    refusal: Optional[list[ChatTokenLogprob]] = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)
