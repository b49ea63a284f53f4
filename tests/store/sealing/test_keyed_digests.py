"""Keyed digests (issue 33): a dump of LMDB and Redis holds no digest that can be reproduced
from a conversation's token ids without its tenant's key. Real LMDB, a real redis-server.

Chunk names (chunks/keys.py) and prefix index entries (records/prefix_index.py) are keyed
blake2b under the tenant's digest key when sealing; in the clear they are plain blake2b, and
there the same search finds them (so the search can fail).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from chatstore.store.attention_store import AttentionStore
from chatstore.store.chunks import ChunkHasher
from chatstore.store.records.prefix_index import registration
from chatstore.store.session_kv import SessionKey, SessionKV
from chatstore.store.settings import StoreSettings
from tests.support.store import TINY_SPEC

pytestmark = pytest.mark.timeout(120)

CHUNK = 64
FP = "fp"


def _store(root: Path, encrypt: bool, redis_url: str = "") -> AttentionStore:
    settings = StoreSettings(
        data_dir=root,
        dram_bytes=0,  # every chunk goes to LMDB or Redis
        ssd_bytes=0 if redis_url else 1 << 24,
        redis_url=redis_url,
        redis_bytes=1 << 24,
        block_size=4,
        chunk_tokens=CHUNK,
        persist="write_through",
        encrypt_at_rest=encrypt,
    )
    return AttentionStore(settings, TINY_SPEC, FP)


def _guesses(store: AttentionStore, tenant: str, ids: list[int]) -> set[bytes]:
    """Every digest of ids one can compute without the tenant's key: the chunk names and the
    prefix index's entry names and end hashes, as hex and as raw bytes."""
    unkeyed = ChunkHasher(FP, store.settings.storage_dtype, CHUNK)
    found = {k.digest for k in unkeyed.chain(tenant, ids)}
    for entry, end in registration(tenant, FP, ids).items():
        found.add(entry)
        if end is not None:
            found.add(end[1])
    return {h.encode() for h in found} | {bytes.fromhex(h) for h in found}


def _lmdb_dump(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def _redis_dump(client) -> bytes:
    client.config_set("rdbcompression", "no")  # DUMP payloads as stored, not LZF'd
    names = list(client.scan_iter("chatstore:*"))
    return b"".join(names) + b"".join(client.dump(n) or b"" for n in names)


@pytest.mark.parametrize("encrypt", [True, False], ids=["sealed", "clear"])
def test_no_stored_digest_is_reproducible_from_token_ids_without_the_tenant_key(
    tmp_path, redis_url, redis_client, encrypt
):
    ids = list(range(3, 3 + 3 * CHUNK + 17))  # a guessable conversation: 3 chunks and a tail
    kv = torch.randn(2, 2, len(ids), 2, 4, generator=torch.Generator().manual_seed(1))
    local = _store(tmp_path / "local", encrypt)
    shared = _store(tmp_path / "shared", encrypt, redis_url)
    stored: set[bytes] = set()
    for store in (local, shared):
        store.save("alice", "s", SessionKV(ids, kv))
        assert store.flush_persist(30)
        assert store.records.match_prefix("alice", [*ids, 5, 6], FP) == "s"  # the index works
        chain = store.index.get(SessionKey("alice", "s"))
        assert chain is not None and len(chain.chunks) == 4
        stored |= {c.digest.encode() for c in chain.chunks}
    guesses = _guesses(local, "alice", ids)
    local.close()
    shared.close()
    dump = _lmdb_dump(tmp_path / "local") + _redis_dump(redis_client)
    assert all(name in dump for name in stored)  # the names as stored are in the dump
    found = {g for g in guesses if g in dump}
    if encrypt:
        assert found == set()
    else:  # the control: unkeyed, every chunk name and index entry is found
        assert len(found) >= len(guesses) // 2 and stored <= guesses
