"""Tool calling on /v1/chat/completions with the official `openai` client against a real
server on the embedded SmolLM2-135M (its template knows no tools: the generic JSON form, its
output constrained by xgrammar to a call or a response, as llama.cpp does).

Under tool_choice "auto" the grammar allows a call or a reply, and the choice is the model's:
on the loop below it ranks `{"tool_response` a little above `{"tool_call` (-0.57 vs -0.87 nats).
The loop test tips that one token with a logit_bias (a client knob, +2) and everything else is
the model's own greedy output, parsed by the server: the call, its arguments, then, after the
tool's result, the final answer. The other tests check the plumbing on whatever the model
writes; test_openai_structured.py has required / named calls, which need no tipping."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from chatstore.api.tools.formats import ToolFormat
from chatstore.api.tools.replies import reply_message
from chatstore.server.launcher import local_server
from tests.support.tool_defs import WEATHER

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

GREEDY = {"model": "default", "temperature": 0, "max_tokens": 40}


def call(call_id: str, city: str) -> dict:
    arguments = json.dumps({"city": city})
    function = {"name": "get_weather", "arguments": arguments}
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def loop_so_far() -> list[dict]:
    """Two finished steps of a weather agent, then a new question."""
    return [
        {"role": "user", "content": "Weather in Paris?"},
        call("call_1", "Paris"),
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        {"role": "assistant", "content": "It is 18 C in Paris."},
        {"role": "user", "content": "Weather in London?"},
        call("call_2", "London"),
        {"role": "tool", "tool_call_id": "call_2", "content": "12 C"},
        {"role": "assistant", "content": "It is 12 C in London."},
        {"role": "user", "content": "Weather in Rome?"},
    ]


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("api-tools")
    with local_server(data, default_model, kv_cache_bytes=48 << 20, dram_bytes=128 << 20) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def tip(default_model) -> dict[str, float]:
    """logit_bias +2 on the token "call" of `{"tool_call`."""
    ids = default_model.tokenizer.encode('{"tool_call', add_special_tokens=False)
    assert default_model.tokenizer.decode(ids[-1:]) == "call"
    return {str(ids[-1]): 2.0}


def test_official_client_tool_loop(client, tip):
    messages = loop_so_far()
    first = client.chat.completions.create(
        messages=messages, tools=[WEATHER], logit_bias=tip, **GREEDY
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tool_call,) = choice.message.tool_calls
    assert tool_call.id.startswith("call_") and tool_call.type == "function"
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Rome"}
    # The client's loop: the assistant message as received, the tool's result, ask again.
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": "25 C, sunny"})
    second = client.chat.completions.create(messages=messages, tools=[WEATHER], **GREEDY)
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "25" in answer.message.content and not answer.message.content.startswith("{")
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2


def test_streamed_call_accumulates_to_the_non_streamed_one(client, tip):
    kw = {"messages": loop_so_far(), "tools": [WEATHER], "logit_bias": tip, **GREEDY}
    whole = client.chat.completions.create(**kw).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kw))
    calls: dict[int, dict] = {}  # accumulated as the openai docs show
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            acc = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            acc["arguments"] += d.function.arguments or ""
    heads = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or [] if d.id]
    assert len(heads) == 1 and heads[0].function.name == "get_weather"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.tool_calls]) > 2
    assert [(a["name"], a["arguments"]) for a in calls.values()] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls
    ]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    with client.chat.completions.stream(**kw) as stream:  # the client's own accumulator
        final = stream.get_final_completion().choices[0]
    assert final.message.tool_calls[0].function.arguments == '{"city": "Rome"}'


def test_reply_is_the_parse_of_the_model_output(client, server):
    """Whatever the model wrote (stored raw in the session record) parsed by the generic
    parser is what the client got."""
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    raw_reply = client.chat.completions.with_raw_response.create(
        messages=messages, tools=[WEATHER], **GREEDY
    )
    reply = raw_reply.parse().choices[0]
    sid = raw_reply.headers["X-Session-ID"]
    stored = httpx.get(f"{server.url}/v1/sessions/{sid}").json()["messages"][-1]["content"]
    expected, called = reply_message(stored, ToolFormat.GENERIC, parallel=True)
    assert reply.message.content == expected["content"]
    assert bool(reply.message.tool_calls) == called
    assert reply.finish_reason in (("tool_calls",) if called else ("stop", "length"))


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "tool", "tool_call_id": "call_9", "content": "1"},
                ]
            },
            "messages.1.tool_call_id",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": "{oops"},
                            }
                        ],
                    },
                ]
            },
            "messages.1.tool_calls.0.function.arguments",
        ),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(server, change, param):
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], **GREEDY}
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
