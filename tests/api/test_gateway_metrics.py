"""/metrics carries vLLM's gauges under the names the Gateway API Inference Extension's
endpoint picker scrapes, labelled model_name, with values from the engine's stats."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chatstore.api.admin.metrics import GatewayCollector
from chatstore.engine.engine_stats import EngineStats
from chatstore.server.launcher import local_server


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def stats(**kw) -> EngineStats:
    fields = {f: 0 for f in EngineStats.__dataclass_fields__}
    fields.update(mean_batch_size=0.0, **kw)
    return EngineStats(**fields)


def test_the_collector_reads_the_engine_stats() -> None:
    s = stats(waiting=3, running=2, num_blocks=200, free_blocks=150, block_size=16)
    families = {f.name: f for f in GatewayCollector(lambda: s, "m").collect()}
    value = {name: f.samples[0].value for name, f in families.items()}
    assert value["vllm:num_requests_waiting"] == 3
    assert value["vllm:num_requests_running"] == 2
    assert value["vllm:kv_cache_usage_perc"] == value["vllm:gpu_cache_usage_perc"] == 0.25
    assert families["vllm:num_requests_waiting"].samples[0].labels == {"model_name": "m"}
    info = families["vllm:cache_config_info"].samples[0]
    assert info.labels == {"block_size": "16", "num_gpu_blocks": "200"} and info.value == 1


def test_no_stats_no_gauges() -> None:
    assert list(GatewayCollector(lambda: None, "m").collect()) == []


@pytest.mark.model
@pytest.mark.timeout(300)
def test_metrics_after_a_request(default_model, tmp_path) -> None:
    srv = local_server(tmp_path, default_model, kv_cache_bytes=16 << 20)
    with srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        body = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        text = client.get("/metrics").text
        engine = srv.app.state.service.engine.stats()
    got = samples(text)
    model = srv.app.state.settings.model_name
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
    ):
        (sample,) = got[name]
        assert sample.labels == {"model_name": model}
    assert got["vllm:num_requests_waiting"][0].value == 0
    assert got["vllm:num_requests_running"][0].value == 0
    usage = got["vllm:kv_cache_usage_perc"][0].value
    assert 0 <= usage <= 1
    assert usage == (engine.num_blocks - engine.free_blocks) / engine.num_blocks
    (info,) = got["vllm:cache_config_info"]
    assert info.labels["block_size"] == str(engine.block_size)
    assert "chatstore_engine_waiting" in got  # ours stay beside them
