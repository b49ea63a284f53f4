"""The Redis record store's prefix index (prefix_index.py): which session a client that resends
its history continues, for every replica sharing the Redis.

    chatstore:prefix:{<tenant>}   the tenant's index, a hash: entry key -> entry, and `built`
                                  (what RecordSealing.index_mark said when it was built) once
                                  the records written before it are in

An entry is written after its record, in a transaction of its own (another Cluster slot than
the record's): a lookup verifies every candidate on its record, so an entry that lags behind
or outlives its record costs a read, never a wrong match. Best effort: an entry Redis failed to
take is logged, and the turn stands.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from chatstore.store.record_keys import key_digest
from chatstore.store.records import prefix_index
from chatstore.store.records.prefix_index import PrefixEntry, PrefixMatch, Saved, saved
from chatstore.store.records.record import SessionRecord
from chatstore.store.records.record_sealing import RecordSealing
from chatstore.store.session_kv import SessionKey

log = logging.getLogger(__name__)

INDEX_PREFIX = "chatstore:prefix:"
INDEX_BUILT = "built"  # a field of a tenant's index hash: its older records are in it


def index_name(tenant: str) -> str:
    return f"{INDEX_PREFIX}{{{quote(tenant, safe='')}}}"


class RedisPrefixIndex:
    """The tenants' index hashes in one Redis. `load(tenant, digest)`: the live record of that
    name digest (None: absent, expired or not opening), to verify a candidate on;
    `records_of(tenant)`: every record of the tenant that opens, to build its index from."""

    def __init__(
        self,
        client: Any,
        sealing: RecordSealing,
        errors: tuple[type[BaseException], ...],
        load: Callable[[str, str], SessionRecord | None],
        records_of: Callable[[str], list[SessionRecord]],
    ) -> None:
        self.client = client  # redis.Redis or RedisCluster
        self.sealing = sealing
        self._errors = errors  # Redis out of reach (tiers/redis_client.outage_errors)
        self._load = load
        self._records_of = records_of
        self._memo = prefix_index.HashMemo()  # O(new) prefix index updates per turn

    def move(self, key: SessionKey, was: Saved | None, now: Saved | None) -> None:
        """Move the session's entries in its tenant's index hash (only those that differ).
        Best effort: the record is written already, and lookups verify on the records."""
        if was == now:
            return
        digest, hname = key_digest(key), index_name(key.tenant)
        hkey = self.sealing.digest_key(key.tenant)
        keys, new = self._memo.moved(digest, key.tenant, was, now, hkey)

        def attempt(pipe: Any) -> None:  # retried by redis-py if the hash changes meanwhile
            entries = [PrefixEntry.from_bytes(raw) for raw in pipe.hmget(hname, keys)]
            for k, entry in zip(keys, entries, strict=True):
                prefix_index.apply(entry, digest, k, new)
            pipe.multi()
            kept = {k: e.to_bytes() for k, e in zip(keys, entries, strict=True) if not e.empty()}
            if kept:
                pipe.hset(hname, mapping=kept)
            if dropped := [k for k, e in zip(keys, entries, strict=True) if e.empty()]:
                pipe.hdel(hname, *dropped)

        if keys:
            try:
                self.client.transaction(attempt, hname)
            except self._errors as exc:
                log.warning("prefix index of %s not updated (%s)", key, exc)

    def build(self, tenant: str) -> None:
        """The tenant's records written before the prefix index, or indexed with other hashes
        (before keyed ones): index them anew, once per Redis (the tenant's first lookup; two
        replicas doing it at once change nothing; a turn's entry written meanwhile may be
        lost: lookups verify on the records, the index is best effort)."""
        records = [r for r in self._records_of(tenant) if r.tenant == tenant]
        self.client.delete(index_name(tenant))
        for record in records:
            self.move(record.key, None, saved(record))
        self.client.hset(index_name(tenant), INDEX_BUILT, self.sealing.index_mark())
        log.info("indexed %d session records of %r by prefix", len(records), tenant)

    def unbuild(self, tenant: str) -> None:
        """Mark the tenant's index unbuilt: its next lookup builds it anew."""
        self.client.hdel(index_name(tenant), INDEX_BUILT)

    def match(self, tenant: str, token_ids: list[int], fingerprint: str) -> PrefixMatch | None:
        """RecordStore.match_prefix: the entries read in one HMGET (the index built first if
        it is not, or was built with other hashes), each candidate verified on its record."""
        hname = index_name(tenant)

        def read(keys: list[str]) -> list[bytes | None]:
            *entries, built = self.client.hmget(hname, [*keys, INDEX_BUILT])
            # Its first lookup: index the records, read again.
            if built != self.sealing.index_mark():
                self.build(tenant)
                entries = self.client.hmget(hname, keys)
            return list(entries)

        def load(digest: str) -> SessionRecord | None:
            return self._load(tenant, digest)

        key = self.sealing.digest_key(tenant)
        return prefix_index.best_match(tenant, fingerprint, token_ids, read, load, key)
