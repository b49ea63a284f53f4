"""Server-sent events of a streamed response, numbered, as OpenAI frames them:

    event: response.output_text.delta
    data: {"type": "response.output_text.delta", "sequence_number": 4, "delta": "Hi", …}

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added                          one write, before the first token
    response.output_text.delta …                         one write per token delta
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed | response.incomplete             one write, once the response is kept
    response.failed (generation failed) | error (the reply could not be kept)

A delta is framed by concatenation around the one JSON-encoded string it carries: a stream
writes one per token, and a dict built and encoded per token costs the event loop more than the
rest of the frame.
"""

from __future__ import annotations

import json
from typing import Any

from chatstore.api.common.errors import APIError
from chatstore.api.responses.body import ResponseHead, message_item, output_text

_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
DELTA = "response.output_text.delta"
FINAL = {"completed": "response.completed", "incomplete": "response.incomplete"}


class ResponseEvents:
    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.sequence = 0
        self._where = f'"item_id":{_ENCODE(head.item_id)},"output_index":0,"content_index":0'
        self._delta_prefix = (
            f'event: {DELTA}\ndata: {{"type":"{DELTA}",{self._where},"logprobs":[],'
        )

    def event(self, kind: str, **fields: Any) -> bytes:
        return self._frame(kind, "," + _ENCODE(fields)[1:-1] if fields else "")

    def delta(self, text: str) -> bytes:
        n = self.sequence
        self.sequence += 1
        return f'{self._delta_prefix}"sequence_number":{n},"delta":{_ENCODE(text)}}}\n\n'.encode()

    def opening(self) -> bytes:
        """The events before the first token (the response object encoded once for two)."""
        started = f',"response":{_ENCODE(self.head.body())}'
        item = message_item(self.head.item_id, None, "in_progress")
        return b"".join(
            (
                self._frame("response.created", started),
                self._frame("response.in_progress", started),
                self.event("response.output_item.added", output_index=0, item=item),
                self._part("response.content_part.added", ""),
            )
        )

    def closing(self, response: dict[str, Any], response_json: str) -> bytes:
        """The events after the last token, ending with the finished response (given as its
        object and that object's JSON, which the final event carries as is)."""
        item = response["output"][0]
        text = item["content"][0]["text"]
        done = f',{self._where},"text":{_ENCODE(text)},"logprobs":[]'
        return b"".join(
            (
                self._frame("response.output_text.done", done),
                self._part("response.content_part.done", text),
                self.event("response.output_item.done", output_index=0, item=item),
                self._frame(FINAL[response["status"]], f',"response":{response_json}'),
            )
        )

    def failed(self, response: dict[str, Any]) -> bytes:
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
