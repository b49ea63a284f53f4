"""A Redis session record as a small header plus an append-only log (LMDB's layout, lmdb_log.py):

    chatstore:rec:{<tenant>:<digest>}   the header: the record's fields but its three growing
                                        lists, and `log`, how many entries the list holds
                                        (lmdb_log.header_json)
    chatstore:log:{<tenant>:<digest>}   a LIST, element i the log's entry i: what a write kept of
                                        each list and added to it (lmdb_log.entry_json)

One hash tag: header, log and lease (leases.py) share a Redis Cluster slot, so one MULTI/EXEC
covers them. A write, under WATCH of the header, is RPUSH of its entry, SET of the header (with
its entry count) and the same absolute deadline on both (PXAT / PEXPIREAT: they expire at one
instant, or PERSIST both); after lmdb_log.MAX_ENTRIES, or over a record stored whole (the layout
before this one: read as is, migrated by its first write), it is DEL of the log and one base
entry. Its bytes grow with the turn, not with the conversation. A read is one MULTI of GET and
LRANGE (a snapshot); many records are read in one pipeline of GET, LRANGE, GET each, and a
record whose two header reads differ (a write landed between) is read again in a MULTI.

Sealed under the tenant's key like every record: the header with its own name as associated
data, entry i with `<log name>/<i in 8 hex digits>`, so an entry moved to another index or
another session's log fails to open (the record then reads as absent, counted in
`open_failures`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from chatstore.store.records import lmdb_log
from chatstore.store.records.base import RecordStore
from chatstore.store.records.record import SessionRecord
from chatstore.store.sealing.legacy_v1 import LegacyOpener

log = logging.getLogger(__name__)

HEADER_PREFIX = "chatstore:rec:"
LOG_PREFIX = "chatstore:log:"

Opened = tuple[SessionRecord | None, int | None]  # the record, its entry count (None: whole)


def log_name(header_name: str) -> str:
    """The log's name: the header's hash tag under LOG_PREFIX."""
    return LOG_PREFIX + header_name[len(HEADER_PREFIX) :]


def entry_ad(log_name: str, index: int) -> bytes:
    """Entry index's associated data when sealed: its log's name and its place."""
    return f"{log_name}/{index:08x}".encode()


def open_record(
    store: RecordStore, tenant: str, name: str, header: bytes | None, entries: list[bytes]
) -> Opened:
    """The record stored as header and log entries under name, assembled, and how many
    entries its log has (None: a whole record of the older layout, or none). A header or an
    entry that fails to open, or a log of another length than its header says: absent."""
    plain = store.unseal(tenant, name.encode(), header)
    if plain is None:
        return None, None
    try:
        count = lmdb_log.entries_of(plain)
        record = SessionRecord.from_json(plain)
        if count is None:
            return record, None
        if len(entries) != count:
            raise ValueError(f"its log has {len(entries)} entries, not {count}")
        logged = log_name(name)
        opened = [store.unseal(tenant, entry_ad(logged, i), raw) for i, raw in enumerate(entries)]
        if any(p is None for p in opened):
            raise ValueError("a log entry failed to open")
        return lmdb_log.assemble(record, [p for p in opened if p is not None]), count
    except (ValueError, TypeError, KeyError) as exc:
        store.open_failures += 1
        log.warning("session record %r failed to open (%s): read as absent", name, exc)
        return None, None


def open_cached(
    store: RecordStore, cache: lmdb_log.LogCache, tenant: str, name: str, header: bytes | None
) -> Opened | None:
    """The record under header from the cache of assembled lists (lmdb_log.LogCache: valid
    while the stored header is the same bytes), without reading its log; None: not cached."""
    if header is None:
        return None, None
    plain = store.unseal(tenant, name.encode(), header)
    if plain is None:
        return None, None
    try:
        if lmdb_log.entries_of(plain) is None:
            return None  # the older layout: read whole
        record = SessionRecord.from_json(plain)
    except (ValueError, TypeError, KeyError):
        return None  # open_record counts it and says so
    count = cache.get(name.encode(), bytes(header), record)
    return None if count is None else (record, count)


def read_one(
    store: RecordStore,
    client: Any,
    tenant: str,
    name: str,
    cache: lmdb_log.LogCache | None = None,
) -> Opened:
    """One record: its header alone when `cache` has its lists, else one MULTI of GET and
    LRANGE (header and log from one instant)."""
    if cache is not None:
        cached = open_cached(store, cache, tenant, name, client.get(name))
        if cached is not None:
            return cached
    with client.pipeline(transaction=True) as pipe:
        pipe.get(name)
        pipe.lrange(log_name(name), 0, -1)
        header, entries = pipe.execute()
    opened = open_record(store, tenant, name, header, entries)
    if cache is not None and opened[0] is not None and opened[1] is not None:
        cache.put(name.encode(), bytes(header), opened[1], opened[0])
    return opened


def read_many(
    store: RecordStore, client: Any, named: list[tuple[str, str]]
) -> list[SessionRecord | None]:
    """The records (tenant, header name) in one pipeline (their names lie in many cluster
    slots: no MULTI over them all): GET, LRANGE, GET each; one whose header changed between
    its two reads is read again on its own (read_one)."""
    if not named:
        return []
    with client.pipeline(transaction=False) as pipe:
        for _, name in named:
            pipe.get(name)
            pipe.lrange(log_name(name), 0, -1)
            pipe.get(name)
        raws = pipe.execute()
    found = []
    for i, (tenant, name) in enumerate(named):
        header, entries, again = raws[3 * i : 3 * i + 3]
        if header != again:
            found.append(read_one(store, client, tenant, name)[0])
        else:
            found.append(open_record(store, tenant, name, header, entries)[0])
    return found


def queue_write(
    store: RecordStore,
    pipe: Any,
    name: str,
    record: SessionRecord,
    lists: lmdb_log.Lists | None,
    count: int | None,
) -> tuple[int, bytes, int]:
    """Queue on pipe (in MULTI) the header and one log entry of what the change added (lists:
    the record's lists before it; None, or a full log: a new base, the old entries dropped);
    the bytes it puts (names and values), the header it sets and the log's entry count."""
    tenant, logged = record.tenant, log_name(name)
    if lists is None or count is None or count >= lmdb_log.MAX_ENTRIES:
        pipe.delete(logged)
        lists, count = None, 0
    put = 0
    entry = lmdb_log.entry_json(lists, record)
    if entry is not None:
        sealed = store.seal(tenant, entry_ad(logged, count), entry)
        pipe.rpush(logged, sealed)
        count += 1
        put += len(logged) + len(sealed)
    header = store.seal(tenant, name.encode(), lmdb_log.header_json(record, count))
    expiry_s = store._expiry_s(record)
    if expiry_s is None:
        pipe.set(name, header)
        pipe.persist(logged)
    else:
        deadline_ms = int(time.time() * 1000) + 1000 * expiry_s
        pipe.set(name, header, pxat=deadline_ms)
        pipe.pexpireat(logged, deadline_ms)
    return put + len(name) + len(header), bytes(header), count


def reseal_record(
    store: RecordStore,
    pipe: Any,
    tenant: str,
    name: str,
    adopt_clear: bool = False,
    legacy: LegacyOpener | None = None,
) -> bool:
    """Re-seal a record's header and log entries under the sealing key (key rotation,
    encrypt-existing, migrate-v1: store.reseal), in one MULTI under WATCH of both (pipe:
    watching them); whether anything was rewritten. Each value keeps its TTL (SET KEEPTTL,
    LSET)."""
    logged = log_name(name)
    raw = pipe.get(name)
    entries = pipe.lrange(logged, 0, -1)
    header = raw and store.reseal(tenant, name.encode(), raw, adopt_clear, legacy)
    changed = {
        i: sealed
        for i, entry in enumerate(entries)
        if (sealed := store.reseal(tenant, entry_ad(logged, i), entry, adopt_clear, legacy))
    }
    if not raw or not (header or changed):
        return False
    pipe.multi()
    pipe.set(name, header or raw, keepttl=True)  # the header always moves: writers WATCH it
    for i, sealed in changed.items():
        pipe.lset(logged, i, sealed)
    return True
