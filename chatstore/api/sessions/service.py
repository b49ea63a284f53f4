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
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from chatstore.api.common.chat_template import ChatTemplate, Message, RichPrompt
from chatstore.api.common.errors import APIError, bad_param, not_found, store_error
from chatstore.api.common.settings import ServerSettings
from chatstore.api.sessions.limits import check_metadata, check_retention_fields, check_text
from chatstore.api.sessions.reservations import SessionReservations
from chatstore.api.sessions.turn import Turn
from chatstore.engine.request import (
    EngineDeadError,
    EngineOverloadedError,
    InvalidRequestError,
    Request,
    SamplingParams,
)
from chatstore.store.ports import (
    OpenedTurn,
    RecordStoreError,
    SessionKVAdmin,
    SessionRecord,
)

log = logging.getLogger("chatstore.api")


@dataclass(frozen=True)
class TurnSpec:
    tenant: str
    sampling: SamplingParams
    started: float  # perf_counter when the request arrived
    session_id: str | None = None
    messages: list[Message] | None = None  # OpenAI: the whole conversation, as sent
    new_message: Message | None = None  # session API: appended to the stored history
    create_missing: bool = True
    api: str = "openai"
    # OpenAI with tools: the prompt as the template's tool support renders it; `messages` are
    # then the same conversation in plain role/content form, for the record
    rich: RichPrompt | None = None


@dataclass
class _Prepared:
    record: SessionRecord
    messages: list[Message]  # the conversation including the new user message
    prompt: list[int]
    opened: OpenedTurn | None  # the store's handle of the turn (None: records only)


def new_session_id() -> str:
    return "sess_" + uuid.uuid4().hex[:24]


