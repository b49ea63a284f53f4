"""The response object of the Responses API, and its usage, as OpenAI's clients read them.

    {"id": "resp_…", "object": "response", "status": "completed" | "incomplete" | "failed" |
     "in_progress", "output": [{"type": "message", "content": [{"type": "output_text", …}]}],
     "usage": {"input_tokens", "input_tokens_details": {"cached_tokens"}, "output_tokens", …},
     … the request's settings echoed …}

Extensions beside OpenAI's fields (clients ignore them): `usage.cached_tokens_by_tier`,
`session_id` (the session holding the conversation's KV; null when not stored) and `timings`
(as the session API reports them).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypedDict

from chatstore.api.chat.turn import TurnResult
from chatstore.api.common.usage import cached_by_tier, timings
from chatstore.api.openai.logprobs import LogprobEntry

STATUS = {"stop": "completed", "length": "incomplete"}  # by the engine's finish reason


class OutputText(TypedDict):
    """An output_text content part of a message item."""

    type: str  # "output_text"
    text: str
    annotations: list[object]  # always empty
    logprobs: list[LogprobEntry]


class MessageItem(TypedDict):
    """The assistant's message output item."""

    id: str
    type: str  # "message"
    role: str  # "assistant"
    status: str
    content: list[OutputText]  # empty until the message's text begins


class FunctionCallItem(TypedDict):
    """A call of one of the request's tools, as an output item (output.py)."""

    id: str
    type: str  # "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: str


OutputItem = MessageItem | FunctionCallItem


def responses_usage(result: TurnResult) -> dict[str, object]:
    u = result.usage
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "cached_tokens_by_tier": cached_by_tier(u),
    }


def output_text(text: str, logprobs: list[LogprobEntry] | None = None) -> OutputText:
    """An output_text part; `logprobs`: its tokens' (OpenAI's logprobs.content entries), when
    the request includes message.output_text.logprobs."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(
    item_id: str, text: str | None, status: str, logprobs: list[LogprobEntry] | None = None
) -> MessageItem:
    """The assistant's output message; `text=None`: not begun (no content part yet)."""
    content = [] if text is None else [output_text(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content}  # fmt: skip


def turn_status(result: TurnResult) -> str:
    if result.error is not None:
        return "failed"
    return STATUS.get(result.finish_reasons[0] or "", "completed")


@dataclass(frozen=True)
class ResponseHead:
    """What a response object says before any token: its ids and the request's settings."""

    id: str
    item_id: str  # the output message's
    model: str
    instructions: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    store: bool
    user: str | None
    metadata: dict[str, str] = field(default_factory=dict)
    tools: list[dict[str, object]] = field(default_factory=list)  # as the request gave them
    tool_choice: object = "none"  # as the request gave it (echo_choice)
    parallel_tool_calls: bool = False
    top_logprobs: int | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str = "in_progress", **fields: object) -> dict[str, object]:
        """The response object; `fields` (output, usage, error, …) override the defaults."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": [],
            "usage": None,
            "error": None,
            "incomplete_details": None,
            "instructions": self.instructions,
            "previous_response_id": self.previous_response_id,
            "max_output_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "metadata": self.metadata,
            "store": self.store,
            "user": self.user,
            "parallel_tool_calls": self.parallel_tool_calls,
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "top_logprobs": self.top_logprobs,
            "text": {"format": {"type": "text"}},
            "truncation": "auto",  # the server drops the oldest history past the context
            "background": False,
            "reasoning": None,
            "session_id": None,
            **fields,
        }

    def finished(
        self,
        result: TurnResult,
        session_id: str | None,
        output: Sequence[OutputItem] | None = None,
    ) -> dict[str, object]:
        """The response object of a turn that ended (completed, incomplete or failed);
        `output`: its items (output.py), the reply as one message when not given."""
        status = turn_status(result)
        if status == "failed":
            error = {"code": "server_error", "message": f"generation failed: {result.error}"}
            return self.body("failed", error=error, usage=responses_usage(result))
        if output is None:
            output = [message_item(self.item_id, result.texts[0], status)]
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return self.body(
            status,
            output=output,
            usage=responses_usage(result),
            incomplete_details=incomplete,
            completed_at=int(time.time()) if status == "completed" else None,
            session_id=session_id,
            timings=timings(result),
        )
