"""One running sample (`Sequence`) and the request that owns its n samples (`RequestState`).

A sequence's tokens are its prompt followed by its outputs. `num_computed` of them have KV in
the pool (through `block_table`); each step computes the next tokens[num_computed:] (a prefill
chunk, or the one newest token of a decode):

    tokens        p0 p1 p2 p3 p4 p5 | o0 o1
    KV computed   ████████████████████████  num_computed = 7: o1 was sampled, not yet fed back
    block_table   [ b3         | b8        ]  block_size 4: slot of token i = table[i//4]*4 + i%4

Recompute preemption drops the blocks and sets num_computed back to 0 (the tokens stay), so the
next prefill recomputes prompt and outputs together; swap keeps the KV in host blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chatstore.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from chatstore.engine.request import FinishReason, Request, SampleDelta, Usage
from chatstore.engine.sample_state import SampleState

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Sequence:
    def __init__(self, seq_id: int, group: RequestState, sample_index: int) -> None:
        request = group.request
        self.seq_id = seq_id
        self.group = group
        self.sample_index = sample_index
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.sample = SampleState(request.sampling, request.prompt_token_ids, sample_index)
        self.status = SequenceStatus.WAITING
        self.num_computed = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hash chain of this sequence's full token blocks
        self.num_registered = 0  # leading blocks already offered to the prefix cache
        self.host_blocks: list[int] = []  # where its KV lives while swapped out
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.detok = IncrementalDetokenizer(group.tokenizer) if group.tokenizer else None
        self.stop = StopStringMatcher(request.sampling.stop)
        self._new_tokens: list[int] = []
        self._new_text: list[str] = []
        self._reported_finish = False

    @property
    def request(self) -> Request:
        return self.group.request

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, seq_id: int, sample_index: int) -> Sequence:
        """A sibling sample at the same point (its blocks are shared by the caller)."""
        child = Sequence(seq_id, self.group, sample_index)
        child.status = self.status
        child.num_computed = self.num_computed
        child.block_table = list(self.block_table)
        child.block_hashes = list(self.block_hashes)
        child.num_registered = self.num_registered
        return child

    def append_token(self, token_id: int, emit_text: bool) -> bool:
        """Record a sampled token; True when a stop string ended the sequence."""
        self.token_ids.append(token_id)
        self.sample.append(token_id)
        self._new_tokens.append(token_id)
        if not emit_text or self.detok is None:
            return False
        text, stopped = self.stop.feed(self.detok.append(token_id))
        self._new_text.append(text)
        return stopped

    def flush_text(self) -> None:
        """Release text held back for a possible stop string or partial character."""
        if self.detok is not None and not self.stop.stopped:
            text, stopped = self.stop.feed(self.detok.flush())
            self._new_text.append(text + ("" if stopped else self.stop.flush()))

    def take_delta(self) -> SampleDelta | None:
        """What this sample produced since the last call (None when nothing new)."""
        finish_now = self.finished and not self._reported_finish
        if not self._new_tokens and not finish_now and not any(self._new_text):
            return None
        delta = SampleDelta(
            index=self.sample_index,
            token_ids=self._new_tokens,
            text="".join(self._new_text),
            finish_reason=self.finish_reason if finish_now else None,
            logprobs=self.sample.take_logprobs(),
        )
        self._new_tokens, self._new_text = [], []
        self._reported_finish = self._reported_finish or finish_now
        return delta


@dataclass
class RequestState:
    """A request in the engine: its samples (one until the prompt is computed, then n)."""

    request: Request
    tokenizer: PreTrainedTokenizerBase | None = None
    seqs: list[Sequence] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens reused (device prefix cache + connector)
    cached_by_tier: dict[str, int] = field(default_factory=dict)  # cached_tokens by source
    first_token_time: float | None = None
    admitted: bool = False  # its prompt has been scheduled once (cached_tokens is known)
    forked: bool = False  # the n samples exist (or never will: ended before its first token)
    error: str | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return (self.forked or self.request.sampling.n == 1) and all(s.finished for s in self.seqs)

    def note_first_token(self) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def usage(self) -> Usage:
        completion = sum(len(s.output_token_ids) for s in self.seqs)
        prompt = len(self.request.prompt_token_ids)
        cached = min(self.cached_tokens, prompt)
        return Usage(prompt, cached, completion, self._cached_by_tier(cached))

    def _cached_by_tier(self, cached: int) -> dict[str, int]:
        """cached_by_tier trimmed to `cached` (the device share goes first: it is the part
        counted past the prompt, if any)."""
        split = {tier: n for tier, n in self.cached_by_tier.items() if n > 0}
        over = sum(split.values()) - cached
        if over > 0 and "device" in split:
            split["device"] -= min(over, split["device"])
        return split
