"""The Redis record store's base: calls through the circuit breaker, and the sessions' facts
every replica shares (redis.py lists the keys):

    chatstore:exp:{<tenant>}     the tenant's sessions by expiry (record name digest -> deadline,
                                 inf: never): the live count is a ZCOUNT, the purge reads what
                                 is due
    chatstore:start:{<tenant>}   the sessions a start reads (KV chunks or a retention of their own)
    chatstore:tenants            the tenants with sessions

They are written right after the record (another Redis Cluster slot), in one pipeline.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar
from urllib.parse import quote, unquote

from chatstore.store.record_keys import key_digest
from chatstore.store.records import lmdb_facts
from chatstore.store.records.base import RecordStore
from chatstore.store.records.record import RecordStoreUnavailable, SessionRecord
from chatstore.store.session_kv import SessionKey

if TYPE_CHECKING:
    from chatstore.store.tiers.breaker import CircuitBreaker

P = ParamSpec("P")
T = TypeVar("T")


def as_text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def tagged_tenant(name: str) -> str:
    """The tenant of a tagged name `<prefix>{<tenant>:<digest>}`."""
    return unquote(name[name.index("{") + 1 :].rsplit(":", 1)[0])


class RedisFacts(RecordStore):
    """RecordStore over one Redis (or a Cluster): its breaker-guarded calls and facts."""

    PREFIX = "chatstore:rec:"
    EXPIRY_PREFIX = "chatstore:exp:"
    TENANTS = "chatstore:tenants"
    START_PREFIX = "chatstore:start:"
    client: Any  # redis.Redis or RedisCluster
    breaker: CircuitBreaker | None
    _errors: tuple[type[BaseException], ...]

    @abstractmethod
    def _read(self, tenant: str, name: str) -> SessionRecord | None:
        """The record (header and log) stored under name (None: absent or not opening)."""

    @abstractmethod
    def _read_many(self, names: list[str]) -> list[SessionRecord | None]:
        """The records stored under names (tagged: their tenant is in the name), in order."""

    def _expiry_name(self, tenant: str) -> str:
        return f"{self.EXPIRY_PREFIX}{{{quote(tenant, safe='')}}}"

    # -- calls through the breaker ----------------------------------------------------------

    def _call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        breaker = self.breaker
        if breaker is not None and not breaker.allow():
            raise RecordStoreUnavailable("session records (Redis) unavailable: circuit open")
        try:
            out = fn(*args, **kwargs)
        except self._errors as exc:
            if breaker is not None:
                breaker.failure(exc)
            raise RecordStoreUnavailable(f"session records (Redis) unavailable: {exc}") from None
        except BaseException:
            if breaker is not None:
                breaker.success()  # Redis answered (an error reply is not an outage)
            raise
        if breaker is not None:
            breaker.success()
        return out

    # -- counts and expiry ------------------------------------------------------------------

    def _facts(self, key: SessionKey, record: SessionRecord | None) -> None:
        """The session in its tenant's expiry set at its deadline (None: out of it)."""
        zname, digest = self._expiry_name(key.tenant), key_digest(key)
        start = f"{self.START_PREFIX}{{{quote(key.tenant, safe='')}}}"
        with self.client.pipeline(transaction=False) as pipe:
            if record is not None and lmdb_facts.restored(record):
                pipe.sadd(start, digest)
            else:
                pipe.srem(start, digest)
            if record is None:
                pipe.zrem(zname, digest)
            else:
                deadline = self.expires_at(record)
                score = float("inf") if deadline is None else deadline
                pipe.zadd(zname, {key_digest(key): score})
                pipe.sadd(self.TENANTS, key.tenant)
            pipe.execute()

    def restore_sessions(self) -> list[SessionRecord]:
        """The sessions a start needs, through the per-tenant start sets."""

        def read() -> list[SessionRecord]:
            names = []
            for raw in self.client.smembers(self.TENANTS):
                tenant = quote(as_text(raw), safe="")
                start = self.client.smembers(f"{self.START_PREFIX}{{{tenant}}}")
                names += [f"{self.PREFIX}{{{tenant}:{as_text(d)}}}" for d in start]
            found = self._read_many(names)
            return [r for r in found if r is not None and self._live(r) is not None]

        return list(self._call(read))

    def count_sessions(self, tenant: str) -> int:
        """The tenant's members not yet due: one ZCOUNT, the same on every replica."""
        return int(self._call(self.client.zcount, self._expiry_name(tenant), time.time(), "+inf"))

    def _due(self, now: float) -> list[tuple[str, str]]:
        def due() -> list[tuple[str, str]]:
            found = []
            for raw in self.client.smembers(self.TENANTS):
                tenant = as_text(raw)
                digests = self.client.zrangebyscore(self._expiry_name(tenant), "-inf", f"({now}")
                found += [(tenant, as_text(d)) for d in digests]
            return found

        return list(self._call(due))

    def _load_due(self, tenant: str, digest: str) -> SessionRecord | None:
        name = f"{self.PREFIX}{{{quote(tenant, safe='')}:{digest}}}"
        return self._call(self._read, tenant, name)

    def _drop_due(self, tenant: str, digest: str, record: SessionRecord | None) -> None:
        if record is None:
            self._call(self.client.zrem, self._expiry_name(tenant), digest)
        else:
            self._call(self._facts, record.key, record)

    def purge_expired(self, now: float | None = None) -> list[SessionKey]:
        return list(self._call(super().purge_expired, now))
