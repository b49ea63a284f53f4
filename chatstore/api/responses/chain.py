"""Where a response's turn runs: a chain of responses is a session under the hood.

    resp_1 ── resp_2 ── resp_3           session S: its record holds the conversation through
       │                                 resp_3, its stored KV the tokens of that conversation
       └──── resp_4 (previous = resp_1)  a fork: S has moved on, so resp_4 opens a new session
                                         (the engine's prefix cache still serves the shared
                                         prefix while it is on the device)

The prompt is always built from the previous response's own record (its conversation, stored
whole), never from the session: the session only decides which KV is reused. A response
continues its chain's session when that session's messages are exactly the conversation so far
(instructions included: OpenAI does not carry instructions over, so new instructions fork);
otherwise - a fork, a session continued or edited through another API, deleted or expired - the
turn runs in a new session, and the result is the same text either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatstore.api.common.chat_template import Message
from chatstore.api.common.errors import APIError
from chatstore.api.responses.store import ResponseStore
from chatstore.api.sessions.service import new_session_id, plain
from chatstore.store.ports import SessionKVAdmin


@dataclass(frozen=True)
class ChainTurn:
    messages: list[Message]  # what the model reads: instructions, the conversation, the input
    items: list[Message]  # the conversation through the new input (no instructions)
    session_id: str
    continues: bool  # the previous response's own session, whose KV matches as is


def plan_turn(
    store: SessionKVAdmin,
    tenant: str,
    previous_id: str | None,
    instructions: str | None,
    new_items: list[Message],
    keep: bool,
) -> ChainTurn:
    """The turn of a new response (blocking: reads records; one worker thread hop for both).
    keep=False (store=false): a session of its own, to be deleted after the turn. 404 when
    the previous response is unknown (or another tenant's)."""
    previous = None
    if previous_id is not None:
        previous = ResponseStore(store).get(tenant, previous_id)
        if previous is None:
            raise APIError(
                404,
                f"previous response {previous_id} not found",
                param="previous_response_id",
                code="not_found",
            )
    head = [{"role": "system", "content": instructions}] if instructions else []
    history = previous.items if previous is not None else []
    items = [*history, *new_items]
    messages = [*head, *items]
    if keep and previous is not None:
        record = store.get(tenant, previous.session_id)
        if record is not None and plain(record.messages) == [*head, *history]:
            return ChainTurn(messages, items, previous.session_id, True)
    return ChainTurn(messages, items, new_session_id(), False)
