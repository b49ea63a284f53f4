"""The HTTP API: OpenAI-compatible chat, sessions, WebSocket streaming, admin and metrics."""

from chatstore.api.common.app import Served, create_app
from chatstore.api.common.settings import ServerSettings

__all__ = ["Served", "ServerSettings", "create_app"]
