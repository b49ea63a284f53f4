"""The Responses API's tool fields, read into chat completions' own ToolRequest (api/tools/), so
both APIs check, render, constrain and parse tools the same way.

    Responses (flat)                                   Chat Completions (nested)
    {"type": "function", "name", "description",        {"type": "function", "function":
     "parameters", "strict"}                             {"name", "description", "parameters"}}
    tool_choice {"type": "function", "name": "f"}      {"type": "function", "function": {"name"}}

`tool_choice` is read by hand, as `input` is: a pydantic union's errors name its branches, and a
client needs to hear what is wrong with the value it sent.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from chatstore.api.common.errors import bad_param
from chatstore.api.tools.protocol import (
    FUNCTION_NAME,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    ToolChoiceBody,
    ToolDef,
)
from chatstore.api.tools.request import ToolRequest, tool_request

MAX_TOOLS = 128  # as chat completions allows
CHOICES: tuple[Literal["none"], Literal["auto"], Literal["required"]] = ("none", "auto", "required")


class FunctionTool(BaseModel):
    """A function tool in the Responses API's flat shape."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat(self) -> ToolDef:
        function = FunctionDef(
            name=self.name,
            description=self.description,
            parameters=self.parameters,
            strict=self.strict,
        )
        return ToolDef(type="function", function=function)


def responses_tool_request(
    tools: list[FunctionTool] | None, choice: object, parallel: bool | None
) -> ToolRequest | None:
    """The checked tool fields (chat completions' rules: duplicate names, a choice naming a
    function not in tools, required without tools are 400s); None: no tools."""
    return tool_request([t.as_chat() for t in tools or ()], tool_choice(choice), parallel)


def tool_choice(raw: object) -> ToolChoiceBody | None:
    if raw is None:
        return None
    for choice in CHOICES:
        if raw == choice:
            return choice
    if isinstance(raw, dict) and raw.get("type") == "function":
        name = raw.get("name")
        if not isinstance(name, str) or not name:
            raise bad_param("tool_choice.name", "a function tool_choice needs the function's name")
        return NamedToolChoice(type="function", function=NamedFunction(name=name))
    raise bad_param(
        "tool_choice",
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
    )


def echo_tools(tools: list[FunctionTool] | None) -> list[dict[str, object]]:
    """The tools as the response object repeats them (OpenAI's shape, strict always said)."""
    return [{**t.model_dump(exclude_none=True), "strict": bool(t.strict)} for t in tools or ()]


def echo_choice(raw: object, tools: ToolRequest | None) -> object:
    if raw is not None:
        return raw
    return "auto" if tools is not None else "none"
