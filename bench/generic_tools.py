"""The generic tool form, rendered by the client: for a peer whose model's chat template knows no
tools (vLLM serving the embedded SmolLM2, whose template drops `tools=`).

chatstore renders such a conversation server-side the way llama.cpp's server does
(`chatstore.api.tools.rendering`: the tools' schemas and the answer's JSON form in the system
message, calls and results as JSON messages) and constrains the answer with xgrammar to
`chatstore.api.tools.schema.answer_schema`. `generic_request` does both on the client, with the
same functions, so the peer gets the same messages (hence the same prompt tokens) and decodes
under the same schema, sent as a strict `response_format`; `answer_calls` reads the calls back
from the answer's JSON. Without it the peer's prompt lacked the schemas and its own guided
decoding for `tool_choice: required` (a JSON list of calls, whitespace allowed) ran replies to
max_tokens: not the same work.
"""

from __future__ import annotations

import json

from chatstore.api.tools.formats import ToolFormat
from chatstore.api.tools.protocol import FunctionDef, ToolChatMessage
from chatstore.api.tools.rendering import render_tools
from chatstore.api.tools.request import Mode, ToolRequest
from chatstore.api.tools.schema import answer_schema

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


def generic_request(body: dict) -> dict:
    """`body` (a chat completion with `tools`, a string `tool_choice`) as the generic form: its
    messages rendered, no tool fields, the answer constrained by `response_format`."""
    choice = body.get("tool_choice", "auto")
    if choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice {choice!r}: only none / auto / required are rendered here")
    mode: Mode = choice
    functions = tuple(FunctionDef.model_validate(t["function"]) for t in body["tools"])
    tools = ToolRequest(functions, mode, None, bool(body.get("parallel_tool_calls", True)))
    messages = [ToolChatMessage.model_validate(m) for m in body["messages"]]
    out = {k: v for k, v in body.items() if k not in TOOL_FIELDS}
    out["messages"] = render_tools(messages, tools, ToolFormat.GENERIC).messages
    if mode != "none":
        schema = {"name": "tool_answer", "schema": answer_schema(tools), "strict": True}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    return out


def answer_calls(text: str, id_prefix: str) -> list[dict[str, str]]:
    """The calls of a generic answer (`{"tool_call": C}` or `{"tool_calls": [C, ...]}`), as a
    stream's tool_calls accumulate (id, name, arguments as JSON text); [] for any other text."""
    try:
        answer = json.loads(text)
    except ValueError:
        return []
    if not isinstance(answer, dict):
        return []
    found = answer.get("tool_calls") or ([answer["tool_call"]] if "tool_call" in answer else [])
    calls = []
    for n, call in enumerate(found if isinstance(found, list) else []):
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = json.dumps(call.get("arguments"), ensure_ascii=False)
            calls.append({"id": f"{id_prefix}-{n}", "name": call["name"], "arguments": arguments})
    return calls
