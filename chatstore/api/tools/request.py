"""A chat request's tool fields, checked: unknown or contradictory choices and tool messages
that answer no call are 400s naming the field, before anything is rendered or queued."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from chatstore.api.common.errors import bad_param
from chatstore.api.tools.protocol import (
    FunctionDef,
    NamedToolChoice,
    ToolChatMessage,
    ToolChoiceBody,
    ToolDef,
)

Mode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolRequest:
    """What the request asks of tools: the functions, how the model may use them."""

    functions: tuple[FunctionDef, ...]
    mode: Mode = "auto"
    named: str | None = None  # the function a named tool_choice requires
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none"


def tool_request(
    tools: list[ToolDef] | None, choice: ToolChoiceBody | None, parallel: bool | None
) -> ToolRequest | None:
    """The checked tool fields; None when the request has no tools (and asks for none)."""
    functions = tuple(t.function for t in tools or ())
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise bad_param("tools", "two tools share a function name")
    mode, named = _mode(choice)
    if not functions:
        if mode in ("required", "named"):
            raise bad_param("tool_choice", f"tool_choice {mode!r} needs tools")
        return None
    if named is not None and named not in names:
        raise bad_param("tool_choice", f"tool_choice names {named!r}, which is not in tools")
    return ToolRequest(functions, mode, named, True if parallel is None else parallel)


def check_tool_messages(
    messages: list[ToolChatMessage], field: str = "messages", calls: Iterable[str] = ()
) -> None:
    """Every tool message answers a call an earlier assistant message made (or one of `calls`,
    made before these messages); every call's arguments are a JSON object. A 400 names the
    field as `{field}.{i}.<name>` (just `<name>` when `field` is "": one message, sent flat)."""
    made = set(calls)
    for i, m in enumerate(messages):
        for j, call in enumerate(m.tool_calls or ()):
            if m.role != "assistant":
                raise bad_param(_at(field, i, "tool_calls"), "only assistant messages make calls")
            where = _at(field, i, f"tool_calls.{j}.function.arguments")
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError:
                raise bad_param(where, "arguments are not valid JSON") from None
            if not isinstance(arguments, dict):
                raise bad_param(where, "arguments must be a JSON object")
            made.add(call.id)
        if m.role == "tool":
            if m.tool_call_id is None:
                raise bad_param(_at(field, i, "tool_call_id"), "a tool message needs tool_call_id")
            if m.tool_call_id not in made:
                raise bad_param(
                    _at(field, i, "tool_call_id"),
                    f"{m.tool_call_id[:64]!r} answers no tool call of an earlier message",
                )


def _at(field: str, index: int, name: str) -> str:
    return f"{field}.{index}.{name}" if field else name


def _mode(choice: ToolChoiceBody | None) -> tuple[Mode, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, NamedToolChoice):
        return "named", choice.function.name
    return choice, None
