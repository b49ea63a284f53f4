"""The HTTP API: OpenAI-compatible chat, sessions, WebSocket streaming, admin and metrics.

    common/     the app factory, errors, middleware, settings, auth and keys, the chat
                template, sampling, streaming, usage, running the server
    sessions/   /v1/sessions and its WebSocket; the chat service and the turn every surface uses
    openai/     /v1/chat/completions, /v1/models
    responses/  /v1/responses (routes, protocol; body, chain, events, store)
    admin/      /admin/*, /metrics and its history, the chat page and dashboard (static/)

Each surface is routes (a FastAPI router; no route module imports another), protocol (its
pydantic bodies) and what serves them. The session store is seen only through
chatstore.store.ports.SessionKVAdmin; what is served is built by chatstore.serving.
"""

from chatstore.api.common.app import Served, create_app
from chatstore.api.common.settings import ServerSettings

__all__ = ["Served", "ServerSettings", "create_app"]
