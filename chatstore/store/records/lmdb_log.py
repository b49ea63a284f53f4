"""An LMDB session record as a small header plus an append-only log of what each write added.

    t:<tenant>/<digest>              the header: the record's fields but its three growing lists
                                     (messages, token ids, chunk digests), and `log`, how many
                                     entries follow
    u:<tenant>/<digest>/<seq>        log entry seq (8 hex digits), for each list that changed:
                                     how many of its items stay and the items appended after
                                     them (token ids as base64 int32)

A write (a turn's messages, a commit's token ids and chunks, a retention patch) puts one entry
of what it adds and the header, in one transaction: its bytes grow with the turn, not with the
conversation. A write that keeps less than it had (a truncation, an edited history resent)
writes an entry that keeps few items: no rewrite of the entries before it. After MAX_ENTRIES
entries, or over a record in the layout before this one (one JSON value holding everything:
read as is, and rewritten as a base by its first write, so no start-up pass), the next write
starts a new log with a base entry holding the lists whole. Every value is sealed under the
tenant's key, its own name the associated data.

`write` and `open_record` are the store's write and read of one record in a transaction (the
store, lmdb.py, keeps the transaction, the index and the facts that follow the record).
"""

from __future__ import annotations

import array
import base64
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from chatstore.store.records.lmdb_facts import key_range
from chatstore.store.records.record import SessionRecord
from chatstore.store.records.record_sealing import RecordSealing

if TYPE_CHECKING:
    from lmdb import Transaction

log = logging.getLogger(__name__)

SESSIONS, LOG = b"t:", b"u:"  # the headers, the logs
MAX_ENTRIES = 256  # a read assembles at most this many entries; then a new base
LISTS = ("messages", "token_ids", "chunks")

Opened = tuple[SessionRecord | None, int | None]  # the record, its entry count (None: whole)
# A record's growing lists by name (LISTS): messages (dicts), token ids, chunk digests.
Lists = dict[str, list[Any]]


def entry_prefix(header_name: bytes) -> bytes:
    """The log's names: the header's, under `u:`, and a slash."""
    return LOG + header_name[2:] + b"/"


def entry_name(header_name: bytes, seq: int) -> bytes:
    return entry_prefix(header_name) + b"%08x" % seq


_NOT_IN_HEADER = frozenset((*LISTS, "expires_at"))


def header_json(record: SessionRecord, entries: int) -> bytes:
    # Not dataclasses.asdict: it deep-copies every field first, the growing lists too, which
    # made each write cost O(conversation) in CPU though it wrote O(turn) bytes.
    header = {
        f.name: getattr(record, f.name) for f in fields(record) if f.name not in _NOT_IN_HEADER
    }
    header["log"] = entries
    return json.dumps(header).encode()


def entries_of(plain: bytes) -> int | None:
    """How many log entries a stored header has; None: a whole record (the older layout)."""
    entries = json.loads(plain).get("log")
    return None if entries is None else int(entries)


def _common(old: list[Any], new: list[Any]) -> int:
    """How many leading items new keeps of old."""
    n = min(len(old), len(new))
    if old[:n] == new[:n]:
        return n
    lo, hi = 0, n  # old[:lo] == new[:lo], old[:hi] != new[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if old[:mid] == new[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _pack_ids(ids: list[int]) -> str:
    return base64.b64encode(array.array("i", ids).tobytes()).decode()


def _unpack_ids(packed: str) -> list[int]:
    ids = array.array("i")
    ids.frombytes(base64.b64decode(packed))
    return ids.tolist()


def entry_json(old: Lists | None, record: SessionRecord) -> bytes | None:
    """The entry from the lists `old` (None: a base, everything whole) to record's; None
    when no list changed."""
    entry: dict[str, Any] = {}
    for name in LISTS:
        new = getattr(record, name)
        before = old[name] if old is not None else []
        keep = _common(before, new) if old is not None else 0
        if old is not None and keep == len(before) == len(new):
            continue
        added = new[keep:]
        entry[name] = [keep, _pack_ids(added) if name == "token_ids" else added]
    if not entry:
        return None
    return json.dumps(entry).encode()


def assemble(record: SessionRecord, entries: list[bytes]) -> SessionRecord:
    """The header's record with its lists rebuilt from the log's entries, in order."""
    lists: Lists = {name: [] for name in LISTS}
    for plain in entries:
        for name, (keep, added) in json.loads(plain).items():
            items = lists[name]
            del items[keep:]
            items.extend(_unpack_ids(added) if name == "token_ids" else added)
    record.messages, record.token_ids, record.chunks = (
        lists["messages"],
        lists["token_ids"],
        lists["chunks"],
    )
    return record


