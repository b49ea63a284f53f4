"""OpenAI-compatible routes: POST /v1/chat/completions (JSON or SSE), GET /v1/models."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response

from chatstore.api.common.auth import Principal, tenant_principal
from chatstore.api.common.errors import ERRORS, APIError, bad_param, error_body
from chatstore.api.common.protocol import SESSION_ID_PATTERN
from chatstore.api.common.replies import finish_reason, message_choices
from chatstore.api.common.sampling import to_sampling
from chatstore.api.common.streaming import sse, sse_response
from chatstore.api.common.usage import usage_body
from chatstore.api.openai.logprobs import TokenBytes, choice_logprobs, token_bytes_for
from chatstore.api.openai.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    ModelCard,
    ModelList,
)
from chatstore.api.sessions.service import ChatService, TurnSpec
from chatstore.api.sessions.turn import Turn, TurnResult

router = APIRouter(tags=["openai"])


@router.get("/v1/models", response_model=ModelList)
def list_models(request: Request, _: Annotated[Principal, Depends(tenant_principal)]) -> Any:
    app = request.app.state
    return ModelList(data=[ModelCard(id=app.settings.model_name, created=app.started_at)])


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=ERRORS)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    principal: Annotated[Principal, Depends(tenant_principal)],
    x_session_id: Annotated[str | None, Header(pattern=SESSION_ID_PATTERN)] = None,
) -> Any:
    started = request.scope.get("chatstore.started", time.perf_counter())
    service: ChatService = request.app.state.service
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_param("top_logprobs", "top_logprobs needs logprobs: true")
    if x_session_id and body.session_id and x_session_id != body.session_id:
        raise bad_param("session_id", "X-Session-ID header and session_id disagree")
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        for m in body.messages
    ]
    sampling = to_sampling(body, service.settings.default_max_tokens)
    if body.logprobs:  # None = nothing computed: the requests that do not ask pay nothing
        sampling = replace(sampling, logprobs=body.top_logprobs or 0)
    spec = TurnSpec(
        tenant=principal.tenant,
        sampling=sampling,
        started=started,
        session_id=x_session_id or body.session_id,
        messages=messages,
    )
    turn = await service.open_turn(spec)
    request.scope["chatstore.turn"] = turn
    model = body.model or request.app.state.settings.model_name
    headers = {"X-Session-ID": turn.session_id}
    token_bytes = token_bytes_for(service.template.tokenizer)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_stream(turn, model, include_usage, token_bytes), headers)
    result = await turn.run_watching(request.is_disconnected)
    if result is None:  # the client went away: the turn was aborted, nobody to answer
        return Response(status_code=499)
    if result.error is not None:
        raise APIError(500, f"generation failed: {result.error}", code="engine_error")
    if turn.save_error is not None:  # not kept: never acknowledge it
        raise turn.save_error
    return JSONResponse(_completion(turn, result, model, token_bytes), headers=headers)


def _completion(
    turn: Turn, result: TurnResult, model: str, token_bytes: TokenBytes
) -> dict[str, Any]:
    choices = message_choices(result)
    if result.logprobs is not None:
        for choice, entries in zip(choices, result.logprobs, strict=True):
            choice["logprobs"] = choice_logprobs(entries, token_bytes)
    return {
        "id": turn.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_body(result),
        "system_fingerprint": None,
        "session_id": turn.session_id,
    }


async def _stream(
    turn: Turn, model: str, include_usage: bool, token_bytes: TokenBytes
) -> AsyncIterator[bytes]:
    base = {
        "id": turn.request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
    }
    extra = {"usage": None} if include_usage else {}

    def chunk(
        index: int, delta: dict[str, Any], reason: str | None = None, logprobs: Any = None
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return sse({**base, "choices": [choice], **extra})

    try:
        for i in range(turn.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for delta in turn.deltas():
            if delta.logprobs:  # a chunk per token batch, its text possibly held back ("")
                logprobs = choice_logprobs(delta.logprobs, token_bytes)
                yield chunk(delta.index, {"content": delta.text}, logprobs=logprobs)
            elif delta.text:
                yield chunk(delta.index, {"content": delta.text})
            if delta.finish_reason:
                yield chunk(delta.index, {}, finish_reason(delta.finish_reason))
        result = turn.result
        assert result is not None
        if result.error is not None:
            yield sse(error_body(500, f"generation failed: {result.error}", code="engine_error"))
        elif turn.save_error is not None:
            yield sse(turn.save_error.body())
        elif include_usage:
            yield sse({**base, "choices": [], "usage": usage_body(result)})
        yield sse("[DONE]")
    finally:
        turn.close()
