"""Chunk keys: a session's KV as a chain of content-addressed chunks (Store v2).

    tokens   [ chunk 0: C tokens | chunk 1: C tokens | ... | tail: < C tokens ]
    key i  = H(tenant, model fingerprint, storage dtype, key i-1, token ids of chunk i)

A key names the bytes of its chunk everywhere (any session, tier, process or restart): the chain
makes it depend on every token before it, so two histories share a key exactly when they share
that whole prefix, and the tenant in the hash keeps tenants from ever sharing one. H is blake2b,
never Python's salted `hash`. The tail (last, partial chunk) is keyed the same way; it is
replaced, not extended, when the next turn completes it.

With encryption at rest H is keyed blake2b (a MAC) under the tenant's digest key
(sealing/keyring.py, kept wrapped with its data keys): a chunk's name in LMDB or Redis cannot be
reproduced from guessed token ids without that key, and once a shred destroys the key no name
of the tenant's means anything. Without encryption (`digest_key` None) it is plain blake2b.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

import torch

from chatstore.store.session_kv import ChunkKey

_DOMAIN = b"chatstore-chunk-v1"


class ChunkHasher:
    """Keys of a token sequence's chunks for one model, storage dtype and chunk size."""

    def __init__(
        self,
        fingerprint: str,
        storage_dtype: torch.dtype,
        chunk_tokens: int,
        digest_key: Callable[[str], bytes] | None = None,
    ) -> None:
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.digest_key = digest_key  # tenant -> its digest key (None: unkeyed)
        dtype = str(storage_dtype).removeprefix("torch.")
        self._salt = b"\0".join([_DOMAIN, fingerprint.encode(), dtype.encode()])

    def chain(
        self, tenant: str, token_ids: list[int], parent: ChunkKey | None = None
    ) -> list[ChunkKey]:
        """The key of every chunk of token_ids, the last one partial when the length is not a
        multiple of chunk_tokens (none for no tokens); `parent`: the chunk they follow."""
        keys: list[ChunkKey] = []
        previous = bytes.fromhex(parent.digest) if parent is not None else b""
        tenant_bytes = tenant.encode()
        key = self.digest_key(tenant) if self.digest_key is not None else b""
        C = self.chunk_tokens
        for start in range(0, len(token_ids), C):
            ids = token_ids[start : start + C]
            h = hashlib.blake2b(digest_size=16, key=key)
            h.update(self._salt)
            h.update(struct.pack("<I", len(tenant_bytes)) + tenant_bytes)
            h.update(previous)
            h.update(struct.pack(f"<{len(ids)}i", *ids))
            previous = h.digest()
            keys.append(ChunkKey(tenant, previous.hex()))
        return keys

    def num_chunks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.chunk_tokens)
