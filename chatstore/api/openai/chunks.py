"""A chat completion streamed as `chat.completion.chunk` SSE frames: a role delta per sample,
content deltas (with their tokens' logprobs when asked), tool-call deltas when the request has
tools (api/tools/replies.py), a finish delta per sample, usage, `[DONE]`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import NamedTuple

from chatstore.api.chat.turn import Turn
from chatstore.api.common.errors import error_body
from chatstore.api.common.replies import finish_reason
from chatstore.api.common.streaming import sse
from chatstore.api.common.usage import usage_body
from chatstore.api.openai.logprobs import ChoiceLogprobs, TokenBytes, choice_logprobs
from chatstore.api.tools.formats import ToolFormat
from chatstore.api.tools.replies import ToolDeltas
from chatstore.engine.request import SampleDelta


class ToolForm(NamedTuple):
    """How to read tool calls out of the replies of a request that has tools."""

    fmt: ToolFormat
    parallel: bool


async def completion_chunks(
    turn: Turn,
    model: str,
    include_usage: bool,
    token_bytes: TokenBytes,
    form: ToolForm | None = None,
) -> AsyncIterator[bytes]:
    base = {
        "id": turn.request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
    }
    extra = {"usage": None} if include_usage else {}
    tools = [ToolDeltas(form.fmt, form.parallel) for _ in range(turn.n)] if form else None

    def chunk(
        index: int,
        delta: dict[str, object],
        reason: str | None = None,
        logprobs: ChoiceLogprobs | None = None,
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return sse({**base, "choices": [choice], **extra})

    try:
        for i in range(turn.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for delta in turn.deltas():
            logprobs = choice_logprobs(delta.logprobs, token_bytes) if delta.logprobs else None
            for body in _bodies(delta, tools, logprobs is not None):
                yield chunk(delta.index, body, logprobs=logprobs)
                logprobs = None  # the delta's entries go out once, with its first chunk
            if delta.finish_reason:
                reason = finish_reason(delta.finish_reason)
                if tools is not None and tools[delta.index].calls:
                    reason = "tool_calls"
                yield chunk(delta.index, {}, reason)
        result = turn.result
        assert result is not None
        if result.error is not None:
            yield sse(error_body(500, f"generation failed: {result.error}", code="engine_error"))
        elif turn.save_error is not None:
            yield sse(turn.save_error.body())
        elif include_usage:
            yield sse({**base, "choices": [], "usage": usage_body(result)})
        yield sse("[DONE]")
    finally:
        turn.close()


def _bodies(
    delta: SampleDelta, tools: list[ToolDeltas] | None, has_logprobs: bool
) -> list[dict[str, object]]:
    """The `delta` objects one engine delta becomes (at least one when it carries logprobs:
    a token whose text is held back still reports its logprob, with content "")."""
    if tools is None:
        bodies: list[dict[str, object]] = [{"content": delta.text}] if delta.text else []
    else:
        parser = tools[delta.index]
        bodies = parser.feed(delta.text)
        if delta.finish_reason:
            bodies += parser.finish()
    if has_logprobs and not bodies:
        bodies = [{"content": ""}]
    return bodies
