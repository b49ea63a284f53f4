"""What a Redis record store does at start: once per Redis, not per start (`chatstore:facts-built`
says it is done), records named before the hash tag get their tagged name and the records written
before the counts and expiry sets are counted in them; and, with encryption on, at every start a
look at a few records for values sealed by version 1 (a hint how to migrate them, not a scan).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ParamSpec, Protocol, TypeVar

from chatstore.store.records.record import RecordStoreUnavailable, SessionRecord
from chatstore.store.records.redis_facts import as_text
from chatstore.store.sealing import Sealer
from chatstore.store.sealing.legacy_v1 import warn_if_legacy
from chatstore.store.session_kv import SessionKey

log = logging.getLogger(__name__)

FACTS_BUILT = "chatstore:facts-built"
LEGACY_SAMPLE = 16  # records a start looks at for version-1 values (one SCAN page, a hint)
P = ParamSpec("P")
T = TypeVar("T")


class StartedStore(Protocol):
    """What the start uses of the Redis record store (redis.py)."""

    PREFIX: str
    client: Any
    sealer: Sealer | None
    _errors: tuple[type[BaseException], ...]

    def _call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T: ...

    def _all(self, tenant: str | None = None) -> list[SessionRecord]: ...

    def _facts(self, key: SessionKey, record: SessionRecord | None) -> None: ...


def start(store: StartedStore) -> None:
    """Once per Redis, not per start (a SCAN): legacy names renamed, older records counted;
    then the version-1 hint."""
    _migrate(store)
    warn_legacy(store)


def _migrate(store: StartedStore) -> None:
    try:
        if store._call(store.client.exists, FACTS_BUILT):
            return
    except RecordStoreUnavailable as exc:
        log.warning("session records: start checks skipped (%s)", exc)
        return
    rename_legacy_records(store)
    try:
        records = store._call(store._all)
        for record in records:
            store._facts(record.key, record)
        store._call(store.client.set, FACTS_BUILT, b"1")
        log.info("counted %d session records by tenant and expiry", len(records))
    except RecordStoreUnavailable as exc:
        log.warning("session records: expiry sets not built (%s)", exc)


def warn_legacy(store: StartedStore) -> None:
    """Log how to migrate when the first few records found are sealed by version 1 (one
    SCAN page and one MGET: a hint at every start, not a scan of every record)."""
    if store.sealer is None:
        return
    client = store.client
    try:
        page = client.scan(0, match=f"{store.PREFIX}*", count=100)
        # One node: (cursor, names); a Cluster answers per node: {node: (cursor, names)}.
        pages = page.values() if isinstance(page, dict) else [page]
        found = [as_text(n) for _, names in pages for n in names]
        names = [n for n in found if n.endswith("}")][:LEGACY_SAMPLE]
        sample = [raw for name in names if (raw := client.get(name))]
    except store._errors as exc:
        log.debug("session records: version-1 check skipped (%s)", exc)
        return
    warn_if_legacy("session records in Redis", sample)


def rename_legacy_records(store: StartedStore) -> None:
    """Records named before the hash tag (`chatstore:rec:<tenant>:<digest>`, single-node
    Redis only) get their tagged name, once; a tagged record already there wins."""
    client, prefix = store.client, store.PREFIX

    def rename() -> int:
        done = 0
        for raw in client.scan_iter(match=f"{prefix}*", count=1000):
            old = as_text(raw)
            rest = old[len(prefix) :]
            if rest.startswith("{"):
                continue
            if not client.renamenx(old, f"{prefix}{{{rest}}}"):
                client.delete(old)
            done += 1
        return done

    try:
        if done := store._call(rename):
            log.info("renamed %d session records (hash tags)", done)
    except RecordStoreUnavailable as exc:
        log.warning("session records: legacy names kept (%s)", exc)
