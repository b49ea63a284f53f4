"""A session and a session turn's reply as the API returns them (routes, the WebSocket and
the admin's session table share them)."""

from __future__ import annotations

from chatstore.api.common.replies import finish_reason, message_choices
from chatstore.api.common.usage import timings, usage_body
from chatstore.api.sessions.service import ChatService
from chatstore.api.sessions.turn import Turn, TurnResult
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
        "messages": [dict(m) for m in record.messages] if full else None,
    }


def reply_body(turn: Turn, result: TurnResult) -> dict[str, object]:
    choices = message_choices(result)
    return {
        "id": turn.request_id,
        "object": "session.message",
        "session_id": turn.session_id,
        "message": {"role": "assistant", "content": result.texts[0]},
        "choices": choices,
        "finish_reason": finish_reason(result.finish_reasons[0]),
        "usage": usage_body(result),
        "timings": timings(result),
    }
