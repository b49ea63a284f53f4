"""Where a response's turn runs: a chain of responses is a session under the hood.

    resp_1 ── resp_2 ── resp_3           session S: its record holds the conversation through
       │                                 resp_3, its stored KV the tokens of that conversation
       └──── resp_4 (previous = resp_1)  a fork: S has moved on, so resp_4 opens a new session
                                         (the engine's prefix cache still serves the shared
                                         prefix while it is on the device)

The prompt is always built from the previous response's own record (its conversation, stored
whole), never from the session: the session only decides which KV is reused. A response
continues its chain's session when that session's messages are exactly the conversation so far
(instructions included: OpenAI does not carry instructions over, so new instructions fork);
otherwise - a fork, a session continued or edited through another API, deleted or expired - the
turn runs in a new session, and the result is the same text either way.

A conversation with tools (the request's, or function_call items in it) is rendered as chat
completions renders the same chat (api/tools/rendering.py); the session's record holds that
rendered form, so the comparison is between renderings.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatstore.api.chat.service import new_session_id, plain
from chatstore.api.common.chat_template import Message, RichPrompt
from chatstore.api.common.errors import APIError
from chatstore.api.responses.items import Item, check_outputs, is_tool_item, tool_messages
from chatstore.api.responses.store import ResponseStore
from chatstore.api.tools.formats import ToolFormat
from chatstore.api.tools.rendering import ToolPrompt, render_tools
from chatstore.api.tools.request import ToolRequest
from chatstore.store.ports import SessionKVAdmin


@dataclass(frozen=True)
class ChainTurn:
    messages: list[Message]  # what the model reads: instructions, the conversation, the input
    items: list[Item]  # the conversation through the new input (no instructions)
    session_id: str
    continues: bool  # the previous response's own session, whose KV matches as is
    rich: RichPrompt | None = None  # a template with its own tool support renders this


@dataclass(frozen=True)
class ToolRendering:
    """The request's tools (None: none) and the model's tool format (api/tools/formats.py)."""

    tools: ToolRequest | None
    fmt: ToolFormat

    def render(self, conversation: list[Item]) -> ToolPrompt:
        """Plain role/content messages when nothing in the chat is about tools (as before
        tools existed here); else chat completions' rendering of the same chat."""
        if self.tools is None and not any(is_tool_item(i) for i in conversation):
            return ToolPrompt(plain(conversation), None)
        return render_tools(tool_messages(conversation), self.tools, self.fmt)


def plan_turn(
    store: SessionKVAdmin,
    tenant: str,
    previous_id: str | None,
    instructions: str | None,
    new_items: list[Item],
    keep: bool,
    rendering: ToolRendering,
) -> ChainTurn:
    """The turn of a new response (blocking: reads records; one worker thread hop for both).
    keep=False (store=false): a session of its own, to be deleted after the turn. 404 when
    the previous response is unknown (or another tenant's); 400 for a function_call_output
    that answers no call."""
    previous = None
    if previous_id is not None:
        previous = ResponseStore(store).get(tenant, previous_id)
        if previous is None:
            raise APIError(
                404,
                f"previous response {previous_id} not found",
                param="previous_response_id",
                code="not_found",
            )
    head = [{"role": "system", "content": instructions}] if instructions else []
    history = previous.items if previous is not None else []
    check_outputs(history, new_items)
    items = [*history, *new_items]
    prompt = rendering.render([*head, *items])
    messages = prompt.messages
    if keep and previous is not None:
        record = store.get(tenant, previous.session_id)
        so_far = rendering.render([*head, *history]).messages
        if record is not None and plain(record.messages) == so_far:
            return ChainTurn(messages, items, previous.session_id, True, prompt.rich)
    return ChainTurn(messages, items, new_session_id(), False, prompt.rich)
