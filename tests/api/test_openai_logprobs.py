"""logprobs / top_logprobs on /v1/chat/completions through the official `openai` client: the
content entries match the reply's tokens, streamed equals non-streamed, bad values are 400s."""

from __future__ import annotations

import openai
import pytest

from chatstore.server.launcher import local_server

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

MESSAGES = [{"role": "user", "content": "Name three colours."}]
ASK = {"model": "default", "messages": MESSAGES, "temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def client(default_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("api-logprobs")
    srv = local_server(data, default_model, kv_cache_bytes=48 << 20, dram_bytes=128 << 20)
    with srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_non_streamed_entries_spell_the_reply(client):
    reply = client.chat.completions.create(logprobs=True, top_logprobs=3, **ASK)
    choice = reply.choices[0]
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens
    spelled = b"".join(bytes(e.bytes) for e in content)
    if choice.finish_reason == "stop":  # the EOS token is reported, its text is not sent
        assert content[-1].token == "<|im_end|>"
        spelled = spelled[: -len(b"<|im_end|>")]
    assert spelled.decode() == choice.message.content
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token  # greedy: the likeliest token was drawn
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )


def test_streamed_equals_non_streamed(client):
    whole = client.chat.completions.create(logprobs=True, top_logprobs=2, **ASK)
    chunks = list(client.chat.completions.create(logprobs=True, top_logprobs=2, stream=True, **ASK))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    expected = whole.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in expected]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in expected], abs=1e-4)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        whole.choices[0].message.content
    )


def test_without_logprobs_nothing_is_reported(client):
    reply = client.chat.completions.create(**ASK)
    assert reply.choices[0].logprobs is None
    chunks = list(client.chat.completions.create(stream=True, **ASK))
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    zero = client.chat.completions.create(logprobs=True, **ASK)  # no top_logprobs: none listed
    assert all(e.top_logprobs == [] for e in zero.choices[0].logprobs.content)


def test_each_of_n_samples_has_its_own(client):
    reply = client.chat.completions.create(
        model="default",
        messages=MESSAGES,
        max_tokens=6,
        n=2,
        temperature=1.0,
        seed=3,
        logprobs=True,
        top_logprobs=1,
    )
    for choice in reply.choices:
        spelled = b"".join(bytes(e.bytes) for e in choice.logprobs.content).decode(errors="replace")
        assert spelled.startswith(choice.message.content)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_values_are_400s_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**ASK, **extra)
    assert err.value.status_code == 400 and err.value.body["param"] == param
