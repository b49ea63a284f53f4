"""bench/generic_tools.py: the generic tool form rendered by the client gives a peer the work
chatstore does server-side. Proved against chatstore itself: the same conversation sent with
`tools` and as `generic_request` has the same prompt tokens and, greedy under the same schema,
the same call."""

from __future__ import annotations

import json

import httpx
import pytest

from bench.generic_tools import answer_calls, generic_request
from chatstore.server.launcher import local_server
from tests.api.test_openai_tools import loop_so_far
from tests.support.tool_defs import WEATHER

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]


def test_client_rendered_form_is_the_servers_own(default_model, tmp_path) -> None:
    body = {
        "model": "default", "messages": loop_so_far(), "tools": [WEATHER],
        "tool_choice": "required", "parallel_tool_calls": False,
        "temperature": 0, "max_tokens": 40,
    }  # fmt: skip
    with (
        local_server(tmp_path, default_model, kv_cache_bytes=48 << 20) as srv,
        httpx.Client(base_url=srv.url, trust_env=False, timeout=120) as http,
    ):
        server_side = http.post("/v1/chat/completions", json=body).json()
        client_side = http.post("/v1/chat/completions", json=generic_request(body)).json()
    assert client_side["usage"]["prompt_tokens"] == server_side["usage"]["prompt_tokens"]
    (made,) = server_side["choices"][0]["message"]["tool_calls"]
    (read,) = answer_calls(client_side["choices"][0]["message"]["content"], "call")
    assert read["name"] == made["function"]["name"] == "get_weather"
    assert json.loads(read["arguments"]) == json.loads(made["function"]["arguments"])


def test_answer_calls_reads_one_or_several_and_nothing_else() -> None:
    one = '{"tool_call": {"name": "f", "arguments": {"a": 1}}}'
    two = '{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": 2}}]}'
    assert answer_calls(one, "x") == [{"id": "x-0", "name": "f", "arguments": '{"a": 1}'}]
    assert [c["name"] for c in answer_calls(two, "y")] == ["f", "g"]
    assert answer_calls('{"response": "hi"}', "z") == answer_calls("not json", "z") == []
    with pytest.raises(ValueError, match="tool_choice"):
        generic_request({"tools": [WEATHER], "tool_choice": {"type": "function"}, "messages": []})
