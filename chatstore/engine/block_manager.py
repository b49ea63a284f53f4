"""Block manager: a sequence's block table, automatic prefix caching and copy-on-write.

Full blocks are named by a hash chain over (tenant, parent hash, the block's tokens), as in vLLM's
automatic prefix caching, so two requests of one tenant with the same system prompt find the
same physical blocks and share them by ref count. Tenants never share: the tenant is in the hash.

    tokens   [ sys prompt 16 | sys prompt 16 | user 16 | us.. ]
    hashes     h0=H(t,-,b0)    h1=H(t,h0,b1)   h2=H(t,h1,b2)   (partial block: no hash)

A block whose last reference goes away returns to the pool's free list but keeps its hash: it is
the "device tier" of cached KV, an LRU set (the free list's head is the least recently freed) from
which a later request may revive it, until `allocate` hands it out and its hash is dropped.
Only the block being written can be partial; when it is shared (n>1 samples after a fork) the
writer copies it first (copy-on-write).

Sessions on the device: each session's tip, the hash of the last full block its sequences
computed or reused, is remembered while that block stays cached (a session is a request's
(tenant, session_id); requests without a session id are not followed). A session is on the device
when its tip is cached, and then its whole history up to the tip is: the hash chain names the
prefix, a sequence holds every block from the first to its tip, and `BlockPool.free` puts a
sequence's tail first in line for reuse, so a parent block is never evicted before its child.
The tip is forgotten when its block is evicted (a deleted session counts until then: the engine
keeps no session records).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

from chatstore.engine.block_pool import BlockIdPool
from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.sequence import Sequence


def hash_block(parent: bytes | None, tenant: str, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or tenant.encode())
    h.update(b"|")
    h.update(",".join(map(str, tokens)).encode())
    return h.digest()


@dataclass(frozen=True)
class PrefixCacheStats:
    cached_blocks: int  # blocks holding a hashed full block (in use or evictable)
    evictable_blocks: int  # cached blocks nobody references (ref count 0)
    hit_blocks: int  # full prompt blocks found cached at admission
    miss_blocks: int  # full prompt blocks looked up and not found
    evictions: int  # cached blocks reused for other content
    sessions: int = 0  # sessions whose history (up to their tip) is cached: see the module doc


class PrefixCacheListener(Protocol):
    """Told, on the engine thread, when full blocks enter and leave the prefix cache."""

    def block_stored(self, block_hash: bytes, parent: bytes | None, tokens: list[int]) -> None: ...
    def block_removed(self, block_hash: bytes) -> None: ...


class BlockManager:
    def __init__(
        self, pool: BlockIdPool, kv_cache: PagedKVCache, enable_caching: bool = True
    ) -> None:
        self.pool = pool
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.enable_caching = enable_caching
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.hits = self.misses = self.evictions = 0
        # Sessions on the device (module doc): session -> tip hash, and tip hash -> sessions.
        self._tip_of: dict[tuple[str, str], bytes] = {}
        self._sessions_at: dict[bytes, set[tuple[str, str]]] = {}
        self.listener: PrefixCacheListener | None = None  # KV events; None costs one test

    # -- prefix lookup at admission ----------------------------------------------------------
    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks for the sequence's leading full blocks; at least one token stays
        uncomputed (its logits are needed). Changes nothing."""
        if not self.enable_caching:
            return []
        self._extend_hashes(seq, seq.num_tokens - 1)
        found: list[int] = []
        for h in seq.block_hashes[: (seq.num_tokens - 1) // self.block_size]:
            block = self._block_of.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def blocks_needed(self, seq: Sequence, num_tokens: int, hit: list[int] | None = None) -> int:
        """Free blocks that `reserve(seq, num_tokens, hit)` would take from the pool."""
        if hit:
            revived = sum(1 for b in hit if self.pool.ref_count(b) == 0)
            return revived + max(0, self._num_blocks(num_tokens) - len(hit))
        table = seq.block_table
        need = max(0, self._num_blocks(num_tokens) - len(table))
        return need + int(self._needs_cow(seq))

    def can_reserve(self, seq: Sequence, num_tokens: int, hit: list[int] | None = None) -> bool:
        return self.blocks_needed(seq, num_tokens, hit) <= self.pool.num_free

    def reserve(self, seq: Sequence, num_tokens: int, hit: list[int] | None = None) -> None:
        """Give `seq` blocks for its first `num_tokens` tokens (taking `hit` as its prefix)."""
        if not self.can_reserve(seq, num_tokens, hit):
            raise RuntimeError("reserve called without enough free blocks")
        if hit:
            assert not seq.block_table, "a prefix hit is only taken by a sequence with no blocks"
            self._take(hit)
            seq.block_table = list(hit)
            seq.num_computed = len(hit) * self.block_size
            seq.num_registered = len(hit)
            self._note_tip(seq, len(hit))
        if self._needs_cow(seq):
            self._copy_on_write(seq)
        missing = self._num_blocks(num_tokens) - len(seq.block_table)
        if missing > 0:
            seq.block_table.extend(self._allocate(missing))

    def count_lookup(self, seq: Sequence, hit: list[int]) -> None:
        """Account a taken prefix lookup: hits and misses in full prompt blocks."""
        full = (seq.num_tokens - 1) // self.block_size
        self.hits += len(hit)
        self.misses += full - len(hit)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (one more reference each)."""
        self.pool.share(parent.block_table)
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its hashed blocks stay cached until reused."""
        if seq.block_table:
            self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_registered = 0

    def register_computed(self, seq: Sequence) -> None:
        """Offer the sequence's newly computed full blocks to the prefix cache."""
        if not self.enable_caching:
            return
        full = seq.num_computed // self.block_size
        if full <= seq.num_registered:
            return
        self._extend_hashes(seq, seq.num_computed)
        for i in range(seq.num_registered, full):
            h, block = seq.block_hashes[i], seq.block_table[i]
            if h not in self._block_of and block not in self._hash_of:
                self._block_of[h] = block
                self._hash_of[block] = h
                if self.listener is not None:
                    self._tell_stored(seq, i)
        seq.num_registered = full
        self._note_tip(seq, full)

    def stats(self) -> PrefixCacheStats:
        cached = list(self._hash_of)  # one C-level copy: safe while the model thread runs
        evictable = sum(1 for b in cached if self.pool.ref_count(b) == 0)
        return PrefixCacheStats(
            len(cached), evictable, self.hits, self.misses, self.evictions, len(self._tip_of)
        )

    # -- internals ---------------------------------------------------------------------------
    def _num_blocks(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        bs, hashes = self.block_size, seq.block_hashes
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(
                hash_block(parent, seq.request.tenant, seq.token_ids[i * bs : (i + 1) * bs])
            )

    def _needs_cow(self, seq: Sequence) -> bool:
        """The block the next token goes into is partly filled and shared with a sibling."""
        index, offset = divmod(seq.num_computed, self.block_size)
        return (
            offset != 0
            and index < len(seq.block_table)
            and (self.pool.ref_count(seq.block_table[index]) > 1)
        )

    def _copy_on_write(self, seq: Sequence) -> None:
        index = seq.num_computed // self.block_size
        old = seq.block_table[index]
        (new,) = self._allocate(1)
        self.kv_cache.copy_block(old, new)
        self.pool.free([old])
        seq.block_table[index] = new

    def _tell_stored(self, seq: Sequence, i: int) -> None:
        assert self.listener is not None
        bs, hashes = self.block_size, seq.block_hashes
        parent = hashes[i - 1] if i else None
        self.listener.block_stored(hashes[i], parent, seq.token_ids[i * bs : (i + 1) * bs])

    def _note_tip(self, seq: Sequence, full: int) -> None:
        """The session's tip is now its sequence's `full`-th block, when that one is cached."""
        session_id = seq.request.session_id
        if session_id is None or full == 0:
            return
        tip = seq.block_hashes[full - 1]
        if tip not in self._block_of:  # not cached (cannot happen for a hit or a registration)
            return
        session = (seq.request.tenant, session_id)
        old = self._tip_of.get(session)
        if old == tip:
            return
        if old is not None:
            left = self._sessions_at[old]
            left.discard(session)
            if not left:
                del self._sessions_at[old]
        self._tip_of[session] = tip
        self._sessions_at.setdefault(tip, set()).add(session)

    def _allocate(self, n: int) -> list[int]:
        blocks = self.pool.allocate(n)
        for b in blocks:
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._block_of[h]
                self.evictions += 1
                for session in self._sessions_at.pop(h, ()):
                    del self._tip_of[session]
                if self.listener is not None:
                    self.listener.block_removed(h)
        return blocks

    def _take(self, blocks: list[int]) -> None:
        """One more reference to each hit block; a cached free block leaves the free list."""
        self.pool.take(blocks)
