"""A response streamed as server-sent events (events.py), plain or with tools.

Plain: the message item opens before the first token and each token delta is one
output_text.delta (with its tokens' logprobs when asked; a token whose text is held back, such
as the EOS, passes its entry on to the next delta, and output_text.done carries them all).

With tools the model may call, the reply goes through chat completions' stream parser
(api/tools/streaming.py): text that cannot be part of a call streams as the message's deltas
(the message item opens at the first text that is not blank), and each call goes out whole once
parsed, as a function_call item (events.py). The finished response lists the items in the
order they were streamed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from chatstore.api.chat.turn import TurnResult
from chatstore.api.common.errors import APIError
from chatstore.api.openai.logprobs import LogprobEntry
from chatstore.api.responses.body import ResponseHead, message_item, turn_status
from chatstore.api.responses.events import ResponseEvents
from chatstore.api.responses.output import ReplyForm, ReplyOutput, function_call_id
from chatstore.api.tools.protocol import ToolCall
from chatstore.api.tools.replies import call_id
from chatstore.api.tools.streaming import CallDone, StreamEvent, ToolStreamParser

if TYPE_CHECKING:
    from chatstore.api.responses.call import ResponseCall


class ToolReplyStream:
    """One reply with tools, as events, and at its end as output items."""

    def __init__(self, events: ResponseEvents, form: ReplyForm) -> None:
        self.events = events
        self.form = form
        self._parser = ToolStreamParser(form.fmt)
        self._order: list[tuple[ToolCall, str] | None] = []  # None: the message
        self._text: str | None = None  # the message's text, once it is open
        self._blank = ""  # whitespace before the message opens (its text, if it does)
        self._calls = 0
        self.done = False  # finish() was called

    def feed(self, text: str) -> bytes:
        return self._on(self._parser.feed(text)) if text else b""

    def finish(self) -> bytes:
        self.done = True
        out = self._on(self._parser.finish())
        if not self._order:  # nothing at all: an empty message, as the non-streamed reply
            out += self._open_message(self._blank)
        return out

    def output(
        self, head: ResponseHead, result: TurnResult, logprobs: list[LogprobEntry] | None
    ) -> ReplyOutput:
        reply, status = ReplyOutput(), turn_status(result)
        for entry in self._order:
            if entry is None:
                reply.add_message(message_item(head.item_id, self._text, status, logprobs))
            else:
                reply.add_call(*entry)
        return reply

    @property
    def message(self) -> bool:
        return self._text is not None

    def _on(self, parsed: list[StreamEvent]) -> bytes:
        out = []
        for event in parsed:
            if isinstance(event, CallDone):
                if self.form.parallel or self._calls == 0:
                    call, item_id = event.call._replace(id=call_id()), function_call_id()
                    out.append(self.events.function_call(len(self._order), call, item_id))
                    self._order.append((call, item_id))
                    self._calls += 1
            elif self._text is not None:
                if event.text:
                    self._text += event.text
                    out.append(self.events.delta(event.text))
            elif (self._blank + event.text).strip():
                text, self._blank = self._blank + event.text, ""
                out.append(self._open_message(text))
            else:
                self._blank += event.text
        return b"".join(out)

    def _open_message(self, text: str) -> bytes:
        self._text = text
        opened = self.events.message_added(len(self._order))
        self._order.append(None)
        return opened + (self.events.delta(text) if text else b"")


async def stream_response(call: ResponseCall) -> AsyncIterator[bytes]:
    events = ResponseEvents(call.head)
    turn = call.turn
    tools = ToolReplyStream(events, call.form) if call.form is not None else None
    try:
        if tools is None:
            yield events.opening()
        else:
            yield events.started()
        pending: list[LogprobEntry] = []  # logprobs of tokens whose text is not out yet
        async for delta in turn.deltas():
            if tools is not None:
                out = tools.feed(delta.text)
                if delta.finish_reason:
                    out += tools.finish()
                if out:
                    yield out
                continue
            if delta.logprobs:
                pending.extend(call.logprobs_of(delta.logprobs))
            if delta.text:
                yield events.delta(delta.text, pending)
                pending = []
        result = turn.result
        assert result is not None
        if result.error is not None:
            yield events.failed(call.head.finished(result, None))
            return
        if turn.save_error is not None:
            yield events.error(turn.save_error)
            return
        reply = None
        if tools is not None:
            if not tools.done:  # the engine's last delta carries the finish reason; if not
                yield tools.finish()
            reply = tools.output(call.head, result, call.result_logprobs(result))
        try:
            reply, response_json = await call.finish(result, reply)
        except APIError as exc:
            yield events.error(exc)
            return
        status = turn_status(result)  # the finished response's
        if tools is None:
            yield events.closing(reply.messages[0], status, response_json)
            return
        done = events.message_done(reply.messages[0]) if tools.message else b""
        yield done + events.final(status, response_json)
    finally:
        turn.close()
        call.discard()  # not awaited: the stream may be cancelled (client gone)
