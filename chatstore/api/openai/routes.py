"""OpenAI-compatible routes: POST /v1/chat/completions (JSON or SSE), GET /v1/models."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from functools import partial
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response

from chatstore.api.chat.service import ChatService, TurnSpec
from chatstore.api.chat.turn import Turn, TurnResult
from chatstore.api.common.auth import Principal, tenant_principal
from chatstore.api.common.errors import ERRORS, APIError, bad_param
from chatstore.api.common.protocol import SESSION_ID_PATTERN
from chatstore.api.common.replies import message_choices
from chatstore.api.common.sampling import to_sampling
from chatstore.api.common.streaming import sse_response
from chatstore.api.common.usage import usage_body
from chatstore.api.openai.chunks import ToolForm, completion_chunks
from chatstore.api.openai.grammar import grammars_for, pick_constraint
from chatstore.api.openai.logprobs import TokenBytes, choice_logprobs, token_bytes_for
from chatstore.api.openai.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    ModelCard,
    ModelList,
)
from chatstore.api.tools.formats import detect_format
from chatstore.api.tools.protocol import ToolChatMessage
from chatstore.api.tools.rendering import render_tools
from chatstore.api.tools.replies import reply_message
from chatstore.api.tools.request import check_tool_messages, tool_request

router = APIRouter(tags=["openai"])


@router.get("/v1/models", response_model=ModelList)
def list_models(request: Request, _: Annotated[Principal, Depends(tenant_principal)]) -> ModelList:
    app = request.app.state
    return ModelList(data=[ModelCard(id=app.settings.model_name, created=app.started_at)])


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=ERRORS)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    principal: Annotated[Principal, Depends(tenant_principal)],
    x_session_id: Annotated[str | None, Header(pattern=SESSION_ID_PATTERN)] = None,
) -> Response:
    started = request.scope.get("chatstore.started", time.perf_counter())
    service: ChatService = request.app.state.service
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_param("top_logprobs", "top_logprobs needs logprobs: true")
    if x_session_id and body.session_id and x_session_id != body.session_id:
        raise bad_param("session_id", "X-Session-ID header and session_id disagree")
    tools = tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
    template = service.template
    form = None  # how to read tool calls out of the reply; None: plain text
    fmt = None
    if tools is not None or any(m.role == "tool" or m.tool_calls for m in body.messages):
        check_tool_messages(body.messages)
        fmt = detect_format(template.tokenizer.chat_template)
        prompt = render_tools(body.messages, tools, fmt)
        messages, rich = prompt.messages, prompt.rich
        if tools is not None and tools.parses_calls:
            form = ToolForm(fmt, tools.parallel)
    else:
        messages, rich = [_plain(m) for m in body.messages], None
    sampling = to_sampling(body, service.settings.default_max_tokens)
    if body.logprobs:  # None = nothing computed: the requests that do not ask pay nothing
        sampling = replace(sampling, logprobs=body.top_logprobs or 0)
    if body.response_format is not None or form is not None:
        grammars = grammars_for(template.tokenizer, service.vocab_size, template.eos_token_ids)
        pick = partial(pick_constraint, body.response_format, tools, fmt, grammars)
        constraint = await asyncio.to_thread(pick)  # the first one reads the vocabulary
        if constraint is not None:
            sampling = replace(sampling, constraint=constraint)
    spec = TurnSpec(
        tenant=principal.tenant,
        sampling=sampling,
        started=started,
        session_id=x_session_id or body.session_id,
        messages=messages,
        rich=rich,
    )
    turn = await service.open_turn(spec)
    request.scope["chatstore.turn"] = turn
    model = body.model or request.app.state.settings.model_name
    headers = {"X-Session-ID": turn.session_id}
    token_bytes = token_bytes_for(template.tokenizer)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = completion_chunks(turn, model, include_usage, token_bytes, form)
        return sse_response(chunks, headers)
    result = await turn.run_watching(request.is_disconnected)
    if result is None:  # the client went away: the turn was aborted, nobody to answer
        return Response(status_code=499)
    if result.error is not None:
        raise APIError(500, f"generation failed: {result.error}", code="engine_error")
    if turn.save_error is not None:  # not kept: never acknowledge it
        raise turn.save_error
    return JSONResponse(_completion(turn, result, model, token_bytes, form), headers=headers)


def _plain(m: ToolChatMessage) -> dict[str, str]:
    return {"role": "system" if m.role == "developer" else m.role, "content": m.text()}


def _completion(
    turn: Turn, result: TurnResult, model: str, token_bytes: TokenBytes, form: ToolForm | None
) -> dict[str, object]:
    choices = message_choices(result)
    if form is not None:
        for choice, text in zip(choices, result.texts, strict=True):
            choice["message"], called = reply_message(text, form.fmt, form.parallel)
            if called:
                choice["finish_reason"] = "tool_calls"
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
