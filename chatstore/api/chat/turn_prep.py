"""A turn's preparation, in a worker thread before anything is sent: the session reserved, its
record read (or a new one), the prompt rendered (continuing the saved token ids exactly when the
record allows) and fitted to the context window, the turn opened in the store."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from chatstore.api.chat.crud import SessionCrud, new_session_id, plain
from chatstore.api.chat.limits import check_text
from chatstore.api.chat.reservations import SessionReservations
from chatstore.api.chat.tool_turn import ToolReply, ToolTurn, has_tool_parts, render_turn
from chatstore.api.common.chat_template import ChatTemplate, Message, RichPrompt
from chatstore.api.common.errors import bad_param, not_found
from chatstore.api.common.settings import ServerSettings
from chatstore.api.tools.formats import detect_format
from chatstore.api.tools.protocol import ToolChatMessage
from chatstore.engine.request import SamplingParams
from chatstore.store.ports import OpenedTurn, SessionKVAdmin, SessionRecord


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
    # Session API with tools, or new messages that are tool results (sessions/tool_turn.py)
    tool_turn: ToolTurn | None = None


@dataclass
class PreparedTurn:
    record: SessionRecord
    messages: list[Message]  # the conversation including the new user message
    prompt: list[int]
    opened: OpenedTurn | None  # the store's handle of the turn (None: records only)
    # A session turn rendered with tools: its messages as the record keeps them (None: plain)
    tools: ToolReply | None = None


def fit_max_tokens(sampling: SamplingParams, prompt_len: int, max_context: int) -> SamplingParams:
    """The reply's max_tokens cut to the room the context leaves after the prompt."""
    room = max_context - prompt_len
    if room < 1:
        raise bad_param(
            "messages",
            f"the conversation is {prompt_len} tokens; the context is {max_context}",
            code="context_length_exceeded",
        )
    return replace(sampling, max_tokens=room) if sampling.max_tokens > room else sampling


class TurnPreparation:
    """settings: the service's, replaced whole when its limits change (ChatService.settings)."""

    def __init__(
        self,
        store: SessionKVAdmin,
        template: ChatTemplate,
        settings: ServerSettings,
        reservations: SessionReservations,
        sessions: SessionCrud,
    ) -> None:
        self.store = store
        self.template = template
        self.settings = settings
        self.reservations = reservations
        self.sessions = sessions

    def prepare(self, spec: TurnSpec) -> PreparedTurn:
        """The turn prepared with its session reserved (released if preparing fails). A resent
        conversation's session is known only once prepared: it is reserved after."""
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

    def _prepare(self, spec: TurnSpec) -> PreparedTurn:
        if spec.tool_turn is not None or spec.new_message is not None:
            return self._prepare_session_turn(spec)
        return self._prepare_resent_turn(spec)

    def _prepare_resent_turn(self, spec: TurnSpec) -> PreparedTurn:
        """OpenAI: the client sent the whole conversation."""
        messages = list(spec.messages or [])
        if len(messages) > self.settings.max_messages:
            raise bad_param(
                "messages", f"{len(messages)} messages; the limit is {self.settings.max_messages}"
            )
        for i, m in enumerate(messages):
            check_text(f"messages.{i}.content", m["content"], self.settings.max_message_chars)
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
            self.sessions.check_quota(spec.tenant)
            now = time.time()
            sid = spec.session_id or new_session_id()
            record = SessionRecord(spec.tenant, sid, [], [], {}, now, now)
        tail = len(self.template.render(messages[-1:])) if messages else 0
        prompt = self._fit_context(record, messages, prompt, tail, spec.sampling)
        opened = self.store.open_turn(record.tenant, record.session_id, prompt)
        return PreparedTurn(record, messages, prompt, opened)

    def _prepare_session_turn(self, spec: TurnSpec) -> PreparedTurn:
        """Session API: new messages on top of the stored history."""
        record = self.sessions.get(spec.tenant, spec.session_id or "")
        turn, new = spec.tool_turn, spec.new_message
        if turn is None and has_tool_parts(record.messages):  # a plain turn after tool calls
            assert new is not None
            fmt = detect_format(self.template.tokenizer.chat_template)
            turn = ToolTurn((ToolChatMessage.model_validate(new),), None, fmt, field="")
        new_text = new["content"] if new is not None else ""
        texts = [m.text() for m in turn.new] if turn is not None else [new_text]
        count = len(texts)
        for i, text in enumerate(texts):
            field = "content" if turn is None or not turn.field else f"{turn.field}.{i}.content"
            check_text(field, text, self.settings.max_message_chars)
        limit = self.settings.max_messages
        if len(record.messages) + count + 1 > limit:
            raise bad_param(
                "content" if turn is None or not turn.field else turn.field,
                f"session {record.session_id} has {len(record.messages)} messages; a session "
                f"keeps at most {limit} (max_messages): start a new session",
                "session_full",
            )
        exact = bool(record.token_ids) and record.kv_tokens == len(record.token_ids)
        history_ids = None
        if exact and record.last_token is not None:
            history_ids = [*record.token_ids, record.last_token]
        if turn is not None:
            return self._prepare_tool_turn(spec, record, turn, history_ids)
        assert new is not None
        history = plain(record.messages)
        if history_ids is not None:
            prompt = self.template.continue_ids(history_ids, history, [new])
            tail = len(prompt) - len(record.token_ids)
        else:
            prompt = self.template.render([*history, new])
            tail = len(self.template.render([new]))
        prompt = self._fit_context(record, [*history, new], prompt, tail, spec.sampling)
        opened = self.store.open_turn(record.tenant, record.session_id, prompt)
        return PreparedTurn(record, [*history, new], prompt, opened)

    def _prepare_tool_turn(
        self,
        spec: TurnSpec,
        record: SessionRecord,
        turn: ToolTurn,
        history_ids: list[int] | None,
    ) -> PreparedTurn:
        parts = render_turn(turn, self.template, record.messages, history_ids)
        prompt = self._fit_context(record, parts.messages, parts.prompt, parts.tail, spec.sampling)
        opened = self.store.open_turn(record.tenant, record.session_id, prompt)
        messages = [
            *plain(record.messages),
            *({"role": m.role, "content": m.text()} for m in turn.new),
        ]
        return PreparedTurn(record, messages, prompt, opened, turn.reply())

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
