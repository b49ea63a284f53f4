"""The app factory: routers per concern over one ChatService (engine + store + template).

What it serves is built elsewhere: `chatstore.serving.build(config)` (the composition root)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Protocol, TypeVar

from fastapi import FastAPI

from chatstore.api.admin import history_routes, pages
from chatstore.api.admin import metrics as metrics_routes
from chatstore.api.admin import routes as admin_routes
from chatstore.api.admin.metrics import Metrics
from chatstore.api.admin.tiers import CacheTiers
from chatstore.api.chat.service import ChatService
from chatstore.api.common.chat_template import ChatTemplate
from chatstore.api.common.engine_client import EngineClient
from chatstore.api.common.errors import install_error_handlers
from chatstore.api.common.middleware import APIMiddleware
from chatstore.api.common.settings import ServerSettings
from chatstore.api.openai import routes as openai_routes
from chatstore.api.responses import routes as responses_routes
from chatstore.api.sessions import routes as session_routes
from chatstore.api.sessions import ws
from chatstore.store.ports import SessionKVAdmin, TierStats

log = logging.getLogger("chatstore.api")
T = TypeVar("T")
D = TypeVar("D")


class Served(Protocol):
    """What the API serves (chatstore.serving.Serving is one): a started-or-startable engine,
    the session store, the chat template, the model's vocabulary and name."""

    @property
    def engine(self) -> EngineClient: ...
    @property
    def store(self) -> SessionKVAdmin: ...
    @property
    def template(self) -> ChatTemplate: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def model_name(self) -> str | None:
        """What /v1/models lists (None: settings.model_name)."""

    def close(self) -> None:
        """After the engine drained: flush and release the store and what feeds it."""


def create_app(served: Served, settings: ServerSettings) -> FastAPI:
    """A FastAPI app over `served`. Its lifespan starts the engine and, on shutdown, drains it
    (finishing or aborting in-flight turns) and closes (flushes) the store."""
    if served.model_name:
        settings = replace(settings, model_name=served.model_name)
    app_metrics = Metrics()
    service = ChatService(
        served.engine,
        served.store,
        served.template,
        settings,
        vocab_size=served.vocab_size,
        on_turn_end=app_metrics.observe_turn,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.engine.start()
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
            await shutdown(service, settings.drain_timeout_s, served.close)

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
    tiers = CacheTiers(served.engine, served.store)
    no_tiers: list[TierStats] = []
    app_metrics.attach_state(_safe(served.engine.stats, None), _safe(tiers, no_tiers))
    install_error_handlers(app)
    routers = (openai_routes, responses_routes, session_routes, ws, admin_routes, metrics_routes)
    for module in (*routers, pages, history_routes):
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


async def shutdown(service: ChatService, drain_timeout: float, close: Callable[[], None]) -> None:
    service.draining = True
    try:
        result = service.engine.shutdown(drain_timeout)
        if inspect.isawaitable(result):
            await result
    finally:
        close()
        log.info("chatstore: engine drained, store flushed")


def _safe(fn: Callable[[], T], default: D) -> Callable[[], T | D]:
    def call() -> T | D:
        try:
            return fn()
        except Exception:
            log.exception("reading stats failed")
            return default

    return call
