"""An agent framework's own client against the server (issue 36 item 7): Pydantic AI
(`pydantic-ai-slim[openai]`, pinned in the test extras) runs a two-tool task through its
OpenAIChatModel on /v1/chat/completions, on the embedded SmolLM2-135M.

The framework does everything an agent does with a hosted model: it sends the tools' schemas
(built from the Python functions' signatures), parses our replies' `tool_calls`, validates the
arguments against those schemas, calls the functions, sends their results back as `tool`
messages, and ends the run on its structured output (its `final_result` output tool). What a
135M model cannot do on its own is pick the right step, so each step names the tool it must call,
through the framework's own per-step settings (a capability's `get_model_settings`): the named
`tool_choice` our grammar then enforces. Instrumentation is off and the provider points only at
the test server: nothing leaves the machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from pydantic import BaseModel
from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ModelResponse, ToolCallPart, ToolReturnPart
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from chatstore.server.launcher import local_server

pytestmark = [pytest.mark.model, pytest.mark.timeout(300)]

STEPS = (["get_weather"], ["get_time"], ["final_result"])  # the tool each step must call


class Report(BaseModel):
    weather: str
    time: str


@dataclass
class OneToolPerStep(AbstractCapability):
    """Step k may call only STEPS[k] (the framework sends it as a named tool_choice)."""

    def get_model_settings(self):
        def per_step(ctx: RunContext) -> dict:
            return {"tool_choice": STEPS[min(ctx.run_step, len(STEPS)) - 1]}

        return per_step


@pytest.fixture(scope="module")
def server(default_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("agent-framework")
    with local_server(data, default_model, kv_cache_bytes=48 << 20, dram_bytes=128 << 20) as srv:
        yield srv


def test_pydantic_ai_runs_a_two_tool_task(server):
    invoked: list[tuple[str, object]] = []

    def get_weather(city: str) -> str:
        """Current weather in a city."""
        invoked.append(("get_weather", city))
        return "18 C, sunny"

    def get_time(city: str) -> str:
        """Local time in a city."""
        invoked.append(("get_time", city))
        return "14:05"

    Agent.instrument_all(False)
    provider = OpenAIProvider(base_url=server.url + "/v1", api_key="unused")
    agent = Agent(
        OpenAIChatModel("default", provider=provider),
        tools=[get_weather, get_time],
        output_type=Report,
        capabilities=[OneToolPerStep()],
        model_settings={"temperature": 0, "max_tokens": 60},
    )
    result = agent.run_sync("What is the weather and the local time in Paris?")

    # Both tools ran, each once, with arguments valid against its schema ({"city": string}).
    assert [name for name, _ in invoked] == ["get_weather", "get_time"]
    assert all(isinstance(city, str) and city for _, city in invoked), invoked
    # The framework parsed our replies: its history holds our calls (ids, JSON arguments) and
    # the results it sent back under the same ids, then the validated structured output.
    messages = result.all_messages()
    calls = [
        p for m in messages if isinstance(m, ModelResponse) for p in m.parts
        if isinstance(p, ToolCallPart)
    ]  # fmt: skip
    assert [c.tool_name for c in calls] == ["get_weather", "get_time", "final_result"]
    for call, (_, city) in zip(calls, invoked, strict=False):
        assert call.tool_call_id.startswith("call_")
        assert json.loads(call.args) == {"city": city}
    returns = {
        p.tool_call_id: p.content for m in messages for p in m.parts
        if isinstance(p, ToolReturnPart) and p.tool_name != "final_result"
    }  # fmt: skip
    assert returns == {calls[0].tool_call_id: "18 C, sunny", calls[1].tool_call_id: "14:05"}
    assert isinstance(result.output, Report)
    assert result.output == Report.model_validate(json.loads(calls[2].args))
    responses = [m for m in messages if isinstance(m, ModelResponse)]
    assert [r.finish_reason for r in responses] == ["tool_call"] * 3
    # The steps continue one conversation: each later prompt finds the one before it stored.
    assert all(r.usage.cache_read_tokens > 0 for r in responses[1:]), [r.usage for r in responses]
