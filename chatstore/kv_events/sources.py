"""What becomes a KV event: the device prefix cache and the store's chunks per tier.

Device prefix cache: medium "GPU" whatever the device, as vLLM does (its block pool always
says MEDIUM_GPU, on its CPU backend too): to a router it is "the engine's own KV".

Store chunks, one medium per tier:

    dram -> "CPU"      what vLLM's CPU offloading connector reports
    ssd  -> "DISK"     LMDB on local disk
    remote -> "REMOTE" Redis (shared; vLLM main names its shared offload tier "STORAGE")

A chunk is published as one block of `chunk_tokens` tokens: its hash, its parent (the chunk
before it in the chain) and its token ids, taken from the session index when the chunk
reaches a tier. Only full chunks are published: a session's partial tail is re-keyed every
turn, and routers expect whole blocks. A chunk the index no longer knows (freed while it
moved) is not published, nor is its later removal: the subscriber's view stays consistent.
"""

from __future__ import annotations

import threading
from typing import Any

from chatstore.kv_events.publisher import KVEventPublisher
from chatstore.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, external_hash

MEDIUM_GPU = "GPU"
TIER_MEDIA = {"dram": "CPU", "ssd": "DISK", "remote": "REMOTE"}
_ARRIVALS = frozenset({"stored", "promoted", "prefetched", "demoted"})


class EngineSource:
    """A `PrefixCacheListener` for the engine's BlockManager (called on the engine thread)."""

    def __init__(self, publisher: KVEventPublisher, block_size: int) -> None:
        self.publisher = publisher
        self.block_size = block_size

    def attach(self, block_manager: Any) -> None:
        block_manager.listener = self

    def block_stored(self, block_hash: bytes, parent: bytes | None, tokens: list[int]) -> None:
        parent_hash = external_hash(parent) if parent is not None else None
        block = external_hash(block_hash)
        self.publisher.put(BlockStored([block], parent_hash, tokens, self.block_size, MEDIUM_GPU))

    def block_removed(self, block_hash: bytes) -> None:
        self.publisher.put(BlockRemoved([external_hash(block_hash)], MEDIUM_GPU))


class StoreSource:
    """A store event listener; keeps which media hold each published chunk."""

    def __init__(self, publisher: KVEventPublisher, store: Any) -> None:
        self.publisher = publisher
        self.store = store
        self.chunk_tokens: int = store.settings.chunk_tokens
        self._media: dict[Any, set[str]] = {}  # published chunk -> media holding it
        self._lock = threading.Lock()  # store events come from several threads

    def attach(self) -> None:
        """Listen from now on, after telling what the tiers hold already (a restart's SSD):
        AllBlocksCleared first, so a router drops what it knew of this replica before."""
        with self._lock:
            self.publisher.put(AllBlocksCleared())
            self.store.add_listener(self)
            for tier in self.store.tiers.tiers:
                medium = TIER_MEDIA.get(tier.name)
                for key in list(tier.keys()) if medium else ():
                    self._arrived(key, medium)

    def __call__(self, event: Any) -> None:
        kind, medium = event.kind, TIER_MEDIA.get(event.tier or "")
        if kind in _ARRIVALS and medium is not None:
            with self._lock:
                self._arrived(event.key, medium)
        elif kind in ("evicted", "corrupt") and medium is not None:  # a corrupt copy is dropped
            with self._lock:
                self._left(event.key, [medium])
        elif kind == "deleted":
            with self._lock:
                self._left(event.key, sorted(self._media.get(event.key, ())))

    def media(self) -> dict[Any, set[str]]:
        with self._lock:
            return {k: set(v) for k, v in self._media.items()}

    def _arrived(self, key: Any, medium: str) -> None:
        held = self._media.get(key)
        if held is not None and medium in held:
            return
        found = self._describe(key)
        if found is None:
            return
        tokens, parent = found
        parent_hash = external_hash(bytes.fromhex(parent.digest)) if parent else None
        block = external_hash(bytes.fromhex(key.digest))
        self.publisher.put(BlockStored([block], parent_hash, tokens, self.chunk_tokens, medium))
        self._media.setdefault(key, set()).add(medium)

    def _left(self, key: Any, media: list[str]) -> None:
        held = self._media.get(key)
        if held is None:
            return
        block = external_hash(bytes.fromhex(key.digest))
        for medium in media:
            if medium in held:
                held.discard(medium)
                self.publisher.put(BlockRemoved([block], medium))
        if not held:
            del self._media[key]

    def _describe(self, key: Any) -> tuple[list[int], Any] | None:
        """(token ids, parent chunk) of a full chunk some session holds; else None. Reads
        the index without its lock: single dict reads of immutable chains."""
        index, C = self.store.index, self.chunk_tokens
        pos = index.position_of(key)
        for owner in index.owners_of(key):
            chain = index.get(owner)
            if chain is None or pos >= len(chain.chunks) or chain.chunks[pos] != key:
                continue
            if (pos + 1) * C > len(chain.token_ids):
                return None
            return chain.token_ids[pos * C : (pos + 1) * C], chain.chunks[pos - 1] if pos else None
        return None
