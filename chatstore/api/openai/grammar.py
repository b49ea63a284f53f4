"""Constrained decoding with xgrammar: a request's JSON schema (or any JSON) compiled against
the server's vocabulary, and per sample a matcher the engine's sampler asks for a token
bitmask each step (engine/request.py: TokenConstraint). Free samples in the same batch are
untouched.

xgrammar is imported, and the vocabulary read (~0.3 s for SmolLM2's 49,152 tokens), on the
first constrained request only; each schema compiles in milliseconds.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

from chatstore.api.common.errors import bad_param
from chatstore.api.openai.protocol import ResponseFormat
from chatstore.api.tools.formats import ToolFormat
from chatstore.api.tools.request import ToolRequest
from chatstore.api.tools.schema import answer_schema
from chatstore.engine.request import TokenConstraint

if TYPE_CHECKING:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerBase

# What json.dumps writes, and the generic tool form's examples show: ", " and ": ", no other
# whitespace (a model free to add whitespace can loop on it).
_SEPARATORS = (", ", ": ")

ConstraintFactory = Callable[[], TokenConstraint]


class XGrammarConstraint:
    """One sample's matcher and its bitmask [1, ceil(V / 32)] (int32)."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size

    def mask(self, logits: torch.Tensor) -> None:
        if self._matcher.is_terminated():  # past the grammar's end (ignore_eos): free again
            return
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(logits, self._bitmask, vocab_size=self._vocab_size)

    def accept(self, token_id: int) -> None:
        if not self._matcher.is_terminated():
            self._matcher.accept_token(token_id)


class Grammars:
    """The server's grammar compiler over its tokenizer (made on first use)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: tuple[int, ...]
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop = list(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()

    def json_object(self) -> ConstraintFactory:
        """A JSON object, whatever it holds (OpenAI's json_object; xgrammar's builtin grammar
        allows arrays)."""
        return self.json_schema({"type": "object"}, strict=False, field="response_format")

    def json_schema(self, schema: dict[str, Any], strict: bool, field: str) -> ConstraintFactory:
        """A schema xgrammar rejects is a 400 naming `field`."""
        try:
            compiled = self._get().compile_json_schema(
                json.dumps(schema),
                any_whitespace=False,
                separators=_SEPARATORS,
                strict_mode=strict,
            )
        except (RuntimeError, ValueError, TypeError) as exc:
            raise bad_param(field, f"the schema cannot be compiled: {str(exc)[-200:]}") from None
        return self._factory(compiled)

    def _factory(self, compiled: xgr.CompiledGrammar) -> ConstraintFactory:
        vocab_size = self._vocab_size
        return lambda: XGrammarConstraint(compiled, vocab_size)

    def _get(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                # xgrammar reads transformers' tokenizer (FastTokenizer loads it here)
                hf = getattr(self._tokenizer, "hf", self._tokenizer)
                info = xgr.TokenizerInfo.from_huggingface(
                    hf, vocab_size=self._vocab_size, stop_token_ids=self._stop
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler


@lru_cache(maxsize=2)
def grammars_for(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: tuple[int, ...]
) -> Grammars:
    """The server's one Grammars (its model, so its vocabulary, is fixed for its life)."""
    return Grammars(tokenizer, vocab_size, stop_token_ids)


def pick_constraint(
    response_format: ResponseFormat | None,
    tools: ToolRequest | None,
    fmt: ToolFormat | None,
    grammars: Grammars,
) -> ConstraintFactory | None:
    """What a request's output must match: the generic tool form's answer when it has tools
    the model may call (llama.cpp's approach), else its response_format; None: free."""
    if tools is not None and tools.parses_calls and fmt is ToolFormat.GENERIC:
        return grammars.json_schema(answer_schema(tools), strict=True, field="tools")
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return grammars.json_object()
    spec = response_format.json_schema
    if spec is None:
        raise bad_param("response_format.json_schema", "json_schema needs its json_schema object")
    strict = bool(spec.strict)
    return grammars.json_schema(spec.schema_, strict, "response_format.json_schema.schema")
