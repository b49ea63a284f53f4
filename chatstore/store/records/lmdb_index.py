"""The LMDB record store's prefix index (prefix_index.py): which session a client that resends
its history continues.

    p:<tenant>/<hash>     a prefix index entry, written in the same transaction as the record
                          whose token ids it follows (so it is exact after any crash)
    m:prefix-index        the index's "built" marker: what RecordSealing.index_mark said when
                          it was built (an index built keyed, or not, is built again when that
                          changes, or when it was built before keyed hashes)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from chatstore.store.record_keys import key_digest
from chatstore.store.records import prefix_index
from chatstore.store.records.lmdb_facts import tenant_prefix
from chatstore.store.records.prefix_index import PrefixEntry, PrefixMatch, Saved, saved
from chatstore.store.records.record import SessionRecord
from chatstore.store.records.record_sealing import RecordSealing
from chatstore.store.session_kv import SessionKey

if TYPE_CHECKING:
    from lmdb import Environment, Transaction

INDEX = b"p:"
INDEX_BUILT = b"m:prefix-index"


class LmdbPrefixIndex:
    """The index's entries in the records' environment. `load(tenant, digest)`: the live record
    of that name digest (None: absent, expired or not opening), to verify a candidate on."""

    def __init__(
        self,
        env: Environment,
        sealing: RecordSealing,
        load: Callable[[str, str], SessionRecord | None],
    ) -> None:
        self.env = env
        self.sealing = sealing
        self._load = load
        self._memo = prefix_index.HashMemo()  # O(new) prefix index updates per turn

    def is_built(self, txn: Transaction[bytes]) -> bool:
        """Whether the index was built, and with the hashes the store uses now."""
        return txn.get(INDEX_BUILT) == self.sealing.index_mark()

    def move(
        self, txn: Transaction[bytes], key: SessionKey, was: Saved | None, now: Saved | None
    ) -> None:
        """Move the session's index entries from what it registered with the saved ids and
        fingerprint `was` to what it does with `now` (only the entries that differ)."""
        if was == now:
            return
        digest = key_digest(key)
        hkey = self.sealing.digest_key(key.tenant)
        keys, new = self._memo.moved(digest, key.tenant, was, now, hkey)
        base = tenant_prefix(key.tenant, INDEX)
        for entry_key in keys:
            name = base + entry_key.encode()
            entry = PrefixEntry.from_bytes(txn.get(name))
            entry = prefix_index.apply(entry, digest, entry_key, new)
            if entry.empty():
                txn.delete(name)
            else:
                txn.put(name, entry.to_bytes())

    def build(self, records: list[SessionRecord]) -> None:
        """The index from every record that opens (`records`), its old entries dropped."""
        with self.env.begin(write=True) as txn:
            old_entries = txn.cursor()
            if old_entries.set_range(INDEX):
                while bytes(old_entries.key())[:2] == INDEX and old_entries.delete():
                    pass
            for record in records:
                self.move(txn, record.key, None, saved(record))
            txn.put(INDEX_BUILT, self.sealing.index_mark())

    def match(self, tenant: str, token_ids: list[int], fingerprint: str) -> PrefixMatch | None:
        """RecordStore.match_prefix: the entries read in one transaction, each candidate
        verified on its live record."""
        base = tenant_prefix(tenant, INDEX)

        def read(keys: list[str]) -> list[bytes | None]:
            with self.env.begin() as txn:
                return [txn.get(base + k.encode()) for k in keys]

        def load(digest: str) -> SessionRecord | None:
            return self._load(tenant, digest)

        key = self.sealing.digest_key(tenant)
        return prefix_index.best_match(tenant, fingerprint, token_ids, read, load, key)
