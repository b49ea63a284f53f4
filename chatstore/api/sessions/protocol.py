"""The session API's bodies (pydantic): create, patch, list, a message and its reply."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

from chatstore.api.common.protocol import Choice, SamplingFields, SessionId, UsageBody
from chatstore.api.tools.protocol import ToolCallBody, ToolChoiceBody, ToolDef
from chatstore.store.retention import PRIORITY_MAX, PRIORITY_MIN, TTL_MAX_S

Priority = Annotated[int, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX, strict=True)]
TtlSeconds = Annotated[int, Field(ge=0, le=TTL_MAX_S, strict=True)]  # 0: the server's TTL


class SessionCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    system_prompt: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict, max_length=64)
    id: SessionId | None = None
    priority: Priority = 0
    ttl_s: TtlSeconds = 0


class SessionPatchRequest(BaseModel):
    """PATCH /v1/sessions/{id}: the fields given change, the others stay; metadata is
    replaced whole."""

    model_config = ConfigDict(extra="forbid")
    priority: Priority | None = None
    ttl_s: TtlSeconds | None = None
    metadata: dict[str, str] | None = Field(None, max_length=64)


class NewMessage(BaseModel):
    """One of a turn's new messages: the user's, or a tool call's result."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "tool"]
    content: str
    tool_call_id: str | None = Field(None, max_length=256)


class SessionMessageRequest(SamplingFields):
    """A turn: one new message (`content`; a tool's result with role "tool" and
    `tool_call_id`), or several (`messages`: the results of parallel calls, say). `tools`,
    `tool_choice` and `parallel_tool_calls` as /v1/chat/completions takes them."""

    model_config = ConfigDict(extra="forbid")
    content: str | None = None
    role: Literal["user", "tool"] = "user"
    tool_call_id: str | None = Field(None, max_length=256)
    messages: list[NewMessage] | None = Field(None, min_length=1, max_length=128)
    stream: bool = False
    tools: list[ToolDef] | None = Field(None, max_length=128)
    tool_choice: ToolChoiceBody | None = None
    parallel_tool_calls: bool | None = None


class MessageOut(BaseModel):
    role: str
    content: str
    tool_calls: list[ToolCallBody] | None = None  # an assistant reply that calls tools
    tool_call_id: str | None = None  # a tool's result: the call it answers

    @model_serializer(mode="wrap")
    def _present_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """A message without calls (or a call id) is {"role", "content"}, as before tools."""
        out: dict[str, object] = handler(self)
        for name in ("tool_calls", "tool_call_id"):
            if out.get(name) is None:
                out.pop(name, None)
        return out


class SessionInfo(BaseModel):
    id: str
    object: Literal["session"] = "session"
    created_at: float
    updated_at: float
    metadata: dict[str, str]
    num_messages: int
    num_tokens: int
    kv_location: str | None = None  # device | dram | ssd | remote | None (no KV kept)
    priority: int = 0
    ttl_s: int = 0  # 0: the server's session TTL
    expires_at: float | None = None  # if left idle; None: never
    messages: list[MessageOut] | None = None


class SessionChoice(Choice):
    message: MessageOut  # type: ignore[assignment]  # with its calls, when it makes any


class SessionList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SessionInfo]
    has_more: bool
    next_offset: int | None = None


class TurnTimings(BaseModel):
    ttft_ms: float | None
    engine_ttft_ms: float | None
    total_ms: float


class SessionReply(BaseModel):
    id: str
    object: Literal["session.message"] = "session.message"
    session_id: str
    message: MessageOut
    choices: list[SessionChoice]
    finish_reason: str | None
    usage: UsageBody
    timings: TurnTimings
