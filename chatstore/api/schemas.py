"""Request and response bodies (pydantic): the OpenAI subset we serve, and the session API."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from chatstore.store.ports import PRIORITY_MAX, PRIORITY_MIN, TTL_MAX_S

SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
SessionId = Annotated[str, StringConstraints(pattern=SESSION_ID_PATTERN)]
INT64_MAX = (1 << 63) - 1

Role = Literal["system", "developer", "user", "assistant"]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingFields(BaseModel):
    """Sampling knobs shared by /v1/chat/completions and /v1/sessions/{id}/messages."""

    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=1_000_000)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: bool = False


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionRequest(SamplingFields):
    """OpenAI's request; unknown fields are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    session_id: SessionId | None = None
    logprobs: bool | None = None


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


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageBody(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    # Extension: cached_tokens by where that KV was (device, dram, ssd, remote); usage.py.
    cached_tokens_by_tier: dict[str, int] = Field(default_factory=dict)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
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


class Deleted(BaseModel):
    id: str
    object: str
    deleted: bool = True


AnyDict = dict[str, Any]
