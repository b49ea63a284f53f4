"""The asyncio face of the engine: the model loop runs in its own thread.

    API (event loop)                         model thread
    submit(req) ── add_request ─────────────► scheduler.waiting
       │ RequestStream ◄── call_soon_threadsafe ── step() outputs
    abort(id)   ── abort_request ────────────► applied at the next step

`submit` validates on the caller's thread, so InvalidRequestError / EngineOverloadedError are
raised by `submit` itself. The stream it returns aborts its request when the consumer's task is
cancelled, when it is closed (`aclose`), or when it is dropped unfinished, so every block comes
back even if a client goes away mid-generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.kv_connector import KVConnector
from chatstore.engine.llm_engine import EngineStats, LLMEngine
from chatstore.engine.request import InvalidRequestError, Request, RequestOutput
from chatstore.engine.runtime import Runtime
from chatstore.engine.scheduler import WaitingEntry

log = logging.getLogger(__name__)


@dataclass
class _Route:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class RequestStream(AsyncIterator[RequestOutput]):
    """Outputs of one request, in order; ends after the output with `finished=True`."""

    def __init__(self, engine: AsyncEngine, request_id: str, route: _Route) -> None:
        self._engine = engine
        self.request_id = request_id
        self._queue = route.queue
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except asyncio.CancelledError:
            self._cancel()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        self._cancel()

    def _cancel(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    def __del__(self) -> None:
        if not self._done:
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(
        self, runtime: Runtime, config: EngineConfig, connector: KVConnector | None = None
    ) -> None:
        self.engine = LLMEngine(runtime, config, connector)
        self.config = config
        self.tokenizer = runtime.model.tokenizer
        self.spec = runtime.model.spec
        self.model = runtime.model
        self._routes: dict[str, _Route] = {}
        self._routes_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._accepting = True
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(target=self._loop, name="chatstore-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, request: Request) -> RequestStream:
        """Queue a request (call from a coroutine); returns the stream of its outputs."""
        if not self._accepting or not self.is_running:
            raise RuntimeError("engine is not running")
        route = _Route(asyncio.get_running_loop(), asyncio.Queue())
        with self._routes_lock:
            if request.request_id in self._routes:
                raise InvalidRequestError("request_id", f"{request.request_id!r} is in flight")
            self._routes[request.request_id] = route
        try:
            self.engine.add_request(request)
        except BaseException:
            with self._routes_lock:
                self._routes.pop(request.request_id, None)
            raise
        self._wake.set()
        return RequestStream(self, request.request_id, route)

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request ends with finish_reason "abort" at the next step."""
        self.engine.abort_request(request_id)
        self._wake.set()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def waiting_sessions(self) -> list[WaitingEntry]:
        return self.engine.waiting_sessions()

    async def shutdown(self, drain_timeout: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `drain_timeout` seconds,
        abort the rest, then stop the model thread."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        while self.is_running and self.engine.has_work() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        with self._routes_lock:
            pending = list(self._routes)
        for request_id in pending:
            self.abort(request_id)
        while self.is_running and self.engine.has_work() and loop.time() < deadline + 5:
            await asyncio.sleep(0.01)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # -- the model thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_work():
                self._wake.wait(self.config.idle_wait_s)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in the engine: fail everything, keep serving
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            for out in outputs:
                self._deliver(out)

    def _deliver(self, item: RequestOutput) -> None:
        with self._routes_lock:
            route = self._routes.get(item.request_id)
            if route is not None and item.finished:
                del self._routes[item.request_id]
        if route is None:
            return
        with contextlib.suppress(RuntimeError):  # the consumer's loop is closed
            route.loop.call_soon_threadsafe(route.queue.put_nowait, item)

    def _fail_all(self, exc: Exception) -> None:
        with self._routes_lock:
            routes, self._routes = self._routes, {}
        for request_id, route in routes.items():
            self.engine.abort_request(request_id)
            with contextlib.suppress(RuntimeError):
                route.loop.call_soon_threadsafe(route.queue.put_nowait, exc)
