"""Truncation on overflow (CachedAttention §3.4): when a conversation outgrows the context window,
the oldest tokens after the system prompt are dropped from the prompt *and* from the saved KV;
the kept KV (stored before RoPE) is simply rotated to its new positions when it is loaded.

    before   [ system | oldest ......... dropped | kept history ......... | new message ]
    after    [ system | kept history ......... | new message ]
             0        head                     head + kept

The store rounds the cut to whole chunks (AttentionStore.fit_context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatstore.store.session_kv import SessionKV


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
