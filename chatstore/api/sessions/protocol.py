"""The session API's bodies (pydantic): create, patch, list, a message and its reply."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from chatstore.api.common.protocol import Choice, SamplingFields, SessionId, UsageBody
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


class SessionMessageRequest(SamplingFields):
    model_config = ConfigDict(extra="forbid")
    content: str
    stream: bool = False


class MessageOut(BaseModel):
    role: str
    content: str


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
    choices: list[Choice]
    finish_reason: str | None
    usage: UsageBody
    timings: TurnTimings
