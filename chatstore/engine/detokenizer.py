"""Output text, token by token: incremental detokenization and stop strings.

`IncrementalDetokenizer` turns each new token id into the text it adds, using vLLM's
prefix-offset / read-offset technique:

    ids:   ... | prefix_offset ... read_offset | new id(s)
                 └ already emitted, decoded ┘
    delta = decode(ids[prefix:]) minus decode(ids[prefix:read])

Decoding a short window that starts a few tokens back keeps merges (a byte-level BPE splitting
one character over several tokens, SentencePiece's leading spaces) right, and a delta that ends
in U+FFFD is an incomplete UTF-8 character: it is held back until the next token completes it.

`StopStringMatcher` holds back any tail that could be the start of a stop string, so a stop
string split over several tokens is caught and never emitted.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of a growing list of output token ids, one delta per appended token."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = rust_backend(tokenizer)
        self.token_ids: list[int] = []
        self.text = ""  # all text emitted so far
        self._prefix_offset = 0
        self._read_offset = 0

    def append(self, token_id: int) -> str:
        """Record `token_id`; return only the new text (maybe "" while a character is partial)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self.token_ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: release text still held back (e.g. a trailing U+FFFD)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self.token_ids))
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        if self._backend is not None:
            return self._backend.decode(
                self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens
            )
        return self.tokenizer.decode(
            self.token_ids[start:end],
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )


def rust_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer whose decode is the stock
    one: with clean_up_tokenization_spaces=False that decode is exactly the backend's, plus a few
    microseconds of Python per call (and a token costs two). None for anything else."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    if getattr(tokenizer, "decodes_as_backend", False):
        return backend  # FastTokenizer: its decode is the backend's (no transformers import)
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    if getattr(type(tokenizer), "_decode", None) is not PreTrainedTokenizerFast._decode:
        return None  # a class with its own decoding: keep going through it
    return backend


class StopStringMatcher:
    """Cut the output at the first stop string; never emit a stop string or a piece of one."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = tuple(s for s in stop if s)
        self._longest = max((len(s) for s in self.stop), default=0)
        self._held = ""
        self.stopped = False

    def feed(self, new_text: str) -> tuple[str, bool]:
        """(text safe to emit now, stopped). After a stop, everything further is dropped."""
        if self.stopped:
            return "", True
        text = self._held + new_text
        cut = self._first_stop(text)
        if cut is not None:
            self._held = ""
            self.stopped = True
            return text[:cut], True
        hold = self._partial_tail(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """At the end of generation (length / EOS): release the held-back text."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _partial_tail(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        for size in range(min(len(text), self._longest - 1), 0, -1):
            tail = text[-size:]
            if any(s.startswith(tail) for s in self.stop):
                return size
        return 0
