"""The LMDB record store's rewrites in place: what a start migrates once, and re-sealing.

At start (`migrate`), once each: records written before keys carried the tenant are re-keyed
(`t:<tenant>/<digest>`), records written before the prefix index are indexed (lmdb_index.py),
and the counts and expiry index (lmdb_facts.py) are built for the records written before them,
or again when the server's TTL changed. With encryption on, a few records are looked at for
values sealed by version 1 (a hint how to migrate them, not a scan).

`reseal_batch` re-seals records `batch` at a time (key rotation, encrypt-existing, migrate-v1:
RecordSealing.reseal), each swapped only if it did not change meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from chatstore.store.record_keys import key_digest
from chatstore.store.records import lmdb_facts, lmdb_log
from chatstore.store.records.lmdb_facts import tenant_of, tenant_prefix
from chatstore.store.records.lmdb_index import INDEX_BUILT, LmdbPrefixIndex
from chatstore.store.records.lmdb_log import SESSIONS
from chatstore.store.records.lmdb_responses import RESPONSES
from chatstore.store.records.record import SessionRecord
from chatstore.store.records.record_sealing import RecordSealing
from chatstore.store.sealing.legacy_v1 import LegacyOpener, warn_if_legacy
from chatstore.store.session_kv import SessionKey

if TYPE_CHECKING:
    from lmdb import Environment, Transaction

log = logging.getLogger(__name__)

LEGACY_SAMPLE = 16  # records a start looks at for version-1 values (a hint, not a scan)
T = TypeVar("T")


class MigratedStore(Protocol):
    """What the rewrites use of the LMDB record store (lmdb.py)."""

    env: Environment
    path: Path
    ttl_s: int
    sealing: RecordSealing
    index: LmdbPrefixIndex

    def _all(self, tenant: str | None = None) -> list[SessionRecord]: ...

    def _facts(
        self,
        txn: Transaction[bytes],
        key: SessionKey,
        was: lmdb_facts.State,
        now: SessionRecord | None,
    ) -> None: ...

    def _write(self, fn: Callable[[Transaction[bytes]], T]) -> T: ...


def migrate(store: MigratedStore) -> None:
    """Records written before keys carried the tenant: re-key them once. Records written
    before the prefix index: index them once."""
    with store.env.begin() as txn:
        old = []  # their names are hex digests: they sort before every `x:` name here
        for name, raw in txn.cursor():
            if bytes(name) >= INDEX_BUILT[:2]:
                break
            if b":" not in bytes(name)[:2]:
                old.append((bytes(name), bytes(raw)))
        indexed = store.index.is_built(txn)
        facts_ttl = lmdb_facts.ttl_marker(txn)
    if old and store.sealing.sealer is not None:
        # Clear values written before sealing existed: a migration never seals a value
        # it did not write (a planted one would become authentic). Left where they are.
        log.warning(
            "%s: %d records in an old clear layout are not read with encryption on: "
            "start once with encrypt_at_rest = false to migrate them, then run "
            "`chatstore admin encrypt-existing`",
            store.path, len(old),
        )  # fmt: skip
    elif old:
        with store.env.begin(write=True) as txn:
            for name, raw in old:
                record = SessionRecord.from_json(raw)  # the clear layout before tenants
                new_name = tenant_prefix(record.tenant, SESSIONS) + key_digest(record.key).encode()
                txn.put(new_name, store.sealing.seal(record.tenant, new_name, record.to_json()))
                txn.delete(name)
    if not indexed:  # never, or hashed otherwise (before keyed hashes): built anew
        store.index.build(store._all())
    if facts_ttl != store.ttl_s:
        build_facts(store)
    if store.sealing.sealer is not None:
        warn_if_legacy(str(store.path), first_values(store.env, SESSIONS, LEGACY_SAMPLE))


def first_values(env: Environment, prefix: bytes, count: int) -> list[bytes]:
    """Up to `count` values whose names start with prefix (not the whole range)."""
    found: list[bytes] = []
    with env.begin() as txn:
        cursor = txn.cursor()
        if cursor.set_range(prefix):
            for name, raw in cursor:
                if not name.startswith(prefix) or len(found) >= count:
                    break
                found.append(bytes(raw))
    return found


def build_facts(store: MigratedStore) -> None:
    """The counts and the expiry index from every record: once for the records written
    before them, and again when the server's TTL changed (the deadlines move)."""
    records = store._all()
    with store.env.begin(write=True) as txn:
        for tenant in lmdb_facts.tenants(txn):
            lmdb_facts.drop_tenant(txn, tenant)
        for record in records:
            store._facts(txn, record.key, (False, False), record)
        lmdb_facts.set_ttl_marker(txn, store.ttl_s)


def reseal_batch(
    store: MigratedStore,
    after: bytes = b"",
    batch: int = 64,
    adopt_clear: bool = False,
    legacy: LegacyOpener | None = None,
) -> tuple[int, bytes | None]:
    """Re-seal up to `batch` records (Responses, then sessions' headers and log entries)
    whose names follow `after` (key rotation, encrypt-existing, migrate-v1: `reseal`);
    (how many were rewritten, the last name looked at: the cursor to resume from; None
    when done)."""
    with store.env.begin() as txn:
        cursor = txn.cursor()
        todo: list[tuple[bytes, bytes]] = []
        if cursor.set_range(after or RESPONSES):
            for name, raw in cursor:
                if name == after:
                    continue
                if bytes(name)[:2] not in (RESPONSES, SESSIONS, lmdb_log.LOG):
                    break
                if len(todo) >= batch:
                    break
                todo.append((bytes(name), bytes(raw)))
    if not todo:
        return 0, None
    done = 0
    for name, raw in todo:
        sealed = store.sealing.reseal(tenant_of(name), name, raw, adopt_clear, legacy)
        if sealed is None:
            continue

        def swap(
            txn: Transaction[bytes], name: bytes = name, raw: bytes = raw, sealed: bytes = sealed
        ) -> bool:
            return txn.get(name) == raw and txn.put(name, sealed)  # unchanged meanwhile

        done += bool(store._write(swap))
    return done, todo[-1][0]
