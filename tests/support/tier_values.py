"""Chunk keys and random KV values for the tiers tested on their own (no store above them)."""

from __future__ import annotations

import hashlib

import torch

from chatstore.store.session_kv import ChunkKey, SessionKV


def K(name: str, tenant: str = "t") -> ChunkKey:
    """The chunk key called `name` (its digest: blake2b of the name)."""
    return ChunkKey(tenant, hashlib.blake2b(name.encode(), digest_size=16).hexdigest())


def value(num_tokens: int, seed: int = 0) -> SessionKV:
    """A chunk of num_tokens: token ids from the seed, random KV of a two-layer model."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((2, 2, num_tokens, 2, 4), generator=g)
    return SessionKV([seed * 1000 + i for i in range(num_tokens)], kv)
