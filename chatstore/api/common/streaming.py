"""Server-sent events: `data: <json>\\n\\n` frames, ending with `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# One encoder for every frame: json.dumps with non-default arguments builds a new one per call,
# and a stream writes a frame per token.
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode


def sse(data: dict[str, object] | str) -> bytes:
    payload = data if isinstance(data, str) else _ENCODE(data)
    return f"data: {payload}\n\n".encode()


def sse_response(
    events: AsyncIterator[bytes], headers: dict[str, str] | None = None
) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})}
    )
