"""The engine's TokenLogprobs as OpenAI's `choices[].logprobs.content[]`: token, logprob, bytes,
top_logprobs.

`bytes` are the token's own bytes, which for a byte-level BPE (GPT-2 style: SmolLM2, Llama 3,
Qwen2) may be part of a UTF-8 character; `token` is those bytes as text, with any byte that is
not valid UTF-8 on its own written `\\xNN` (what OpenAI shows for such tokens). SentencePiece
vocabularies (Llama 2, Mistral) map `▁` to a space and `<0xNN>` to its byte.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import TYPE_CHECKING, TypedDict

from chatstore.engine.request import TokenLogprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TopLogprob(TypedDict):
    """One of `top_logprobs`: an alternative token at that position."""

    token: str
    logprob: float
    bytes: list[int]


class LogprobEntry(TypedDict):
    """One entry of OpenAI's `logprobs.content` (and of the Responses API's output_text
    `logprobs`): a generated token and its alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(TypedDict):
    """A choice's `logprobs`."""

    content: list[LogprobEntry]
    refusal: None


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: the character a byte-level BPE writes -> its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenBytes:
    """Token id -> (text, bytes), cached: the vocabulary is fixed for the server's life."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        probe = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a", add_special_tokens=False))
        self._byte_level = any(piece.startswith("Ġ") for piece in probe)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            data = self._bytes(token_id)
            found = (data.decode("utf-8", errors="backslashreplace"), list(data))
            self._cache[token_id] = found
        return found

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        assert isinstance(piece, str)  # one id in, one token out
        decoder = _byte_decoder()
        if self._byte_level and all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
        match = _BYTE_PIECE.fullmatch(piece)
        if match is not None:
            return bytes([int(match.group(1), 16)])
        if not self._byte_level:
            return piece.replace("▁", " ").encode()
        return str(self._tokenizer.decode([token_id])).encode()  # an added token


@lru_cache(maxsize=2)
def token_bytes_for(tokenizer: PreTrainedTokenizerBase) -> TokenBytes:
    """The server's one TokenBytes (the model, so its tokenizer, is fixed for its life)."""
    return TokenBytes(tokenizer)


def choice_logprobs(
    entries: list[TokenLogprob] | None, token_bytes: TokenBytes
) -> ChoiceLogprobs | None:
    """A choice's (or a chunk's) `logprobs`: None when not asked for."""
    if entries is None:
        return None
    return {"content": logprobs_content(entries, token_bytes), "refusal": None}


def logprobs_content(entries: list[TokenLogprob], token_bytes: TokenBytes) -> list[LogprobEntry]:
    """OpenAI's `logprobs.content`: one object per generated token."""
    return [_entry(e, token_bytes) for e in entries]


def _entry(entry: TokenLogprob, token_bytes: TokenBytes) -> LogprobEntry:
    text, data = token_bytes(entry.token_id)
    top: list[TopLogprob] = []
    for token_id, logprob in entry.top:
        alt_text, alt_data = token_bytes(token_id)
        top.append({"token": alt_text, "logprob": logprob, "bytes": alt_data})
    return {"token": text, "logprob": entry.logprob, "bytes": data, "top_logprobs": top}
