"""Operator endpoints: /admin/* (admin key) and the open health probes.

GET  /admin/cache        per tier: capacity, used bytes, sessions, hits, misses, bytes moved
                         up/down, evictions, prefetches, hit rate (the device tier first: the
                         engine's block pool and prefix cache, also with kv_store = "off";
                         `hit_rate` is the store tiers'), write failures (writes a tier did
                         not take: `write_failures`, and by reason map_full / disk_full /
                         error in `write_failures_by_reason`); engine queue and block pool;
                         the remote tier's circuit breaker (null without Redis); `sessions`:
                         the first page of /admin/cache/sessions; `open_failures`: stored
                         values that failed to open (encryption at rest), per slow tier and
                         `records`
GET  /admin/cache/sessions  per session (newest first, paginated, ?tenant=): retention
                         (priority, ttl_s, expires_at) and where its KV is, tokens/bytes per tier
GET  /admin/sessions     every tenant's sessions (paginated)
POST /admin/cache/flush  drop this replica's cached session KV (records stay; next turns
                         recompute); ?shared=true: the shared tier's (Redis) chunks too
DELETE /admin/tenants/{tenant}/data  crypto-shred: destroy the tenant's data key (every sealed
                         copy of its data stops opening at once), then purge its sessions, KV
                         and stored Responses
POST /admin/keys/rotate  master-key rotation: every data key wrapped by the newest master key
POST /admin/keys/rotate-data  new data keys, every value re-sealed, old keys dropped; and
POST /admin/keys/encrypt-existing  seal values written in the clear; and
POST /admin/keys/migrate-v1  re-seal the records sealed by version 1 (keys derived from the
                         old secret, which the server is given as CHATSTORE_LEGACY_SECRET_FILE
                         or _KEY, never in a request): background jobs, resumable from their
                         saved cursor; GET /admin/keys/rotation: progress
GET  /healthz            the process is up
GET  /readyz             the engine is started and not draining (503 otherwise)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from chatstore.api.admin.tiers import cache_tiers
from chatstore.api.chat.service import ChatService
from chatstore.api.common.auth import Principal, admin_principal
from chatstore.api.common.errors import APIError, store_error
from chatstore.api.sessions.bodies import session_info
from chatstore.store.ports import RecordStoreError, SessionRecord, TierStats, store_hits
from chatstore.store.sealing.errors import KeyUnavailable, ShredFailed

CACHE_SESSIONS_SHOWN = 50  # rows of the session table inlined in /admin/cache
# The pagination of every admin listing.
Offset = Annotated[int, Query(ge=0, le=1_000_000)]
Limit = Annotated[int, Query(ge=1, le=100)]
TenantFilter = Annotated[str | None, Query(max_length=256)]

router = APIRouter(tags=["admin"])
Admin = Annotated[Principal, Depends(admin_principal)]


def tier_body(t: TierStats) -> dict[str, object]:
    """A tier's line: its TierStats, hit rate, and write failures in all (by reason:
    write_failures_by_reason)."""
    return {**dataclasses.asdict(t), "hit_rate": t.hit_rate, "write_failures": t.write_failures}


def engine_body(service: ChatService) -> dict[str, object]:
    raw = service.engine.stats()
    stats: dict[str, object] = dict(raw.as_dict())
    if raw.block_usage is not None:
        stats["block_usage"] = round(raw.block_usage, 4)
    # The resolved compute dtype: `dtype = "auto"` picks it per machine.
    stats["dtype"] = str(service.engine.model.dtype).removeprefix("torch.")
    return stats


@router.get("/admin/cache")
def cache_stats(request: Request, _: Admin) -> dict[str, object]:
    service: ChatService = request.app.state.service
    tiers = cache_tiers(service.engine.stats(), service.store)
    hits, misses = store_hits(tiers)
    return {
        "tiers": [tier_body(t) for t in tiers],
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "engine": engine_body(service),
        "remote_breaker": service.store.remote_health(),
        "sessions": _sessions_or_error(service),
        "open_failures": service.store.open_failures(),
    }


def _sessions_or_error(service: ChatService) -> dict[str, object]:
    """The first page of the session table; when the records store is down (Redis outage),
    an empty table saying why: the tier and breaker numbers above must still answer."""
    try:
        return session_table(service, None, 0, CACHE_SESSIONS_SHOWN)
    except RecordStoreError as exc:
        return {
            "object": "list",
            "data": [],
            "has_more": False,
            "next_offset": None,
            "total": None,
            "error": str(exc),
        }


def session_row(service: ChatService, record: SessionRecord) -> dict[str, object]:
    """One session's retention and KV placement (kv_tiers: fastest first)."""
    placement = service.store.placement(record.tenant, record.session_id)
    by_tier = placement.bytes_by_tier if placement is not None else {}
    tokens = placement.tokens_by_tier if placement is not None else {}
    return {
        "id": record.session_id,
        "tenant": record.tenant,
        "priority": record.priority,
        "ttl_s": record.ttl_s,
        "expires_at": record.expires_at,
        "updated_at": record.updated_at,
        "kv_location": service.store.kv_location(record.tenant, record.session_id),
        "kv_tiers": [t for t in ("dram", "ssd", "remote") if tokens.get(t)],
        "kv_tokens": sum(tokens.values()),
        "kv_bytes": sum(by_tier.values()),
        "kv_tokens_by_tier": tokens,
        "kv_bytes_by_tier": by_tier,
    }


