"""One POST /v1/responses once its turn is open (`ResponseCall`): what the JSON reply and the
SSE stream (stream.py) both finish with, storing the response when it is to be kept, or
deleting the store=false turn's own session."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from chatstore.api.chat.service import ChatService
from chatstore.api.chat.turn import Turn, TurnResult
from chatstore.api.common.errors import APIError
from chatstore.api.openai.logprobs import LogprobEntry, TokenBytes, logprobs_content
from chatstore.api.responses.body import ResponseHead
from chatstore.api.responses.chain import ChainTurn
from chatstore.api.responses.output import ReplyForm, ReplyOutput, reply_output
from chatstore.api.responses.store import ResponseStore, StoredResponse
from chatstore.engine.request import TokenLogprob

log = logging.getLogger("chatstore.api")
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


@dataclass(frozen=True)
class ResponseCall:
    """One POST /v1/responses, once its turn is open."""

    service: ChatService
    tenant: str
    head: ResponseHead
    chain: ChainTurn
    turn: Turn
    form: ReplyForm | None  # tools the model may call: how to read them out of the reply
    token_bytes: TokenBytes

    def logprobs_of(self, entries: list[TokenLogprob]) -> list[LogprobEntry]:
        return logprobs_content(entries, self.token_bytes)

    def result_logprobs(self, result: TurnResult) -> list[LogprobEntry] | None:
        """The reply's tokens' logprobs (None: not asked for)."""
        return None if result.logprobs is None else self.logprobs_of(result.logprobs[0])

    async def finish(
        self, result: TurnResult, reply: ReplyOutput | None = None
    ) -> tuple[ReplyOutput, str]:
        """The finished response's output, and the response object as JSON, stored first when it
        is to be kept; `reply`: its output as streamed, else read from the result here."""
        keep = self.head.store
        if reply is None:
            reply = reply_output(self.head, result, self.form, self.result_logprobs(result))
        body = self.head.finished(result, self.turn.session_id if keep else None, reply.output)
        text = _ENCODE(body)
        if keep:
            items = [*self.chain.items, *reply.kept]
            stored = StoredResponse(text, self.turn.session_id, items)
            put = response_store(self.service).put
            await asyncio.to_thread(put, self.tenant, self.head.id, stored)
        return reply, text

    def discard(self) -> asyncio.Future[None] | None:
        """store=false: delete the turn's own session (in the background; the future)."""
        if self.head.store:
            return None
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, _discard, self.service, self.tenant, self.turn.session_id)


def response_store(service: ChatService) -> ResponseStore:
    return ResponseStore(service.store)


def _discard(service: ChatService, tenant: str, session_id: str) -> None:
    try:
        service.delete_session(tenant, session_id)
    except APIError as exc:
        if exc.status != 404:  # 404: the turn failed before its record was written
            log.warning("could not delete the store=false session %s: %s", session_id, exc)
