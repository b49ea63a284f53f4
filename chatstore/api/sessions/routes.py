"""The session API: the server keeps the history, the client sends only the new message.

    POST   /v1/sessions                  create (optional system prompt, metadata)
    GET    /v1/sessions                  the tenant's own, newest first (offset/limit)
    GET    /v1/sessions/{id}             messages, token count, where its KV sits now
    PATCH  /v1/sessions/{id}             change priority, ttl_s (retention) or metadata
    POST   /v1/sessions/{id}/messages    one turn: JSON reply, or SSE with stream=true
    DELETE /v1/sessions/{id}             history and KV gone from every tier
    POST   /v1/sessions/{id}/prefetch    hint: the user is about to write; move the KV up (202)

Another tenant's session is "not found" (404), never "forbidden": its existence is not leaked.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import JSONResponse, Response

from chatstore.api.chat.service import ChatService
from chatstore.api.chat.turn import Turn
from chatstore.api.common.auth import Principal, tenant_principal
from chatstore.api.common.errors import ERRORS, APIError, error_body
from chatstore.api.common.protocol import SESSION_ID_PATTERN, Deleted
from chatstore.api.common.streaming import sse, sse_response
from chatstore.api.sessions.bodies import reply_body, session_info
from chatstore.api.sessions.message import session_turn_spec, shown_deltas
from chatstore.api.sessions.protocol import (
    SessionCreateRequest,
    SessionInfo,
    SessionList,
    SessionMessageRequest,
    SessionPatchRequest,
    SessionReply,
)

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])
Tenant = Annotated[Principal, Depends(tenant_principal)]
SessionPath = Annotated[str, Path(pattern=SESSION_ID_PATTERN)]


def _service(request: Request) -> ChatService:
    service: ChatService = request.app.state.service
    return service


@router.post("", response_model=SessionInfo, status_code=201, responses=ERRORS)
def create_session(body: SessionCreateRequest, request: Request, principal: Tenant) -> JSONResponse:
    service = _service(request)
    if service.draining:
        raise APIError(503, "server is shutting down", code="draining")
    record = service.create_session(
        principal.tenant,
        body.system_prompt,
        body.metadata,
        body.id,
        priority=body.priority,
        ttl_s=body.ttl_s,
    )
    return JSONResponse(session_info(service, record, True), status_code=201)


@router.get("", response_model=SessionList, responses=ERRORS)
def list_sessions(
    request: Request,
    principal: Tenant,
    offset: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict[str, object]:
    service = _service(request)
    records, total = service.store.list_sessions(principal.tenant, offset, limit)
    more = offset + len(records) < total
    return {
        "object": "list",
        "data": [session_info(service, r, False) for r in records],
        "has_more": more,
        "next_offset": offset + len(records) if more else None,
    }


@router.get("/{session_id}", response_model=SessionInfo, responses=ERRORS)
def get_session(session_id: SessionPath, request: Request, principal: Tenant) -> dict[str, object]:
    service = _service(request)
    return session_info(service, service.get_session(principal.tenant, session_id), True)


@router.patch("/{session_id}", response_model=SessionInfo, responses=ERRORS)
def patch_session(
    session_id: SessionPath, body: SessionPatchRequest, request: Request, principal: Tenant
) -> dict[str, object]:
    """Partial update: only the fields sent change (retention takes effect at once)."""
    service = _service(request)
    changes = body.model_dump(exclude_unset=True)
    record = service.update_session(principal.tenant, session_id, changes)
    return session_info(service, record, True)


@router.delete("/{session_id}", response_model=Deleted, responses=ERRORS)
def delete_session(
    session_id: SessionPath, request: Request, principal: Tenant
) -> dict[str, object]:
    _service(request).delete_session(principal.tenant, session_id)
    return {"id": session_id, "object": "session.deleted", "deleted": True}


@router.post("/{session_id}/prefetch", status_code=202, responses=ERRORS)
def prefetch_session(session_id: SessionPath, request: Request, principal: Tenant) -> JSONResponse:
    """Start moving the session's KV up to DRAM (returns at once; see kv_location)."""
    service = _service(request)
    service.get_session(principal.tenant, session_id)  # 404 for unknown / another tenant's
    service.store.hint(principal.tenant, session_id)
    return JSONResponse(
        {"id": session_id, "object": "session.prefetch", "accepted": True}, status_code=202
    )


@router.post("/{session_id}/messages", response_model=SessionReply, responses=ERRORS)
async def post_message(
    session_id: SessionPath, body: SessionMessageRequest, request: Request, principal: Tenant
) -> Response | dict[str, object]:
    started = request.scope.get("chatstore.started", time.perf_counter())
    service = _service(request)
    spec = await session_turn_spec(
        body, service, principal.tenant, session_id, started, api="sessions"
    )
    turn = await service.open_turn(spec)
    request.scope["chatstore.turn"] = turn
    if body.stream:
        return sse_response(_stream(turn))
    result = await turn.run_watching(request.is_disconnected)
    if result is None:  # the client went away: the turn was aborted, nobody to answer
        return Response(status_code=499)
    if result.error is not None:
        raise APIError(500, f"generation failed: {result.error}", code="engine_error")
    if turn.save_error is not None:  # not kept: never acknowledge it
        raise turn.save_error
    return reply_body(turn, result)


async def _stream(turn: Turn) -> AsyncIterator[bytes]:
    """Events: {"type": "delta", "index", "text"} ... then {"type": "done", ...reply_body}.
    With tools the model may call, a call is not streamed as text: it is in the done event's
    message (tool_calls)."""
    try:
        async for delta in shown_deltas(turn):
            yield sse({"type": "delta", "index": delta.index, "text": delta.text})
        result = turn.result
        assert result is not None
        if result.error is not None:
            yield sse(error_body(500, f"generation failed: {result.error}", code="engine_error"))
        elif turn.save_error is not None:
            yield sse(turn.save_error.body())
        else:
            yield sse({"type": "done", **reply_body(turn, result)})
        yield sse("[DONE]")
    finally:
        turn.close()
