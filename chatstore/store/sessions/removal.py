"""Sessions leaving the store: one deleted, a tenant shredded, the expired purged, every
session's KV dropped. Each waits for the session's pending write first: API threads only."""

from __future__ import annotations

from collections.abc import Callable

from chatstore.store.commit.turn_commit import TurnCommitter
from chatstore.store.placement.session_placement import SessionPlacement
from chatstore.store.sealing import Sealer
from chatstore.store.session_kv import ChunkKey, SessionKey
from chatstore.store.sessions.retention_table import RetentionTable

WAIT_SAVED_S = 30.0  # the longest a reader waits for a session's pending write


class SessionRemoval:
    def __init__(
        self,
        committer: TurnCommitter,
        placement: SessionPlacement,
        retention: RetentionTable,
        sealer: Sealer | None,
        wait_restored: Callable[[float | None], bool] = lambda timeout: True,
    ) -> None:
        """wait_restored: until the index restore is done (restore.py): a shred or a flush
        must see every session, not those restored so far."""
        self.committer, self.placement, self.retention = committer, placement, retention
        self.sealer = sealer
        self.index, self.tiers, self.records = committer.index, committer.tiers, committer.records
        self.writer, self.versions = committer.writer, committer.versions
        self.wait_restored = wait_restored

    def _forget(self, key: SessionKey) -> list[ChunkKey]:
        """Under the store's lock: the session leaves the index, the policy and retention, and
        is tombstoned; the chunks it alone held (the caller frees them)."""
        self.versions.tombstone(key)
        freed = self.index.remove(key)
        self.placement.tell("forget", key)
        self.retention.drop(key)
        self.placement.tell("set_priority", key, 0)
        return freed

    def delete_session(self, key: SessionKey) -> bool:
        """Remove the session's record and the chunks no other session holds."""
        self.writer.wait(key, WAIT_SAVED_S)
        committer = self.committer
        # Under mutate, so a turn the writer is committing cannot re-create the record
        # between its check and our delete; the tombstone drops turns begun before now.
        with committer.mutate:
            with committer.lock:
                found = self.index.get(key) is not None
                freed = self._forget(key)
            existed = bool(self.records.delete(key))
        committer.free(freed)
        self.versions.bump(key)
        return existed or found

    def shred_tenant(self, tenant: str) -> int:
        """Crypto-shred tenant: its key is destroyed first (every sealed copy of its data, in
        any tier or backup, stops opening at once), then its sessions are deleted, then any of
        its chunks still stored (orphans) are; how many sessions went. Its records the index
        does not know (no KV) are the caller's to delete (records.delete_tenant)."""
        if self.sealer is not None:
            self.sealer.keyring.shred(tenant)
        self.wait_restored(None)
        with self.committer.lock:
            sessions = [k for k in self.index.sessions() if k.tenant == tenant]
        for key in sessions:
            self.delete_session(key)
        with self.committer.mutate:
            held = [c for t in self.tiers.tiers for c in list(t.keys())]
            self.committer.delete_unneeded(list({c for c in held if c.tenant == tenant}))
        # No replica deletes a shared chunk it merely stopped using; a shred removes the
        # tenant's from the shared tier explicitly (its key is gone: they open nowhere).
        self.tiers.delete_tenant_shared(tenant)
        return len(sessions)

    def purge_expired(self) -> list[SessionKey]:
        self.writer.flush(WAIT_SAVED_S)
        gone = self.records.purge_expired()
        for key in gone:
            with self.committer.lock:
                freed = self._forget(key)
            self.committer.free(freed)
            self.versions.bump(key)
        return gone

    def invalidate_all(self, shared: bool = False) -> int:
        """Drop every session's KV (records keep their messages) from this replica's tiers,
        and with `shared` every chunk of the model from the shared tier (Redis) too; how many
        sessions had KV."""
        self.wait_restored(None)
        self.writer.flush(WAIT_SAVED_S)
        with self.committer.lock:
            dropped = len(self.index)
            for key in self.index.sessions():
                self.index.remove(key)
                self.placement.tell("forget", key)
            self.versions.bump_all()
        with self.committer.mutate:
            self.tiers.clear(shared)
        if shared or not any(t.remote for t in self.tiers.slow):
            # The chunks are gone everywhere: no record lists them. A flush of this
            # replica's tiers alone leaves the records (shared with the replicas, whose
            # chunks Redis still holds) as they are: what is gone reads as a miss.
            for record in self.records.list_sessions():
                self.records.upsert(record.key, token_ids=[], chunks=[])
        return dropped
