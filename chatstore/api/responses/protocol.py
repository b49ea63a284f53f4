"""The Responses API request (`POST /v1/responses`): fields, their limits, and its input items.

`input` is read by hand (`input_messages`) rather than by a pydantic union: a union's errors name
its branches ("input.str: ..."), while a client needs to hear which item and which field is wrong.
Unknown fields are ignored, as OpenAI-compatible servers do; features this server does not have
(built-in tools, background runs, structured output) are refused with a 400 rather than ignored.
Function tools, function_call / function_call_output items and output_text logprobs are
served by chat completions' own code (responses/tools.py, items.py, api/tools/).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from chatstore.api.chat.limits import check_text
from chatstore.api.common.errors import bad_param
from chatstore.api.common.protocol import INT64_MAX, SamplingFields
from chatstore.api.responses.items import (
    FUNCTION_CALL,
    FUNCTION_CALL_OUTPUT,
    Item,
    call_item,
    output_item,
)
from chatstore.api.responses.tools import MAX_TOOLS, FunctionTool
from chatstore.api.tools.protocol import ToolCall
from chatstore.engine.request import MAX_LOGPROBS

RESPONSE_ID_MAX = 128
METADATA_KEYS = 16  # OpenAI's limits on `metadata`
METADATA_KEY_CHARS = 64
METADATA_VALUE_CHARS = 512
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")  # output_text: a client replaying an earlier output
LOGPROBS_INCLUDE = "message.output_text.logprobs"
CALL_ID_MAX = 256  # as chat completions' tool_call_id


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: object = Field(description="a string, or a list of message items")
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=RESPONSE_ID_MAX)
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=256)
    max_output_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    # Beyond OpenAI's fields, the sampling knobs vLLM's Responses endpoint also takes.
    top_k: int | None = Field(None, ge=0, le=1_000_000)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: object = None  # read by responses/tools.py: "none" | "auto" | "required" | named
    parallel_tool_calls: bool | None = None
    include: list[str] | None = None  # "message.output_text.logprobs" is the one acted on
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Accepted only in the form that asks for nothing this server lacks.
    background: bool = False
    text: TextConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None

    def sampling_fields(self) -> SamplingFields:
        """The fields `to_sampling` reads (max_output_tokens is Chat's max_tokens)."""
        return SamplingFields(
            max_tokens=self.max_output_tokens,
            max_completion_tokens=None,  # Responses name it max_output_tokens (above)
            n=1,  # one output per response
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias,
            ignore_eos=self.ignore_eos,
        )

    def check_supported(self) -> None:
        """400 for what the request asks that this server cannot do (or a metadata too big)."""
        if self.top_logprobs is not None and not self.wants_logprobs:
            raise bad_param("top_logprobs", f'top_logprobs needs include: ["{LOGPROBS_INCLUDE}"]')
        if self.background:
            raise bad_param("background", "background responses are not supported", "unsupported")
        kind = self.text.format.type if self.text and self.text.format else "text"
        if kind != "text":
            raise bad_param("text.format", f"text format {kind!r} is not supported", "unsupported")
        check_metadata(self.metadata or {})

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())


def check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > METADATA_KEYS:
        raise bad_param("metadata", f"at most {METADATA_KEYS} metadata keys", "too_long")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise bad_param("metadata", f"metadata keys are at most {METADATA_KEY_CHARS} chars")
        if len(value) > METADATA_VALUE_CHARS:
            raise bad_param(
                f"metadata.{key}", f"metadata values are at most {METADATA_VALUE_CHARS} chars"
            )


def input_items(raw: object, max_chars: int) -> list[Item]:
    """`input` as conversation items (items.py): a string is one user message; a list holds
    message items (content a string or text parts), function_call and function_call_output
    items. 400 naming the item for anything else, or for a text over `max_chars` (the
    server's max_message_chars)."""
    if isinstance(raw, str):
        if not raw:
            raise bad_param("input", "input must not be empty", "empty_input")
        return [{"role": "user", "content": check_text("input", raw, max_chars)}]
    if not isinstance(raw, list):
        raise bad_param("input", "input must be a string or a list of input items", "invalid_type")
    if not raw:
        raise bad_param("input", "input must hold at least one item", "empty_input")
    items = [_item(f"input.{i}", item) for i, item in enumerate(raw)]
    for i, item in enumerate(items):
        for key in ("content", "arguments", "output"):
            if key in item:
                check_text(f"input.{i}.{key}", item[key], max_chars)
    return items


def _item(where: str, item: object) -> Item:
    if not isinstance(item, dict):
        raise bad_param(
            where, "an input item must be an object with role and content", "invalid_type"
        )
    kind = item.get("type", "message")
    if kind == FUNCTION_CALL:
        return _function_call(where, item)
    if kind == FUNCTION_CALL_OUTPUT:
        call_id = _string(where, item, "call_id")
        output = item.get("output")
        text = output if isinstance(output, str) else _content(f"{where}.output", output)
        return output_item(call_id, text)
    if kind != "message":
        raise bad_param(
            f"{where}.type", f"input items of type {kind!r} are not supported", "unsupported"
        )
    role = item.get("role")
    if role not in ROLES:
        raise bad_param(f"{where}.role", f"role must be one of {', '.join(ROLES)}")
    return {"role": ROLES[role], "content": _content(f"{where}.content", item.get("content"))}


def _function_call(where: str, item: dict[str, object]) -> Item:
    """A call the model made, sent back (arguments: the JSON text of an object, as
    chat completions requires of an assistant message's tool_calls)."""
    call_id, name = _string(where, item, "call_id"), _string(where, item, "name")
    arguments = _string(where, item, "arguments")
    try:
        value = json.loads(arguments)
    except ValueError:
        raise bad_param(f"{where}.arguments", "arguments are not valid JSON") from None
    if not isinstance(value, dict):
        raise bad_param(f"{where}.arguments", "arguments must be a JSON object")
    return call_item(ToolCall(name, arguments, call_id))


def _string(where: str, item: dict[str, object], key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and key != "arguments"):
        raise bad_param(f"{where}.{key}", f"{key} must be a non-empty string", "invalid_type")
    if key == "call_id" and len(value) > CALL_ID_MAX:
        raise bad_param(f"{where}.{key}", f"call_id is at most {CALL_ID_MAX} chars")
    return value


def _content(where: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_param(where, "content must be a string or a list of text parts", "invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad_param(
                f"{where}.{j}",
                f"content part {kind!r} is not supported: only input_text",
                "unsupported",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_param(f"{where}.{j}.text", "text must be a string", "invalid_type")
        texts.append(text)
    return "".join(texts)
