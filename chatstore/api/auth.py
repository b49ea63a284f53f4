"""API keys -> tenants, and the admin key.

    Authorization: Bearer <key>      (WebSocket clients may also pass ?api_key=<key>)

With no key configured the server runs in local single-user mode: every caller is the tenant
"local" and may use the admin endpoints (the server then only listens on loopback and answers
only to loopback Host names, see origin_policy.py). Otherwise a tenant key grants the tenant's
own sessions and nothing else; the admin key grants /admin, and /metrics too when
`metrics_auth` is set.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from starlette.requests import HTTPConnection

from chatstore.api.errors import APIError
from chatstore.api.settings import LOCAL_TENANT, ServerSettings


@dataclass(frozen=True)
class Principal:
    tenant: str
    is_admin: bool = False


def _presented_key(conn: HTTPConnection) -> str | None:
    header = conn.headers.get("authorization")
    if header:
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(
                401, "Authorization header must be 'Bearer <key>'", code="invalid_api_key"
            )
        return key.strip()
    return conn.query_params.get("api_key") if conn.scope["type"] == "websocket" else None


def _match(key: str, candidates: dict[str, str]) -> str | None:
    found = None
    for candidate, tenant in candidates.items():  # constant time per candidate
        if hmac.compare_digest(key.encode(), candidate.encode()):
            found = tenant
    return found


def authenticate(conn: HTTPConnection, settings: ServerSettings) -> Principal:
    if settings.local_mode:
        return Principal(LOCAL_TENANT, is_admin=True)
    key = _presented_key(conn)
    if key is None:
        raise APIError(401, "missing API key (Authorization: Bearer <key>)", code="missing_api_key")
    if settings.admin_key and hmac.compare_digest(key.encode(), settings.admin_key.encode()):
        return Principal("admin", is_admin=True)
    tenant = _match(key, settings.api_keys)
    if tenant is None:
        raise APIError(401, "invalid API key", code="invalid_api_key")
    return Principal(tenant)


def tenant_principal(conn: HTTPConnection) -> Principal:
    """FastAPI dependency: the caller's tenant (the admin key is not a tenant)."""
    principal = authenticate(conn, conn.app.state.settings)
    if principal.is_admin and not conn.app.state.settings.local_mode:
        raise APIError(403, "the admin key cannot use tenant endpoints", code="forbidden")
    return principal


def admin_principal(conn: HTTPConnection) -> Principal:
    """FastAPI dependency: the admin (or the single user in local mode)."""
    principal = authenticate(conn, conn.app.state.settings)
    if not principal.is_admin:
        raise APIError(403, "admin endpoints need the admin key", code="forbidden")
    return principal


def guard_metrics(conn: HTTPConnection) -> None:
    """/metrics needs the admin key only when `metrics_auth` asks for it: Prometheus scrapers
    usually hold no key, and in local mode there is none to ask for."""
    settings: ServerSettings = conn.app.state.settings
    if settings.metrics_auth and not settings.local_mode:
        admin_principal(conn)
