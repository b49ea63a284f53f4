"""A Responses conversation's items, as they are kept (each a flat dict of strings, the
records store's item type) and as chat completions' tool rendering reads them.

    {"role": "user" | "assistant" | "system", "content": "..."}           a message
    {"type": "function_call", "call_id", "name", "arguments"}             the model's call
    {"type": "function_call_output", "call_id", "output"}                 the tool's result

`tool_messages` turns them into chat messages exactly as a chat completions client would send
the same conversation: the calls after an assistant message (or after one another) are that
assistant message's `tool_calls`, and a call's output is a role "tool" message answering it.
So a conversation prompts the model the same through either API (api/tools/rendering.py).
"""

from __future__ import annotations

from typing import Any

from chatstore.api.common.errors import bad_param
from chatstore.api.tools.protocol import (
    FunctionCallBody,
    ToolCall,
    ToolCallBody,
    ToolChatMessage,
)

Item = dict[str, str]
FUNCTION_CALL = "function_call"
FUNCTION_CALL_OUTPUT = "function_call_output"


def is_tool_item(item: Item) -> bool:
    return item.get("type") in (FUNCTION_CALL, FUNCTION_CALL_OUTPUT)


def call_item(call: ToolCall) -> Item:
    return {"type": FUNCTION_CALL, "call_id": call.id, "name": call.name,
            "arguments": call.arguments}  # fmt: skip


def output_item(call_id: str, output: str) -> Item:
    return {"type": FUNCTION_CALL_OUTPUT, "call_id": call_id, "output": output}


def tool_messages(items: list[Item]) -> list[ToolChatMessage]:
    messages: list[ToolChatMessage] = []
    for item in items:
        kind = item.get("type")
        if kind == FUNCTION_CALL:
            call = ToolCallBody(
                id=item["call_id"],
                function=FunctionCallBody(name=item["name"], arguments=item["arguments"]),
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or ()), call]
            else:
                messages.append(
                    ToolChatMessage(role="assistant", tool_calls=[call], tool_call_id=None)
                )
        elif kind == FUNCTION_CALL_OUTPUT:
            messages.append(
                ToolChatMessage(role="tool", tool_call_id=item["call_id"], content=item["output"])
            )
        else:
            role: Any = item["role"]  # one of ROLES' values (protocol.py)
            messages.append(ToolChatMessage(role=role, content=item["content"], tool_call_id=None))
    return messages


def check_outputs(history: list[Item], new_items: list[Item]) -> None:
    """Every function_call_output of the input answers a function_call made before it (in the
    previous responses' conversation or earlier in the input): 400 naming the item."""
    calls = {item["call_id"] for item in history if item.get("type") == FUNCTION_CALL}
    for i, item in enumerate(new_items):
        if item.get("type") == FUNCTION_CALL:
            calls.add(item["call_id"])
        elif item.get("type") == FUNCTION_CALL_OUTPUT and item["call_id"] not in calls:
            raise bad_param(
                f"input.{i}.call_id",
                f"{item['call_id'][:64]!r} answers no function_call of the conversation",
            )
