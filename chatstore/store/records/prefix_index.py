"""Which session a client that resends its history continues, in O(1) per prefix step.

A content-addressed index per tenant, kept in the record store itself (LMDB keys `p:`, a Redis
hash per tenant), so every replica sharing one Redis finds sessions made on another:

    ids    [t0 ........ t63][t64 ....... t127][t128 ... t150]      a session's saved token ids
    key    h0 ─────────────► h64 ─────────────► h128               h(k) = H(h(k-64), ids[k-64:k])
    entry  {ends: ...}       {through: [d]}     {through: [d], ends: {d: [151, H(h128, t128..150)]}}

h0 is a hash of the tenant and the model's fingerprint (no other tenant or model ever matches).
With encryption at rest every H is keyed blake2b under the tenant's digest key (`key`, from the
keyring, as chunk names are): an entry's name or end hash cannot be reproduced from guessed
token ids without it, and a shred makes them meaningless. Without it (key b"") plain blake2b.
A session (named by its record digest `d`, never its id in the clear) is "through" every step
boundary k ≤ len(ids), k > 0, and "ends" at the last boundary ≤ len(ids), with its exact
length and the hash of all its ids. A lookup hashes the prompt's boundaries once (O(len)), reads
their entries in one batch, and ranks candidates as the scan it replaces did:

1. a saved history that is a prefix of the prompt, the longest wins (an `ends` entry whose
   exact hash equals the prompt's hash at that length);
2. otherwise the longest common prefix: every session sharing ≥ k tokens is in entry k, so
   the deepest boundary with entries holds the best (compared token by token on its records).

Candidates are verified on their records (fingerprint, token ids) before they are returned:
an entry left by a record that is gone or changed is skipped. An entry keeps its `CANDIDATES`
most recent sessions: more sessions than that diverging within one step of one shared prefix
find the most recent ones.
"""

from __future__ import annotations

import array
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from chatstore.store.records.record import SessionRecord
from chatstore.store.session_kv import common_prefix_len

PREFIX_STEP = 64  # tokens between index boundaries
CANDIDATES = 8  # sessions an entry keeps (most recent first)
MAX_VERIFIED = 32  # records a lookup reads at most


class PrefixMatch(NamedTuple):
    session_id: str
    shared: int  # tokens the prompt shares with the session's saved history
    whole: bool  # the saved history is a prefix of the prompt


@dataclass
class PrefixEntry:
    """One boundary's sessions: through it (most recent first), and ending after it."""

    through: list[str] = field(default_factory=list)
    ends: dict[str, tuple[int, str]] = field(default_factory=dict)  # digest -> (len, hash)

    def to_bytes(self) -> bytes:
        return json.dumps({"t": self.through, "e": self.ends}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes | None) -> PrefixEntry:
        if not raw:
            return cls()
        fields = json.loads(raw)
        return cls(fields["t"], {d: (int(n), h) for d, (n, h) in fields["e"].items()})

    def empty(self) -> bool:
        return not self.through and not self.ends

    def drop(self, digest: str) -> None:
        self.through = [d for d in self.through if d != digest]
        self.ends.pop(digest, None)

    def add(self, digest: str, end: tuple[int, str] | None) -> None:
        if end is None:
            self.through = [digest, *(d for d in self.through if d != digest)][:CANDIDATES]
            return
        self.ends.pop(digest, None)
        self.ends[digest] = end  # newest last
        while len(self.ends) > CANDIDATES:
            del self.ends[next(iter(self.ends))]


def _seed(tenant: str, fingerprint: str, key: bytes) -> bytes:
    blob = json.dumps(["chatstore-prefix", tenant, fingerprint]).encode()
    return hashlib.blake2b(blob, digest_size=16, key=key).digest()


def _step(previous: bytes, ids: Sequence[int], key: bytes) -> bytes:
    data = previous + array.array("i", ids).tobytes()
    return hashlib.blake2b(data, digest_size=16, key=key).digest()


def boundary_hashes(
    tenant: str,
    fingerprint: str,
    ids: Sequence[int],
    known: list[bytes] | None = None,
    key: bytes = b"",
) -> list[bytes]:
    """h(0), h(STEP), h(2 STEP), ... up to len(ids): entry i is the hash of ids[: i * STEP].
    `known`: the first hashes already computed for these ids (a prefix of the answer); `key`:
    the tenant's digest key (b"": unkeyed)."""
    out = list(known) if known else [_seed(tenant, fingerprint, key)]
    for k in range(PREFIX_STEP * len(out), len(ids) + 1, PREFIX_STEP):
        out.append(_step(out[-1], ids[k - PREFIX_STEP : k], key))
    return out


Registration = dict[str, tuple[int, str] | None]  # entry key -> None (through) or its end


def registration(
    tenant: str,
    fingerprint: str,
    ids: Sequence[int],
    hashes: list[bytes] | None = None,
    key: bytes = b"",
) -> Registration:
    """The entries a session with saved `ids` is in (none without ids, or without the model
    that made them: such ids are never reused). `hashes`: its boundary hashes, if known."""
    if not ids or not fingerprint:
        return {}
    hashes = hashes or boundary_hashes(tenant, fingerprint, ids, key=key)
    out: Registration = {h.hex(): None for h in hashes[1:]}
    out[hashes[-1].hex()] = (len(ids), _end_hash(hashes, ids, len(ids), key))
    return out


