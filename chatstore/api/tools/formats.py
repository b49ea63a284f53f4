"""Which tool-call format a model speaks, read from its chat template.

    template mentions        format     the model writes a call as
    <tool_call>              hermes     <tool_call>{"name": .., "arguments": {..}}</tool_call>
    [TOOL_CALLS]             mistral    [TOOL_CALLS][{"name": .., "arguments": {..}}, ..]
    <|python_tag|>/ipython   llama3     {"name": .., "parameters": {..}} (";"-separated)
    none of them             generic    one JSON object: {"tool_call": ..} or {"response": ..}

The first three are rendered by the template itself (`tools=`); a template that knows no tools
(the embedded SmolLM2's) gets llama.cpp's generic form (rendering.py).
"""

from __future__ import annotations

import enum
from functools import lru_cache


class ToolFormat(enum.Enum):
    HERMES = "hermes"
    MISTRAL = "mistral"
    LLAMA3 = "llama3"
    GENERIC = "generic"

    @property
    def native(self) -> bool:
        """The template renders tools and calls itself."""
        return self is not ToolFormat.GENERIC


@lru_cache(maxsize=4)  # the server's one template, read once
def detect_format(chat_template: str | None) -> ToolFormat:
    text = chat_template or ""
    if "tools" not in text:
        return ToolFormat.GENERIC
    if "<tool_call>" in text:
        return ToolFormat.HERMES
    if "[TOOL_CALLS]" in text:
        return ToolFormat.MISTRAL
    if "<|python_tag|>" in text or "ipython" in text:
        return ToolFormat.LLAMA3
    return ToolFormat.GENERIC
