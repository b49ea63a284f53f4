"""The OpenAI Responses API, over the chat service: a chain of responses is a session.

    POST   /v1/responses          a response: JSON, or SSE events with stream=true
    GET    /v1/responses/{id}     a stored response object
    DELETE /v1/responses/{id}     forget it (its session and the rest of its chain stay)

`previous_response_id` continues a conversation: the new turn runs in the chain's session when
that session is still at the previous response, so its prompt reuses the stored KV; from an
older response (a fork) it opens a new session (responses_chain.py). A response is stored once
it has finished (completed or incomplete), in the tenant's records (responses_store.py), and
survives restarts. `store=false`: the turn runs in a session of its own, deleted when the turn
ends; the response can be neither fetched nor continued. Another tenant's response, like an
unknown one, is "not found" (404).
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from dataclasses import replace
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from chatstore.api.chat.limits import check_text
from chatstore.api.chat.service import ChatService, TurnSpec, new_session_id
from chatstore.api.chat.turn import Turn
from chatstore.api.common.auth import Principal, tenant_principal
from chatstore.api.common.errors import ERRORS, APIError, bad_param, not_found
from chatstore.api.common.sampling import to_sampling
from chatstore.api.common.streaming import sse_response
from chatstore.api.openai.grammar import grammars_for, pick_constraint
from chatstore.api.openai.logprobs import token_bytes_for
from chatstore.api.responses.body import ResponseHead
from chatstore.api.responses.call import ResponseCall, response_store
from chatstore.api.responses.chain import ChainTurn, ToolRendering, plan_turn
from chatstore.api.responses.output import ReplyForm
from chatstore.api.responses.protocol import RESPONSE_ID_MAX, ResponsesRequest, input_items
from chatstore.api.responses.store import StoredResponse, new_response_id
from chatstore.api.responses.stream import stream_response
from chatstore.api.responses.tools import echo_choice, echo_tools, responses_tool_request
from chatstore.api.tools.formats import detect_format
from chatstore.api.tools.request import ToolRequest
from chatstore.engine.request import SamplingParams

router = APIRouter(prefix="/v1/responses", tags=["responses"])


async def _tenant(request: Request) -> Principal:
    """tenant_principal, on the event loop: it only compares keys, and FastAPI would run the
    plain function in a worker thread, a hop before every turn's first token."""
    return tenant_principal(request)


Tenant = Annotated[Principal, Depends(_tenant)]


@router.post("", responses=ERRORS)
async def create_response(body: ResponsesRequest, request: Request, principal: Tenant) -> Response:
    started = request.scope.get("chatstore.started", time.perf_counter())
    service: ChatService = request.app.state.service
    body.check_supported()
    max_chars = service.settings.max_message_chars
    new_items = input_items(body.input, max_chars)
    check_text("instructions", body.instructions or "", max_chars)
    tools = responses_tool_request(body.tools, body.tool_choice, body.parallel_tool_calls)
    template = service.template
    rendering = ToolRendering(tools, detect_format(template.tokenizer.chat_template))
    form = ReplyForm(rendering.fmt, tools.parallel) if tools and tools.parses_calls else None
    sampling = to_sampling(body.sampling_fields(), service.settings.default_max_tokens)
    if body.wants_logprobs:  # None = nothing computed: the requests that do not ask pay nothing
        sampling = replace(sampling, logprobs=body.top_logprobs or 0)
    if form is not None:  # the generic form's answer is constrained, as chat completions does
        grammars = grammars_for(template.tokenizer, service.vocab_size, template.eos_token_ids)
        pick = functools.partial(pick_constraint, None, tools, form.fmt, grammars)
        constraint = await asyncio.to_thread(pick)  # the first one reads the vocabulary
        if constraint is not None:
            sampling = replace(sampling, constraint=constraint)
    plan = functools.partial(
        plan_turn,
        service.store,
        principal.tenant,
        body.previous_response_id,
        body.instructions,
        new_items,
        body.store,
        rendering,
    )
    # Only a continuation reads records: a new chain skips the hop to a worker thread.
    chain = plan() if body.previous_response_id is None else await asyncio.to_thread(plan)
    limit = service.settings.max_messages
    if len(chain.messages) > limit:
        raise bad_param(
            "input",
            f"the conversation would hold {len(chain.messages)} messages; the limit is {limit} "
            "(max_messages): start a new conversation",
            "conversation_too_long",
        )
    spec = TurnSpec(
        tenant=principal.tenant,
        sampling=sampling,
        started=started,
        session_id=chain.session_id,
        messages=chain.messages,
        api="responses",
        rich=chain.rich,
    )
    head = _head(body, sampling, request.app.state.settings.model_name, tools)
    turn = await _open(service, spec, chain)
    request.scope["chatstore.turn"] = turn
    token_bytes = token_bytes_for(template.tokenizer)
    call = ResponseCall(service, principal.tenant, head, chain, turn, form, token_bytes)
    if body.stream:
        return sse_response(stream_response(call))
    return await _reply(call, request)


def _head(
    body: ResponsesRequest,
    sampling: SamplingParams,
    default_model: str,
    tools: ToolRequest | None,
) -> ResponseHead:
    return ResponseHead(
        id=new_response_id(),
        item_id="msg_" + uuid.uuid4().hex,
        model=body.model or default_model,
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        max_output_tokens=body.max_output_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        store=body.store,
        user=body.user,
        metadata=body.metadata or {},
        tools=echo_tools(body.tools),
        tool_choice=echo_choice(body.tool_choice, tools),
        parallel_tool_calls=tools.parallel
        if tools is not None
        else body.parallel_tool_calls is not False,
        top_logprobs=body.top_logprobs,
    )


async def _open(service: ChatService, spec: TurnSpec, chain: ChainTurn) -> Turn:
    """Open the turn; if the chain's session is busy (another continuation of the same
    response in flight), fork into a new session instead of refusing."""
    try:
        return await service.open_turn(spec)
    except APIError as exc:
        if exc.code != "session_busy" or not chain.continues:
            raise
    return await service.open_turn(replace(spec, session_id=new_session_id()))


async def _reply(call: ResponseCall, request: Request) -> Response:
    try:
        result = await call.turn.run_watching(request.is_disconnected)
        if result is None:  # the client went away: the turn was aborted, nobody to answer
            return Response(status_code=499)
        if result.error is not None:
            raise APIError(500, f"generation failed: {result.error}", code="engine_error")
        if call.turn.save_error is not None:  # the session was not kept: never acknowledge
            raise call.turn.save_error
        _, text = await call.finish(result)
        return Response(text, media_type="application/json")
    finally:
        discarded = call.discard()
        if discarded is not None:
            await discarded


@router.get("/{response_id}", responses=ERRORS)
def get_response(response_id: str, request: Request, principal: Tenant) -> Response:
    stored = _find(request, principal, response_id)
    return Response(stored.body_json, media_type="application/json")


@router.delete("/{response_id}", responses=ERRORS)
def delete_response(response_id: str, request: Request, principal: Tenant) -> dict[str, object]:
    store = response_store(request.app.state.service)
    if len(response_id) > RESPONSE_ID_MAX or not store.delete(principal.tenant, response_id):
        raise not_found(f"response {response_id}")
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _find(request: Request, principal: Principal, response_id: str) -> StoredResponse:
    stored = None
    if len(response_id) <= RESPONSE_ID_MAX:
        stored = response_store(request.app.state.service).get(principal.tenant, response_id)
    if stored is None:
        raise not_found(f"response {response_id}")
    return stored
