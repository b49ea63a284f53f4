"""Truncation on overflow (CachedAttention §3.4): when a conversation outgrows the context window,
the oldest tokens after the system prompt are dropped from the prompt *and* from the saved KV;
the kept KV (stored before RoPE) is simply rotated to its new positions when it is loaded.

    before   [ system | oldest ......... dropped | kept history ......... | new message ]
    after    [ system | kept history ......... | new message ]
             0        head                     head + kept

The store rounds the cut to whole chunks (`fit_context`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from chatstore.store.chunks.reader import ChunkReader
from chatstore.store.commit.turn_commit import TurnCommitter
from chatstore.store.session_kv import SessionKey, SessionKV, common_prefix_len
from chatstore.store.sessions.index import SessionChain

WAIT_SAVED_S = 30.0  # the longest the cut waits for the session's pending write


class ContextOverflowError(ValueError):
    """Even with the whole droppable history gone the prompt does not fit the context."""


@dataclass(frozen=True)
class TruncationPlan:
    """Drop tokens [head, head + drop) — the oldest history after the system prompt."""

    head: int
    drop: int

    def apply_ids(self, token_ids: list[int]) -> list[int]:
        return token_ids[: self.head] + token_ids[self.head + self.drop :]

    def apply_kv(self, value: SessionKV) -> SessionKV:
        """The saved KV cut the same way; only tokens it holds are kept (no recompute)."""
        if value.num_tokens <= self.head:
            return value
        end = min(self.head + self.drop, value.num_tokens)
        kv = torch.cat([value.kv[:, :, : self.head], value.kv[:, :, end:]], dim=2)
        ids = value.token_ids[: self.head] + value.token_ids[end:]
        return SessionKV(ids, kv)


def plan_truncation(
    total: int, head: int, tail: int, max_context: int, ratio: float
) -> TruncationPlan | None:
    """What to drop so `total` tokens fit `max_context`, or None when they already fit.

    head: tokens kept at the front (the system prompt); tail: tokens kept at the end (the new
    message, plus room for the reply). At least ratio x max_context tokens are dropped at once
    (as in the paper: a 4K window drops 2K), so the next turns do not truncate again right away.
    """
    if total <= max_context:
        return None
    droppable = total - head - tail
    overflow = total - max_context
    if overflow > droppable:
        raise ContextOverflowError(
            f"{total} tokens do not fit the context of {max_context} even after dropping all "
            f"{max(droppable, 0)} tokens of history"
        )
    return TruncationPlan(head, min(droppable, max(overflow, int(ratio * max_context))))


class SessionTruncation:
    """The cut of an overflowing prompt, and of its session's chain the same way. API threads
    (it waits for the session's pending write)."""

    def __init__(
        self,
        reader: ChunkReader,
        committer: TurnCommitter,
        save: Callable[[SessionKey, SessionKV], object],
        window: int,
    ) -> None:
        """window: the context a prompt and its reply share (ports.ContextBudget)."""
        self.reader, self.committer, self._save = reader, committer, save
        self.settings, self.window = committer.settings, window

    def fit_context(
        self, key: SessionKey | None, prompt_ids: list[int], head: int, tail: int, reserve: int = 0
    ) -> list[int]:
        """The prompt cut so that it and `reserve` reply tokens fit the window: whole chunks of
        the oldest history after the chunks holding the first `head` tokens are dropped (the
        last `tail` kept: the new message); the session's chain loses the same chunks, the kept
        ones stay valid and are re-positioned at load (K is stored before RoPE)."""
        s = self.settings
        total, kept = len(prompt_ids) + reserve, tail + reserve
        plan = plan_truncation(total, head, kept, self.window, s.truncation_ratio)
        if plan is None:
            return list(prompt_ids)
        C = s.chunk_tokens
        head_c = -(-head // C) * C
        drop_c = -(-plan.drop // C) * C
        aligned = head_c + drop_c <= len(prompt_ids) - tail
        if aligned:
            plan = TruncationPlan(head_c, drop_c)
        if key is not None:
            self._truncate_session(key, prompt_ids, plan, aligned)
        return plan.apply_ids(prompt_ids)

    def _truncate_session(
        self, key: SessionKey, prompt_ids: list[int], plan: TruncationPlan, aligned: bool
    ) -> None:
        self.committer.writer.wait(key, WAIT_SAVED_S)
        stored = self.reader.find(key)
        if stored is None:
            return
        lcp = common_prefix_len(stored.token_ids, prompt_ids)
        if not aligned:  # chunks cannot stay whole: the kept KV is written again, cut
            value = self.reader.whole(key)
            if value is not None:
                self._save(key, plan.apply_kv(value.prefix(lcp)))
            return
        C = self.settings.chunk_tokens
        full = {i for i in range(len(stored.chunks)) if stored.span(i)[1] <= lcp}
        first_dropped = plan.head // C
        keep: list[int] = []
        while len(keep) < first_dropped and len(keep) in full:
            keep.append(len(keep))
        if len(keep) == first_dropped:  # the head is whole: what follows the cut
            i = (plan.head + plan.drop) // C
            while i in full:
                keep.append(i)
                i += 1
        ids: list[int] = []
        for i in keep:
            a, b = stored.span(i)
            ids.extend(stored.token_ids[a:b])
        chain = SessionChain(ids, [stored.chunks[i] for i in keep])
        self.committer.write_turn(key, chain, None, dict, 0, self.settings.async_save)