def plain(messages: list[dict[str, Any]]) -> list[Message]:
    """Messages as the template and clients see them (role and content only)."""
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class ChatService:
    def __init__(
        self,
        engine: Any,
        store: SessionKVAdmin,
        template: ChatTemplate,
        settings: ServerSettings,
        vocab_size: int,
        on_turn_end: Any = None,
    ) -> None:
        self.engine = engine
        self.store = store
        self.template = template
        self.settings = settings
        self.max_context = store.context.window  # the store's budget (ports.ContextBudget)
        self.vocab_size = vocab_size
        self.on_turn_end = on_turn_end
        self.draining = False
        self.reservations = SessionReservations(store)

    # -- sessions ---------------------------------------------------------------------------

    def create_session(
        self,
        tenant: str,
        system_prompt: str | None,
        metadata: dict[str, str],
        sid: str | None,
        priority: int = 0,
        ttl_s: int = 0,
    ) -> SessionRecord:
        self._check_metadata(metadata)
        check_retention_fields({"priority": priority, "ttl_s": ttl_s})
        if sid is not None and self.store.get(tenant, sid) is not None:
            raise self._exists(sid)
        self._check_session_quota(tenant)
        messages = []
        if system_prompt is not None:
            self._check_chars("system_prompt", system_prompt)
            messages = [{"role": "system", "content": system_prompt}]
        now = time.time()
        record = SessionRecord(tenant, sid or new_session_id(), messages, [], metadata, now, now)
        record.priority, record.ttl_s = priority, ttl_s
        if not self.store.create(record):  # another replica created the id meanwhile
            raise self._exists(record.session_id)
        return record

    def update_session(self, tenant: str, sid: str, changes: dict[str, Any]) -> SessionRecord:
        """Change the session's priority, ttl_s and/or metadata (404 if it does not exist)."""
        if not changes:
            raise bad_param("body", "nothing to change: give priority, ttl_s or metadata")
        if changes.get("metadata") is not None:
            self._check_metadata(changes["metadata"])
        elif "metadata" in changes:
            raise bad_param("metadata", "metadata must be an object (send {} to clear it)")
        for name in ("priority", "ttl_s"):
            if name in changes and changes[name] is None:
                raise bad_param(name, f"{name} must be an integer")
        check_retention_fields(changes)
        try:
            record = self.store.update(tenant, sid, **changes)
        except RecordStoreError as exc:
            raise store_error(exc) from None
        if record is None:
            raise not_found(f"session {sid}")
        return record

    def get_session(self, tenant: str, sid: str) -> SessionRecord:
        record = self.store.get(tenant, sid)
        if record is None:
            raise not_found(f"session {sid}")
        return record

    def delete_session(self, tenant: str, sid: str) -> None:
        with self.reservations.deleting((tenant, sid)):
            if not self.store.delete(tenant, sid):
                raise not_found(f"session {sid}")

    def purge_expired(self) -> int:
        """Delete the sessions idle past the TTL (records and KV); how many went."""
        return self.store.purge_expired()

    # -- turns ------------------------------------------------------------------------------

    async def open_turn(self, spec: TurnSpec) -> Turn:
        """Prepare the turn in a worker thread (it reads records, may truncate the stored KV,
        tokenizes up to a MiB), then submit it to the engine from the event loop."""
        if self.draining:
            raise self._draining()
        prep = await asyncio.to_thread(self._prepare_reserved, spec)
        key = (spec.tenant, prep.record.session_id)
        try:
            sampling = self._fit_max_tokens(spec.sampling, len(prep.prompt))
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
        turn = Turn(
            request, stream, sampling.n, spec.started, self._finish, self._end, self.engine.abort
        )
        turn.opened = prep.opened
        turn.record_messages = prep.messages
        turn.log.update(record=prep.record, api=spec.api)
        return turn

    def _prepare_reserved(self, spec: TurnSpec) -> _Prepared:
        """`_prepare`, with the session reserved for this turn (released if it fails)."""
        if spec.session_id is not None:
            key = (spec.tenant, spec.session_id)
            self.reservations.reserve_turn(key, self.settings)
            try:
                return self._prepare(spec)
            except BaseException:
                self.reservations.release_turn(key)
                raise
        prep = self._prepare(spec)
        try:
            self.reservations.reserve_turn((spec.tenant, prep.record.session_id), self.settings)
        except BaseException:
            self.store.end_turn(prep.opened)
            raise
        return prep

    def turns_in_flight(self, tenant: str) -> int:
        return self.reservations.turns_in_flight(tenant)

    def _prepare(self, spec: TurnSpec) -> _Prepared:
        if spec.new_message is not None:
            return self._prepare_session_turn(spec, spec.new_message)
        messages = list(spec.messages or [])
        if len(messages) > self.settings.max_messages:
            raise bad_param(
                "messages", f"{len(messages)} messages; the limit is {self.settings.max_messages}"
            )
        for i, m in enumerate(messages):
            self._check_chars(f"messages.{i}.content", m["content"])
        if spec.rich is None:
            prompt = self.template.render(messages)
        else:
            prompt = self.template.render_rich(spec.rich)
        if spec.session_id is not None:
            record = self.store.get(spec.tenant, spec.session_id)
            if record is None and not spec.create_missing:
                raise not_found(f"session {spec.session_id}")
        else:
            record = self._continued(spec.tenant, prompt, messages)
        if record is None:
            self._check_session_quota(spec.tenant)
            now = time.time()
            sid = spec.session_id or new_session_id()
            record = SessionRecord(spec.tenant, sid, [], [], {}, now, now)
        tail = len(self.template.render(messages[-1:])) if messages else 0
        prompt = self._fit_context(record, messages, prompt, tail, spec.sampling)
        opened = self.store.open_turn(record.tenant, record.session_id, prompt)
        return _Prepared(record, messages, prompt, opened)

    def _prepare_session_turn(self, spec: TurnSpec, new: Message) -> _Prepared:
        record = self.get_session(spec.tenant, spec.session_id or "")
        self._check_chars("content", new["content"])
        limit = self.settings.max_messages
        if len(record.messages) + 2 > limit:
            raise bad_param(
                "content",
                f"session {record.session_id} has {len(record.messages)} messages; a session "
                f"keeps at most {limit} (max_messages): start a new session",
                "session_full",
            )
        history = plain(record.messages)
        exact = bool(record.token_ids) and record.kv_tokens == len(record.token_ids)
        if exact and record.last_token is not None:
            history_ids = [*record.token_ids, record.last_token]
            prompt = self.template.continue_ids(history_ids, history, [new])
            tail = len(prompt) - len(record.token_ids)
        else:
            prompt = self.template.render([*history, new])
            tail = len(self.template.render([new]))
        prompt = self._fit_context(record, [*history, new], prompt, tail, spec.sampling)
        opened = self.store.open_turn(record.tenant, record.session_id, prompt)
        return _Prepared(record, [*history, new], prompt, opened)

    def _continued(
        self, tenant: str, prompt: list[int], messages: list[Message]
    ) -> SessionRecord | None:
        """The tenant's session this resent history continues, if one is idle and matches."""
        sid = self.store.match_prefix(tenant, prompt)
        record = self.store.get(tenant, sid) if sid else None
        busy = record is not None and self.reservations.is_busy((tenant, record.session_id))
        if record is None or busy:
            return None
        if messages[: len(record.messages)] != plain(record.messages):
            return None  # shares a prefix only (a system prompt): a new conversation
        return record

    def _fit_context(
        self,
        record: SessionRecord,
        messages: list[Message],
        prompt: list[int],
        tail: int,
        sampling: SamplingParams,
    ) -> list[int]:
        """Past the context window (leaving room for a reply): drop the oldest history after
        the system prompt, from the prompt and from the session's saved KV alike."""
        budget = self.store.context
        reply_room = budget.reply_room(sampling.max_tokens)
        if budget.fits(len(prompt), reply_room):
            return prompt
        head = 0
        if messages and messages[0]["role"] == "system":
            head = len(self.template.encode(self.template.render_text(messages[:1], False)))
        try:
            return self.store.fit_context(
                record.tenant, record.session_id, prompt, head, min(tail, len(prompt)), reply_room
            )
        except ValueError as exc:  # ContextOverflowError: the new message alone is too long
            raise bad_param("messages", str(exc), "context_length_exceeded") from None

    def _fit_max_tokens(self, sampling: SamplingParams, prompt_len: int) -> SamplingParams:
        room = self.max_context - prompt_len
        if room < 1:
            raise bad_param(
                "messages",
                f"the conversation is {prompt_len} tokens; the context is {self.max_context}",
                code="context_length_exceeded",
            )
        return replace(sampling, max_tokens=room) if sampling.max_tokens > room else sampling

    def _submit(self, request: Request):
        try:
            request.sampling.validate(self.vocab_size)
            return self.engine.submit(request)
        except InvalidRequestError as exc:
            raise bad_param(exc.field, str(exc)) from None
        except EngineOverloadedError as exc:
            raise APIError(
                429, f"server busy: {exc}", code="queue_full", headers=self._retry()
            ) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_failed", headers=self._retry()) from None
        except RuntimeError:  # the engine stopped accepting: shutting down
            raise self._draining() from None

    # -- the end of a turn ------------------------------------------------------------------

    def _finish(self, turn: Turn) -> None:
        """The engine ended the turn: keep the new messages (runs in a worker thread). Raises
        APIError (503/507) when the record could not be made durable: the turn must not be
        acknowledged then."""
        record: SessionRecord = turn.log["record"]
        result = turn.result
        ended = result.finish_reasons[0] if result and result.finish_reasons else None
        if result is None or result.error is not None or ended not in ("stop", "length"):
            return
        try:
            self._save(turn, record)
        except APIError:
            raise
        except Exception as exc:
            log.error("saving session %s failed: %s", record.session_id, exc)
            raise store_error(exc) from None
        finally:
            self.reservations.release_lease((record.tenant, record.session_id))

    def _end(self, turn: Turn) -> None:
        record: SessionRecord = turn.log["record"]
        self.store.end_turn(turn.opened)  # unpins, and records a chain no append took
        self.reservations.release_turn((record.tenant, record.session_id))
        if self.on_turn_end is not None:
            self.on_turn_end(turn)

    def _save(self, turn: Turn, record: SessionRecord) -> None:
        result = turn.result
        assert result is not None
        ids = result.token_ids[0]
        reply: dict[str, Any] = {"role": "assistant", "content": result.texts[0]}
        kv_tokens, last_token = 0, None
        if ids and (ids[-1] in self.template.eos_token_ids or result.finish_reasons[0] == "length"):
            # The store saved the KV of every token but the last sampled one (never fed back);
            # the next turn appends that token and continues exactly. (A stop string cuts the
            # text short of its tokens: the next turn renders afresh then.)
            kv_tokens = len(turn.request.prompt_token_ids) + len(ids) - 1
            last_token = ids[-1]
        # Append on top of what the turn read: the version check refuses the save if another
        # replica wrote the session since. A client that resent an edited history (OpenAI)
        # replaces the stored one instead.
        stored, sent = plain(record.messages), turn.record_messages
        if sent[: len(stored)] == stored:
            new, keep = [*sent[len(stored) :], reply], None
        else:
            new, keep = [*sent, reply], 0
        self.store.append_turn(record, new, keep, kv_tokens, last_token, turn.opened)

    # -- helpers ----------------------------------------------------------------------------

    def _check_chars(self, param: str, text: str) -> None:
        check_text(param, text, self.settings.max_message_chars)

    def _check_metadata(self, metadata: dict[str, str]) -> None:
        check_metadata(metadata, self.settings.max_metadata_bytes)

    def _check_session_quota(self, tenant: str) -> None:
        limit = self.settings.max_sessions_per_tenant
        if self.store.count_sessions(tenant) >= limit:
            raise APIError(
                429,
                f"tenant has {limit} sessions (max_sessions_per_tenant): delete some first",
                code="too_many_sessions",
                headers=self._retry(),
            )

    def _exists(self, sid: str) -> APIError:
        return APIError(409, f"session {sid} already exists", param="id", code="conflict")

    def _draining(self) -> APIError:
        return APIError(503, "server is shutting down", code="draining", headers=self._retry())

    def _retry(self) -> dict[str, str]:
        return {"Retry-After": str(self.settings.retry_after_s)}
