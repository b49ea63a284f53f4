"""The app factory: routers per concern over one ChatService (engine + store + template)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI

from chatstore.api import admin, metrics, openai_routes, pages, responses_routes, session_routes, ws
from chatstore.api.chat_service import ChatService
from chatstore.api.chat_template import ChatTemplate
from chatstore.api.errors import install_error_handlers
from chatstore.api.metrics import Metrics
from chatstore.api.middleware import APIMiddleware
from chatstore.api.settings import ServerSettings
from chatstore.api.store_port import SessionStorePort

log = logging.getLogger("chatstore.api")


@dataclass
class Backend:
    """What the API serves: a started-or-startable engine, the session store, the model's shape."""

    engine: Any  # chatstore.engine.async_engine.AsyncEngine
    store: SessionStorePort
    template: ChatTemplate
    max_context: int
    vocab_size: int
    model_name: str | None = None  # what /v1/models lists (default: settings.model_name)
    on_shutdown: list[Callable[[], None]] = field(default_factory=list)  # after the store closes


def create_app(backend: Backend, settings: ServerSettings) -> FastAPI:
    """A FastAPI app over `backend`. Its lifespan starts the engine and, on shutdown, drains it
    (finishing or aborting in-flight turns) and closes (flushes) the store."""
    if backend.model_name:
        settings = replace(settings, model_name=backend.model_name)
    app_metrics = Metrics()
    service = ChatService(
        backend.engine,
        backend.store,
        backend.template,
        settings,
        max_context=backend.max_context,
        vocab_size=backend.vocab_size,
        on_turn_end=app_metrics.observe_turn,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend.engine.start()
        app.state.ready = True
        purger = None
        if settings.purge_interval_s > 0:
            purger = asyncio.create_task(purge_periodically(service, settings.purge_interval_s))
        try:
            yield
        finally:
            if purger is not None:
                purger.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await purger
            try:
                await shutdown(service, settings.drain_timeout_s)
            finally:
                for close in backend.on_shutdown:
                    close()

    app = FastAPI(
        title="chatstore",
        version="0.1.0",
        summary="Multi-turn chat whose sessions keep their KV cache across turns",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.service = service
    app.state.metrics = app_metrics
    app.state.started_at = int(time.time())
    app_metrics.attach_state(_safe(backend.engine.stats), _safe(backend.store.tier_stats, []))
    install_error_handlers(app)
    for module in (openai_routes, responses_routes, session_routes, ws, admin, metrics, pages):
        app.include_router(module.router)
    app.add_middleware(APIMiddleware, max_body_bytes=settings.max_body_bytes)
    return app


async def purge_periodically(service: ChatService, interval_s: float) -> None:
    """Delete expired sessions (records and KV) every interval, off the event loop."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            gone = await asyncio.to_thread(service.purge_expired)
        except Exception:
            log.exception("purging expired sessions failed")
            continue
        if gone:
            log.info("purged %d expired sessions", gone)


async def shutdown(service: ChatService, drain_timeout: float) -> None:
    service.draining = True
    try:
        result = service.engine.shutdown(drain_timeout)
        if inspect.isawaitable(result):
            await result
    finally:
        service.store.close()
        log.info("chatstore: engine drained, store flushed")


def _safe(fn: Any, default: Any = None) -> Any:
    def call() -> Any:
        try:
            return fn()
        except Exception:
            log.exception("reading stats failed")
            return default

    return call
