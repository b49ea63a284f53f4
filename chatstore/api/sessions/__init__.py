"""The session API (/v1/sessions, its WebSocket) and the services every surface shares: the
chat service (a turn opened, run and saved) and the turn."""
