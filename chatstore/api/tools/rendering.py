"""A conversation with tools -> what the chat template renders, and its plain form for the
session record.

Native formats (hermes, mistral, llama3): the template renders tools and calls itself; it
gets the messages with `tool_calls` (arguments as objects, as HF templates expect) and `tool`
messages with `tool_call_id` and the function's name, and the schemas as `tools=` (also under
tool_choice "none", as vLLM does, so an agent's prompt prefix does not change with the choice).

Generic (a template that knows no tools), llama.cpp's approach: the schemas and the answer's
JSON form go into the system message, a call in the history is the JSON object the model was
asked to write, a tool's result is a user message `{"tool_response": ...}`, and while tools are
on a plain assistant reply is shown as the `{"response": ...}` it was asked to write. Under
tool_choice "none" the tools are left out and the chat is plain.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from chatstore.api.common.chat_template import Message, RichPrompt
from chatstore.api.tools.formats import ToolFormat
from chatstore.api.tools.protocol import FunctionDef, ToolCallBody, ToolChatMessage
from chatstore.api.tools.request import ToolRequest


class ToolPrompt(NamedTuple):
    messages: list[Message]  # plain role/content: the record, and the generic prompt
    rich: RichPrompt | None  # native formats: what the template renders


def render_tools(
    messages: list[ToolChatMessage], tools: ToolRequest | None, fmt: ToolFormat
) -> ToolPrompt:
    names = {c.id: c.function.name for m in messages for c in m.tool_calls or ()}
    if fmt.native:
        rich = RichPrompt([_native(m, names) for m in messages], _schemas(tools))
        return ToolPrompt([_generic(m, names, wrap=False) for m in messages], rich)
    active = tools is not None and tools.mode != "none"
    plain = [_generic(m, names, wrap=active) for m in messages]
    if active:
        assert tools is not None
        plain = _with_instructions(plain, instructions(tools))
    return ToolPrompt(plain, None)


def instructions(tools: ToolRequest) -> str:
    """The generic form's system text: the schemas, then the JSON the answer must be."""
    schemas = "\n".join(json.dumps(_schema(f), ensure_ascii=False) for f in tools.functions)
    call = '{"tool_call": {"name": "<tool name>", "arguments": {<its arguments>}}}'
    several = '{"tool_calls": [{"name": "<tool name>", "arguments": {...}}, ...]}'
    if tools.mode == "named":
        call = call.replace("<tool name>", str(tools.named))
        only = f"Answer by calling {tools.named} with this JSON object only:"
        return f"{_LIST}\n{schemas}\n\n{only}\n{call}"
    forms = [f"a tool call:\n{call}"]
    if tools.parallel:
        forms.append(f"several tool calls:\n{several}")
    if tools.mode == "auto":
        forms.append('your reply to the user:\n{"response": "<your reply>"}')
    return f"{_LIST}\n{schemas}\n\n{_ANSWER}\n" + "\nor ".join(forms)


_LIST = "You can call these tools (JSON schemas):"
_ANSWER = "Answer with one JSON object and nothing else, either"


def _with_instructions(messages: list[Message], text: str) -> list[Message]:
    if messages and messages[0]["role"] == "system":
        head = messages[0]["content"]
        return [{"role": "system", "content": f"{head}\n\n{text}" if head else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _generic(m: ToolChatMessage, names: dict[str, str], wrap: bool) -> Message:
    role = "system" if m.role == "developer" else m.role
    if m.role == "tool":
        name = names.get(m.tool_call_id or "", "")
        result = {"tool_response": {"name": name, "content": m.text()}}
        return {"role": "user", "content": json.dumps(result, ensure_ascii=False)}
    if m.role == "assistant" and m.tool_calls:
        calls = [_call_object(c) for c in m.tool_calls]
        value = {"tool_call": calls[0]} if len(calls) == 1 else {"tool_calls": calls}
        return {"role": role, "content": json.dumps(value, ensure_ascii=False)}
    if m.role == "assistant" and wrap:
        return {"role": role, "content": json.dumps({"response": m.text()}, ensure_ascii=False)}
    return {"role": role, "content": m.text()}


def _native(m: ToolChatMessage, names: dict[str, str]) -> dict[str, object]:
    out: dict[str, object] = {"role": "system" if m.role == "developer" else m.role}
    out["content"] = m.text()
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": _call_object(c)} for c in m.tool_calls
        ]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
        out["name"] = names.get(m.tool_call_id or "", "")
    return out


def _call_object(call: ToolCallBody) -> dict[str, object]:
    """{"name", "arguments": object} (request.py checked the arguments are a JSON object)."""
    return {"name": call.function.name, "arguments": json.loads(call.function.arguments)}


def _schemas(tools: ToolRequest | None) -> list[dict[str, object]] | None:
    if tools is None:
        return None
    return [{"type": "function", "function": _schema(f)} for f in tools.functions]


def _schema(function: FunctionDef) -> dict[str, object]:
    return function.model_dump(exclude_none=True, exclude={"strict"})
