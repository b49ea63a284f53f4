"""The OpenAI-compatible API, driven by the official `openai` client against a real server
(real default model, engine and session store) on a loopback port."""

from __future__ import annotations

import httpx
import openai
import pytest

from chatstore.server.launcher import local_server

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("api-openai")
    srv = local_server(data, default_model, kv_cache_bytes=48 << 20, dram_bytes=256 << 20)
    with srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct"]


def test_non_stream_then_second_turn_reports_cached_tokens(client):
    history = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model="default", messages=history, **GREEDY)
    assert first.object == "chat.completion"
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens > 0
    assert first.usage.completion_tokens <= 8
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # A plain client resends its history without a session id: the store finds it by prefix.
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And of Italy?"},
    ]
    second = client.chat.completions.create(model="default", messages=history, **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens
    assert cached < second.usage.prompt_tokens


def test_stream_with_usage(client):
    messages = [{"role": "user", "content": "Count from one to five."}]
    stream = client.chat.completions.create(
        model="default",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text and finish in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens >= 1
    # Same prompt, not streamed, greedy: the same text.
    again = client.chat.completions.create(model="default", messages=messages, **GREEDY)
    assert again.choices[0].message.content == text


def test_session_header_multi_turn_stream(client, server):
    sid = "openai-header-session"
    messages = [{"role": "user", "content": "Say hello."}]
    first = client.chat.completions.create(
        model="default", messages=messages, extra_headers={"X-Session-ID": sid}, **GREEDY
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Again."},
    ]
    stream = client.chat.completions.create(
        model="default",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"session_id": sid},
        **GREEDY,
    )
    usage = [c.usage for c in stream if c.usage][-1]
    assert usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    info = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
    assert info["num_messages"] == 4 and info["kv_location"] in ("device", "dram", "ssd")


def test_sampling_parameters(client):
    messages = [{"role": "user", "content": "Write a word."}]
    kw = {"model": "default", "messages": messages, "max_completion_tokens": 6}
    a = client.chat.completions.create(temperature=1.0, top_p=0.9, seed=7, **kw)
    b = client.chat.completions.create(temperature=1.0, top_p=0.9, seed=7, **kw)
    assert a.choices[0].message.content == b.choices[0].message.content
    n = client.chat.completions.create(
        temperature=1.0, seed=1, n=2, presence_penalty=0.5, frequency_penalty=0.5, user="u1", **kw
    )
    assert [c.index for c in n.choices] == [0, 1]
    assert all(c.message.content for c in n.choices)
    stop = client.chat.completions.create(temperature=0, stop=["e"], **kw)
    assert "e" not in stop.choices[0].message.content


def test_logit_bias_bans_a_token(client, default_model):
    tok = default_model.tokenizer
    messages = [{"role": "user", "content": "Reply with the single word: yes"}]
    base = client.chat.completions.create(model="default", messages=messages, **GREEDY)
    first = tok.encode(base.choices[0].message.content, add_special_tokens=False)[0]
    banned = client.chat.completions.create(
        model="default", messages=messages, logit_bias={str(first): -100}, **GREEDY
    )
    ids = tok.encode(banned.choices[0].message.content, add_special_tokens=False)
    assert not ids or ids[0] != first


def test_errors_in_openai_shape(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}], temperature=-1
        )
    assert err.value.status_code == 400
    assert err.value.body["param"] == "temperature"
    assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}], n=99
        )
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}], logit_bias={"10**9": 1}
        )
    assert err.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", messages=[])
    assert err.value.body["param"] == "messages"
