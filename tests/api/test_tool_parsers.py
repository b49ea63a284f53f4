"""Tool-call parsers on fixed model outputs, each format; the stream parser cut at every
boundary adds up to the whole-text parse."""

from __future__ import annotations

import pytest

from chatstore.api.tools.formats import ToolFormat, detect_format
from chatstore.api.tools.protocol import ParsedReply, ToolCall
from chatstore.api.tools.replies import ToolDeltas, reply_message
from chatstore.api.tools.streaming import ToolStreamParser, collect, parse_reply

H, L, M, G = ToolFormat.HERMES, ToolFormat.LLAMA3, ToolFormat.MISTRAL, ToolFormat.GENERIC
WEATHER = ToolCall("get_weather", '{"city": "Paris"}')
TIME = ToolCall("get_time", "{}")

CASES = [
    # hermes / Qwen
    (H, "Plain answer.", ParsedReply("Plain answer.")),
    (
        H,
        'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        ParsedReply("Checking.\n", (WEATHER, TIME)),
    ),
    (
        H,
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
        (ParsedReply("", (WEATHER,))),
    ),  # unclosed at the end, arguments as JSON text
    (H, "a <tool_call>not json</tool_call> b", ParsedReply("a <tool_call>not json</tool_call> b")),
    (H, "x < y <tool_c", ParsedReply("x < y <tool_c")),
    # llama 3.x JSON
    (L, '{"name": "get_weather", "parameters": {"city": "Paris"}}', ParsedReply("", (WEATHER,))),
    (
        L,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"type": "function", "name": "get_time", "parameters": {}}',
        ParsedReply("", (WEATHER, TIME)),
    ),
    (L, '{"name": "get_weather"} and more', ParsedReply('{"name": "get_weather"} and more')),
    (L, "Paris is in France.", ParsedReply("Paris is in France.")),
    # mistral
    (
        M,
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        ParsedReply("Sure. ", (WEATHER,)),
    ),
    (  # [TOOL_CALLS] is a special token: detokenized text starts at the list
        M,
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]',
        ParsedReply("", (WEATHER, TIME)),
    ),
    (M, "[TOOL_CALLS] oops", ParsedReply("[TOOL_CALLS] oops")),
    (M, "[1] is a citation", ParsedReply("[1] is a citation")),
    # generic (llama.cpp's form)
    (
        G,
        '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}',
        (ParsedReply("", (WEATHER,))),
    ),
    (
        G,
        ' {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]}\n',
        ParsedReply("", (WEATHER, TIME)),
    ),
    (G, '{"response": "Hello there!"}', ParsedReply("Hello there!")),
    (G, '{"answer": 42}', ParsedReply('{"answer": 42}')),
    (G, "Hello, how can I help?", ParsedReply("Hello, how can I help?")),
    (
        G,
        '{"tool_call": {"name": "f", "arguments": [1]}}',
        (ParsedReply('{"tool_call": {"name": "f", "arguments": [1]}}')),
    ),
]


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES)
def test_whole_text(fmt, text, expected):
    assert parse_reply(text, fmt) == expected


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES)
def test_streamed_cut_at_every_boundary(fmt, text, expected):
    for cut in range(len(text) + 1):
        parser = ToolStreamParser(fmt)
        events = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
        assert collect(events) == expected, cut
    parser = ToolStreamParser(fmt)
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    assert collect(events) == expected


def test_hermes_text_streams_before_the_call_ends():
    parser = ToolStreamParser(H)
    assert collect(parser.feed("Let me look <tool")).content == "Let me look "
    assert collect(parser.feed('_call>{"name": "get_time", "arguments": {}}')) == ParsedReply("")
    assert collect(parser.feed("</tool_call>")).calls == (TIME,)


def test_deltas_the_openai_client_accumulates():
    deltas = ToolDeltas(G, parallel=True)
    text = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris, France"}}}'
    out = [d for ch in text for d in deltas.feed(ch)] + deltas.finish()
    first, *rest = (d["tool_calls"][0] for d in out)
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert len(rest) > 1 and all(set(r) == {"index", "function"} for r in rest)
    assert "".join(r["function"]["arguments"] for r in rest) == '{"city": "Paris, France"}'
    assert deltas.calls == 1


def test_parallel_false_keeps_the_first_call():
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, ' + (
        '{"name": "get_time", "arguments": {}}]}'
    )
    message, called = reply_message(text, G, parallel=False)
    assert called and [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert message["content"] is None
    deltas = ToolDeltas(G, parallel=False)
    out = deltas.feed(text) + deltas.finish()
    assert {d["tool_calls"][0]["index"] for d in out} == {0} and deltas.calls == 1


def test_format_from_template():
    assert detect_format(None) is G
    assert detect_format("{{ message['content'] }}") is G  # SmolLM2's knows no tools
    assert detect_format("{% if tools %}<tool_call>{% endif %}") is H
    assert detect_format("{% if tools %}[TOOL_CALLS]{% endif %}") is M
    assert detect_format("{% if tools %}<|python_tag|>{% endif %}") is L
