"""Reading a stored session's chunks as a ChunkedKV from any tier (the loader's threads: a
staged session, a load re-read after a preemption): StoredSession.read_span over
`store.read_chunks`, one read of the store for all of them.
"""

from __future__ import annotations

from chatstore.store.ports import KVSource, StoredSession
from chatstore.store.session_kv import SessionKey
from chatstore.transfer.chunked_kv import ChunkedKV, MissingChunkError


def fetch_span(store: KVSource, stored: StoredSession, start: int, end: int) -> ChunkedKV:
    """The KV of positions [start, end) of `stored`; MissingChunkError when a chunk is gone."""
    parts, reached = stored.read_span(
        lambda keys, rows: store.read_chunks(keys, rows=rows), start, end
    )
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
