"""Redis killed (then restarted on its port and data) and Redis hung (SIGSTOP, then SIGCONT)
mid-run, Redis holding the session records and the KV below DRAM (tests/chaos/redis_outage.py):
record operations get a quick 503, /healthz and a running stream keep their pace, no
acknowledged turn is lost, and once Redis is back turns succeed, the breaker closes and KV held
in Redis is reused again."""

from __future__ import annotations

import pytest

from tests.chaos.harness import RedisProcess
from tests.chaos.redis_outage import OutageConfig, run

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(150)]


@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_server_keeps_serving_through_a_redis_outage(tmp_path, mode):
    if RedisProcess.binary() is None:
        pytest.skip("redis-server is not installed")
    report = run(tmp_path, OutageConfig(mode=mode, outage_s=2.5, sessions=3, probe_tokens=300))
    # While Redis is out: a clear, quick 503 for what needs a record; the rest keeps its pace.
    assert report.record_ops and not report.server_errors, report.server_errors[:5]
    # A refusal that waited for Redis to come back would take about the outage: less is the
    # liveness bound (the refusals' own speed is bench/chaos.py's to report).
    slowest = report.slowest_refusal_s
    assert slowest < report.outage_s, f"a refusal took {slowest:.2f} s of the outage"
    assert report.breaker_seen_open and report.breaker_metric_seen_open
    assert report.healthz_p99_ms < 1000, f"/healthz p99 {report.healthz_p99_ms:.1f} ms"
    assert report.probe_deltas_during > 0, "the running stream stopped during the outage"
    assert report.stall_ms < max(1000.0, 3 * report.baseline_gap_ms), (
        f"the stream stalled {report.stall_ms:.0f} ms (before: {report.baseline_gap_ms:.0f} ms)"
    )
    # Nothing acknowledged was lost.
    assert report.history.acked > 0
    assert not report.history.lost, f"acknowledged, then lost: {report.history.lost}"
    assert not report.history.wrong and not report.history.phantom
    # Redis back: turns, the breaker and KV reuse from Redis recover in bounded time.
    assert report.recovered_s is not None and report.recovered_s < 15
    assert report.breaker_closed_s is not None and report.breaker_closed_s < 15
    assert report.resumed_session is not None, "no session's KV was left in Redis"
    assert report.resumed_bytes_up > 0 and report.resumed_cached > 0, (
        f"{report.resumed_session}: {report.resumed_bytes_up} bytes up from Redis, "
        f"{report.resumed_cached} of {report.resumed_stored} stored tokens reused"
    )
