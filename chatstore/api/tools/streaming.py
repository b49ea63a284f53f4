"""Model output, as it streams, split into reply text and complete tool calls.

Text that cannot be part of a call goes out at once; what may be one is held:

    hermes    text streams; "<tool_call>" ... "</tool_call>" is held, then one call (or, if
              its body is not a call, that block as text); a partial "<tool_ca" is held until
              the next piece says which
    mistral   text streams; from "[TOOL_CALLS]" (or a reply opening with "[") to the end is held
    llama3    a reply opening with "{" (or <|python_tag|>) is held to the end: calls or text
    generic   a reply opening with "{" is held to the end: calls, a response, or text

`parse_reply(text)` is the same machine fed the whole text at once, so a streamed reply adds
up to exactly what the non-streamed one says, however the text was cut.
"""

from __future__ import annotations

from typing import NamedTuple

from chatstore.api.tools import parsers
from chatstore.api.tools.formats import ToolFormat
from chatstore.api.tools.protocol import ParsedReply, ToolCall

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"


class ContentDelta(NamedTuple):
    text: str


class CallDone(NamedTuple):
    call: ToolCall


StreamEvent = ContentDelta | CallDone


class ToolStreamParser:
    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._buf = ""  # text not decided yet
        self._state = "text" if fmt is ToolFormat.HERMES else "start"

    def feed(self, text: str) -> list[StreamEvent]:
        self._buf += text
        events: list[StreamEvent] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[StreamEvent]:
        """The end of the reply: decide everything still held."""
        buf, state, self._buf = self._buf, self._state, ""
        if state == "block":
            call = parsers.hermes_block(buf)
            return [CallDone(call)] if call else [ContentDelta(HERMES_OPEN + buf)]
        if state == "held":
            return self._held(buf)
        return [ContentDelta(buf)] if buf else []

    # -- one decision at a time: True while there is more to decide ------------------------

    def _step(self, events: list[StreamEvent]) -> bool:
        if self._state == "start":
            return self._start()
        if self._state == "text":
            return self._text(events)
        if self._state == "block":
            return self._block(events)
        return False  # held: nothing is decided before the end

    def _start(self) -> bool:
        head = self._buf.lstrip()
        if not head:
            return False
        opener = "[" if self.fmt is ToolFormat.MISTRAL else "{"
        if head.startswith((opener, PYTHON_TAG, MISTRAL_MARK)):
            self._state = "held"
            return False
        if PYTHON_TAG.startswith(head) or MISTRAL_MARK.startswith(head):
            return False  # may still become a marker
        self._state = "text"
        return True

    def _text(self, events: list[StreamEvent]) -> bool:
        marker = {ToolFormat.HERMES: HERMES_OPEN, ToolFormat.MISTRAL: MISTRAL_MARK}.get(self.fmt)
        if marker is None:
            self._emit(events, len(self._buf))
            return False
        at = self._buf.find(marker)
        if at < 0:
            self._emit(events, len(self._buf) - _partial_suffix(self._buf, marker))
            return False
        self._emit(events, at)
        if self.fmt is ToolFormat.HERMES:
            self._buf, self._state = self._buf[len(marker) :], "block"
            return True
        self._state = "held"  # mistral: the marker and everything after it
        return False

    def _block(self, events: list[StreamEvent]) -> bool:
        at = self._buf.find(HERMES_CLOSE)
        if at < 0:
            return False
        body, self._buf = self._buf[:at], self._buf[at + len(HERMES_CLOSE) :]
        call = parsers.hermes_block(body)
        events.append(CallDone(call) if call else ContentDelta(HERMES_OPEN + body + HERMES_CLOSE))
        self._state = "text"
        return True

    def _emit(self, events: list[StreamEvent], upto: int) -> None:
        if upto > 0:
            events.append(ContentDelta(self._buf[:upto]))
            self._buf = self._buf[upto:]

    def _held(self, text: str) -> list[StreamEvent]:
        segment = text.strip()
        calls: tuple[ToolCall, ...] | None = None
        if self.fmt is ToolFormat.GENERIC:
            reply = parsers.generic_reply(segment)
            if reply is not None:
                head = [ContentDelta(reply.content)] if reply.content else []
                return head + [CallDone(c) for c in reply.calls]
        elif self.fmt is ToolFormat.LLAMA3:
            calls = parsers.llama3_calls(segment.removeprefix(PYTHON_TAG))
        elif self.fmt is ToolFormat.MISTRAL:
            calls = parsers.mistral_calls(segment.removeprefix(MISTRAL_MARK))
        if calls is None:
            return [ContentDelta(text)]
        return [CallDone(c) for c in calls]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: it may be one)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def collect(events: list[StreamEvent]) -> ParsedReply:
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    return ParsedReply(content, tuple(e.call for e in events if isinstance(e, CallDone)))


def parse_reply(text: str, fmt: ToolFormat) -> ParsedReply:
    parser = ToolStreamParser(fmt)
    return collect(parser.feed(text) + parser.finish())
