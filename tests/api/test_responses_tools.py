"""Function tools and output_text logprobs on /v1/responses, against a real server on the
embedded SmolLM2-135M (its template knows no tools: chat completions' generic JSON form, its
calls constrained by xgrammar), through the official `openai` client and raw HTTP.

The Responses API reuses chat completions' tool code (api/tools/), so the same conversation
must prompt the model the same through both APIs: the tests compare the session records (the
rendered conversation each turn ran on) and the replies."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from chatstore.server.launcher import local_server
from tests.api.test_openai_tools import loop_so_far  # the weather agent's two finished steps

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": PARAMETERS,
}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: v for k, v in WEATHER.items() if k != "type"},
}
GREEDY = {"model": "default", "temperature": 0, "max_output_tokens": 40}
ASK = "What is the weather in Rome?"


def responses_loop() -> list[dict]:
    """The same conversation as Responses input items."""
    items: list[dict] = []
    for m in loop_so_far():
        if m.get("tool_calls"):
            for c in m["tool_calls"]:
                f = c["function"]
                items.append(
                    {
                        "type": "function_call",
                        "call_id": c["id"],
                        "name": f["name"],
                        "arguments": f["arguments"],
                    }
                )
        elif m["role"] == "tool":
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": m["tool_call_id"],
                    "output": m["content"],
                }
            )
        else:
            items.append({"role": m["role"], "content": m["content"]})
    return items


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("api-responses-tools")
    with local_server(data, default_model, kv_cache_bytes=48 << 20, dram_bytes=128 << 20) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tip(default_model) -> dict[str, float]:
    """logit_bias +2 on the token "call" of `{"tool_call` (as test_openai_tools.py tips it)."""
    ids = default_model.tokenizer.encode('{"tool_call', add_special_tokens=False)
    return {str(ids[-1]): 2.0}


def session_messages(http: httpx.Client, session_id: str) -> list[dict]:
    return http.get(f"/v1/sessions/{session_id}").json()["messages"]


def check_weather_arguments(arguments: str) -> None:
    """Valid against PARAMETERS: an object with exactly the required string `city`."""
    value = json.loads(arguments)
    assert isinstance(value, dict) and set(value) == {"city"}
    assert isinstance(value["city"], str)


@pytest.mark.parametrize(
    ("choice", "name"),
    [("required", None), ({"type": "function", "name": "get_weather"}, "get_weather")],
)
def test_forced_call_is_a_function_call_item_valid_against_the_schema(client, choice, name):
    reply = client.responses.create(input=ASK, tools=[WEATHER, TIME], tool_choice=choice, **GREEDY)
    assert reply.status == "completed" and reply.output
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls and all(item.type in ("function_call", "message") for item in reply.output)
    for call in calls:  # parsed by the openai client as ResponseFunctionToolCall
        assert call.status == "completed" and call.call_id.startswith("call_")
        assert call.id.startswith("fc_")
        if name is not None:
            assert call.name == name
        if call.name == "get_weather":
            check_weather_arguments(call.arguments)
        else:
            assert call.name == "get_time" and json.loads(call.arguments) == {}
    assert reply.tool_choice == choice if name is None else reply.tool_choice.name == name
    assert [t.name for t in reply.tools] == ["get_weather", "get_time"]
    assert reply.usage.output_tokens > 0


def test_agent_loop_prompts_as_chat_completions_and_continues_the_chain(client, http, tip):
    """The same history through both APIs: the same rendered conversation, the same call;
    then the tool's result sent as function_call_output with previous_response_id runs in the
    chain's session (its KV reused), rendered as chat completions renders a tool message."""
    chat_raw = client.chat.completions.with_raw_response.create(
        messages=loop_so_far(),
        tools=[CHAT_WEATHER],
        logit_bias=tip,
        model="default",
        temperature=0,
        max_tokens=40,
    )
    chat = chat_raw.parse().choices[0]
    first = client.responses.create(
        input=responses_loop(), tools=[WEATHER], extra_body={"logit_bias": tip}, **GREEDY
    )
    assert (
        session_messages(http, first.session_id)[:-1]
        == (session_messages(http, chat_raw.headers["X-Session-ID"])[:-1])
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert (call.name, call.arguments) == (
        chat.message.tool_calls[0].function.name,
        chat.message.tool_calls[0].function.arguments,
    )
    assert json.loads(call.arguments) == {"city": "Rome"}
    # The client's loop: the result of the call, answered by previous_response_id.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "25 C, sunny"}
    second = client.responses.create(
        input=[result], previous_response_id=first.id, tools=[WEATHER], **GREEDY
    )
    assert second.status == "completed" and second.session_id == first.session_id
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2
    rendered = session_messages(http, second.session_id)
    assert rendered[-2] == {
        "role": "user",
        "content": json.dumps({"tool_response": {"name": "get_weather", "content": "25 C, sunny"}}),
    }
    assert json.loads(rendered[-3]["content"]) == {
        "tool_call": {"name": "get_weather", "arguments": {"city": "Rome"}}
    }
    # Chat completions, sent the same step, writes the same answer.
    messages = [*loop_so_far(), chat.message.model_dump(exclude_none=True)]
    messages.append(
        {"role": "tool", "tool_call_id": chat.message.tool_calls[0].id, "content": "25 C, sunny"}
    )
    chat_answer = client.chat.completions.create(
        messages=messages, tools=[CHAT_WEATHER], model="default", temperature=0, max_tokens=40
    ).choices[0]
    assert chat_answer.message.content and "25" in chat_answer.message.content
    assert second.output_text == chat_answer.message.content
    assert [item.type for item in second.output] == ["message"]
    # The stored response keeps the chain: GET returns it with its function_call item.
    stored = http.get(f"/v1/responses/{first.id}").json()
    assert [item["type"] for item in stored["output"]] == ["function_call"]


def sse_events(http: httpx.Client, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(line[len("data: ") :]) for line in lines]


def test_streamed_call_events_add_up_to_the_final_arguments(client, http):
    named = {"type": "function", "name": "get_weather"}
    body = {"input": ASK, "tools": [WEATHER, TIME], "tool_choice": named, **GREEDY}
    events = sse_events(http, body)
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas > 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added, done, final = events[2], events[-2], events[-1]["response"]
    assert added["item"]["type"] == "function_call" and added["item"]["arguments"] == ""
    arguments = "".join(e["delta"] for e in events if e["type"].endswith("arguments.delta"))
    assert arguments == events[-3]["arguments"] == done["item"]["arguments"]
    assert final["output"] == [done["item"]] and done["item"]["name"] == "get_weather"
    check_weather_arguments(arguments)
    whole = client.responses.create(**body)  # the non-streamed reply: the same call
    assert [(i.name, i.arguments) for i in whole.output] == [("get_weather", arguments)]
    with client.responses.stream(**body) as stream:  # the openai client's own accumulator
        streamed = stream.get_final_response()
    assert [(i.type, i.arguments) for i in streamed.output] == [("function_call", arguments)]


def test_tool_choice_none_gives_no_call(client, http):
    reply = client.responses.create(input=ASK, tools=[WEATHER], tool_choice="none", **GREEDY)
    assert [item.type for item in reply.output] == ["message"] and reply.tool_choice == "none"
    assert not reply.output_text.startswith("{")
    kinds = [
        e["type"]
        for e in sse_events(
            http, {"input": ASK, "tools": [WEATHER], "tool_choice": "none", **GREEDY}
        )
    ]
    assert "response.function_call_arguments.delta" not in kinds


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{**WEATHER, "name": "bad name"}]}, "tools.0.name"),
        ({"tools": [{"type": "function"}]}, "tools.0.name"),
        (
            {"tools": [{**WEATHER, "parameters": {"type": "wat"}}], "tool_choice": "required"},
            "tools",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_9", "output": "1"}]},
            "input.0.call_id",
        ),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]},
            "input.0.arguments",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(http, change, param):
    body = {"input": "x", "tools": [WEATHER], **GREEDY, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 3}


