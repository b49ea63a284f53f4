"""The read buffer of layer-wise pre-load (CachedAttention §3.2.1, Fig. 6(c)).

Without it a job's pre-load can only start when the job does: layer 0's copy is on the critical
path and the lookup that finds the session's KV (and reads it out of its tier) runs on the engine
thread. With it, while earlier jobs compute, the loader's lookup thread looks up the sessions
queued next (or hinted: WebSocket "typing", POST /v1/sessions/{id}/prefetch) and the loader
thread stages the first `layers` layers of their history KV in device memory, RoPE already
applied at positions 0..T-1:

    staged entry (per session):  its stored chunks  +  layers 0..N-1 as (K rotated, V) [T, Hkv, D]
    job scheduled:               layers < N  buffer -> pool slots (a plain copy)
                                 layers >= N  tier copy -> RoPE -> pool slots, during the forward

An entry's life: `want` (a hint) -> `begin` (its lookup starts, off the engine thread) ->
`publish` (the lookup's result, with the bytes it will hold: the saved copy plus the layers to
stage) -> `claim` by the job that loads it -> `release` (consumed). A published entry is counted
in full from the start; one the budget refuses is dropped and holds nothing. A job claims only a
published entry: one still being looked up is cancelled and the job reads the store itself, so a
slow lookup (a cold tier, a hung Redis) never holds up the engine thread.

An entry is valid for the store version it was looked up at (`AttentionStore.version`): a newer
save of the session makes it stale and it is dropped, never used. Entries are bounded by
`capacity_bytes`; an entry in use by a load is never evicted, others go least recently staged
first. All methods are thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from chatstore.store.session_kv import SessionKey
from chatstore.transfer.chunked_kv import ChunkedKV


@dataclass
class StagedKV:
    key: SessionKey
    version: int
    saved: ChunkedKV | None = None  # every stored chunk of the session, positions 0..T-1
    looked_up: threading.Event = field(default_factory=threading.Event)  # published or dropped
    k: list[torch.Tensor] = field(default_factory=list)  # layer i rotated K [T, Hkv, D]
    v: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    cancelled: bool = False
    users: int = 0

    @property
    def num_staged_layers(self) -> int:
        return len(self.k)


class ReadBuffer:
    def __init__(self, layers: int, capacity_bytes: int) -> None:
        if layers < 0:
            raise ValueError(f"read_buffer_layers must be >= 0, got {layers}")
        self.layers = layers
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[SessionKey, StagedKV] = OrderedDict()
        self._lock = threading.Lock()
        self.staged = 0  # entries whose lookup ran ahead of their job
        self.claimed = 0  # jobs that found their session staged
        self.evicted = 0

    @property
    def enabled(self) -> bool:
        return self.layers > 0 and self.capacity_bytes > 0

    def used_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def want(self, key: SessionKey, version: int) -> StagedKV | None:
        """A new entry to stage for key at `version`, or None when a fresh one is there already
        (a stale one not in use is replaced)."""
        if not self.enabled:
            return None
        with self._lock:
            old = self._entries.get(key)
            if old is not None:
                if old.version == version or old.users:
                    return None
                self._remove(old)
            entry = StagedKV(key, version)
            self._entries[key] = entry
            return entry

    def begin(self, entry: StagedKV) -> bool:
        """The entry is about to be looked up; False when it was cancelled meanwhile."""
        with self._lock:
            return not entry.cancelled

    def publish(self, entry: StagedKV, saved: ChunkedKV | None, nbytes: int) -> bool:
        """The lookup found `saved` (None: nothing stored), to be held with nbytes counted;
        room is made by evicting idle entries least recently staged first. False when the
        entry was cancelled, found nothing, or does not fit: it is then dropped, holding
        nothing."""
        with self._lock:
            ok = saved is not None and self._make_room(entry, nbytes)
            if ok:
                entry.saved = saved
                entry.nbytes += nbytes
                self.staged += 1
            else:
                self._remove(entry)
            entry.looked_up.set()
            return ok

    def claim(self, key: SessionKey, version: int) -> StagedKV | None:
        """The published entry a job about to load `key` at `version` may use, or None. An
        entry whose lookup has not finished is cancelled: the caller reads the store itself
        rather than wait for a lookup it cannot bound."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            if entry.version != version or not entry.looked_up.is_set():
                if not entry.users:
                    self._remove(entry)
                return None
            entry.users += 1
            self.claimed += 1
            return entry

    def release(self, entry: StagedKV) -> None:
        """A job is done with the entry; once no job uses it, it is dropped (consumed)."""
        with self._lock:
            entry.users -= 1
            if entry.users <= 0 and self._entries.get(entry.key) is entry:
                self._remove(entry)

    def _make_room(self, entry: StagedKV, nbytes: int) -> bool:
        """(Under the lock) room for nbytes more in `entry`, evicting idle entries; False,
        nothing evicted, when even that would not make room."""
        if entry.cancelled or self._entries.get(entry.key) is not entry:
            return False
        used = sum(e.nbytes for e in self._entries.values())
        idle = [e for e in self._entries.values() if e is not entry and not e.users]
        if used + nbytes - sum(e.nbytes for e in idle) > self.capacity_bytes:
            return False
        for victim in idle:
            if used + nbytes <= self.capacity_bytes:
                break
            used -= victim.nbytes
            self._remove(victim)
            self.evicted += 1
        return True

    def discard(self, key: SessionKey) -> None:
        """Forget key's entry (unless a job is using it)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and not entry.users:
                self._remove(entry)

    def _remove(self, entry: StagedKV) -> None:
        entry.cancelled = True
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        entry.saved = None  # a dropped entry holds nothing (its KV is what counts)
        entry.nbytes = 0
        entry.k.clear()
        entry.v.clear()
        entry.looked_up.set()
