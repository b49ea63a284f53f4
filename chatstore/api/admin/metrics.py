"""Prometheus metrics (GET /metrics): request counters and latency histograms kept here, engine
and store state read at scrape time by a collector (nothing is copied in the hot path).

    chatstore_store_write_failures_total{tier, reason}   writes a tier did not take: map_full /
                                  disk_full (its LMDB map or disk is full; the chunk stays in
                                  DRAM and the write-back retries), error (the write raised);
                                  a series appears with its first failure

    chatstore_store_open_failures_total{tier}   stored values that failed to open (encryption
                                  at rest: another or a shredded key, a changed byte), per
                                  slow tier and `records`; dropped, never served

Authentication refusals (auth.py), every reason present from the start at 0:

    chatstore_auth_failures_total{reason}   missing / malformed / invalid / revoked / forbidden

The remote (Redis) tier's circuit breaker, when the store has one:

    chatstore_remote_breaker_open             1 while open or half-open (Redis counts as absent)
    chatstore_remote_breaker_opens_total      times it opened
    chatstore_remote_short_circuited_total    calls answered without touching Redis

vLLM's names, which the Gateway API Inference Extension's endpoint picker scrapes (its model
server protocol), labelled model_name as vLLM does:

    vllm:num_requests_waiting     requests queued for admission
    vllm:num_requests_running     requests in the running batch
    vllm:kv_cache_usage_perc      KV blocks in use, a fraction in [0, 1] (cached free blocks
                                  count as free, as in vLLM)
    vllm:gpu_cache_usage_perc     the same under its pre-v0.10 name
    vllm:cache_config_info        1, labels block_size and num_gpu_blocks (prefix-cache scorer)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from chatstore.api.admin.history import MetricsHistory
from chatstore.api.chat.turn import Turn
from chatstore.engine.engine_stats import EngineStats
from chatstore.store.ports import TierStats

router = APIRouter(tags=["ops"])
T = TypeVar("T")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TIER_COUNTERS = ("hits", "misses", "bytes_up", "bytes_down", "evictions", "prefetches")
TIER_GAUGES = ("capacity_bytes", "used_bytes", "sessions")
AUTH_FAILURE_REASONS = ("missing", "malformed", "invalid", "revoked", "forbidden")


class StateCollector(Collector):
    def __init__(
        self, engine_stats: Callable[[], EngineStats | None], tiers: Callable[[], list[TierStats]]
    ) -> None:
        self.engine_stats = engine_stats
        self.tiers = tiers

    def collect(self) -> Iterator[Metric]:
        stats = self.engine_stats()
        if stats is not None:
            for name, value in stats.as_dict().items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    yield GaugeMetricFamily(f"chatstore_engine_{name}", f"engine {name}", value)
        tiers = self.tiers()
        for field in TIER_GAUGES:
            g = GaugeMetricFamily(f"chatstore_store_{field}", f"store {field}", labels=["tier"])
            for t in tiers:
                g.add_metric([t.name], getattr(t, field))
            yield g
        for field in TIER_COUNTERS:
            c = CounterMetricFamily(f"chatstore_store_{field}", f"store {field}", labels=["tier"])
            for t in tiers:
                c.add_metric([t.name], getattr(t, field))
            yield c
        failures = CounterMetricFamily(
            "chatstore_store_write_failures", "writes a tier did not take, by reason",
            labels=["tier", "reason"],
        )  # fmt: skip
        for t in tiers:
            for reason, count in sorted(t.write_failures_by_reason.items()):
                failures.add_metric([t.name, reason], count)
        yield failures


class OpenFailuresCollector(Collector):
    """Values that failed to open, as `open_failures()` (SessionKVAdmin) counts them per tier."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily(
            "chatstore_store_open_failures", "stored values that failed to open", labels=["tier"]
        )
        for tier, count in sorted(self.counts().items()):
            c.add_metric([tier], count)
        yield c


