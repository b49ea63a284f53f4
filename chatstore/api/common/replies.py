"""A finished turn as OpenAI's `choices` (the chat completion and the session reply both
carry them)."""

from __future__ import annotations

from typing import NotRequired, TypedDict

from chatstore.api.chat.turn import TurnResult
from chatstore.api.openai.logprobs import ChoiceLogprobs


class ChoiceMessage(TypedDict):
    """A choice's `message`: the reply's text; with tools, the calls it makes (content None
    when the reply is only calls: api/tools/replies.py)."""

    role: str
    content: str | None
    tool_calls: NotRequired[list[dict[str, object]]]


class Choice(TypedDict):
    index: int
    message: ChoiceMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None


def finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def message_choices(result: TurnResult) -> list[Choice]:
    """One OpenAI `choices` entry per sample of a finished turn."""
    return [
        {
            "index": i,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason(result.finish_reasons[i]),
            "logprobs": None,
        }
        for i, text in enumerate(result.texts)
    ]
