"""The asyncio face of the engine: the model loop runs in its own thread.

    API (event loop)                         model thread
    submit(req) ── add_request ─────────────► scheduler.waiting
       │ RequestStream ◄── call_soon_threadsafe ── step() outputs (one call per step and loop)
    abort(id)   ── abort_request ────────────► applied at the next step

A step's outputs reach their event loop in one `call_soon_threadsafe` (one wake-up, one
self-pipe write) however many requests it advanced. A consumer that falls behind gets the
outputs queued for it merged into one (`merge_outputs`): fewer, larger deltas, the same text.

`submit` validates on the caller's thread, so InvalidRequestError / EngineOverloadedError are
raised by `submit` itself. The stream it returns aborts its request when the consumer's task is
cancelled, when it is closed (`aclose`), or when it is dropped unfinished, so every block comes
back even if a client goes away mid-generation.

A step that raises fails the requests in flight and the thread goes on. If the thread itself
dies (an exception outside a step, a BaseException), the engine is dead: every open stream ends
with an error output, `submit` raises EngineDeadError, and `alive` / `failure` say so (/readyz).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from chatstore.engine.block_manager import BlockManager
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.kv_connector import KVConnector
from chatstore.engine.llm_engine import EngineStats, LLMEngine
from chatstore.engine.request import (
    EngineDeadError,
    InvalidRequestError,
    Request,
    RequestOutput,
    SampleDelta,
    TokenLogprob,
)
from chatstore.engine.runtime import Runtime
from chatstore.engine.scheduler import WaitingEntry

log = logging.getLogger(__name__)


@dataclass
class _Route:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    num_samples: int = 1


class RequestStream(AsyncIterator[RequestOutput]):
    """Outputs of one request, in order; ends after the output with `finished=True`."""

    def __init__(self, engine: AsyncEngine, request_id: str, route: _Route) -> None:
        self._engine = engine
        self.request_id = request_id
        self._queue = route.queue
        self._done = False
        self._failure: BaseException | None = None  # queued behind outputs merged ahead of it

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = self._failure or await self._queue.get()
        except asyncio.CancelledError:
            self._cancel()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        while not item.finished and not self._queue.empty():
            queued = self._queue.get_nowait()
            if isinstance(queued, BaseException):  # raised next, after what came before it
                self._failure = queued
                break
            item = merge_outputs(item, queued)
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        self._cancel()

    def _cancel(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    def __del__(self) -> None:
        if not self._done:
            self._engine.abort(self.request_id)


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive outputs of one request as one: each sample's tokens and text joined."""
    samples = {d.index: d for d in first.samples}
    for d in then.samples:
        before = samples.get(d.index)
        if before is not None:
            d = SampleDelta(
                d.index,
                before.token_ids + d.token_ids,
                before.text + d.text,
                d.finish_reason or before.finish_reason,
                _joined(before.logprobs, d.logprobs),
            )
        samples[d.index] = d
    return RequestOutput(
        request_id=then.request_id,
        samples=list(samples.values()),
        finished=then.finished,
        usage=then.usage,
        error=then.error,
        first_token_time=first.first_token_time or then.first_token_time,
    )


def _joined(
    first: list[TokenLogprob] | None, then: list[TokenLogprob] | None
) -> list[TokenLogprob] | None:
    """Two deltas' logprobs as one list (None when the sample did not ask for them)."""
    if first is None or then is None:
        return first if then is None else then
    return first + then


