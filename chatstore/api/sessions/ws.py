"""WebSocket /v1/sessions/{id}/ws: a session's turns over one connection.

client -> server (JSON text frames)
    {"type": "message", "content": "...", ...sampling fields}   start a turn
    {"type": "typing"}                                         hint: prefetch the session's KV
    {"type": "cancel"}                                         abort the running turn
    {"type": "ping"}
server -> client
    {"type": "ready", "session_id"}
    {"type": "start", "id"}  {"type": "delta", "index", "text", "t"}...  {"type": "done", ...reply}
    {"type": "cancelled", "id"}  {"type": "error", "error": {...}}  {"type": "pong"}

A delta's "t" is the server's wall clock as it sends the frame (epoch milliseconds, a float): a
client on the same host can measure its own overhead, server token to token on screen.

A cancel, or the client going away, aborts the turn in the engine, which frees its blocks.
Auth: the Authorization header, or ?api_key=... for clients that cannot set headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from chatstore.api.chat.service import ChatService
from chatstore.api.chat.turn import Turn
from chatstore.api.common.auth import Principal, tenant_principal
from chatstore.api.common.errors import APIError, error_body, store_error
from chatstore.api.common.protocol import SESSION_ID_PATTERN
from chatstore.api.sessions.bodies import reply_body
from chatstore.api.sessions.message import session_turn_spec, shown_deltas
from chatstore.api.sessions.protocol import SessionMessageRequest
from chatstore.store.ports import RecordStoreError

router = APIRouter(tags=["websocket"])
log = logging.getLogger("chatstore.api")


class SessionSocket:
    def __init__(self, ws: WebSocket, service: ChatService, tenant: str, sid: str) -> None:
        self.ws = ws
        self.service = service
        self.tenant = tenant
        self.sid = sid
        self._send_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._turn: Turn | None = None

    async def send(self, message: dict[str, object]) -> None:
        async with self._send_lock:
            await self.ws.send_text(json.dumps(message, separators=(",", ":")))

    async def error(self, exc: APIError) -> None:
        await self.send({"type": "error", **exc.body()})

    async def serve(self) -> None:
        await self.send({"type": "ready", "session_id": self.sid})
        try:
            while True:
                frame = await self.ws.receive()
                if frame["type"] == "websocket.disconnect":
                    break
                raw = frame.get("text") or (frame.get("bytes") or b"").decode("utf-8", "replace")
                limit = self.service.settings.max_body_bytes
                if len(raw) > limit:  # the same cap as an HTTP body
                    await self.error(APIError(413, f"frame over {limit} bytes", code="too_large"))
                    continue
                try:
                    await self.handle(raw)
                except WebSocketDisconnect:
                    raise
                except Exception:  # one bad frame must not drop the connection
                    log.exception("websocket frame failed on session %s", self.sid)
                    await self.error(APIError(500, "internal server error", code="internal_error"))
        except WebSocketDisconnect:
            pass
        finally:
            await self.cancel()

    async def handle(self, raw: str) -> None:
        try:
            message = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested too deep
            return await self.error(APIError(400, "frame is not valid JSON", code="invalid_json"))
        kind = message.get("type") if isinstance(message, dict) else None
        if kind == "message":
            return await self.start(message)
        if kind == "cancel":
            return await self.cancel()
        if kind == "typing":
            await asyncio.to_thread(self.service.store.hint, self.tenant, self.sid)
            return None
        if kind == "ping":
            return await self.send({"type": "pong"})
        return await self.error(APIError(400, f"unknown frame type {kind!r}", param="type"))

    async def start(self, message: dict[str, object]) -> None:
        if self._task is not None and not self._task.done():
            return await self.error(APIError(409, "a turn is in progress", code="session_busy"))
        started = time.perf_counter()
        message.pop("type", None)
        try:
            body = SessionMessageRequest.model_validate(message)
            spec = await session_turn_spec(
                body, self.service, self.tenant, self.sid, started, api="websocket"
            )
            turn = await self.service.open_turn(spec)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"])
            return await self.error(APIError(400, f"{param}: {err['msg']}", param=param))
        except APIError as exc:
            return await self.error(exc)
        except RecordStoreError as exc:
            return await self.error(store_error(exc))
        self._turn = turn
        self._task = asyncio.create_task(self.run(turn))

    async def run(self, turn: Turn) -> None:
        try:
            await self.send({"type": "start", "id": turn.request_id})
            async for delta in shown_deltas(turn):
                frame = {"type": "delta", "index": delta.index, "text": delta.text}
                await self.send({**frame, "t": round(time.time() * 1000, 3)})
            result = turn.result
            assert result is not None
            if result.error is not None:
                err = error_body(500, f"generation failed: {result.error}", code="engine_error")
                await self.send({"type": "error", **err})
            elif turn.save_error is not None:
                await self.error(turn.save_error)
            else:
                await self.send({"type": "done", **reply_body(turn, result)})
        except (WebSocketDisconnect, RuntimeError):
            pass  # the client went away; close() below aborts the turn
        finally:
            turn.close()

    async def cancel(self) -> None:
        task, turn = self._task, self._turn
        if task is None or task.done() or turn is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        turn.close()
        with contextlib.suppress(Exception):
            await self.send({"type": "cancelled", "id": turn.request_id})


@router.websocket("/v1/sessions/{session_id}/ws")
async def session_ws(ws: WebSocket, session_id: str) -> None:
    await ws.accept()
    service: ChatService = ws.app.state.service
    try:
        principal: Principal = tenant_principal(ws)
        if not _valid_id(session_id):
            raise APIError(404, f"session {session_id[:64]} not found", code="not_found")
        await asyncio.to_thread(service.get_session, principal.tenant, session_id)
    except RecordStoreError as exc:
        error = store_error(exc)
        await ws.send_text(json.dumps({"type": "error", **error.body()}))
        await ws.close(code=4000 + error.status)
        return
    except APIError as exc:
        await ws.send_text(json.dumps({"type": "error", **exc.body()}))
        await ws.close(code=4000 + exc.status)
        return
    await SessionSocket(ws, service, principal.tenant, session_id).serve()


def _valid_id(sid: str) -> bool:
    import re

    return re.fullmatch(SESSION_ID_PATTERN, sid) is not None
