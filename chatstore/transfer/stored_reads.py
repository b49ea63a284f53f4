"""Reading a stored session's chunks as a ChunkedKV: the rows of positions [start, end) from
the chunks that hold them (the first chunk from `start`, the last up to `end`), one read of the
store for all of them.

    chunks   [ c0 | c1 | c2 | c3 ]          C tokens each; [start, end) = [1.5 C, 3.2 C)
    read          c1[.5C:] c2 c3[:.2C]      parts: (value, first position), up to a gone chunk
"""

from __future__ import annotations

from chatstore.store.ports import KVSource, StoredSession
from chatstore.store.session_kv import SessionKey, SessionKV
from chatstore.transfer.chunked_kv import ChunkedKV, MissingChunkError

Parts = list[tuple[SessionKV, int]]  # (chunk value, its first position)


def read_span(store: KVSource, stored: StoredSession, start: int, end: int) -> tuple[Parts, int]:
    """The parts of positions [start, end) up to the first chunk that is gone, and the
    position they reach (`end` when every chunk was there)."""
    C = stored.chunk_tokens
    first, last = start // C, -(-end // C)
    spans = [(max(start - i * C, 0), min(end - i * C, C)) for i in range(first, last)]
    parts: Parts = []
    values = store.read_chunks(stored.chunks[first:last], rows=spans)
    for i, value in enumerate(values):
        if value is None:
            return parts, (first + i) * C
        parts.append((value, (first + i) * C + spans[i][0]))
    return parts, end


def fetch_span(store: KVSource, stored: StoredSession, start: int, end: int) -> ChunkedKV:
    """The KV of positions [start, end) of `stored`; MissingChunkError when a chunk is gone."""
    parts, reached = read_span(store, stored, start, end)
    if reached < end:
        key = stored.chunks[reached // stored.chunk_tokens]
        raise MissingChunkError(f"chunk {key} of {stored.key} is no longer stored")
    return ChunkedKV(parts, start, end, stored.token_ids)


def fetch_session(store: KVSource, key: SessionKey) -> ChunkedKV | None:
    """Every stored chunk of the session (the read buffer's staging read); None when none."""
    stored = store.find(key.tenant, key.session_id)
    if stored is None or not stored.chunks:
        return None
    return fetch_span(store, stored, 0, stored.num_tokens)
