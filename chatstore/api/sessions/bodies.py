"""A session and a session turn's reply as the API returns them (routes, the WebSocket and
the admin's session table share them)."""

from __future__ import annotations

from chatstore.api.chat.service import ChatService
from chatstore.api.chat.tool_turn import shown, tool_reply
from chatstore.api.chat.turn import Turn, TurnResult
from chatstore.api.common.replies import ChoiceMessage, finish_reason, message_choices
from chatstore.api.common.usage import timings, usage_body
from chatstore.store.ports import SessionRecord


def session_info(service: ChatService, record: SessionRecord, full: bool) -> dict[str, object]:
    return {
        "id": record.session_id,
        "object": "session",
        "created_at": record.created_at,
        "updated_at": record.updated_at,
        "metadata": record.metadata,
        "num_messages": len(record.messages),
        "num_tokens": len(record.token_ids),
        "kv_location": service.store.kv_location(record.tenant, record.session_id),
        "priority": record.priority,
        "ttl_s": record.ttl_s,
        "expires_at": record.expires_at,
        "messages": [shown(m) for m in record.messages] if full else None,
    }


def reply_body(turn: Turn, result: TurnResult) -> dict[str, object]:
    choices = message_choices(result)
    message: dict[str, object] = {"role": "assistant", "content": result.texts[0]}
    reason = finish_reason(result.finish_reasons[0])
    tools = tool_reply(turn)
    if tools is not None:  # the reply as the session keeps it: its calls read out
        message = tools.message(result.texts[0])
        calls = message.get("tool_calls")
        first: ChoiceMessage = {"role": "assistant", "content": str(message["content"])}
        if isinstance(calls, list):
            first["tool_calls"] = calls
            reason = choices[0]["finish_reason"] = "tool_calls"
        choices[0]["message"] = first
    return {
        "id": turn.request_id,
        "object": "session.message",
        "session_id": turn.session_id,
        "message": message,
        "choices": choices,
        "finish_reason": reason,
        "usage": usage_body(result),
        "timings": timings(result),
    }