def changed_keys(old: Registration, new: Registration) -> list[str]:
    """The entry keys a session's move from `old` to `new` changes (a turn that extends its
    history touches only the boundaries past the old end)."""
    return [k for k in {**old, **new} if k not in old or k not in new or old[k] != new[k]]


Saved = tuple[tuple[int, ...], str]  # a record's saved token ids and fingerprint


def saved(record: SessionRecord | None) -> Saved | None:
    """What the index registers of a record (None: nothing, it is absent)."""
    return None if record is None else (tuple(record.token_ids), record.fingerprint)


class HashMemo:
    """Each recently written session's last ids and boundary hashes (bounded, by record name
    digest): a turn extends a session's ids, so its registration hashes only the boundaries
    it adds, and the one it replaces is the memo's own (O(new), not O(conversation))."""

    def __init__(self, size: int = 4096) -> None:
        # slot -> (tenant, fingerprint, digest key, ids, their boundary hashes)
        self._last: OrderedDict[str, tuple[str, str, bytes, tuple[int, ...], list[bytes]]] = (
            OrderedDict()
        )
        self._size = size
        self._lock = threading.Lock()

    def registration(
        self, slot: str, tenant: str, fingerprint: str, ids: tuple[int, ...], key: bytes = b""
    ) -> Registration:
        if not ids or not fingerprint:
            return {}
        with self._lock:
            found = self._last.get(slot)
        known: list[bytes] | None = None
        if found is not None and found[:3] == (tenant, fingerprint, key):
            old_ids, old = found[3], found[4]
            full = (len(old) - 1) * PREFIX_STEP  # ids the memo's hashes cover
            if len(ids) >= full and ids[:full] == old_ids[:full]:
                known = old
        hashes = boundary_hashes(tenant, fingerprint, ids, known, key)
        with self._lock:
            self._last[slot] = (tenant, fingerprint, key, ids, hashes)
            self._last.move_to_end(slot)
            while len(self._last) > self._size:
                self._last.popitem(last=False)
        return registration(tenant, fingerprint, ids, hashes, key)

    def moved(
        self, digest: str, tenant: str, was: Saved | None, now: Saved | None, key: bytes
    ) -> tuple[list[str], Registration]:
        """The entry keys a session's move from what it registered with `was` to what it
        does with `now` changes (changed_keys), and its registration with `now`."""
        old = self.registration(digest, tenant, was[1], was[0], key) if was else {}
        new = self.registration(digest, tenant, now[1], now[0], key) if now else {}
        return changed_keys(old, new), new


def _end_hash(hashes: list[bytes], ids: Sequence[int], length: int, key: bytes) -> str:
    """The hash of ids[:length] (length ≤ len(ids)), from the boundary hash below it."""
    base = length // PREFIX_STEP
    return _step(hashes[base], ids[base * PREFIX_STEP : length], key).hex()


def apply(entry: PrefixEntry, digest: str, key: str, new: Registration) -> PrefixEntry:
    entry.drop(digest)
    if key in new:
        entry.add(digest, new[key])
    return entry


def rank(
    tenant: str,
    fingerprint: str,
    ids: list[int],
    read: Callable[[list[str]], list[bytes | None]],
    key: bytes = b"",
) -> tuple[list[tuple[int, str]], list[list[str]]]:
    """The candidates for ids, from one batched `read` of its boundaries' entries: whole-prefix
    candidates as (length, digest), longest first; and each non-empty boundary's sessions,
    deepest boundary first (a session sharing s tokens is in the entry at s // STEP)."""
    hashes = boundary_hashes(tenant, fingerprint, ids, key=key)
    entries = [PrefixEntry.from_bytes(raw) for raw in read([h.hex() for h in hashes])]
    whole: list[tuple[int, str]] = []
    for entry in entries:
        for digest, (length, end) in entry.ends.items():
            if length <= len(ids) and _end_hash(hashes, ids, length, key) == end:
                whole.append((length, digest))
    whole.sort(reverse=True)
    levels = [[*e.through, *reversed(e.ends)] for e in reversed(entries) if not e.empty()]
    return whole, levels


def best_match(
    tenant: str,
    fingerprint: str,
    ids: list[int],
    read: Callable[[list[str]], list[bytes | None]],
    load: Callable[[str], SessionRecord | None],
    key: bytes = b"",
) -> PrefixMatch | None:
    """The session ids continues, verified on its record: `load(digest)` gives the live
    record, None when it is gone. `key`: the tenant's digest key (b"": unkeyed)."""
    whole, levels = rank(tenant, fingerprint, ids, read, key)
    loaded: dict[str, tuple[str, list[int]] | None] = {}

    def record(digest: str) -> tuple[str, list[int]] | None:
        if digest not in loaded and len(loaded) < MAX_VERIFIED:
            got = load(digest)
            ok = got is not None and got.fingerprint == fingerprint
            loaded[digest] = (got.session_id, got.token_ids) if got is not None and ok else None
        return loaded.get(digest)

    for length, digest in whole:
        got = record(digest)
        if got is not None and len(got[1]) == length and ids[:length] == got[1]:
            return PrefixMatch(got[0], length, True)
    for level in levels:  # the deepest boundary with a live session holds the best
        best: PrefixMatch | None = None
        for digest in level:
            got = record(digest)
            shared = common_prefix_len(got[1], ids) if got is not None else 0
            if got is not None and shared > (best.shared if best else 0):
                best = PrefixMatch(got[0], shared, False)
        if best is not None:
            return best
    return None
