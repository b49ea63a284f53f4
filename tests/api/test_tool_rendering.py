"""A tool loop rendered through real templates: the embedded SmolLM2's (which knows no tools:
llama.cpp's generic form) and a Hermes/Qwen-style one that renders tools itself."""

from __future__ import annotations

import copy
import json

import pytest

from chatstore.api.common.chat_template import ChatTemplate
from chatstore.api.tools.formats import ToolFormat, detect_format
from chatstore.api.tools.protocol import NamedToolChoice, ToolChatMessage, ToolDef
from chatstore.api.tools.rendering import render_tools
from chatstore.api.tools.request import tool_request

pytestmark = pytest.mark.model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
NAMED = {"name": "get_weather"}
LOOP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "assistant", "content": "It is 18 C."},
    {"role": "user", "content": "And Rome?"},
]
# A trimmed Qwen2.5 template: tools into the system turn, calls as <tool_call> blocks, results
# as <tool_response> blocks in a user turn.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ messages[0]['content'] }}\n\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}{%- if not tools %}<|im_start|>system\n"
    "{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- elif message.role == 'tool' %}\n<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>"
    "{%- elif message.tool_calls %}\n<|im_start|>assistant\n{{ message.content }}"
    '{%- for tc in message.tool_calls %}<tool_call>\n{"name": "{{ tc.function.name }}", '
    '"arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>'
    "{%- else %}\n<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>{%- endif %}"
    "{%- endfor %}\n<|im_start|>assistant\n"
)


def messages() -> list[ToolChatMessage]:
    return [ToolChatMessage.model_validate(m) for m in LOOP]


def tools(choice=None):
    return tool_request([ToolDef.model_validate(WEATHER)], choice, None)


def test_generic_form_through_smollm2s_template(default_model):
    template = ChatTemplate(default_model.tokenizer, default_model.spec.eos_token_ids)
    assert detect_format(default_model.tokenizer.chat_template) is ToolFormat.GENERIC
    prompt = render_tools(messages(), tools(), ToolFormat.GENERIC)
    assert prompt.rich is None
    text = template.render_text(prompt.messages)
    schema = json.dumps(WEATHER["function"])
    assert text.startswith(
        "<|im_start|>system\nBe brief.\n\nYou can call these tools (JSON schemas):\n"
        f"{schema}\n\nAnswer with one JSON object and nothing else, either\na tool call:\n"
    )
    assert '{"response": "<your reply>"}<|im_end|>\n' in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n{"tool_call": {"name": "get_weather", "arguments": '
        '{"city": "Paris"}}}<|im_end|>\n'
        '<|im_start|>user\n{"tool_response": {"name": "get_weather", "content": "18 C"}}'
        "<|im_end|>\n"
        '<|im_start|>assistant\n{"response": "It is 18 C."}<|im_end|>\n'
        "<|im_start|>user\nAnd Rome?<|im_end|>\n<|im_start|>assistant\n"
    )
    named = render_tools(
        messages(),
        tools(NamedToolChoice.model_validate({"type": "function", "function": NAMED})),
        ToolFormat.GENERIC,
    )
    assert "Answer by calling get_weather" in named.messages[0]["content"]
    none = render_tools(messages(), tools("none"), ToolFormat.GENERIC)
    assert none.messages[0] == {"role": "system", "content": "Be brief."}
    assert none.messages[4] == {"role": "assistant", "content": "It is 18 C."}


def test_native_form_through_a_hermes_template(default_model):
    tokenizer = copy.copy(default_model.tokenizer)
    tokenizer.chat_template = HERMES_TEMPLATE
    assert detect_format(HERMES_TEMPLATE) is ToolFormat.HERMES
    template = ChatTemplate(tokenizer, default_model.spec.eos_token_ids)
    prompt = render_tools(messages(), tools(), ToolFormat.HERMES)
    assert prompt.rich is not None and prompt.rich.tools == [WEATHER]
    text = tokenizer.decode(template.render_rich(prompt.rich))
    assert text == (  # (transformers renders templates with trim_blocks: no newline after tags)
        f"<|im_start|>system\nBe brief.\n\n# Tools\n<tools>{json.dumps(WEATHER)}</tools><|im_end|>"
        "<|im_start|>user\nWeather in Paris?<|im_end|>"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>'
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>"
        "<|im_start|>assistant\nIt is 18 C.<|im_end|>"
        "<|im_start|>user\nAnd Rome?<|im_end|><|im_start|>assistant"
    )
    # the record keeps the same conversation in plain role/content form
    assert prompt.messages[2] == {
        "role": "assistant",
        "content": '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}',
    }
    assert prompt.messages[3]["role"] == "user"