class RemoteBreakerCollector(Collector):
    """The breaker as `remote_health()` (SessionKVAdmin) describes it; nothing without Redis."""

    def __init__(self, health: Callable[[], dict[str, Any] | None]) -> None:
        self.health = health

    def collect(self) -> Iterator[Metric]:
        health = self.health()
        if health is None:
            return
        is_open = int(health["state"] != "closed")
        yield GaugeMetricFamily(
            "chatstore_remote_breaker_open", "remote tier circuit breaker open (0/1)", is_open
        )
        yield CounterMetricFamily(
            "chatstore_remote_breaker_opens", "remote tier circuit breaker openings",
            health["opens"],
        )  # fmt: skip
        yield CounterMetricFamily(
            "chatstore_remote_short_circuited", "remote tier calls refused while open",
            health["short_circuited"],
        )  # fmt: skip


class GatewayCollector(Collector):
    """Engine stats under vLLM's metric names (read per scrape)."""

    def __init__(self, engine_stats: Callable[[], EngineStats | None], model_name: str) -> None:
        self.engine_stats = engine_stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine_stats()
        if stats is None:
            return
        usage = stats.block_usage or 0
        for name, doc, value in (
            ("vllm:num_requests_waiting", "requests waiting to be admitted", stats.waiting),
            ("vllm:num_requests_running", "requests in the running batch", stats.running),
            ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", usage),
            ("vllm:gpu_cache_usage_perc", "KV cache usage (1 = full), old name", usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self.model_name], value)
            yield g
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "KV cache configuration",
            labels=["block_size", "num_gpu_blocks"],
        )  # fmt: skip
        info.add_metric([str(stats.block_size), str(stats.num_blocks)], 1)
        yield info


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "chatstore_http_requests", "HTTP requests", ["method", "route", "status"], registry=r
        )
        self.latency = Histogram(
            "chatstore_http_request_seconds", "HTTP request latency", ["route"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.turns = Counter("chatstore_turns", "chat turns", ["api", "finish"], registry=r)
        self.tokens = Counter("chatstore_tokens", "tokens by kind", ["kind"], registry=r)
        self.ttft = Histogram(
            "chatstore_ttft_seconds", "time to first token (API arrival to first token)",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.auth_failures = Counter(
            "chatstore_auth_failures", "requests refused by authentication, by reason",
            ["reason"], registry=r,
        )  # fmt: skip
        for reason in AUTH_FAILURE_REASONS:
            self.auth_failures.labels(reason)
        self.history = MetricsHistory()  # the dashboard's plots (GET /admin/history)

    def attach_state(
        self, engine_stats: Callable[[], EngineStats | None], tiers: Callable[[], list[TierStats]]
    ) -> None:
        self.registry.register(StateCollector(engine_stats, tiers))

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def observe_auth_failure(self, reason: str) -> None:
        self.auth_failures.labels(reason).inc()

    def observe_turn(self, turn: Turn) -> None:
        api = turn.log.get("api", "openai")
        result = turn.result
        if result is None:
            return
        finish = (result.finish_reasons[0] if result.finish_reasons else None) or "none"
        self.turns.labels(api, finish).inc()
        u = result.usage
        self.tokens.labels("prompt").inc(u.prompt_tokens)
        self.tokens.labels("cached").inc(u.cached_tokens)
        self.tokens.labels("completion").inc(u.completion_tokens)
        if result.ttft_s is not None:
            self.ttft.observe(result.ttft_s)
            self.history.record_ttft(result.ttft_s)


@router.get("/metrics", include_in_schema=False)
def metrics(request: Request) -> Response:
    state = request.app.state
    body = generate_latest(state.metrics.registry)
    service = getattr(state, "service", None)
    health = getattr(getattr(service, "store", None), "remote_health", None)
    if health is not None:  # read per scrape from the store port (app.py attaches no more)
        body += generate_latest(RemoteBreakerCollector(health))
    open_failures = getattr(getattr(service, "store", None), "open_failures", None)
    if open_failures is not None:
        body += generate_latest(OpenFailuresCollector(open_failures))
    engine = getattr(service, "engine", None)
    if engine is not None:
        gateway = GatewayCollector(_quiet(engine.stats), state.settings.model_name)
        body += generate_latest(gateway)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _quiet(fn: Callable[[], T]) -> Callable[[], T | None]:
    """A scrape shows what it can: stats that fail to read are left out, not a 500."""

    def call() -> T | None:
        try:
            return fn()
        except Exception:
            return None

    return call
