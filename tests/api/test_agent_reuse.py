"""The store sees agent loops as they are (issue 36 item 5): each step of a tool loop resent by
the official `openai` client reuses the whole previous step, the assistant's tool call tokens
included exactly as generated, and a new agent with the same tools borrows the tool-definition
prompt another agent stored.

Counted by the server's own usage: a step's `cached_tokens` must equal the previous step's prompt
plus its completion, less one token (the last sampled token is never fed back, so it has no KV;
the next prompt renders it again). Real server, the embedded SmolLM2-135M, whose template knows no
tools: the generic JSON form, each call constrained by `tool_choice: required`.

Where it does not hold yet: the generic grammar allows one call as `{"tool_call": C}` or as a
one-item `{"tool_calls": [C]}`, and a call sent back is rendered in the first form. A model that
wrote the second (SmolLM2 does for "What is the weather in Paris?") finds the next step's prompt
diverging at that reply: the history before it is reused (device prefix cache, the store's
borrowed chunks), the reply and what follows are recomputed. Allowing only the list form made
the 135M model write calls until max_tokens. The loop below is test_openai_tools.py's weather
agent, whose calls the model writes in the single form.
"""

from __future__ import annotations

import itertools

import openai
import pytest

from chatstore.server.launcher import local_server
from tests.api import test_openai_tools as weather_agent
from tests.api.test_openai_tools import WEATHER, loop_so_far

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

STEPS = 4
tip = weather_agent.tip  # its fixture: logit_bias +2 on the token "call" of `{"tool_call`
GREEDY = {"model": "default", "temperature": 0, "max_tokens": 80}


@pytest.fixture(scope="module")
def client(default_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("agent-reuse")
    sizes = {"kv_cache_bytes": 48 << 20, "dram_bytes": 128 << 20}
    with (
        local_server(data, default_model, **sizes) as srv,
        openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0) as c,
    ):
        yield c


def step(client: openai.OpenAI, messages: list[dict], result: str, bias: dict | None = None):
    """One agent step: ask, append the call as received and the tool's result."""
    reply = client.chat.completions.create(
        messages=messages, tools=[WEATHER], tool_choice="required", logit_bias=bias, **GREEDY
    )
    message = reply.choices[0].message
    assert message.tool_calls, message
    call = message.tool_calls[-1]
    messages.append(message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return reply.usage


def test_each_step_reuses_the_previous_one_token_for_token(client, tip):
    messages = loop_so_far()
    usages = [step(client, messages, f"{18 + i} C", tip) for i in range(STEPS)]
    for before, after in itertools.pairwise(usages):
        assert after.prompt_tokens_details.cached_tokens == (
            before.prompt_tokens + before.completion_tokens - 1
        ), (before, after)


def test_a_new_agent_borrows_the_tool_prompt(client):
    """Another conversation with the same tools: its prompt starts with the same tool-definition
    system text, which it finds stored (the device prefix cache or the store's borrowed chunks),
    though it shares no session with the first."""
    first = step(client, [{"role": "user", "content": "Weather in Oslo?"}], "3 C")
    other = step(client, [{"role": "user", "content": "Weather in Lima, please?"}], "20 C")
    assert first.prompt_tokens > 100
    assert other.prompt_tokens_details.cached_tokens >= first.prompt_tokens // 2