def test_logprobs_spell_the_text_and_lead_their_top_logprobs(client):
    reply = client.responses.create(input="Name three colours.", **LOGPROBS, **GREEDY)
    (part,) = reply.output[0].content
    entries = part.logprobs
    assert len(entries) == reply.usage.output_tokens and reply.top_logprobs == 3
    spelled = b"".join(bytes(e.bytes) for e in entries)
    if reply.status == "completed":  # the EOS token is reported, its text is not sent
        assert entries[-1].token == "<|im_end|>"
        spelled = spelled[: -len(b"<|im_end|>")]
    assert spelled.decode() == part.text
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].token == e.token  # greedy: the likeliest token was drawn
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
    plain = client.responses.create(input="Name three colours.", **GREEDY)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == part.text


def test_streamed_logprobs_equal_the_non_streamed(client, http):
    body = {"input": "Name three colours.", **LOGPROBS, **GREEDY}
    whole = client.responses.create(**body).output[0].content[0].logprobs
    events = sse_events(http, body)
    streamed = [
        e for ev in events if ev["type"] == "response.output_text.delta" for e in ev["logprobs"]
    ]
    (done,) = [ev for ev in events if ev["type"] == "response.output_text.done"]
    assert [e["token"] for e in done["logprobs"]] == [e.token for e in whole]
    assert [e["logprob"] for e in done["logprobs"]] == pytest.approx(
        [e.logprob for e in whole], abs=1e-4
    )
    # The deltas carry each token's entry with its text (the EOS's, which has none, only done).
    assert [e["token"] for e in streamed] == [e.token for e in whole][: len(streamed)]
    assert len(streamed) >= len(whole) - 1
