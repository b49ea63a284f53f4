"""What becomes a KV event: the device prefix cache and the store's chunks per tier.

Device prefix cache: medium "GPU" whatever the device, as vLLM does (its block pool always
says MEDIUM_GPU, on its CPU backend too): to a router it is "the engine's own KV".

Store chunks, one medium per tier:

    dram -> "CPU"      what vLLM's CPU offloading connector reports
    ssd  -> "DISK"     LMDB on local disk
    remote -> "REMOTE" Redis (shared; vLLM main names its shared offload tier "STORAGE")

Routers index blocks of the engine's block size and drop any other size (Dynamo does), so a
stored chunk of `chunk_tokens` tokens is published as its chunk_tokens / block_size device
blocks, one BlockStored each, named with the engine's own hash chain (`hash_block`: tenant
salt, parent, tokens). The same tokens of one tenant thus have one hash on the device and in
every tier, and the chain runs on from the last block of the chunk before: a router sees one
chain whichever medium holds each part. A chunk that leaves a tier is one BlockRemoved with
the same hashes.

Token ids and the parent chunk come from the store (`ChunkCatalog.describe_chunk`) when the
chunk reaches a tier.
Only full chunks are published: a session's partial tail is re-keyed every turn. A chunk the
index no longer knows (freed while it moved) is not published, nor is its later removal: the
subscriber's view stays consistent.
"""

from __future__ import annotations

import threading
from array import array
from dataclasses import dataclass, field

from chatstore.engine.block_manager import BlockManager, hash_block
from chatstore.kv_events.publisher import KVEventPublisher
from chatstore.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored, external_hash
from chatstore.store.port_values import StoreEvent
from chatstore.store.ports import ChunkCatalog, ChunkText
from chatstore.store.session_kv import ChunkKey

MEDIUM_GPU = "GPU"
TIER_MEDIA = {"dram": "CPU", "ssd": "DISK", "remote": "REMOTE"}
_ARRIVALS = frozenset({"stored", "promoted", "prefetched", "demoted"})


def device_block_hashes(
    parent: bytes | None, tenant: str, tokens: list[int], block_size: int
) -> list[bytes]:
    """The engine's hash chain over whole blocks of `tokens`, continuing from `parent`."""
    out: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tenant, tokens[start : start + block_size])
        out.append(parent)
    return out


class EngineSource:
    """A `PrefixCacheListener` for the engine's BlockManager (called on the engine thread)."""

    def __init__(self, publisher: KVEventPublisher, block_size: int) -> None:
        self.publisher = publisher
        self.block_size = block_size

    def attach(self, block_manager: BlockManager) -> None:
        block_manager.listener = self

    def block_stored(self, block_hash: bytes, parent: bytes | None, tokens: list[int]) -> None:
        parent_hash = external_hash(parent) if parent is not None else None
        block = external_hash(block_hash)
        self.publisher.put(
            BlockStored([block], parent_hash, tokens, self.block_size, None, MEDIUM_GPU, None)
        )

    def block_removed(self, block_hash: bytes) -> None:
        self.publisher.put(BlockRemoved([external_hash(block_hash)], MEDIUM_GPU))


@dataclass(slots=True)
class _Published:
    """A chunk some medium holds as far as subscribers know."""

    hashes: array  # its device blocks' external hashes ("Q": unsigned 64-bit), in order
    tip: bytes  # the engine digest of its last block: the parent of the next chunk's first
    media: set[str] = field(default_factory=set)


class _Gone(Exception):
    """An ancestor of a chunk is no longer described: the chunk cannot be named."""


class StoreSource:
    """A store event listener; keeps which media hold each published chunk."""

    def __init__(self, publisher: KVEventPublisher, store: ChunkCatalog, block_size: int) -> None:
        self.publisher = publisher
        self.store = store
        self.chunk_tokens = store.chunk_tokens
        self.block_size = block_size  # the engine's: what routers index
        if self.chunk_tokens % block_size:
            raise ValueError("chunk_tokens must be a multiple of the device block size")
        self._published: dict[ChunkKey, _Published] = {}
        self._lock = threading.Lock()  # store events come from several threads

    def attach(self) -> None:
        """Listen from now on, after telling what the tiers hold already (a restart's SSD):
        AllBlocksCleared first, so a router drops what it knew of this replica before."""
        with self._lock:
            self.publisher.put(AllBlocksCleared())
            self.store.add_listener(self)
            tips: dict[ChunkKey, bytes] = {}  # chunks walked through, for the ones after them
            for tier, keys in self.store.chunks_by_tier().items():
                medium = TIER_MEDIA.get(tier)
                if medium is not None:
                    for key in keys:
                        self._arrived(key, medium, tips)

    def __call__(self, event: StoreEvent) -> None:
        kind, medium, key = event.kind, TIER_MEDIA.get(event.tier or ""), event.key
        if not isinstance(key, ChunkKey):
            return
        if kind in _ARRIVALS and medium is not None:
            with self._lock:
                self._arrived(key, medium, {})
        elif kind in ("evicted", "corrupt") and medium is not None:  # a corrupt copy is dropped
            with self._lock:
                self._left(key, [medium])
        elif kind == "deleted":
            with self._lock:
                held = self._published.get(key)
                self._left(key, sorted(held.media) if held else [])

    def media(self) -> dict[ChunkKey, set[str]]:
        """Published chunk -> the media holding it."""
        with self._lock:
            return {k: set(p.media) for k, p in self._published.items()}

    def _arrived(self, key: ChunkKey, medium: str, tips: dict[ChunkKey, bytes]) -> None:
        held = self._published.get(key)
        if held is not None and medium in held.media:
            return
        text = self.store.describe_chunk(key)
        if text is None:
            return
        try:
            parent = self._digest_before(key.tenant, text, tips)
        except _Gone:
            return
        B = self.block_size
        digests = device_block_hashes(parent, key.tenant, text.token_ids, B)
        hashes = [external_hash(d) for d in digests]
        parent_hash = external_hash(parent) if parent is not None else None
        for i, block in enumerate(hashes):
            tokens = text.token_ids[i * B : (i + 1) * B]
            self.publisher.put(BlockStored([block], parent_hash, tokens, B, None, medium, None))
            parent_hash = block
        if held is None:
            held = self._published[key] = _Published(array("Q", hashes), digests[-1])
        held.media.add(medium)

    def _left(self, key: ChunkKey, media: list[str]) -> None:
        held = self._published.get(key)
        if held is None:
            return
        for medium in media:
            if medium in held.media:
                held.media.discard(medium)
                self.publisher.put(BlockRemoved(list(held.hashes), medium))
        if not held.media:
            del self._published[key]

    def _digest_before(
        self, tenant: str, text: ChunkText, tips: dict[ChunkKey, bytes]
    ) -> bytes | None:
        """The engine digest of the block before the chunk `text` describes (None: it is the
        first): back through its parents to one published (or walked) already or to the
        first, then hashing forward; each chunk walked through is remembered in `tips`."""
        walked: list[tuple[ChunkKey, list[int]]] = []
        parent, tip = text.parent, None
        while parent is not None:
            held = self._published.get(parent)
            tip = held.tip if held is not None else tips.get(parent)
            if tip is not None:
                break
            above = self.store.describe_chunk(parent)
            if above is None:
                raise _Gone
            walked.append((parent, above.token_ids))
            parent = above.parent
        for key, tokens in reversed(walked):
            tip = tips[key] = device_block_hashes(tip, tenant, tokens, self.block_size)[-1]
        return tip
