"""Tool messages in server-side sessions: a turn's tools and new messages (a user message, or the
results of the calls the last reply made), the stored history read back as chat completions'
tool messages and rendered as chat completions renders them (api/tools/rendering.py), and the
reply kept with its calls.

What the session's record keeps (GET /v1/sessions/{id} returns it, less `tools_key`):

    {"role": "user", "content"}
    {"role": "assistant", "content": "", "tool_calls": [{"id", "type", "function": {"name",
     "arguments"}}], "tools_key"}                      a reply that calls tools
    {"role": "tool", "content", "tool_call_id"}        a call's result

A reply made with tools keeps the key of the rendering they asked for (`tools_key`: the generic
form's instructions, or the native schemas). The next turn continues the session's saved token
ids verbatim (ChatTemplate.continue_ids: the reply's tokens as the model wrote them, whatever
form its JSON took) when it renders the history the same way, that is, asks for the same tools;
other tools (or another tool_choice, in the generic form, whose instructions say what is
allowed) render the conversation afresh, and the store reuses the longest prefix it holds.
A template with its own tool support (native formats) is rendered whole every turn.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from chatstore.api.chat.turn import Turn
from chatstore.api.common.chat_template import ChatTemplate, Message
from chatstore.api.tools.formats import ToolFormat
from chatstore.api.tools.protocol import ToolChatMessage
from chatstore.api.tools.rendering import instructions, render_tools
from chatstore.api.tools.replies import reply_message
from chatstore.api.tools.request import ToolRequest, check_tool_messages
from chatstore.api.tools.streaming import ContentDelta, StreamEvent, ToolStreamParser

TOOLS_KEY = "tools_key"  # on a stored reply: the rendering its tools asked for
SHOWN = ("role", "content", "tool_calls", "tool_call_id")  # what clients see of a message

StoredMessage = dict[str, object]


@dataclass(frozen=True)
class ToolTurn:
    """A session turn's new messages (user and tool results) and the tools it offers."""

    new: tuple[ToolChatMessage, ...]
    tools: ToolRequest | None
    fmt: ToolFormat
    field: str = "messages"  # how the request named its new messages (400s name it)

    @property
    def key(self) -> str:
        """What the history's rendering depends on ("" with no tools the prompt shows)."""
        if self.tools is None:
            return ""
        if self.fmt.native:
            shown = json.dumps([f.model_dump() for f in self.tools.functions], sort_keys=True)
        elif self.tools.mode == "none":
            return ""
        else:
            shown = instructions(self.tools)
        return hashlib.sha256(f"{self.fmt.value}\n{shown}".encode()).hexdigest()[:24]

    @property
    def parses_calls(self) -> bool:
        return self.tools is not None and self.tools.parses_calls

    def reply(self) -> ToolReply:
        parser = ToolStreamParser(self.fmt) if self.parses_calls else None
        return ToolReply([stored(m) for m in self.new], self.reply_of(), parser)

    def reply_of(self) -> Callable[[str], StoredMessage]:
        """The reply as the record keeps it: its calls read out when the model may call."""
        key, fmt = self.key, self.fmt
        parallel = self.tools is not None and self.tools.parallel
        parses = self.parses_calls

        def reply(text: str) -> StoredMessage:
            out: StoredMessage = {"role": "assistant", "content": text}
            if parses:
                message, called = reply_message(text, fmt, parallel)
                out["content"] = message["content"] or ""
                if called:
                    out["tool_calls"] = message["tool_calls"]
            if key:
                out[TOOLS_KEY] = key
            return out

        return reply


@dataclass
class ToolReply:
    """What a session turn with tools keeps (in its Turn's log, under "tools"): its new
    messages, how the reply is kept, and the reply once kept (by the turn's save)."""

    new_messages: list[StoredMessage]
    reply_of: Callable[[str], StoredMessage]
    parser: ToolStreamParser | None  # the model may call: calls are held out of the stream
    kept: StoredMessage | None = None

    def visible(self, text: str) -> str:
        """Of the first sample's streamed text, what is reply text (calls come whole, in the
        reply's message; the generic form's {"response": ...} comes unwrapped, at the end)."""
        return text if self.parser is None else _content(self.parser.feed(text))

    def visible_rest(self) -> str:
        return "" if self.parser is None else _content(self.parser.finish())

    def keep(self, text: str) -> list[StoredMessage]:
        """The messages the turn appends to the record: its new ones, then the reply."""
        self.kept = self.reply_of(text)
        return [*self.new_messages, self.kept]

    def message(self, text: str) -> StoredMessage:
        """The reply as clients see it: the one kept, else read from `text` (a reply that
        was not kept, an aborted one)."""
        return shown(self.kept if self.kept is not None else self.reply_of(text))


def _content(events: list[StreamEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, ContentDelta))


def tool_reply(turn: Turn) -> ToolReply | None:
    found = turn.log.get("tools")
    return found if isinstance(found, ToolReply) else None


class ToolPromptParts(NamedTuple):
    messages: list[Message]  # the whole conversation in plain role/content form
    prompt: list[int]
    tail: int  # tokens of the prompt the new messages add (what truncation must keep)


def has_tool_parts(messages: list[dict[str, object]]) -> bool:
    """The stored conversation has calls, results or a reply made with tools."""
    return any(m.get("tool_calls") or m.get("role") == "tool" or m.get(TOOLS_KEY) for m in messages)


def shown(message: dict[str, object]) -> dict[str, object]:
    """A stored message as clients see it."""
    return {k: message[k] for k in SHOWN if k in message}


def stored(m: ToolChatMessage) -> StoredMessage:
    out: StoredMessage = {"role": "system" if m.role == "developer" else m.role}
    out["content"] = m.text()
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
    return out


def history_of(messages: list[dict[str, object]]) -> list[ToolChatMessage]:
    return [ToolChatMessage.model_validate(shown(m)) for m in messages]


def render_turn(
    turn: ToolTurn,
    chat: ChatTemplate,
    stored_messages: list[dict[str, object]],
    history_ids: list[int] | None,
) -> ToolPromptParts:
    """The turn's prompt: the stored history and the new messages through the tools'
    rendering; `history_ids` (the saved ids and the last sampled token, when the record holds
    them exactly) are continued verbatim if the last reply was made with the same tools."""
    history = history_of(stored_messages)
    calls = {c.id for m in history for c in m.tool_calls or ()}
    check_tool_messages(list(turn.new), turn.field, calls)
    rendered = render_tools([*history, *turn.new], turn.tools, turn.fmt)
    split = len(rendered.messages) - len(turn.new)
    old, new = rendered.messages[:split], rendered.messages[split:]
    if rendered.rich is not None:  # native: the template renders calls itself, whole
        prompt = chat.render_rich(rendered.rich)
        return ToolPromptParts(rendered.messages, prompt, len(chat.render(new)))
    last = stored_messages[-1] if stored_messages else {}
    same_tools = last.get(TOOLS_KEY, "") == turn.key
    if history_ids is not None and same_tools:
        prompt = chat.continue_ids(history_ids, old, new)
        return ToolPromptParts(rendered.messages, prompt, len(prompt) - len(history_ids) + 1)
    return ToolPromptParts(rendered.messages, chat.render(old + new), len(chat.render(new)))