class AsyncEngine:
    def __init__(
        self, runtime: Runtime, config: EngineConfig, connector: KVConnector | None = None
    ) -> None:
        self.engine = LLMEngine(runtime, config, connector)
        self.config = config
        self.tokenizer = runtime.model.tokenizer
        self.spec = runtime.model.spec
        self.model = runtime.model
        self._routes: dict[str, _Route] = {}
        self._routes_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._accepting = True
        self._failure: str | None = None  # why the model thread died
        self._thread: threading.Thread | None = None
        self.device_type = runtime.runner.device.type
        # Intra-op threads of the model thread (set on it when it starts); None = torch's own.
        self.compute_threads: int | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine already started")
        thread = threading.Thread(target=self._loop, name="chatstore-engine", daemon=True)
        thread.start()
        self._thread = thread  # only once started: an unstarted thread would read as exited

    @property
    def blocks(self) -> BlockManager:
        """The device block pool's manager (the KV events publisher attaches to it)."""
        return self.engine.blocks

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """False once the model thread has died of an unexpected error (it never comes back)."""
        return self.failure is None

    @property
    def failure(self) -> str | None:
        """Why the model thread died; None while it serves (or before start, after shutdown)."""
        if self._failure is not None:
            return self._failure
        thread = self._thread
        exited = thread is not None and not thread.is_alive() and not self._stop.is_set()
        return "the engine thread exited unexpectedly" if exited else None

    def submit(self, request: Request) -> RequestStream:
        """Queue a request (call from a coroutine); returns the stream of its outputs.

        Raises EngineDeadError when the model thread has died, RuntimeError when the engine is
        not running (not started, shutting down)."""
        self._check_alive()
        if not self._accepting or not self.is_running:
            raise RuntimeError("engine is not running")
        route = _Route(asyncio.get_running_loop(), asyncio.Queue(), request.sampling.n)
        with self._routes_lock:
            # Under the lock: either the dying thread sees this route, or this sees its failure.
            self._check_alive()
            if request.request_id in self._routes:
                raise InvalidRequestError("request_id", f"{request.request_id!r} is in flight")
            self._routes[request.request_id] = route
        try:
            self.engine.add_request(request)
        except BaseException:
            with self._routes_lock:
                self._routes.pop(request.request_id, None)
            raise
        self._wake.set()
        return RequestStream(self, request.request_id, route)

    def _check_alive(self) -> None:
        failure = self.failure
        if failure is not None:
            raise EngineDeadError(f"engine failed: {failure}")

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request ends with finish_reason "abort" at the next step."""
        self.engine.abort_request(request_id)
        self._wake.set()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def waiting_sessions(self, limit: int | None = None) -> list[WaitingEntry]:
        return self.engine.waiting_sessions(limit)

    async def shutdown(self, drain_timeout: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish for up to `drain_timeout` seconds,
        abort the rest, then stop the model thread."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout
        while self.is_running and self.engine.has_work() and loop.time() < deadline:
            await asyncio.sleep(0.02)
        with self._routes_lock:
            pending = list(self._routes)
        for request_id in pending:
            self.abort(request_id)
        while self.is_running and self.engine.has_work() and loop.time() < deadline + 5:
            await asyncio.sleep(0.01)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # -- the model thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            self._die(exc)

    def _serve(self) -> None:
        if self.compute_threads is not None:
            torch.set_num_threads(self.compute_threads)
        while not self._stop.is_set():
            if not self.engine.has_work():
                self._wake.wait(self.config.idle_wait_s)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in the engine: fail everything, keep serving
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            if outputs:
                self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs over: one thread hop per consumer loop, not per request."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._routes_lock:
            for item in outputs:
                route = self._routes.get(item.request_id)
                if route is None:
                    continue
                if item.finished:
                    del self._routes[item.request_id]
                batches.setdefault(route.loop, []).append((route.queue, item))
        for loop, batch in batches.items():
            with contextlib.suppress(RuntimeError):  # the consumer's loop is closed
                loop.call_soon_threadsafe(_put_all, batch)

    def _die(self, exc: BaseException) -> None:
        """End every open stream with an error output: nothing will step their requests."""
        self._failure = f"{type(exc).__name__}: {exc}"
        log.critical("engine thread died; failing every request", exc_info=exc)
        with self._routes_lock:
            routes, self._routes = self._routes, {}
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for request_id, route in routes.items():
            output = _error_output(request_id, route.num_samples, f"engine failed: {self._failure}")
            batches.setdefault(route.loop, []).append((route.queue, output))
        for loop, batch in batches.items():
            with contextlib.suppress(RuntimeError):  # the consumer's loop is closed
                loop.call_soon_threadsafe(_put_all, batch)

    def _fail_all(self, exc: Exception) -> None:
        with self._routes_lock:
            routes, self._routes = self._routes, {}
        for request_id, route in routes.items():
            self.engine.abort_request(request_id)
            with contextlib.suppress(RuntimeError):
                route.loop.call_soon_threadsafe(route.queue.put_nowait, exc)


def _error_output(request_id: str, num_samples: int, error: str) -> RequestOutput:
    samples = [SampleDelta(i, [], "", "error") for i in range(num_samples)]
    return RequestOutput(request_id, samples, finished=True, error=error)


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, item in batch:
        queue.put_nowait(item)
