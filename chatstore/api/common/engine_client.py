"""What the API asks of the engine: `chatstore.engine.async_engine.AsyncEngine` is one, a test's
stand-in another."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Protocol

import torch

from chatstore.engine.engine_stats import EngineStats
from chatstore.engine.request import Request, RequestOutput


class ServedModel(Protocol):
    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype `dtype = "auto"` resolved to on this machine."""
        ...


class EngineClient(Protocol):
    @property
    def model(self) -> ServedModel: ...

    def start(self) -> None:
        """Start serving (the app's lifespan, before the first request)."""

    def submit(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Queue a request; its outputs as they come."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request (its client went away)."""

    def stats(self) -> EngineStats:
        """Queue and block-pool numbers (admin, metrics, the history's sampler)."""
        ...

    def shutdown(self, drain_timeout: float = ...) -> Awaitable[None] | None:
        """Finish or abort what is in flight, then stop (awaited when it returns an awaitable)."""
