"""Sessions leaving the store: one deleted, a tenant shredded, the expired purged, every
session's KV dropped. Each waits for the session's pending write first: API threads only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from chatstore.store.session_kv import SessionKey

if TYPE_CHECKING:
    from chatstore.store.attention_store import AttentionStore

WAIT_SAVED_S = 30.0  # the longest a reader waits for a session's pending write


def forget_session(store: AttentionStore, key: SessionKey) -> list:
    """Under the store's lock: the session leaves the index, the policy, retention and the
    origin notes, and is tombstoned; the chunks it alone held (for the caller to free)."""
    store.versions.tombstone(key)
    freed = store.index.remove(key)
    store.session_placement.tell("forget", key)
    store.retention.drop(key)
    store.remote_fetch.origins.drop(key)
    store.session_placement.tell("set_priority", key, 0)
    return freed


def delete_session(store: AttentionStore, key: SessionKey) -> bool:
    """Remove the session's record and the chunks no other session holds."""
    store.remote_fetch.release(store.remote_fetch.take(key))  # its opened turn's, if any
    store.writer.wait(key, WAIT_SAVED_S)
    committer = store.committer
    # Under mutate, so a turn the writer is committing cannot re-create the record between
    # its check and our delete; the tombstone drops turns begun before now.
    with committer.mutate:
        with committer.lock:
            found = store.index.get(key) is not None
            freed = forget_session(store, key)
        existed = bool(store.records.delete(key))
    committer.free(freed)
    store.versions.bump(key)
    return existed or found


def shred_tenant(store: AttentionStore, tenant: str) -> int:
    """Crypto-shred tenant: its key is destroyed first (every sealed copy of its data, in any
    tier or backup, stops opening at once), then its sessions are deleted, then any of its
    chunks still stored (orphans) are; how many sessions went. Its records the index does not
    know (no KV) are the caller's to delete (records.delete_tenant)."""
    if store.sealer is not None:
        store.sealer.keyring.shred(tenant)
    with store.committer.lock:
        sessions = [k for k in store.index.sessions() if k.tenant == tenant]
    for key in sessions:
        delete_session(store, key)
    with store.committer.mutate:
        held = [c for t in store.tiers.tiers for c in list(t.keys())]
        store.committer.delete_unneeded(list({c for c in held if c.tenant == tenant}))
    return len(sessions)


def purge_expired(store: AttentionStore) -> list[SessionKey]:
    store.writer.flush(WAIT_SAVED_S)
    gone = store.records.purge_expired()
    for key in gone:
        with store.committer.lock:
            freed = forget_session(store, key)
        store.committer.free(freed)
        store.versions.bump(key)
    return gone


def invalidate_all(store: AttentionStore) -> int:
    """Drop every session's KV (records keep their messages); how many sessions had KV."""
    store.writer.flush(WAIT_SAVED_S)
    with store.committer.lock:
        dropped = len(store.index)
        for key in store.index.sessions():
            store.index.remove(key)
            store.session_placement.tell("forget", key)
        store.versions.bump_all()
    with store.committer.mutate:
        store.tiers.clear()
    for record in store.records.list_sessions():
        store.records.upsert(record.key, token_ids=[], chunks=[])
    return dropped
