"""The Redis record store's Responses namespace: `chatstore:resp:{<tenant>:<digest>}`, each with
its own expiry (`ex=`), created only if absent (`nx=True`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec, Protocol, TypeVar
from urllib.parse import quote

from chatstore.store.record_keys import key_digest
from chatstore.store.records.responses import ResponseRecords, SealedRecords
from chatstore.store.session_kv import SessionKey

P = ParamSpec("P")
T = TypeVar("T")


class RedisRecords(SealedRecords, Protocol):
    """What the namespace uses of the Redis record store (redis.py)."""

    client: Any  # redis.Redis or RedisCluster

    def _call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T: ...

    def _names(self, tenant: str | None, prefix: str = ...) -> list[str]: ...


class RedisResponses(ResponseRecords):
    PREFIX = "chatstore:resp:"
    records: RedisRecords

    def _name(self, tenant: str, response_id: str) -> bytes:
        digest = key_digest(SessionKey(tenant, response_id))
        return f"{self.PREFIX}{{{quote(tenant, safe='')}:{digest}}}".encode()

    def _get(self, name: bytes) -> bytes | None:
        return self.records._call(self.records.client.get, name)

    def _add(self, name: bytes, raw: bytes, expiry_s: int | None) -> bool:
        return bool(self.records._call(self.records.client.set, name, raw, nx=True, ex=expiry_s))

    def _replace(self, name: bytes, raw: bytes) -> None:
        self.records._call(self.records.client.set, name, raw, xx=True, keepttl=True)

    def _keep(self, name: bytes, expiry_s: int) -> None:
        self.records._call(self.records.client.expire, name, expiry_s, gt=True)

    def _delete(self, name: bytes) -> bool:
        return bool(self.records._call(self.records.client.delete, name))

    def _delete_tenant(self, tenant: str) -> int:
        def drop() -> int:
            names = self.records._names(tenant, self.PREFIX)
            for name in names:  # one by one: the names lie in many cluster slots
                self.records.client.delete(name)
            return len(names)

        return int(self.records._call(drop))
