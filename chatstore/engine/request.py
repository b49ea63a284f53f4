"""Typed objects that cross the engine boundary: what the API submits, what the engine streams back.

The API (and benchmarks) build a `Request`; `AsyncEngine.submit` yields `RequestOutput`s, each
carrying the new tokens and text of every sample since the previous output.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length", "abort", "error"]
MAX_LOGPROBS = 20  # top alternatives per token, OpenAI's top_logprobs limit


class InvalidRequestError(ValueError):
    """A request parameter is out of range; `field` names it (the API turns this into a 400)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (the API turns this into a 429 with Retry-After)."""


class EngineDeadError(RuntimeError):
    """The model thread died of an unexpected error: the engine serves nothing more (503)."""


class TokenConstraint(Protocol):
    """One sample's grammar state (constrained decoding; the API builds it, e.g. with
    xgrammar): which tokens may come next, and the token that came."""

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits [1, V] of every token the grammar forbids next to -inf, in place."""

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # 1 = off; multiplicative, as in HF / vLLM
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    # None: no logprobs (nothing computed); k: each sampled token's logprob and its k likeliest
    # alternatives, from the log-softmax of the model's logits (logprobs.py)
    logprobs: int | None = None
    # None: free decoding; else a new TokenConstraint for each sample (n > 1 each get their own)
    constraint: Callable[[], TokenConstraint] | None = field(default=None, compare=False)

    def validate(self, vocab_size: int) -> SamplingParams:
        """Raise InvalidRequestError naming the first bad field; return self when all is well."""
        for name in ("max_tokens", "top_k", "n"):
            _check(_integer(getattr(self, name)), name, "must be an integer")
        _check(self.seed is None or _integer(self.seed), "seed", "must be an integer")
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(_finite(self.temperature) and self.temperature >= 0, "temperature", "must be >= 0")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", f"must be >= 0, got {self.top_k}")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        _check(
            _finite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "must be > 0",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, name, "must be in [-2, 2]")
        for token, bias in self.logit_bias.items():
            _check(
                isinstance(token, int) and 0 <= token < vocab_size,
                "logit_bias",
                f"unknown token id {token!r} (vocabulary has {vocab_size})",
            )
            _check(
                _finite(bias) and -100 <= bias <= 100, "logit_bias", "bias must be in [-100, 100]"
            )
        for token in self.stop_token_ids:
            _check(
                _integer(token) and 0 <= token < vocab_size,
                "stop_token_ids",
                f"unknown token id {token}",
            )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"
        )
        _check(1 <= self.n <= 16, "n", f"must be in 1..16, got {self.n}")
        k = self.logprobs
        ok = k is None or (_integer(k) and 0 <= k <= MAX_LOGPROBS)
        _check(ok, "top_logprobs", f"must be in 0..{MAX_LOGPROBS}")
        return self


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field_name, message)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str = "default"
    session_id: str | None = None  # the store keys saved KV by (tenant, session)
    arrival_time: float = field(default_factory=time.monotonic)
    # The store's handle of the turn (store.OpenedTurn), from the API's opening to the
    # connector's load and save: opaque to the engine, which only carries it.
    store_turn: object | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was reused, not computed
    completion_tokens: int
    # cached_tokens split by where that KV was: "device" (the engine's prefix cache) and
    # "store" (the connector's); the API splits "store" into the tiers the turn found its chunks
    # in ("dram", "ssd", "remote") from the turn's handle. Absent: zero
    cached_by_tier: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and its likeliest alternatives, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), at most the asked k


@dataclass(frozen=True)
class SampleDelta:
    """New output of one sample (index < n) since the previous RequestOutput."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked for


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    samples: list[SampleDelta]
    finished: bool = False
    usage: Usage | None = None  # set on the final output
    error: str | None = None  # set when finish_reason is "error"
    first_token_time: float | None = None  # monotonic time of the first token, when known
