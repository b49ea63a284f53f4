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

from chatstore.store.chunks.keys import ChunkHasher
from chatstore.store.ports import StoredSession, TurnPlan
from chatstore.store.session_kv import ChunkKey, SessionKV


def plan_chain(
    hasher: ChunkHasher,
    tenant: str,
    token_ids: list[int],
    stored: StoredSession | None,
    reusable: int,
    has_chunk: Callable[[ChunkKey], bool],
) -> TurnPlan:
    C = hasher.chunk_tokens
    kept, stored_chunks = 0, stored.chunks if stored is not None else []
    if stored is not None:
        limit = min(reusable, stored.num_tokens, len(token_ids))
        while kept < len(stored.chunks):
            a, b = stored.span(kept)
            if b > limit or (b - a < C and b != len(token_ids)):
                break  # past the reused prefix, or a tail the history goes beyond
            kept += 1
    parent = stored_chunks[kept - 1] if kept else None
    rest = hasher.chain(tenant, token_ids[kept * C :], parent)
    chain = list(stored_chunks[:kept]) + rest
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


def new_chunks_of(plan: TurnPlan, value: SessionKV) -> dict[ChunkKey, SessionKV]:
    """The plan's new chunks cut from `value`, the whole history's KV (copies: the caller's
    tensor may change after)."""
    out = {}
    for i, chunk in enumerate(plan.chain):
        if chunk in plan.new_chunks:
            a, b = plan.span(i)
            out[chunk] = SessionKV(value.token_ids[a:b], value.kv[:, :, a:b].clone())
    return out
