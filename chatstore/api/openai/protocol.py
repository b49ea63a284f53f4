"""OpenAI's chat completion and model list bodies (pydantic), the subset we serve."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from chatstore.api.common.protocol import (
    Choice,
    SamplingFields,
    SessionId,
    UsageBody,
)
from chatstore.api.tools.protocol import ToolCallBody, ToolChatMessage, ToolChoiceBody, ToolDef
from chatstore.engine.request import MAX_LOGPROBS


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(SamplingFields):
    """OpenAI's request; unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ToolChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    session_id: SessionId | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: ToolChoiceBody | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobBody(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobBody] | None
    refusal: list[TokenLogprobBody] | None = None


class ReplyMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallBody] | None = None


class ChatChoice(Choice):
    message: ReplyMessage  # type: ignore[assignment]
    logprobs: ChoiceLogprobs | None = None  # type: ignore[assignment]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageBody
    system_fingerprint: str | None = None
    session_id: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "chatstore"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
