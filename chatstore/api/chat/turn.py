"""One chat turn in flight: the engine's output stream, folded into texts, usage and timings.

ChatService.open_turn ─► deltas(): SampleDeltas with text ─► result (usage, timings)
                             │ the engine finished it: on_finish (save, in a worker thread;
                             │   a record it cannot keep sets save_error: not acknowledged)
                             │ the consumer stopped early: abort in the engine (blocks freed)
                             └ either way, once: on_end (release the session, count the turn)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from chatstore.api.common.errors import APIError
from chatstore.engine.request import Request, RequestOutput, SampleDelta, TokenLogprob, Usage
from chatstore.store.ports import OpenedTurn

log = logging.getLogger("chatstore.api")


@dataclass
class TurnResult:
    texts: list[str]
    token_ids: list[list[int]]
    finish_reasons: list[str | None]
    usage: Usage
    ttft_s: float | None
    engine_ttft_s: float | None
    total_s: float
    error: str | None = None
    logprobs: list[list[TokenLogprob]] | None = None  # per sample, when the request asked


@dataclass
class Turn:
    request: Request
    stream: AsyncIterator[RequestOutput]
    n: int
    started: float  # perf_counter at the API's arrival
    on_finish: Callable[[Turn], None]  # the turn ended in the engine: save (runs in a thread)
    on_end: Callable[[Turn], None]  # always, once: release the session, count the turn
    abort: Callable[[str], None]
    record_messages: list[dict[str, str]] = field(default_factory=list)
    opened: OpenedTurn | None = None  # the store's handle (ChatService: append, end)
    result: TurnResult | None = None
    save_error: APIError | None = None  # the reply was made but its record was not kept
    log: dict[str, Any] = field(default_factory=dict)
    _texts: list[str] = field(default_factory=list)
    _ids: list[list[int]] = field(default_factory=list)
    _finish: list[str | None] = field(default_factory=list)
    _logprobs: list[list[TokenLogprob]] | None = None
    _ttft: float | None = None
    _closed: bool = False

    @property
    def session_id(self) -> str:
        assert self.request.session_id is not None
        return self.request.session_id

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def deltas(self) -> AsyncIterator[SampleDelta]:
        """Every non-empty delta of every sample; sets `result` when the engine is done."""
        self._texts = [""] * self.n
        self._ids = [[] for _ in range(self.n)]
        self._finish = [None] * self.n
        if self.request.sampling.logprobs is not None:
            self._logprobs = [[] for _ in range(self.n)]
        try:
            try:
                async for output in self.stream:
                    for delta in output.samples:
                        self._fold(delta)
                        if delta.text or delta.finish_reason or delta.logprobs:
                            yield delta
                    if output.finished:
                        self._finish_with(output)
                        break
            except Exception as exc:  # the engine's stream broke: an error reply, not a hang
                log.error("turn %s: engine stream failed: %s", self.request_id, exc)
                self._finish = [r or "error" for r in self._finish]
                self.result = self._make_result(None, f"engine failed: {exc}")
            if self.result is None:  # the stream ended without a final output
                self.result = self._make_result(None, "engine stopped before the turn ended")
                return
            if self.result.error is None:
                # Save the record (blocking I/O: off the event loop) before the caller sends
                # its last frame, so the client's next turn sees it.
                try:
                    await asyncio.to_thread(self.on_finish, self)
                except APIError as exc:
                    self.save_error = exc
        finally:
            self.close()

    async def run(self) -> TurnResult:
        async for _ in self.deltas():
            pass
        assert self.result is not None
        return self.result

    async def run_watching(
        self, is_disconnected: Callable[[], Awaitable[bool]], poll_s: float = 0.25
    ) -> TurnResult | None:
        """`run`, but abort (and return None) if the client goes away before the reply."""
        task = asyncio.ensure_future(self.run())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=poll_s)
                if done:
                    return task.result()
                if await is_disconnected():
                    return None
        finally:
            if not task.done():
                task.cancel()
            self.close()

    def close(self) -> None:
        """End the turn: abort it in the engine if it did not finish; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.result is None:
            self.abort(self.request_id)
            self._finish = [r or "abort" for r in self._finish] or ["abort"]
            self.result = self._make_result(None, "aborted")
        self.on_end(self)

    def _fold(self, delta: SampleDelta) -> None:
        if not 0 <= delta.index < self.n:
            return
        if self._ttft is None and delta.token_ids:
            self._ttft = time.perf_counter() - self.started
        self._texts[delta.index] += delta.text
        self._ids[delta.index].extend(delta.token_ids)
        if delta.finish_reason:
            self._finish[delta.index] = delta.finish_reason
        if self._logprobs is not None and delta.logprobs:
            self._logprobs[delta.index].extend(delta.logprobs)

    def _finish_with(self, output: RequestOutput) -> None:
        engine_ttft = None
        if output.first_token_time is not None:
            engine_ttft = max(0.0, output.first_token_time - self.request.arrival_time)
        self.result = self._make_result(output.usage, output.error, engine_ttft)

    def _make_result(
        self, usage: Usage | None, error: str | None, engine_ttft: float | None = None
    ) -> TurnResult:
        if usage is None:
            generated = sum(len(ids) for ids in self._ids)
            usage = Usage(len(self.request.prompt_token_ids), 0, generated)
        elif "store" in usage.cached_by_tier and self.opened is not None:
            usage = replace(usage, cached_by_tier=split_store(usage.cached_by_tier, self.opened))
        return TurnResult(
            texts=list(self._texts),
            token_ids=[list(ids) for ids in self._ids],
            finish_reasons=list(self._finish),
            usage=usage,
            ttft_s=self._ttft,
            engine_ttft_s=engine_ttft,
            total_s=time.perf_counter() - self.started,
            error=error,
            logprobs=None if self._logprobs is None else [list(lp) for lp in self._logprobs],
        )


def split_store(by_tier: dict[str, int], opened: OpenedTurn) -> dict[str, int]:
    """The engine's "store" share (the prompt tokens after the device hit) split by the tier
    each chunk was in when the turn opened, read from the turn's handle."""
    split = {tier: n for tier, n in by_tier.items() if tier != "store"}
    start = by_tier.get("device", 0)
    for tier, n in opened.tokens_by_origin(start, start + by_tier["store"]).items():
        split[tier] = split.get(tier, 0) + n
    return split
