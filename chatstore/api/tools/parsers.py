"""The calls in a piece of model output, per format (formats.py). Each function takes one
segment the stream parser (streaming.py) has cut out and returns its calls, or None when the
segment is not valid calls (it is then the reply's text, as written).

    hermes   one <tool_call> block's body:   {"name": "f", "arguments": {...}}
    llama3   the whole reply:                {"name": "f", "parameters": {...}}; {...}
    mistral  what follows [TOOL_CALLS]:      [{"name": "f", "arguments": {...}}, ...]
    generic  the whole reply:                {"tool_call": {...}} | {"tool_calls": [...]}
                                             | {"response": "..."}

Without constrained decoding nothing forces a model to write these: a reply that is not
valid calls stays text, and a call to an unknown function is returned as the model wrote it.
"""

from __future__ import annotations

import json

from chatstore.api.tools.protocol import ParsedReply, ToolCall

_DECODER = json.JSONDecoder()


def hermes_block(body: str) -> ToolCall | None:
    value = _whole_json(body)
    return _call(value, "arguments") if value is not None else None


def llama3_calls(text: str) -> tuple[ToolCall, ...] | None:
    """One or more JSON objects, separated by ";" (what Llama 3.1+ writes after
    <|python_tag|>, or bare)."""
    values = _json_sequence(text, separator=";")
    if not values:
        return None
    calls = [_call(v, "parameters") or _call(v, "arguments") for v in values]
    return None if any(c is None for c in calls) else tuple(c for c in calls if c is not None)


def mistral_calls(text: str) -> tuple[ToolCall, ...] | None:
    value = _whole_json(text)
    return _calls(value) if isinstance(value, list) else None


def generic_reply(text: str) -> ParsedReply | None:
    value = _whole_json(text)
    if not isinstance(value, dict) or len(value) != 1:
        return None
    if "tool_call" in value:
        call = _call(value["tool_call"], "arguments")
        return None if call is None else ParsedReply("", (call,))
    if "tool_calls" in value:
        calls = _calls(value["tool_calls"])
        return None if calls is None else ParsedReply("", calls)
    if "response" in value:
        reply = value["response"]
        return ParsedReply(reply if isinstance(reply, str) else json.dumps(reply))
    return None


def _calls(value: object) -> tuple[ToolCall, ...] | None:
    if not isinstance(value, list) or not value:
        return None
    calls = [_call(v, "arguments") for v in value]
    return None if any(c is None for c in calls) else tuple(c for c in calls if c is not None)


def _call(value: object, arguments_key: str) -> ToolCall | None:
    """{"name": str, <arguments_key>: object or JSON text of one} -> ToolCall."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if set(value) - {"name", arguments_key, "id", "type"}:
        return None
    arguments = value.get(arguments_key, {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _whole_json(text: str) -> object:
    """The one JSON value `text` holds (surrounding whitespace allowed), else None."""
    values = _json_sequence(text, separator=None)
    return values[0] if values is not None and len(values) == 1 else None


def _json_sequence(text: str, separator: str | None) -> list[object] | None:
    """JSON values back to back (with `separator` between them), nothing else; else None."""
    values: list[object] = []
    at, end = 0, len(text)
    while True:
        at = _skip_space(text, at)
        try:
            value, at = _DECODER.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)
        at = _skip_space(text, at)
        if at == end:
            return values
        if separator is None or text[at] != separator:
            return None
        at += 1


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at
