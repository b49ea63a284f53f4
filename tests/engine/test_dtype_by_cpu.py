"""What `dtype = "auto"` serves on either kind of CPU, whichever kind runs the suite: the
machine's /proc/cpuinfo answer is replaced by one with and one without AVX512-BF16, and both the
dtype resolution and a real server (launcher, engine, store) run under each.

    auto on a CPU with native bf16 (avx512_bf16 / amx_bf16)   -> bfloat16 weights, KV, store
    auto on a CPU without                                      -> float32
    a model handed to the launcher already loaded              -> its own dtype, whatever the CPU
"""

from __future__ import annotations

import httpx
import pytest
import torch

from chatstore import config as config_module
from chatstore.config import Config, load_config, resolve_dtype
from chatstore.server.launcher import local_server

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

FLAGS = "fpu sse avx2 avx512f avx512bw avx512_vnni"
GREEDY = {"temperature": 0, "max_tokens": 4}


@pytest.fixture(params=[True, False], ids=["bf16-cpu", "no-bf16-cpu"])
def cpu_dtype(request, monkeypatch) -> torch.dtype:
    """This process's CPU flags as one kind of machine or the other; auto's answer there."""
    flags = FLAGS + (" avx512_bf16" if request.param else "")
    monkeypatch.setattr(config_module, "_cpu_flags", lambda: frozenset(flags.split()))
    return torch.bfloat16 if request.param else torch.float32


def test_auto_resolves_from_the_cpu_flags(cpu_dtype):
    name = str(cpu_dtype).removeprefix("torch.")
    assert resolve_dtype("auto") == name
    cfg = load_config(env={})
    assert cfg.torch_dtype == cfg.storage_torch_dtype == cpu_dtype
    assert resolve_dtype("float32") == "float32" and resolve_dtype("bfloat16") == "bfloat16"


def test_a_config_follows_the_model_it_is_given(cpu_dtype):
    for model_dtype in (torch.float32, torch.bfloat16):
        cfg = Config().for_model_dtype(model_dtype)
        assert cfg.torch_dtype == cfg.storage_torch_dtype == model_dtype
    assert Config(dtype="float32").for_model_dtype(torch.float32).dtype == "float32"
    with pytest.raises(ValueError, match="dtype = 'bfloat16' but the model given is loaded in"):
        Config(dtype="bfloat16").for_model_dtype(torch.float32)


def _served_dtypes(server) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """(weights, device KV pool, store) dtypes of a running server."""
    engine = server.app.state.service.engine.engine
    runtime = engine.runtime
    store = server.app.state.service.store.kv
    weights = runtime.runner.embed.dtype
    return weights, runtime.kv_cache.dtype, store.settings.storage_dtype


def _two_turns(server) -> int:
    """Cached tokens of a second turn (the store reused the first turn's KV)."""
    with httpx.Client(base_url=server.url, timeout=120) as client:
        sid = client.post("/v1/sessions", json={}).json()["id"]
        for text in ("Name a colour.", "And another?"):
            r = client.post(f"/v1/sessions/{sid}/messages", json={"content": text, **GREEDY})
            assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_launcher_with_a_loaded_model_serves_in_the_models_dtype(
    cpu_dtype, default_model, tmp_path
):
    """The tests' fixture loads fp32: auto must not give it a KV pool or store in bf16."""
    with local_server(tmp_path, default_model, kv_cache_bytes=16 << 20) as server:
        assert _served_dtypes(server) == (torch.float32,) * 3
        assert _two_turns(server) > 0


def test_launcher_loading_the_model_serves_autos_dtype(cpu_dtype, tmp_path):
    """What `chatstore serve` does: the model is loaded in what auto picks on this CPU."""
    with local_server(tmp_path, kv_cache_bytes=16 << 20) as server:
        assert _served_dtypes(server) == (cpu_dtype,) * 3
        assert _two_turns(server) > 0
