"""The LMDB record store's cluster facts: per-tenant session counts and the expiry index.

    c:<tenant>                         how many session records the tenant has stored (ascii)
    k:<tenant>/<digest>                a session the start needs (KV chunks, or a retention
                                       of its own): the start reads these, not every record
    x:<tenant>/<deadline>/<digest>     a session's expiry entry (empty: no session id in the
                                       clear); deadline: 16 hex digits of milliseconds
                                       (`ffff...`: never)
    m:expiry-ttl                       the server TTL the deadlines were counted with

Both change in the write transaction of the record they follow (create, turn, delete), so
they are exact after any crash. A record's deadline depends on the server's TTL (a record
with no TTL of its own): when the TTL changes between starts, the index is rebuilt once.
The purge reads only the entries that are due (and their records, to confirm); the live
count is the counter less the tenant's due entries.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

from chatstore.store.records.record import SessionRecord

if TYPE_CHECKING:
    from lmdb import Transaction

COUNTS, EXPIRY = b"c:", b"x:"
EXPIRY_TTL = b"m:expiry-ttl"
NEVER = b"f" * 16

Deadline = float | None
# (deadline: False absent, True stored but failed to open, else when it expires (None: never);
#  needed at start: None unknown)
State = tuple[Deadline | bool, bool | None]
RESTORE = b"k:"


def restored(record: SessionRecord) -> bool:
    """Whether the start reads this record: it lists KV chunks, or a retention of its own."""
    return bool(record.chunks or record.priority or record.ttl_s)


def _tenant_part(tenant: str) -> bytes:
    return quote(tenant, safe="").encode()


def stamp(deadline: Deadline) -> bytes:
    """A deadline as it sorts in the index (None: after every time)."""
    return NEVER if deadline is None else b"%016x" % max(0, int(deadline * 1000))


def entry_name(tenant: str, deadline: Deadline, digest: str) -> bytes:
    return EXPIRY + _tenant_part(tenant) + b"/" + stamp(deadline) + b"/" + digest.encode()


def count_of(txn: Transaction[bytes], tenant: str) -> int:
    raw = txn.get(COUNTS + _tenant_part(tenant))
    return int(bytes(raw)) if raw is not None else 0


def add_count(txn: Transaction[bytes], tenant: str, delta: int) -> None:
    name = COUNTS + _tenant_part(tenant)
    value = count_of(txn, tenant) + delta
    if value > 0:
        txn.put(name, b"%d" % value)
    else:
        txn.delete(name)


def moved(
    txn: Transaction[bytes], tenant: str, session_id: str, digest: str, old: State, new: State
) -> None:
    """The session's facts from `old` to `new` (State). A record stored but failed to open
    (True): its old expiry entry is unknown, and the purge drops it when it comes due (it
    checks the record)."""
    (was, needed_was), (now, needed) = old, new
    if needed != needed_was:
        restore = RESTORE + _tenant_part(tenant) + b"/" + digest.encode()
        if needed:
            txn.put(restore, b"")
        else:
            txn.delete(restore)
    if was is False and now is not False:
        add_count(txn, tenant, 1)
    elif was is not False and now is False:
        add_count(txn, tenant, -1)
    if was is not False and was is not True and was != now:
        txn.delete(entry_name(tenant, was, digest))
    if now is not False and now is not True and was != now:
        txn.put(entry_name(tenant, now, digest), b"")


def restore_entries(txn: Transaction[bytes]) -> list[tuple[str, bytes]]:
    """(tenant, digest) of every session the start needs."""
    return [(tenant_of(name), name.rsplit(b"/", 1)[1]) for name, _ in key_range(txn, RESTORE)]


def tenants(txn: Transaction[bytes]) -> list[str]:
    """Every tenant with a stored session (one counter each)."""
    found = []
    cursor = txn.cursor()
    if cursor.set_range(COUNTS):
        for name in cursor.iternext(keys=True, values=False):
            if not bytes(name).startswith(COUNTS):
                break
            found.append(unquote(bytes(name)[2:].decode()))
    return found


def due(txn: Transaction[bytes], tenant: str, now: float) -> Iterator[tuple[bytes, str]]:
    """The tenant's entries due before now: (entry name, record name digest), soonest first;
    reads nothing past the first entry not due."""
    base = EXPIRY + _tenant_part(tenant) + b"/"
    limit = base + stamp(now)
    cursor = txn.cursor()
    if not cursor.set_range(base):
        return
    for name in cursor.iternext(keys=True, values=False):
        name = bytes(name)
        if not name.startswith(base) or name >= limit:
            return
        yield name, name.rsplit(b"/", 1)[1].decode()


def due_count(txn: Transaction[bytes], tenant: str, now: float) -> int:
    return sum(1 for _ in due(txn, tenant, now))


def drop_tenant(txn: Transaction[bytes], tenant: str) -> None:
    txn.delete(COUNTS + _tenant_part(tenant))
    for name, _ in key_range(txn, RESTORE + _tenant_part(tenant) + b"/"):
        txn.delete(name)
    base = EXPIRY + _tenant_part(tenant) + b"/"
    cursor = txn.cursor()
    names = []
    if cursor.set_range(base):
        for name in cursor.iternext(keys=True, values=False):
            if not bytes(name).startswith(base):
                break
            names.append(bytes(name))
    for name in names:
        txn.delete(name)


def ttl_marker(txn: Transaction[bytes]) -> int | None:
    raw = txn.get(EXPIRY_TTL)
    return None if raw is None else int(struct.unpack(">q", bytes(raw))[0])


def set_ttl_marker(txn: Transaction[bytes], ttl_s: int) -> None:
    txn.put(EXPIRY_TTL, struct.pack(">q", ttl_s))


def key_range(txn: Transaction[bytes], prefix: bytes) -> list[tuple[bytes, bytes]]:
    """Every (name, value) whose name starts with prefix, in order."""
    cursor = txn.cursor()
    found: list[tuple[bytes, bytes]] = []
    if cursor.set_range(prefix):
        for name, raw in cursor:
            if not name.startswith(prefix):
                break
            found.append((bytes(name), bytes(raw)))
    return found


def tenant_prefix(tenant: str, space: bytes) -> bytes:
    """The names of tenant's values in one namespace (`t:`, `p:`, `r:`, `u:`): `<space><tenant>/`,
    the tenant quoted."""
    return space + _tenant_part(tenant) + b"/"


def tenant_of(name: bytes) -> str:
    return unquote(name[2:].decode().split("/", 1)[0])  # quote() left no "/" in the tenant