def lists_of(record: SessionRecord) -> Lists:
    """The record's lists, as they are before a change rebinds them."""
    return {name: getattr(record, name) for name in LISTS}


class LogCache:
    """The lists of recently written or read records, by name, while their stored header is
    the same bytes: a write or read then skips opening and parsing every entry of the log
    (O(conversation)), the bulk of a turn's record CPU. Any write of a record replaces its
    header (sealed: a fresh nonce; in the clear: a new timestamp or entry count), so a stale
    entry is never found by another writer's header. Bounded; thread-safe."""

    def __init__(self, size: int = 1024) -> None:
        self._items: OrderedDict[bytes, tuple[bytes, int, tuple[tuple[Any, ...], ...]]] = (
            OrderedDict()
        )
        self._size = size
        self._lock = threading.Lock()

    def get(self, name: bytes, header: bytes, record: SessionRecord) -> int | None:
        """Fill record's lists from the cache and return its entry count; None: not cached."""
        with self._lock:
            found = self._items.get(name)
            if found is None or found[0] != header:
                return None
            self._items.move_to_end(name)
        entries, (messages, token_ids, chunks) = found[1], found[2]
        record.messages = [dict(m) for m in messages]  # callers may edit them in place
        record.token_ids, record.chunks = list(token_ids), list(chunks)
        return entries

    def put(self, name: bytes, header: bytes, entries: int, record: SessionRecord) -> None:
        lists = tuple(tuple(getattr(record, n)) for n in LISTS)
        with self._lock:
            self._items[name] = (header, entries, lists)
            self._items.move_to_end(name)
            while len(self._items) > self._size:
                self._items.popitem(last=False)

    def drop(self, name: bytes | None = None) -> None:
        """Forget name (None: everything)."""
        with self._lock:
            if name is None:
                self._items.clear()
            else:
                self._items.pop(name, None)


def write(
    sealing: RecordSealing,
    txn: Transaction[bytes],
    name: bytes,
    record: SessionRecord,
    lists: Lists | None,
    entries: int | None,
    check_room: Callable[[int], None],
) -> tuple[int, bytes, int]:
    """The header, and one log entry of what the change added (lists: the record's lists
    before it; None, or a full log: a new base, the old entries dropped), put in txn once
    `check_room` passes their size; the bytes put (names and values), the header's stored
    bytes and the log's entry count."""
    tenant = record.tenant
    if lists is None or entries is None or entries >= MAX_ENTRIES:
        for old_entry, _ in key_range(txn, entry_prefix(name)):
            txn.delete(old_entry)
        lists, entries = None, 0
    entry = entry_json(lists, record)
    values = []
    if entry is not None:
        logged = entry_name(name, entries)
        values.append((logged, sealing.seal(tenant, logged, entry)))
        entries += 1
    values.append((name, sealing.seal(tenant, name, header_json(record, entries))))
    check_room(sum(len(v) for _, v in values))
    for value_name, value in values:
        txn.put(value_name, value)
    put = sum(len(n) + len(v) for n, v in values)
    return put, bytes(values[-1][1]), entries


def open_record(
    sealing: RecordSealing,
    cache: LogCache,
    txn: Transaction[bytes],
    tenant: str,
    name: bytes,
    raw: bytes | None,
    keep: bool = True,
) -> Opened:
    """The record stored as raw under name, assembled from its header and log, and how
    many entries its log has (None: a whole record of the older layout, or none). A header
    or an entry that fails to open, or a log of another length than its header says:
    absent (counted in sealing.open_failures). keep: keep its lists in `cache`; not for
    reads over many records (a start's)."""
    if raw is None:
        return None, None
    plain = sealing.unseal(tenant, name, bytes(raw))
    if plain is None:
        return None, None
    try:
        entries = entries_of(plain)
        record = SessionRecord.from_json(plain)
        if entries is None:
            return record, None
        if cache.get(name, bytes(raw), record) == entries:
            return record, entries
        found = key_range(txn, entry_prefix(name))
        logged = [sealing.unseal(tenant, n, v) for n, v in found]
        if len(logged) != entries or any(p is None for p in logged):
            raise ValueError(f"its log has {len(logged)} entries, not {entries}")
        record = assemble(record, [p for p in logged if p is not None])
        if keep:
            cache.put(name, bytes(raw), entries, record)
        return record, entries
    except (ValueError, TypeError, KeyError) as exc:
        sealing.open_failures += 1
        log.warning("session record %r failed to open (%s): read as absent", name, exc)
        return None, None
