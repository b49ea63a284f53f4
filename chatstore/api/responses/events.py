"""Server-sent events of a streamed response, numbered, as OpenAI frames them:

    event: response.output_text.delta
    data: {"type": "response.output_text.delta", "sequence_number": 4, "delta": "Hi", …}

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added                          one write, before the first token
    response.output_text.delta …                         one write per token delta
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed | response.incomplete             one write, once the response is kept
    response.failed (generation failed) | error (the reply could not be kept)

With tools the model may call (stream.py), the message item opens at the reply's first text,
and each call, once parsed, is one write:

    response.output_item.added (function_call, arguments "")
    response.function_call_arguments.delta …  response.function_call_arguments.done
    response.output_item.done (function_call, completed)

A delta is framed by concatenation around the one JSON-encoded string it carries: a stream
writes one per token, and a dict built and encoded per token costs the event loop more than the
rest of the frame.
"""

from __future__ import annotations

import json

from chatstore.api.common.errors import APIError
from chatstore.api.openai.logprobs import LogprobEntry
from chatstore.api.responses.body import MessageItem, ResponseHead, message_item, output_text
from chatstore.api.responses.output import function_call_item
from chatstore.api.tools.protocol import ToolCall
from chatstore.api.tools.replies import ARGUMENT_PIECE

_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
DELTA = "response.output_text.delta"
FINAL = {"completed": "response.completed", "incomplete": "response.incomplete"}


class ResponseEvents:
    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.sequence = 0
        self._at(0)

    def _at(self, output_index: int) -> None:
        """Where the message item sits in the output (0 unless calls came first)."""
        self._message_index = output_index
        self._where = (
            f'"item_id":{_ENCODE(self.head.item_id)},"output_index":{output_index},'
            '"content_index":0'
        )
        self._delta_prefix = f'event: {DELTA}\ndata: {{"type":"{DELTA}",{self._where},'

    def event(self, kind: str, **fields: object) -> bytes:
        return self._frame(kind, "," + _ENCODE(fields)[1:-1] if fields else "")

    def delta(self, text: str, logprobs: list[LogprobEntry] | None = None) -> bytes:
        n = self.sequence
        self.sequence += 1
        entries = _ENCODE(logprobs) if logprobs else "[]"
        return (
            f'{self._delta_prefix}"logprobs":{entries},"sequence_number":{n},'
            f'"delta":{_ENCODE(text)}}}\n\n'
        ).encode()

    def opening(self) -> bytes:
        """The events before the first token (the response object encoded once for two)."""
        return self.started() + self.message_added(0)

    def started(self) -> bytes:
        started = f',"response":{_ENCODE(self.head.body())}'
        return self._frame("response.created", started) + self._frame(
            "response.in_progress", started
        )

    def message_added(self, output_index: int) -> bytes:
        """The message item opens (its empty text part with it) at `output_index`."""
        self._at(output_index)
        item = message_item(self.head.item_id, None, "in_progress")
        return self.event(
            "response.output_item.added", output_index=output_index, item=item
        ) + self._part("response.content_part.added", "")

    def function_call(self, output_index: int, call: ToolCall, item_id: str) -> bytes:
        """A parsed call, whole: added, its arguments in pieces (as chat completions streams
        them), done."""
        where = {"item_id": item_id, "output_index": output_index}
        added = function_call_item(call._replace(arguments=""), item_id, "in_progress")
        frames = [self.event("response.output_item.added", output_index=output_index, item=added)]
        for at in range(0, len(call.arguments), ARGUMENT_PIECE):
            piece = call.arguments[at : at + ARGUMENT_PIECE]
            frames.append(
                self.event("response.function_call_arguments.delta", **where, delta=piece)
            )
        frames.append(
            self.event(
                "response.function_call_arguments.done",
                **where,
                name=call.name,
                arguments=call.arguments,
            )
        )
        item = function_call_item(call, item_id)
        frames.append(self.event("response.output_item.done", output_index=output_index, item=item))
        return b"".join(frames)

    def closing(self, message: MessageItem, status: str, response_json: str) -> bytes:
        """The events after the last token, ending with the finished response (given as its
        message item, its status and its JSON, which the final event carries as is)."""
        return self.message_done(message) + self.final(status, response_json)

    def message_done(self, item: MessageItem) -> bytes:
        part = item["content"][0]
        text = part["text"]
        done = f',{self._where},"text":{_ENCODE(text)},"logprobs":{_ENCODE(part["logprobs"])}'
        index = self._message_index
        return b"".join(
            (
                self._frame("response.output_text.done", done),
                self._frame("response.content_part.done", f',{self._where},"part":{_ENCODE(part)}'),
                self.event("response.output_item.done", output_index=index, item=item),
            )
        )

    def final(self, status: str, response_json: str) -> bytes:
        return self._frame(FINAL[status], f',"response":{response_json}')

    def failed(self, response: dict[str, object]) -> bytes:
        return self.event("response.failed", response=response)

    def error(self, exc: APIError) -> bytes:
        return self.event("error", code=exc.code, message=exc.message, param=exc.param)

    def _part(self, kind: str, text: str) -> bytes:
        return self._frame(kind, f',{self._where},"part":{_ENCODE(output_text(text))}')

    def _frame(self, kind: str, fields: str) -> bytes:
        """One event; `fields`: its JSON members after type and sequence_number (a leading
        comma each), already encoded."""
        n = self.sequence
        self.sequence += 1
        return (
            f'event: {kind}\ndata: {{"type":"{kind}","sequence_number":{n}{fields}}}\n\n'.encode()
        )
