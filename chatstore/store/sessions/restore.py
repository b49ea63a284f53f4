"""At start: the index rebuilt from the session records that list KV chunks (or a retention of
their own: records.restore_sessions, read through the records' index, not a listing of every
record), and the chunks on local tiers that no record lists (a crash between a commit's chunks
and its record) deleted."""

from __future__ import annotations

import logging
from collections.abc import Callable

from chatstore.store.chunks.keys import ChunkHasher, ChunkKey
from chatstore.store.records import RecordStore, RecordStoreUnavailable, SessionRecord
from chatstore.store.sessions.index import SessionChain, SessionIndex
from chatstore.store.tiers.base import StorageTier

log = logging.getLogger(__name__)


def restore_index(
    records: RecordStore,
    index: SessionIndex,
    hasher: ChunkHasher,
    fingerprint: str,
    slow_tiers: list[StorageTier],
    retain: Callable[[SessionRecord], None],
) -> None:
    try:
        listed = records.restore_sessions()
    except RecordStoreUnavailable as exc:
        # Redis out of reach at start (down, or refusing us: a TLS certificate that does
        # not verify, a wrong password). Serve from the local tiers; sessions are found in
        # the records when Redis is back. No orphan sweep: with no records read, every
        # local chunk would look unreferenced.
        log.warning("session records unreachable at start (%s): index starts empty", exc)
        return
    for record in listed:
        retain(record)
        chunks = getattr(record, "chunks", None) or []
        if not chunks or not record.token_ids:
            continue
        if record.fingerprint != fingerprint:
            # Another model's ids (the API hides them: the next turn re-renders the
            # messages); its chunks are orphans, deleted below.
            log.info("session %s was saved by another model: its KV is not reused", record.key)
            continue
        if hasher.num_chunks(len(record.token_ids)) != len(chunks):
            continue  # a record from another chunk size: its KV is not reused
        keys = [ChunkKey(record.tenant, d) for d in chunks]
        index.set(record.key, SessionChain(list(record.token_ids), keys, record.updated_at))
    orphans = 0
    for tier in slow_tiers:
        if tier.name == "remote":
            continue  # shared with other replicas: their chunks expire by TTL
        for key in tier.keys():  # noqa: SIM118 (a tier, not a dict)
            if not index.referenced(key):
                tier.delete(key)
                orphans += 1
    if orphans:
        log.info("deleted %d stored chunks no session references", orphans)
