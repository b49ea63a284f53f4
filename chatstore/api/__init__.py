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

__all__ = ["Served", "ServerSettings", "create_app"]


def __getattr__(name: str) -> object:
    # Imported on use, not with the package: a module under chatstore.api (the CLI's key
    # commands, the server's settings) must not pull in FastAPI and every route with it.
    if name in ("Served", "create_app"):
        from chatstore.api.common import app

        return getattr(app, name)
    if name == "ServerSettings":
        from chatstore.api.common.settings import ServerSettings

        return ServerSettings
    raise AttributeError(f"module 'chatstore.api' has no attribute {name!r}")
