"""Tool calling's request bodies (pydantic, as OpenAI defines them) and the small typed values
the rest of the package passes around."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from chatstore.api.common.protocol import ChatMessage

FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceBody = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallBody(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallBody


class ToolChatMessage(ChatMessage):
    """A chat message that may be a tool call (assistant) or a tool's result (role "tool")."""

    role: Literal["system", "developer", "user", "assistant", "tool"]  # type: ignore[assignment]
    tool_calls: list[ToolCallBody] | None = None
    tool_call_id: str | None = Field(None, max_length=256)


class ToolCall(NamedTuple):
    """A call the model made (or a client sent back): the function and its JSON arguments."""

    name: str
    arguments: str  # JSON text of an object
    id: str = ""  # set by the API when it answers, or as the client sent it


class ParsedReply(NamedTuple):
    """A reply split into its text and its tool calls."""

    content: str
    calls: tuple[ToolCall, ...] = ()
