"""Tool messages in server-side sessions (issue 36): a turn takes `tools` / `tool_choice` as
/v1/chat/completions does, the session keeps the assistant's calls and the tools' results as
messages, and the next turn's prompt continues the stored KV token for token. Bad input is a 400
naming the field. The chat page shows a call as a call (its function and arguments) and a result
as its own bubble.

Real server on the embedded SmolLM2-135M (its template knows no tools: the generic JSON form,
each call constrained by `tool_choice: required`); the browser is Debian's chromium through
Playwright. Reuse is counted by the server's own usage, as tests/api/test_agent_reuse.py counts
it: a step's cached tokens are the previous step's prompt plus its completion less one (the last
sampled token is never fed back, so it has no KV).
"""

from __future__ import annotations

import itertools
import json
import os

import httpx
import pytest
from websockets.sync.client import connect

from chatstore.server.launcher import local_server
from tests.support.tool_defs import WEATHER

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

CHROMIUM = "/usr/bin/chromium"
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOLS = {"tools": [WEATHER, TIME], "tool_choice": "required"}
GREEDY = {"temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("sessions-tools")
    with local_server(data, default_model, kv_cache_bytes=48 << 20, dram_bytes=128 << 20) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def new_session(http: httpx.Client) -> str:
    created = http.post("/v1/sessions", json={"system_prompt": "You are a travel assistant."})
    assert created.status_code == 201, created.text
    return created.json()["id"]


def turn(http: httpx.Client, sid: str, **body) -> dict:
    reply = http.post(f"/v1/sessions/{sid}/messages", json={**GREEDY, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def only_call(reply: dict) -> dict:
    assert reply["finish_reason"] == "tool_calls", reply
    (call,) = reply["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] in ("get_weather", "get_time")
    arguments = json.loads(call["function"]["arguments"])
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    assert reply["choices"][0]["message"]["tool_calls"] == reply["message"]["tool_calls"]
    return call


@pytest.fixture(scope="module")
def agent(http):
    """One session's tool loop: a question, then three results each sent back (as `messages`,
    as one flat tool message, as `messages` again), every step asked with the same tools."""
    sid = new_session(http)
    replies = [turn(http, sid, content="What is the weather in Paris?", **TOOLS)]
    for i, results in enumerate(["18 C, sunny", "14:05", "light rain later"]):
        call = only_call(replies[-1])
        result = {"role": "tool", "tool_call_id": call["id"], "content": results}
        body = {"messages": [result]} if i % 2 == 0 else result
        replies.append(turn(http, sid, **body, **TOOLS))
    return sid, replies


def test_each_step_continues_the_stored_kv_token_for_token(agent):
    _, replies = agent
    for before, after in itertools.pairwise(replies):
        prompt, completion = before["usage"]["prompt_tokens"], before["usage"]["completion_tokens"]
        cached = after["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == prompt + completion - 1, (before["usage"], after["usage"])


def test_the_session_keeps_calls_and_results_as_messages(agent, http):
    sid, replies = agent
    messages = http.get(f"/v1/sessions/{sid}").json()["messages"]
    assert [m["role"] for m in messages] == ["system", "user"] + ["assistant", "tool"] * 3 + [
        "assistant"
    ]
    calls = [m for m in messages if m["role"] == "assistant"]
    assert [m["tool_calls"] for m in calls] == [r["message"]["tool_calls"] for r in replies]
    assert all(m["content"] == "" for m in calls)
    results = [m for m in messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == [c["tool_calls"][0]["id"] for c in calls[:3]]
    assert [m["content"] for m in results] == ["18 C, sunny", "14:05", "light rain later"]
    assert all("tools_key" not in m for m in messages)


def test_a_plain_turn_after_calls_renders_the_history_with_its_calls(agent, http, default_model):
    """No tools on this turn: the stored history is rendered through the model's template as
    the generic form shows it (a call as the JSON the model was asked to write, a result as a
    user message {"tool_response": ...}), no tool list, and the reply is plain text."""
    sid, _ = agent
    history, names = [], {}
    for m in http.get(f"/v1/sessions/{sid}").json()["messages"]:
        if "tool_calls" in m:
            (c,) = m["tool_calls"]
            names[c["id"]] = c["function"]["name"]
            call = {
                "name": c["function"]["name"],
                "arguments": json.loads(c["function"]["arguments"]),
            }
            history.append({"role": "assistant", "content": json.dumps({"tool_call": call})})
        elif m["role"] == "tool":
            name = names[m["tool_call_id"]]
            result = {"tool_response": {"name": name, "content": m["content"]}}
            history.append({"role": "user", "content": json.dumps(result)})
        else:
            history.append({"role": m["role"], "content": m["content"]})
    ask = "Thanks! Summarise in one sentence."
    tokenizer = default_model.tokenizer
    text = tokenizer.apply_chat_template(
        [*history, {"role": "user", "content": ask}], add_generation_prompt=True, tokenize=False
    )
    reply = turn(http, sid, content=ask)
    assert reply["finish_reason"] in ("stop", "length") and "tool_calls" not in reply["message"]
    assert reply["usage"]["prompt_tokens"] == len(tokenizer.encode(text, add_special_tokens=False))


def test_streamed_tool_call_comes_whole_in_the_done_event(http):
    sid = new_session(http)
    body = {**GREEDY, **TOOLS, "content": "What time is it in Tokyo?", "stream": True}
    events = []
    with http.stream("POST", f"/v1/sessions/{sid}/messages", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    assert [e["type"] for e in events] == ["done"]  # the call streams no text
    call = only_call(events[0])
    stored = http.get(f"/v1/sessions/{sid}").json()["messages"][-1]
    assert stored["tool_calls"] == [call]


def test_a_websocket_turn_takes_tools_and_results(http, server):
    """The WebSocket's message frame takes the same fields: a call comes whole in `done` (no
    text deltas), its result goes back as a tool frame, and the step continues the stored KV."""
    sid = new_session(http)
    url = f"{server.ws_url}/v1/sessions/{sid}/ws"
    with connect(url, proxy=None, open_timeout=30) as ws:
        assert json.loads(ws.recv(timeout=60))["type"] == "ready"
        ask = {"type": "message", "content": "Weather in Lima?", **TOOLS, **GREEDY}
        ws.send(json.dumps(ask))
        frames = [json.loads(ws.recv(timeout=120)) for _ in range(2)]
        assert [f["type"] for f in frames] == ["start", "done"]
        call, first = only_call(frames[1]), frames[1]["usage"]
        result = {"type": "message", "role": "tool", "tool_call_id": call["id"], "content": "9 C"}
        ws.send(json.dumps({**result, **TOOLS, **GREEDY}))
        frames = [json.loads(ws.recv(timeout=120)) for _ in range(2)]
        assert [f["type"] for f in frames] == ["start", "done"], frames
    cached = frames[1]["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == first["prompt_tokens"] + first["completion_tokens"] - 1
    messages = http.get(f"/v1/sessions/{sid}").json()["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"] == [call]
    assert messages[3] == {"role": "tool", "content": "9 C", "tool_call_id": call["id"]}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"role": "tool", "tool_call_id": "call_nope", "content": "x"}, "tool_call_id"),
        ({"messages": [{"role": "tool", "tool_call_id": "call_nope", "content": "x"}]},
         "messages.0.tool_call_id"),
        ({"role": "tool", "content": "x"}, "tool_call_id"),
        ({"content": "hi", "tools": [WEATHER],
          "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
        ({"content": "hi", "tool_choice": "required"}, "tool_choice"),
        ({}, "content"),
        ({"content": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ],
)  # fmt: skip
def test_bad_tool_input_is_a_400_naming_the_field(http, agent, body, param):
    sid, _ = agent
    before = http.get(f"/v1/sessions/{sid}").json()["num_messages"]
    refused = http.post(f"/v1/sessions/{sid}/messages", json=body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == param
    assert http.get(f"/v1/sessions/{sid}").json()["num_messages"] == before


def test_the_chat_page_shows_a_call_as_a_call(http, server, tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip("needs Debian's chromium (make installs it)")
    from playwright.sync_api import sync_playwright

    sid = new_session(http)
    call = only_call(turn(http, sid, content="What is the weather in Rome?", **TOOLS))
    result = {"role": "tool", "tool_call_id": call["id"], "content": "25 C, clear"}
    turn(http, sid, **result, **TOOLS)
    arguments = json.loads(call["function"]["arguments"])
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(server.url + "/")
        page.click(f"#sessions li[data-id='{sid}'] button.open")
        shown = page.locator(f".tool-call[data-call-id='{call['id']}']")
        shown.wait_for(timeout=60_000)
        assert shown.locator(".tool-name").inner_text() == call["function"]["name"]
        names = shown.locator(".tool-args dt").all_inner_texts()
        values = shown.locator(".tool-args dd").all_inner_texts()
        assert dict(zip(names, values, strict=True)) == arguments
        tool = page.locator(f".msg.tool[data-call-id='{call['id']}']")
        assert tool.locator(".text").inner_text() == "25 C, clear"
        texts = page.locator("#messages .text").all_inner_texts()
        assert not [t for t in texts if '"tool_call' in t or "tool_response" in t], texts
        assert page.locator(".msg.calls").count() == 2  # the call answered, and the next one
        page.screenshot(path=str(tmp_path / "chat-tool-call.png"), full_page=True)
        browser.close()
    assert not errors, errors
