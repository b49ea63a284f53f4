"""The small interface every storage tier implements (LMCache-style backends).

A tier holds KV chunks (immutable values named by a content hash, chunks.py). Capacity is
counted in the bytes a value occupies in that tier (`footprint`); ChunkTiers makes room before
`put`, so `used_bytes() <= capacity` always holds. `get` raises CorruptValueError for a value that
fails its checksum (the tier has already dropped it) and returns None for a plain miss.

A tier that can (DRAM, LMDB, Redis) tells watchers which keys it comes to hold and lets go
(`watch`), so the placement keeps its eviction order as the tier changes instead of reading
every key at each eviction.

`in_memory` tiers (DRAM) are only touched under ChunkTiers' lock: their operations are memory
copies. The others (LMDB, Redis) are slow: ChunkTiers writes and deletes there outside that lock,
from one thread at a time, while other threads may read. Such a tier keeps `contains`, `keys`,
`size_of` and `used_bytes` safe to call from any thread at any time.

A `remote` tier (Redis) is reached over the network: its calls may fail or hang, so it raises
TierUnavailable (treated as a miss, or as a write not taken) instead of waiting, and the engine
thread does not read it where a local tier can take its chunks (chunk_tiers.py, `foreground`).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from chatstore.store.session_kv import ChunkKey, SessionKV

# Told (key, True) when a tier comes to hold key, (key, False) when it lets go; on the thread
# that changed the tier, outside the tier's own locks. It must not block.
MembershipListener = Callable[[ChunkKey, bool], None]


class TierFull(RuntimeError):
    """The tier cannot take the value now (no room, or the backend refused it)."""


class StorageFull(TierFull):
    """The storage under the tier refused a write the tier's own accounting had room for: the
    LMDB map is full (`reason` "map_full") or the disk under it is ("disk_full"). Nothing
    stored is lost; the hierarchy counts it per tier and reason (TierCounters.write_failures)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TierUnavailable(RuntimeError):
    """The tier's backend cannot be reached now (the call failed, or its circuit breaker is
    open): a read is a miss, a write is not taken, and nothing stored is dropped."""


@dataclass(frozen=True)
class TierOccupancy:
    name: str
    used_bytes: int
    capacity_bytes: int
    num_sessions: int


class FootprintIndex:
    """What a slow tier holds, kept in memory: key -> footprint, and their total.

    One thread writes the tier (ChunkTiers' I/O lock) while others read its occupancy, so
    the map and the total change together under a small lock of their own; `used_bytes`,
    `keys`, `contains` and `size_of` then cost no I/O and are safe from any thread."""

    def __init__(self) -> None:
        self._sizes: dict[ChunkKey, int] = {}
        self._total = 0
        self._lock = threading.Lock()
        self._watchers: list[MembershipListener] = []

    def watch(self, listener: MembershipListener) -> None:
        self._watchers.append(listener)

    def _tell(self, key: ChunkKey, held: bool) -> None:
        for watcher in self._watchers:  # after the lock: a watcher may take others
            watcher(key, held)

    @property
    def total(self) -> int:
        return self._total

    def set(self, key: ChunkKey, footprint: int) -> None:
        with self._lock:
            new = key not in self._sizes
            self._total += footprint - self._sizes.get(key, 0)
            self._sizes[key] = footprint
        if new:
            self._tell(key, True)

    def pop(self, key: ChunkKey) -> bool:
        """Forget key; whether it was there."""
        with self._lock:
            size = self._sizes.pop(key, None)
            if size is not None:
                self._total -= size
        if size is not None:
            self._tell(key, False)
        return size is not None

    def size_of(self, key: ChunkKey) -> int:
        return self._sizes.get(key, 0)

    def clear(self) -> None:
        with self._lock:
            gone = list(self._sizes)
            self._sizes.clear()
            self._total = 0
        for key in gone:
            self._tell(key, False)

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._sizes)

    def __contains__(self, key: ChunkKey) -> bool:
        return key in self._sizes


class StorageTier(ABC):
    name: str = "tier"
    in_memory: bool = False  # a DRAM-like tier: fast, volatile, guarded by ChunkTiers' lock
    remote: bool = False  # reached over the network: may be slow or down (TierUnavailable)

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Bytes this tier may hold."""

    @abstractmethod
    def footprint(self, value: SessionKV) -> int:
        """Bytes `value` would occupy here (what used_bytes grows by after put)."""

    @abstractmethod
    def put(self, key: ChunkKey, value: SessionKV) -> None:
        """Store value under key (replacing any old one); TierFull if it does not fit."""

    @abstractmethod
    def get(self, key: ChunkKey) -> SessionKV | None: ...

    @abstractmethod
    def delete(self, key: ChunkKey) -> bool: ...

    @abstractmethod
    def contains(self, key: ChunkKey) -> bool: ...

    @abstractmethod
    def used_bytes(self) -> int: ...

    @abstractmethod
    def keys(self) -> list[ChunkKey]: ...

    def size_of(self, key: ChunkKey) -> int:
        """Bytes key occupies here (0 when absent)."""
        return 0

    def watch(self, listener: MembershipListener) -> bool:
        """From now on, listener is told each key this tier comes to hold or lets go; False
        when this tier cannot tell (eviction then reads `keys()` each time)."""
        return False

    def check_fits(self, key: ChunkKey, value: SessionKV) -> int:
        """Bytes `value` needs here in place of key's current value; TierFull if over capacity."""
        need = self.footprint(value)
        if self.used_bytes() - self.size_of(key) + need > self.capacity:
            raise TierFull(f"{self.name} tier: {need} bytes do not fit")
        return need

    def can_put(self, value: SessionKV) -> bool:
        return self.used_bytes() + self.footprint(value) <= self.capacity

    def occupancy(self) -> TierOccupancy:
        return TierOccupancy(self.name, self.used_bytes(), self.capacity, len(self.keys()))

    def clear(self) -> None:
        for key in self.keys():
            self.delete(key)

    def close(self) -> None:
        return None


_HEADER_SLACK = 512  # bytes of codec header counted per value


def encoded_footprint(value: SessionKV) -> int:
    """Upper bound of the encoded size: what the LMDB and Redis tiers count a value as."""
    return value.nbytes + 4 * value.num_tokens + _HEADER_SLACK


class IndexedTier(StorageTier):
    """A slow tier whose occupancy is a FootprintIndex kept in memory (LMDB, Redis): the
    occupancy questions cost no I/O and are safe from any thread."""

    def __init__(self, capacity_bytes: int) -> None:
        self._capacity = capacity_bytes
        self._index = FootprintIndex()

    @property
    def capacity(self) -> int:
        return self._capacity

    def footprint(self, value: SessionKV) -> int:
        return encoded_footprint(value)

    def contains(self, key: ChunkKey) -> bool:
        return key in self._index

    def used_bytes(self) -> int:
        return self._index.total

    def keys(self) -> list[ChunkKey]:
        return self._index.keys()

    def size_of(self, key: ChunkKey) -> int:
        return self._index.size_of(key)

    def watch(self, listener: MembershipListener) -> bool:
        self._index.watch(listener)
        return True
