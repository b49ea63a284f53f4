"""Constrained decoding (xgrammar) through the official client on the embedded 135M model:
response_format json_schema / json_object and tool_choice required / named return output that
parses and matches its schema, which the model does not do unconstrained."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from chatstore.server.launcher import local_server
from tests.support.tool_defs import WEATHER

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

GREEDY = {"model": "default", "temperature": 0, "max_tokens": 60}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.fixture(scope="module")
def client(default_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("api-structured")
    srv = local_server(data, default_model, kv_cache_bytes=48 << 20, dram_bytes=128 << 20)
    with srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_json_schema_output_matches_the_schema(client):
    messages = [{"role": "user", "content": "Name a big city and its population."}]
    free = client.chat.completions.create(messages=messages, **GREEDY).choices[0].message.content
    with pytest.raises(ValueError):
        json.loads(free)  # unconstrained, the model writes prose
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    reply = client.chat.completions.create(messages=messages, response_format=fmt, **GREEDY)
    choice = reply.choices[0]
    value = json.loads(choice.message.content)
    assert set(value) == {"city", "population"} and choice.finish_reason == "stop"
    assert isinstance(value["city"], str) and isinstance(value["population"], int)


def test_json_object_output_is_an_object(client):
    messages = [{"role": "user", "content": "Describe a cat in JSON."}]
    reply = client.chat.completions.create(
        messages=messages, response_format={"type": "json_object"}, **GREEDY
    )
    if reply.choices[0].finish_reason == "stop":  # a reply cut by max_tokens is unfinished
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_gives_a_valid_call(client, stream):
    kw = {"messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required", **GREEDY}
    if stream:
        with client.chat.completions.stream(**kw) as s:
            choice = s.get_final_completion().choices[0]
    else:
        choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        arguments = json.loads(call.function.arguments)
        assert isinstance(arguments, dict)
        if call.function.name == "get_weather":
            assert set(arguments) == {"city"} and isinstance(arguments["city"], str)


def test_named_tool_choice_calls_that_tool(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    reply = client.chat.completions.create(
        messages=ASK, tools=[WEATHER, TIME], tool_choice=named, **GREEDY
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}


def test_free_and_constrained_requests_share_the_batch(client):
    """Sent together, so the engine batches them: the constrained one's mask does not touch
    the free one's tokens."""
    messages = [{"role": "user", "content": "Name a planet."}]
    alone = client.chat.completions.create(messages=messages, **GREEDY).choices[0].message.content
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    with ThreadPoolExecutor(2) as pool:
        free = pool.submit(client.chat.completions.create, messages=messages, **GREEDY)
        bound = pool.submit(
            client.chat.completions.create, messages=messages, response_format=fmt, **GREEDY
        )
        together, constrained = free.result(), bound.result()
    assert together.choices[0].message.content == alone
    assert set(json.loads(constrained.choices[0].message.content)) == {"city", "population"}


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
            "response_format.json_schema.schema",
        ),
        ({"type": "json_schema"}, "response_format.json_schema"),
    ],
)
def test_a_schema_xgrammar_rejects_is_a_400(client, fmt, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(messages=ASK, response_format=fmt, **GREEDY)
    assert err.value.body["param"] == param
