"""GET /admin/history: the cache's recent samples (admin/history.py), sampled for the app's
life (this router's lifespan)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request

from chatstore.api.admin.history import DEFAULT_INTERVAL_S, sampling
from chatstore.api.common.auth import Principal, admin_principal

router = APIRouter(tags=["admin"], lifespan=sampling)
Admin = Annotated[Principal, Depends(admin_principal)]


@router.get("/admin/history")
def history(
    request: Request,
    _: Admin,
    since: Annotated[float | None, Query(ge=0, description="epoch seconds")] = None,
) -> dict[str, object]:
    """Samples newer than `since` (all kept ones without it), oldest first."""
    samples = request.app.state.metrics.history.since(since)
    return {
        "object": "list",
        "interval_s": DEFAULT_INTERVAL_S,
        "data": [dataclasses.asdict(s) for s in samples],
    }
