"""A finished reply as the response's output items, and as the conversation items a stored
response keeps for the next turn (items.py).

    no tools, or tool_choice "none"    one message item: the reply as the model wrote it
    tools the model may call           the reply parsed as chat completions parses it
                                       (api/tools/streaming.py): a message item for its text
                                       (when it has any), then one function_call item per call
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

from chatstore.api.chat.turn import TurnResult
from chatstore.api.openai.logprobs import LogprobEntry
from chatstore.api.responses.body import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    ResponseHead,
    message_item,
    turn_status,
)
from chatstore.api.responses.items import Item, call_item
from chatstore.api.tools.formats import ToolFormat
from chatstore.api.tools.protocol import ToolCall
from chatstore.api.tools.replies import call_id
from chatstore.api.tools.streaming import parse_reply


class ReplyForm(NamedTuple):
    """How to read calls out of a reply (a request with tools the model may call)."""

    fmt: ToolFormat
    parallel: bool


def function_call_item(call: ToolCall, item_id: str, status: str = "completed") -> FunctionCallItem:
    """OpenAI's function_call output item; `call.id` is its call_id."""
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}  # fmt: skip


def function_call_id() -> str:
    return "fc_" + uuid.uuid4().hex


@dataclass
class ReplyOutput:
    output: list[OutputItem] = field(default_factory=list)  # the response's items
    kept: list[Item] = field(default_factory=list)  # what the conversation keeps of the reply
    messages: list[MessageItem] = field(default_factory=list)  # output's message items

    def add_message(self, item: MessageItem) -> None:
        self.output.append(item)
        self.messages.append(item)
        self.kept.append({"role": "assistant", "content": item["content"][0]["text"]})

    def add_call(self, call: ToolCall, item_id: str) -> None:
        self.output.append(function_call_item(call, item_id))
        self.kept.append(call_item(call))


def reply_output(
    head: ResponseHead,
    result: TurnResult,
    form: ReplyForm | None,
    logprobs: list[LogprobEntry] | None,
) -> ReplyOutput:
    status, text = turn_status(result), result.texts[0]
    reply = ReplyOutput()
    if form is None:
        reply.add_message(message_item(head.item_id, text, status, logprobs))
        return reply
    parsed = parse_reply(text, form.fmt)
    calls = parsed.calls if form.parallel else parsed.calls[:1]
    if parsed.content.strip() or not calls:
        reply.add_message(message_item(head.item_id, parsed.content, status, logprobs))
    for call in calls:
        reply.add_call(call._replace(id=call_id()), function_call_id())
    return reply
