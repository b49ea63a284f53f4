"""A reply with tools as OpenAI sends it: `message.tool_calls` (non-streamed), or `delta`s
(streamed) the way the official client accumulates them: per call, a first delta with its
index, id, type and name (arguments ""), then its arguments in pieces under the same index."""

from __future__ import annotations

import uuid

from chatstore.api.common.replies import ChoiceMessage
from chatstore.api.tools.formats import ToolFormat
from chatstore.api.tools.protocol import ToolCall
from chatstore.api.tools.streaming import CallDone, StreamEvent, ToolStreamParser, parse_reply

ARGUMENT_PIECE = 8  # characters of arguments per streamed delta


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def reply_message(text: str, fmt: ToolFormat, parallel: bool) -> tuple[ChoiceMessage, bool]:
    """The choice's `message` for a finished reply, and whether it calls tools."""
    parsed = parse_reply(text, fmt)
    calls = parsed.calls if parallel else parsed.calls[:1]
    if not calls:
        return {"role": "assistant", "content": parsed.content}, False
    bodies = [_call_body(c, call_id()) for c in calls]
    content = parsed.content if parsed.content.strip() else None
    return {"role": "assistant", "content": content, "tool_calls": bodies}, True


class ToolDeltas:
    """One sample's streamed reply, as OpenAI `delta` objects."""

    def __init__(self, fmt: ToolFormat, parallel: bool) -> None:
        self._parser = ToolStreamParser(fmt)
        self._parallel = parallel
        self.calls = 0  # calls sent so far: the finish reason is "tool_calls" when > 0

    def feed(self, text: str) -> list[dict[str, object]]:
        return self._deltas(self._parser.feed(text)) if text else []

    def finish(self) -> list[dict[str, object]]:
        return self._deltas(self._parser.finish())

    def _deltas(self, events: list[StreamEvent]) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for event in events:
            if not isinstance(event, CallDone):
                if event.text:
                    out.append({"content": event.text})
            elif self._parallel or self.calls == 0:
                out.extend(_call_deltas(event.call, self.calls))
                self.calls += 1
        return out


def _call_deltas(call: ToolCall, index: int) -> list[dict[str, object]]:
    head = {"index": index, **_call_body(call._replace(arguments=""), call_id())}
    deltas: list[dict[str, object]] = [{"tool_calls": [head]}]
    for at in range(0, len(call.arguments), ARGUMENT_PIECE):
        piece = call.arguments[at : at + ARGUMENT_PIECE]
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
    return deltas


def _call_body(call: ToolCall, id_: str) -> dict[str, object]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": id_, "type": "function", "function": function}
