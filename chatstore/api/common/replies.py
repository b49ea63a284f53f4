"""A finished turn as OpenAI's `choices` (the chat completion and the session reply both
carry them)."""

from __future__ import annotations

from typing import Any

from chatstore.api.sessions.turn import TurnResult


def finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def message_choices(result: TurnResult) -> list[dict[str, Any]]:
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
