"""The session service: ties engine, session store and chat template together.

A turn is opened before any byte of a stream is sent (so every refusal - unknown session, bad
parameter, full queue, tenant limit - becomes an HTTP error), its blocking part (records, the
store's truncation, tokenizing) in a worker thread so the event loop keeps serving, and consumed
asynchronously by the route. When it ends normally the session's record gains the new messages;
the store has by then saved the KV of the turn's tokens, which the next turn's prompt extends.
The turn is acknowledged (200, `done`) only once that record is durable: a record that cannot be
written fails the turn with 503/507 and leaves the session as it was.

A session has at most one turn in flight (409 otherwise), a delete waits for none, and a tenant
has at most `max_turns_per_tenant` turns in flight (none in local mode, where the engine's queue
bounds the one user) and `max_sessions_per_tenant` sessions (429).
Across replicas sharing one Redis, a turn or a delete also holds the session's lease in Redis
(409 `session_busy` while another replica has it), and the turn's messages are appended only on
top of the record version it read (409 `session_conflict` otherwise): an acknowledged turn is
never overwritten by another replica's save.

The record of a turn that ended on EOS or max_tokens keeps `kv_tokens` (the number of tokens
the store saved) and `last_token` (the sampled token after them); when the record still
holds exactly that many, the next prompt is those ids plus the new turn's text (exact reuse, also
after truncation). Otherwise (a reply cut by a stop string, an aborted turn in between) the
conversation is rendered afresh and the store reuses the longest common prefix.

ChatService holds the parts, one concept each:

    crud.py         the sessions as clients manage them (create ... purge), quota and limits
    turn_prep.py    a turn's preparation: reserved, its record read, its prompt rendered and fitted
    turn_end.py     a turn's end: its messages kept (finish), its hold and reservation let go (end)
    reservations.py which sessions and tenants have turns in flight, the replicas' leases
    refusals.py     the errors that name no field: draining, too many sessions, an id taken
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from chatstore.api.chat.crud import SessionCrud, new_session_id, plain
from chatstore.api.chat.refusals import draining, retry_after
from chatstore.api.chat.reservations import SessionReservations
from chatstore.api.chat.turn import Turn
from chatstore.api.chat.turn_end import TurnEnd
from chatstore.api.chat.turn_prep import TurnPreparation, TurnSpec, fit_max_tokens
from chatstore.api.common.chat_template import ChatTemplate
from chatstore.api.common.engine_client import EngineClient
from chatstore.api.common.errors import APIError, bad_param
from chatstore.api.common.settings import ServerSettings
from chatstore.engine.request import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    Request,
    RequestOutput,
)
from chatstore.store.ports import SessionKVAdmin, SessionRecord

# Imported from here by the routes (and responses/): the service's vocabulary.
__all__ = ["ChatService", "TurnSpec", "new_session_id", "plain"]


class ChatService:
    def __init__(
        self,
        engine: EngineClient,
        store: SessionKVAdmin,
        template: ChatTemplate,
        settings: ServerSettings,
        vocab_size: int,
        on_turn_end: Callable[[Turn], None] | None = None,
    ) -> None:
        self.engine = engine
        self.store = store
        self.template = template
        self.max_context = store.context.window  # the store's budget (ports.ContextBudget)
        self.vocab_size = vocab_size
        self.draining = False
        self.reservations = SessionReservations(store)
        self.sessions = SessionCrud(store, settings, self.reservations)
        self.preparation = TurnPreparation(
            store, template, settings, self.reservations, self.sessions
        )
        self.turn_end = TurnEnd(store, template, self.reservations, on_turn_end)
        self._settings = settings

    @property
    def settings(self) -> ServerSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: ServerSettings) -> None:
        """New limits (a test, an operator), in force from the next request on."""
        self._settings = self.sessions.settings = self.preparation.settings = settings

    # -- sessions (crud.py) -----------------------------------------------------------------

    def create_session(
        self,
        tenant: str,
        system_prompt: str | None,
        metadata: dict[str, str],
        sid: str | None,
        priority: int = 0,
        ttl_s: int = 0,
    ) -> SessionRecord:
        return self.sessions.create(tenant, system_prompt, metadata, sid, priority, ttl_s)

    def update_session(self, tenant: str, sid: str, changes: dict[str, Any]) -> SessionRecord:
        """Change the session's priority, ttl_s and/or metadata (404 if it does not exist)."""
        return self.sessions.update(tenant, sid, changes)

    def get_session(self, tenant: str, sid: str) -> SessionRecord:
        return self.sessions.get(tenant, sid)

    def delete_session(self, tenant: str, sid: str) -> None:
        self.sessions.delete(tenant, sid)

    def purge_expired(self) -> int:
        """Delete the sessions idle past the TTL (records and KV); how many went."""
        return self.sessions.purge_expired()

    # -- turns ------------------------------------------------------------------------------

    async def open_turn(self, spec: TurnSpec) -> Turn:
        """Prepare the turn in a worker thread (it reads records, may truncate the stored KV,
        tokenizes up to a MiB), then submit it to the engine from the event loop."""
        if self.draining:
            raise draining(self.settings)
        prep = await asyncio.to_thread(self.preparation.prepare, spec)
        key = (spec.tenant, prep.record.session_id)
        try:
            sampling = fit_max_tokens(spec.sampling, len(prep.prompt), self.max_context)
            request = Request(
                request_id="chatcmpl-" + uuid.uuid4().hex[:24],
                prompt_token_ids=prep.prompt,
                sampling=sampling,
                tenant=spec.tenant,
                session_id=prep.record.session_id,
                store_turn=prep.opened,
            )
            stream = self._submit(request)
        except BaseException:
            self.store.end_turn(prep.opened)
            self.reservations.release_turn(key)
            raise
        end = self.turn_end
        turn = Turn(
            request, stream, sampling.n, spec.started, end.finish, end.end, self.engine.abort
        )
        turn.opened = prep.opened
        turn.record_messages = prep.messages
        if prep.tools is not None:
            turn.log["tools"] = prep.tools
        turn.log.update(record=prep.record, api=spec.api)
        return turn

    def turns_in_flight(self, tenant: str) -> int:
        return self.reservations.turns_in_flight(tenant)

    def _submit(self, request: Request) -> AsyncIterator[RequestOutput]:
        try:
            request.sampling.validate(self.vocab_size)
            stream: AsyncIterator[RequestOutput] = self.engine.submit(request)
            return stream
        except InvalidRequestError as exc:
            raise bad_param(exc.field, str(exc)) from None
        except EngineOverloadedError as exc:
            raise APIError(
                429, f"server busy: {exc}", code="queue_full", headers=retry_after(self.settings)
            ) from None
        except EngineDeadError as exc:
            raise APIError(
                503, str(exc), code="engine_failed", headers=retry_after(self.settings)
            ) from None
        except RuntimeError:  # the engine stopped accepting: shutting down
            raise draining(self.settings) from None
