"""The session service's refusals that name no bad field: the server draining, a tenant at its
quota of sessions, an id already taken. Those a client may simply retry carry Retry-After."""

from __future__ import annotations

from chatstore.api.common.errors import APIError
from chatstore.api.common.settings import ServerSettings


def retry_after(settings: ServerSettings) -> dict[str, str]:
    return {"Retry-After": str(settings.retry_after_s)}


def draining(settings: ServerSettings) -> APIError:
    return APIError(503, "server is shutting down", code="draining", headers=retry_after(settings))


def too_many_sessions(settings: ServerSettings) -> APIError:
    limit = settings.max_sessions_per_tenant
    return APIError(
        429,
        f"tenant has {limit} sessions (max_sessions_per_tenant): delete some first",
        code="too_many_sessions",
        headers=retry_after(settings),
    )


def session_exists(sid: str) -> APIError:
    return APIError(409, f"session {sid} already exists", param="id", code="conflict")
