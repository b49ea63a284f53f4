"""The HTTP API: OpenAI-compatible chat, sessions, WebSocket streaming, admin and metrics."""

from chatstore.api.app import Served, create_app
from chatstore.api.settings import ServerSettings

__all__ = ["Served", "ServerSettings", "create_app"]
