"""API keys -> tenants, and the admin key.

    Authorization: Bearer <key>      (WebSocket clients may also pass ?api_key=<key>)

With no key configured the server runs in local single-user mode: every caller is the tenant
"local" and may use the admin endpoints (the server then only listens on loopback and answers
only to loopback Host names, see origin_policy.py). Otherwise a tenant key grants the tenant's
own sessions and nothing else; the admin key grants /admin, and /metrics too when
`metrics_auth` is set.

Keys are checked against hashes only (api_keys.py: plain configured keys peppered at start, the
keys file's scrypt hashes). Every refusal is counted in /metrics as
chatstore_auth_failures_total{reason}: missing (no key), malformed (not `Bearer <key>`),
invalid (no such key), revoked (a revoked key of the keys file), forbidden (a valid key on an
endpoint it does not grant).
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection

from chatstore.api.common.api_keys import INVALID, Verdict, peppered
from chatstore.api.common.errors import APIError
from chatstore.api.common.settings import LOCAL_TENANT, ServerSettings


@dataclass(frozen=True)
class Principal:
    tenant: str
    is_admin: bool = False


def _presented_key(conn: HTTPConnection) -> str | None:
    header = conn.headers.get("authorization")
    if header:
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise _refused(
                conn, "malformed", "Authorization header must be 'Bearer <key>'", "invalid_api_key"
            )
        return key.strip()
    return conn.query_params.get("api_key") if conn.scope["type"] == "websocket" else None


def _refused(
    conn: HTTPConnection, reason: str, message: str, code: str, status: int = 401
) -> APIError:
    metrics = getattr(conn.app.state, "metrics", None)
    if metrics is not None:
        metrics.observe_auth_failure(reason)
    return APIError(status, message, code=code)


def verify_key(key: str, settings: ServerSettings) -> Verdict:
    """Who key belongs to: the configured keys' hashes, then the keys file."""
    digest = peppered(key)
    verdict = settings.api_keys.match(digest)  # type: ignore[union-attr]
    if verdict is None and settings.key_file is not None:
        verdict = settings.key_file.check(key, digest)
    return verdict or INVALID


def authenticate(conn: HTTPConnection, settings: ServerSettings) -> Principal:
    if settings.local_mode:
        return Principal(LOCAL_TENANT, is_admin=True)
    key = _presented_key(conn)
    if key is None:
        raise _refused(
            conn, "missing", "missing API key (Authorization: Bearer <key>)", "missing_api_key"
        )
    verdict = verify_key(key, settings)
    if verdict.tenant is None:
        raise _refused(conn, verdict.refused or "invalid", "invalid API key", "invalid_api_key")
    return Principal(verdict.tenant, is_admin=verdict.is_admin)


def tenant_principal(conn: HTTPConnection) -> Principal:
    """FastAPI dependency: the caller's tenant (the admin key is not a tenant)."""
    principal = authenticate(conn, conn.app.state.settings)
    if principal.is_admin and not conn.app.state.settings.local_mode:
        raise _refused(
            conn, "forbidden", "the admin key cannot use tenant endpoints", "forbidden", 403
        )
    return principal


def admin_principal(conn: HTTPConnection) -> Principal:
    """FastAPI dependency: the admin (or the single user in local mode)."""
    principal = authenticate(conn, conn.app.state.settings)
    if not principal.is_admin:
        raise _refused(conn, "forbidden", "admin endpoints need the admin key", "forbidden", 403)
    return principal


def guard_metrics(conn: HTTPConnection) -> None:
    """/metrics needs the admin key only when `metrics_auth` asks for it: Prometheus scrapers
    usually hold no key, and in local mode there is none to ask for."""
    settings: ServerSettings = conn.app.state.settings
    if settings.metrics_auth and not settings.local_mode:
        admin_principal(conn)
