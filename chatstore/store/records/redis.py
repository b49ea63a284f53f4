"""Session records in Redis (replicas sharing one Redis, or a Redis Cluster).

    chatstore:rec:{<tenant>:<digest>}    a session's record header (expires with its TTL)
    chatstore:log:{<tenant>:<digest>}    its log of turns, a list (redis_log.py): a write
                                         appends, it never rewrites
    chatstore:resp:{<tenant>:<digest>}   a stored Response (responses.py)
    chatstore:prefix:{<tenant>}          the tenant's prefix index, a hash: entry key -> entry,
                                         and `built` once the records written before it are in
                                         (redis_index.py)
    chatstore:exp:{<tenant>}             the tenant's sessions by expiry, a sorted set: record
                                         name digest (no session id in the clear) -> deadline
                                         (inf: never); its live count is a ZCOUNT
    chatstore:tenants                    the tenants with sessions (the purge's list)
    chatstore:start:{<tenant>}           digests of the sessions a start reads (KV or retention)
    chatstore:facts-built                set once the records written before those are in
                                         (redis_start.py)

The hash tags put a record and anything named after it (its lease, `leases.py`) in one Redis
Cluster slot, so one transaction covers them. The prefix index is written after the record,
in a transaction of its own (another slot): a lookup verifies every candidate on its record,
so an entry that lags behind or outlives its record costs a read, never a wrong match. The
expiry set is written the same way, after the record: a member that outlives its record is
dropped by the purge when it comes due (it reads the record to confirm).
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from chatstore.store.record_keys import key_digest
from chatstore.store.records import lmdb_log, redis_index, redis_log, redis_start
from chatstore.store.records.base import Change
from chatstore.store.records.prefix_index import PrefixMatch, Saved, saved
from chatstore.store.records.record import ChainRecord, SessionRecord
from chatstore.store.records.redis_facts import RedisFacts, as_text, tagged_tenant
from chatstore.store.records.redis_index import RedisPrefixIndex
from chatstore.store.records.redis_responses import RedisResponses
from chatstore.store.sealing import Sealer
from chatstore.store.sealing.legacy_v1 import LegacyOpener
from chatstore.store.session_kv import SessionKey

if TYPE_CHECKING:
    from chatstore.store.tiers.breaker import CircuitBreaker

log = logging.getLogger(__name__)


class RedisRecordStore(RedisFacts):
    INDEX_PREFIX = redis_index.INDEX_PREFIX
    INDEX_BUILT = redis_index.INDEX_BUILT  # a field of a tenant's index hash
    FACTS_BUILT = redis_start.FACTS_BUILT

    def __init__(
        self,
        url_or_client: str | Any,
        ttl_s: int = 0,
        timeout_s: float = 0.25,
        breaker: CircuitBreaker | None = None,
        sealer: Sealer | None = None,
    ) -> None:
        """breaker: the KV tier's CircuitBreaker when both live in one Redis, so an outage
        costs a few timeouts in all, then record operations fail at once (503)."""
        from chatstore.store.tiers.redis_client import connect_redis, outage_errors

        super().__init__(ttl_s, sealer)
        self.breaker = breaker
        self._reseal_order: list[bytes] | None = None  # record names, while a rotation runs
        self._errors = outage_errors()
        self.bytes_put = 0  # names and values of the session records written (headers, logs)
        self._log_cache = lmdb_log.LogCache()  # assembled lists: a turn reads its header only
        if isinstance(url_or_client, str):
            self.client = connect_redis(url_or_client, timeout_s)
        else:
            self.client = url_or_client
        self.responses = RedisResponses(self)
        self.index = RedisPrefixIndex(
            self.client, self.sealing, self._errors, self._load_live, self._all
        )
        redis_start.start(self)

    def _name(self, key: SessionKey) -> str:
        return f"{self.PREFIX}{{{quote(key.tenant, safe='')}:{key_digest(key)}}}"

    def _index_name(self, tenant: str) -> str:
        return redis_index.index_name(tenant)

    def get(self, key: SessionKey) -> SessionRecord | None:
        return self._call(super().get, key)

    def upsert(self, key: SessionKey, **changes: Any) -> SessionRecord:
        return self._call(super().upsert, key, **changes)

    def create(self, record: SessionRecord) -> SessionRecord:
        return self._call(super().create, record)

    def patch(self, key: SessionKey, **changes: Any) -> SessionRecord | None:
        return self._call(super().patch, key, **changes)

    def append_turn(
        self,
        key: SessionKey,
        base_version: int,
        new_messages: list[dict[str, Any]],
        keep: int | None = None,
        chain: ChainRecord | None = None,
        **changes: Any,
    ) -> SessionRecord:
        append = super().append_turn
        return self._call(append, key, base_version, new_messages, keep, chain, **changes)

    def list_sessions(self, tenant: str | None = None) -> list[SessionRecord]:
        return self._call(super().list_sessions, tenant)

    def match_prefix(self, tenant: str, token_ids: list[int], fingerprint: str) -> str | None:
        return self._call(super().match_prefix, tenant, token_ids, fingerprint)

    # -- sessions ---------------------------------------------------------------------------

    def put(self, record: SessionRecord) -> None:
        self._call(self._update, record.key, lambda _: record)

    def delete(self, key: SessionKey) -> bool:
        def drop() -> bool:
            name = self._name(key)
            self._log_cache.drop(name.encode())
            old = redis_log.read_one(self, self.client, key.tenant, name)[0]
            with self.client.pipeline(transaction=True) as pipe:  # one slot: header and log
                pipe.delete(name)
                pipe.delete(redis_log.log_name(name))
                gone = bool(pipe.execute()[0])
            self.index.move(key, saved(old), None)
            self._facts(key, None)
            return gone

        return bool(self._call(drop))

    def _update(self, key: SessionKey, change: Change) -> SessionRecord:
        name = self._name(key)
        done: list[SessionRecord] = []
        was: list[Saved | None] = [None]

        def attempt(pipe: Any) -> None:  # retried by redis-py if `name` changes meanwhile
            header = pipe.get(name)
            opened = redis_log.open_cached(self, self._log_cache, key.tenant, name, header)
            if opened is None:  # not cached: the log is read (O(conversation))
                entries = pipe.lrange(redis_log.log_name(name), 0, -1) if header else []
                opened = redis_log.open_record(self, key.tenant, name, header, entries)
            old, count = opened
            was[0] = saved(old)
            lists = lmdb_log.lists_of(old) if old is not None and count is not None else None
            record = change(old)
            pipe.multi()
            written[:] = [redis_log.queue_write(self, pipe, name, record, lists, count)]
            done[:] = [record]

        written: list[tuple[int, bytes, int]] = []
        self.client.transaction(attempt, name)
        put, header, count = written[0]
        self.bytes_put += put
        # Committed: that header's bytes now stand for these lists (a lost race retried).
        self._log_cache.put(name.encode(), header, count, done[0])
        self.index.move(key, was[0], saved(done[0]))
        self._facts(key, done[0])
        return done[0]

    def _load(self, key: SessionKey) -> SessionRecord | None:
        return self._read(key.tenant, self._name(key))

    def _read(self, tenant: str, name: str) -> SessionRecord | None:
        return redis_log.read_one(self, self.client, tenant, name, self._log_cache)[0]

    def _load_live(self, tenant: str, digest: str) -> SessionRecord | None:
        """The live record of tenant's name digest (a prefix index candidate's)."""
        name = f"{self.PREFIX}{{{quote(tenant, safe='')}:{digest}}}"
        return self._live(self._read(tenant, name))

    def _read_many(self, names: list[str]) -> list[SessionRecord | None]:
        return redis_log.read_many(self, self.client, [(tagged_tenant(n), n) for n in names])

    def _names(self, tenant: str | None, prefix: str = RedisFacts.PREFIX) -> list[str]:
        # quote() leaves no glob character in a tenant (*, ?, [ are %-escaped; `{` is literal
        # in a Redis glob). Only names ending in the tag's `}` are records.
        tag = f"{{{quote(tenant, safe='')}:" if tenant else "{"
        return [
            name
            for raw in self.client.scan_iter(match=f"{prefix}{tag}*", count=1000)
            if (name := as_text(raw)).endswith("}")
        ]

    def delete_tenant(self, tenant: str) -> int:
        """Delete every session record of tenant (and its index) by name, none opened."""
        self._log_cache.drop()

        def drop() -> int:
            names = self._names(tenant)
            for name in names:  # one by one: the names lie in many cluster slots
                self.client.delete(name, redis_log.log_name(name))  # one slot: header, log
            self.client.delete(self._index_name(tenant))
            self.client.delete(self._expiry_name(tenant))
            self.client.delete(f"{self.START_PREFIX}{{{quote(tenant, safe='')}}}")
            self.client.srem(self.TENANTS, tenant)
            return len(names)

        return int(self._call(drop))

    def _all(self, tenant: str | None = None) -> list[SessionRecord]:
        return [r for r in self._read_many(self._names(tenant)) if r is not None]

    # -- the prefix index (redis_index.py) ---------------------------------------------------

    def _prefix_match(
        self, tenant: str, token_ids: list[int], fingerprint: str
    ) -> PrefixMatch | None:
        return self.index.match(tenant, token_ids, fingerprint)

    # -- key rotation -----------------------------------------------------------------------

    def reseal_all(
        self,
        after: bytes = b"",
        batch: int = 64,
        adopt_clear: bool = False,
        legacy: LegacyOpener | None = None,
    ) -> tuple[int, bytes | None]:
        """Re-seal the records and stored Responses (key rotation), `batch` names after
        `after`, in name order (SCAN has no cursor that survives a restart); (rewritten, the
        cursor; None: done). The names are listed once per job (a first call, or one
        resuming), not per batch. A record changed meanwhile is read again (WATCH)."""

        def run() -> tuple[int, bytes | None]:
            if not after or self._reseal_order is None:
                every = [*self._names(None), *self._names(None, RedisResponses.PREFIX)]
                self._reseal_order = sorted(n.encode() for n in every)
            order = self._reseal_order
            todo = order[bisect.bisect_right(order, after) :][:batch]
            done = sum(self._reseal_one(name.decode(), adopt_clear, legacy) for name in todo)
            if not todo:
                self._reseal_order = None
            return done, todo[-1] if todo else None

        return self._call(run)

    def _reseal_one(self, name: str, adopt_clear: bool, legacy: LegacyOpener | None) -> bool:
        tenant = tagged_tenant(name)
        if name.startswith(self.PREFIX):  # a session: its header and log entries

            def whole(pipe: Any) -> bool:  # retried by redis-py if either changes meanwhile
                return redis_log.reseal_record(self, pipe, tenant, name, adopt_clear, legacy)

            watched = (name, redis_log.log_name(name))
            return bool(self.client.transaction(whole, *watched, value_from_callable=True))

        def attempt(pipe: Any) -> bool:  # retried by redis-py if `name` changes meanwhile
            raw = pipe.get(name)
            sealed = raw and self.reseal(tenant, name.encode(), raw, adopt_clear, legacy)
            if not sealed:
                return False
            pipe.multi()
            pipe.set(name, sealed, keepttl=True)
            return True

        return bool(self.client.transaction(attempt, name, value_from_callable=True))

    def rebuild_indexes(self) -> None:
        """Every record's counts, expiry and start entries written again (idempotent adds),
        and every tenant's prefix index marked unbuilt: its next lookup builds it anew."""

        def rebuild() -> int:
            records = self._all()
            for record in records:
                self._facts(record.key, record)
            for tenant in {r.tenant for r in records}:
                self.index.unbuild(tenant)
            return len(records)

        log.info(
            "session records: counts and expiry of %d records written again", self._call(rebuild)
        )

    def close(self) -> None:
        self.client.close()
