"""A turn's end, the two callbacks a Turn calls (turn.py): `finish` when the engine ended it
(keep the new messages in the record, in a worker thread) and `end`, always and once (the
store's hold and the session's reservation let go, the turn counted)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from chatstore.api.chat.crud import plain
from chatstore.api.chat.reservations import SessionReservations
from chatstore.api.chat.tool_turn import tool_reply
from chatstore.api.chat.turn import Turn
from chatstore.api.common.chat_template import ChatTemplate
from chatstore.api.common.errors import APIError, store_error
from chatstore.store.ports import SessionKVAdmin, SessionRecord

log = logging.getLogger("chatstore.api")


class TurnEnd:
    def __init__(
        self,
        store: SessionKVAdmin,
        template: ChatTemplate,
        reservations: SessionReservations,
        on_turn_end: Callable[[Turn], None] | None = None,
    ) -> None:
        self.store = store
        self.template = template
        self.reservations = reservations
        self.on_turn_end = on_turn_end  # the metrics' count of turns, say

    def finish(self, turn: Turn) -> None:
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
        finally:  # the append gave the lease back; a failure before it did not reach it
            self.reservations.release_lease((record.tenant, record.session_id))

    def end(self, turn: Turn) -> None:
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
        tools = tool_reply(turn)
        if tools is not None:  # a session's turn with tools: its messages as tool_turn.py keeps
            kept = tools.keep(result.texts[0])
            lease = self.reservations.take_lease((record.tenant, record.session_id))
            self.store.append_turn(record, kept, None, kv_tokens, last_token, turn.opened, lease)
            return
        stored, sent = plain(record.messages), turn.record_messages
        if sent[: len(stored)] == stored:
            new, keep = [*sent[len(stored) :], reply], None
        else:
            new, keep = [*sent, reply], 0
        lease = self.reservations.take_lease((record.tenant, record.session_id))
        self.store.append_turn(record, new, keep, kv_tokens, last_token, turn.opened, lease)
