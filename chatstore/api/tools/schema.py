"""The JSON schema of the generic form's answer (rendering.py), for constrained decoding:
what `tool_choice` allows, built from the tools' own parameter schemas.

    auto       {"tool_call": C} | {"tool_calls": [C, ...]} | {"response": string}
    required   {"tool_call": C} | {"tool_calls": [C, ...]}
    named f    {"tool_call": C_f}
    C          {"name": <one of the tools>, "arguments": <that tool's parameters>}

`tool_calls` only with parallel_tool_calls (the default). Native formats (hermes, mistral,
llama3) are not constrained: their calls sit inside free text.
"""

from __future__ import annotations

from chatstore.api.tools.protocol import FunctionDef
from chatstore.api.tools.request import ToolRequest


def answer_schema(tools: ToolRequest) -> dict[str, object]:
    functions = [f for f in tools.functions if tools.mode != "named" or f.name == tools.named]
    call: dict[str, object] = {"anyOf": [_call(f) for f in functions]}
    forms = [_object("tool_call", call)]
    if tools.parallel and tools.mode != "named":
        forms.append(_object("tool_calls", {"type": "array", "items": call, "minItems": 1}))
    if tools.mode == "auto":
        forms.append(_object("response", {"type": "string"}))
    return forms[0] if len(forms) == 1 else {"anyOf": forms}


def _call(function: FunctionDef) -> dict[str, object]:
    arguments = function.parameters or {"type": "object", "properties": {}}
    return _object_of({"name": {"const": function.name}, "arguments": arguments})


def _object(key: str, value: dict[str, object]) -> dict[str, object]:
    return _object_of({key: value})


def _object_of(properties: dict[str, object]) -> dict[str, object]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
