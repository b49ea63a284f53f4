"""A session turn's request (POST /v1/sessions/{id}/messages, or a WebSocket "message" frame) as
the turn the service opens: its new messages, its sampling, and its tools as chat completions
takes them (api/tools/request.py), the generic form's answer constrained as chat completions
constrains it (api/openai/grammar.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from functools import partial

from chatstore.api.chat.service import ChatService, TurnSpec
from chatstore.api.chat.tool_turn import ToolTurn, tool_reply
from chatstore.api.chat.turn import Turn
from chatstore.api.common.errors import bad_param
from chatstore.api.common.sampling import to_sampling
from chatstore.api.openai.grammar import grammars_for, pick_constraint
from chatstore.api.sessions.protocol import SessionMessageRequest
from chatstore.api.tools.formats import detect_format
from chatstore.api.tools.protocol import ToolChatMessage
from chatstore.api.tools.request import tool_request


async def session_turn_spec(
    body: SessionMessageRequest,
    service: ChatService,
    tenant: str,
    session_id: str,
    started: float,
    api: str,
) -> TurnSpec:
    """400s name the field: no message, an unknown tool in tool_choice, a tool result that
    answers no call (the last checked when the turn is prepared, against the history)."""
    tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
    new, field = _new_messages(body)
    sampling = to_sampling(body, service.settings.default_max_tokens)
    spec = TurnSpec(
        tenant=tenant,
        sampling=sampling,
        started=started,
        session_id=session_id,
        create_missing=False,
        api=api,
    )
    if tools is None and not field and new[0].role == "user":  # a plain user message
        return replace(spec, new_message={"role": "user", "content": new[0].text()})
    template = service.template
    fmt = detect_format(template.tokenizer.chat_template)
    if tools is not None and tools.parses_calls:
        grammars = grammars_for(template.tokenizer, service.vocab_size, template.eos_token_ids)
        pick = partial(pick_constraint, None, tools, fmt, grammars)
        constraint = await asyncio.to_thread(pick)  # the first one reads the vocabulary
        if constraint is not None:
            sampling = replace(sampling, constraint=constraint)
    return replace(spec, sampling=sampling, tool_turn=ToolTurn(tuple(new), tools, fmt, field))


def _new_messages(body: SessionMessageRequest) -> tuple[list[ToolChatMessage], str]:
    """The turn's new messages, and how the request named them ("": flat, one message)."""
    if body.messages is None:
        if body.content is None:
            raise bad_param("content", "a turn needs content (or messages)")
        if body.role == "user" and body.tool_call_id is not None:
            raise bad_param("tool_call_id", "only a tool message (role 'tool') answers a call")
        message = {"role": body.role, "content": body.content, "tool_call_id": body.tool_call_id}
        return [ToolChatMessage.model_validate(message)], ""
    if body.content is not None or body.tool_call_id is not None or body.role != "user":
        raise bad_param("messages", "give messages, or content (role, tool_call_id): not both")
    for i, m in enumerate(body.messages):
        if m.role == "user" and m.tool_call_id is not None:
            raise bad_param(f"messages.{i}.tool_call_id", "only a tool message answers a call")
    return [ToolChatMessage.model_validate(m.model_dump()) for m in body.messages], "messages"


@dataclass(frozen=True)
class ShownDelta:
    index: int  # the sample's
    text: str


async def shown_deltas(turn: Turn) -> AsyncIterator[ShownDelta]:
    """The turn's non-empty text deltas as a client is shown them: with tools the model may
    call, a call is held out (the reply's message has it) and the generic form's
    {"response": ...} comes unwrapped."""
    tools = tool_reply(turn)
    async for delta in turn.deltas():
        text = delta.text if tools is None or delta.index else tools.visible(delta.text)
        if text:
            yield ShownDelta(delta.index, text)
    rest = tools.visible_rest() if tools is not None else ""
    if rest:
        yield ShownDelta(0, rest)
