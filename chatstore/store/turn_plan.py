"""What a turn stores: the session's new chain and which of its chunks are new.

    stored chain   [ c0 | c1 | c2 | tail ]            reusable = the prompt's LCP with it
    turn's chain   [ c0 | c1 | c2 | c3' | c4' | tail' ]
                     kept as is     new: the old tail's tokens + this turn's, keyed anew

Full stored chunks inside the reusable prefix are kept by key; the chain continues from the
last one with new keys (a content hash from that parent), and of those only the chunks no
tier and no pending write holds are new: a shared prefix (system prompt, fork, resent history)
hashes to keys the store already has and is not written again.

A new chunk that begins inside the stored history (c3' above: the old tail completed) has a
`base`: the stored chunk whose first rows it keeps. The turn then hands the store only the rows
after them (`ChunkDelta`), and the DRAM tier extends the old tail's blocks in place: no history
row is copied or written again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chatstore.store.chunks import ChunkHasher, ChunkKey, chunk_span
from chatstore.store.session_index import SessionChain
from chatstore.store.session_kv import SessionKey, SessionKV

if TYPE_CHECKING:
    from chatstore.store.attention_store import StoredSession


@dataclass(frozen=True)
class ChunkDelta:
    """A new chunk given as the first `keep` rows of the stored chunk `base` + `rows`."""

    base: ChunkKey
    keep: int
    rows: SessionKV  # the rows after the kept ones (token ids and KV)


@dataclass(frozen=True)
class TurnPlan:
    token_ids: list[int]
    chain: list[ChunkKey]
    new_chunks: tuple[ChunkKey, ...]
    chunk_tokens: int
    bases: dict[ChunkKey, tuple[ChunkKey, int]] = field(default_factory=dict)

    def span(self, index: int) -> tuple[int, int]:
        return chunk_span(index, self.chunk_tokens, len(self.token_ids))

    def new_spans(self) -> list[tuple[int, ChunkKey, int, int]]:
        """(chain index, key, start, end) of every new chunk."""
        new = set(self.new_chunks)
        return [(i, k, *self.span(i)) for i, k in enumerate(self.chain) if k in new]


@dataclass(frozen=True)
class TurnWrite:
    """A turn as the writer thread commits it."""

    key: SessionKey
    chain: SessionChain
    new_chunks: list[ChunkKey]
    freed: list[ChunkKey]
    memo: Callable[[], dict[ChunkKey, SessionKV | ChunkDelta]]
    bases: list[ChunkKey] = field(default_factory=list)  # chunks its deltas build on

    def values(self) -> dict[ChunkKey, SessionKV | ChunkDelta]:
        return self.memo()


def plan_chain(
    hasher: ChunkHasher,
    tenant: str,
    token_ids: list[int],
    stored: StoredSession | Any | None,
    reusable: int,
    has_chunk: Callable[[ChunkKey], bool],
) -> TurnPlan:
    C = hasher.chunk_tokens
    kept = 0
    if stored is not None:
        limit = min(reusable, stored.num_tokens, len(token_ids))
        while kept < len(stored.chunks):
            a, b = stored.span(kept)
            if b > limit or (b - a < C and b != len(token_ids)):
                break  # past the reused prefix, or a tail the history goes beyond
            kept += 1
    parent = stored.chunks[kept - 1] if kept else None
    rest = hasher.chain(tenant, token_ids[kept * C :], parent)
    chain = (list(stored.chunks[:kept]) if kept else []) + rest
    new: dict[ChunkKey, None] = {}
    for key in rest:
        if key not in new and not has_chunk(key):
            new[key] = None
    bases: dict[ChunkKey, tuple[ChunkKey, int]] = {}
    if stored is not None and kept < len(stored.chunks) and chain[kept] in new:
        covered = min(reusable, stored.num_tokens, len(token_ids)) - kept * C
        if covered > 0:  # the first new chunk starts with rows the store holds
            bases[chain[kept]] = (stored.chunks[kept], covered)
    return TurnPlan(list(token_ids), chain, tuple(new), C, bases)