def session_page(
    service: ChatService,
    tenant: str | None,
    offset: int,
    limit: int,
    row: Callable[[ChatService, SessionRecord], dict[str, object]],
) -> dict[str, object]:
    """One page of every tenant's sessions (or one tenant's), newest first, as `row` shows
    each."""
    records, total = service.store.list_sessions(tenant, offset, limit)
    more = offset + len(records) < total
    return {
        "object": "list",
        "data": [row(service, r) for r in records],
        "has_more": more,
        "next_offset": offset + len(records) if more else None,
        "total": total,
    }


def session_table(
    service: ChatService, tenant: str | None, offset: int, limit: int
) -> dict[str, object]:
    return session_page(service, tenant, offset, limit, session_row)


@router.get("/admin/cache/sessions")
def cache_sessions(
    request: Request,
    _: Admin,
    offset: Offset = 0,
    limit: Limit = 20,
    tenant: TenantFilter = None,
) -> dict[str, object]:
    return session_table(request.app.state.service, tenant, offset, limit)


@router.get("/admin/sessions")
def all_sessions(
    request: Request,
    _: Admin,
    offset: Offset = 0,
    limit: Limit = 20,
    tenant: TenantFilter = None,
) -> dict[str, object]:
    service: ChatService = request.app.state.service
    return session_page(service, tenant, offset, limit, _listed_session)


def _listed_session(service: ChatService, record: SessionRecord) -> dict[str, object]:
    return {**session_info(service, record, False), "tenant": record.tenant}


@router.post("/admin/cache/flush")
def flush_cache(request: Request, _: Admin, shared: bool = False) -> dict[str, object]:
    """This replica's tiers only; `?shared=true` also empties the shared tier (Redis) of the
    model's chunks, for every replica (they recompute)."""
    service: ChatService = request.app.state.service
    return {"flushed_sessions": service.store.flush(shared), "shared": shared}


@router.delete("/admin/tenants/{tenant}/data")
def shred_tenant(request: Request, tenant: str, _: Admin) -> dict[str, object]:
    """Crypto-shred one tenant: its key first, then its data (SessionKVAdmin.shred_tenant)."""
    service: ChatService = request.app.state.service
    try:
        purged = service.store.shred_tenant(tenant)
    except RecordStoreError as exc:
        raise store_error(exc) from None
    except ShredFailed as exc:  # the key store did not take it: nothing was destroyed
        raise APIError(503, str(exc), code="shred_not_shared") from None
    return {"tenant": tenant, "key_destroyed": True, **purged}


@router.post("/admin/keys/rotate")
def rotate_keys(request: Request, _: Admin) -> dict[str, object]:
    """Master-key rotation: every data key wrapped by the newest master key (no data moves)."""
    service: ChatService = request.app.state.service
    try:
        rewrapped = service.store.rewrap_keys()
    except KeyUnavailable as exc:  # a data key wrapped by a master key this server lacks
        raise APIError(409, str(exc), code="key_unavailable") from None
    if rewrapped is None:
        raise APIError(409, "encryption at rest is off: there are no keys to rotate")
    return {"rewrapped_tenants": rewrapped}


@router.post("/admin/keys/rotate-data", status_code=202)
def rotate_data_keys(request: Request, _: Admin) -> dict[str, object]:
    """New data keys for every tenant, every value re-sealed under them, the old ones dropped:
    in the background, resumable (GET /admin/keys/rotation)."""
    return _start_job(request, "data-keys")


@router.post("/admin/keys/encrypt-existing", status_code=202)
def encrypt_existing(request: Request, _: Admin) -> dict[str, object]:
    """Seal the values written in the clear (encrypt_at_rest = false) in the background."""
    return _start_job(request, "encrypt-existing")


@router.post("/admin/keys/migrate-v1", status_code=202)
def migrate_v1(request: Request, _: Admin) -> dict[str, object]:
    """Re-seal the records sealed by version 1 under the tenants' data keys, in the background
    (KV chunks are a cache: recomputed). 409 when the server was given no legacy secret."""
    return _start_job(request, "migrate-v1")


def _start_job(request: Request, job: str) -> dict[str, object]:
    service: ChatService = request.app.state.service
    try:
        progress = service.store.rotate_keys(job)
    except ValueError as exc:  # the store's KeyringError: migrate-v1 without its secret
        raise APIError(409, str(exc), code="legacy_secret_missing") from None
    if progress is None:
        raise APIError(409, "encryption at rest is off: there is nothing to seal")
    return progress


@router.get("/admin/keys/rotation")
def rotation(request: Request, _: Admin) -> dict[str, object]:
    service: ChatService = request.app.state.service
    progress = service.store.rotation_progress()
    if progress is None:
        raise APIError(409, "encryption at rest is off: there are no keys to rotate")
    return progress


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"description": "starting, draining or engine failed"}})
def readyz(request: Request) -> Any:
    service: ChatService | None = getattr(request.app.state, "service", None)
    engine = getattr(service, "engine", None)
    if not getattr(engine, "alive", True):  # engines without the property count as alive
        body = {"status": "engine_failed", "error": getattr(engine, "failure", None)}
        return JSONResponse(body, status_code=503)
    if service is None or service.draining:
        state = "draining" if service is not None else "starting"
        return JSONResponse({"status": state}, status_code=503)
    return {"status": "ready"}
