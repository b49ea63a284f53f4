"""Server-sent events: `data: <json>\\n\\n` frames, ending with `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def sse_response(
    events: AsyncIterator[bytes], headers: dict[str, str] | None = None
) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})}
    )
