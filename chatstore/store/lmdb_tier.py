"""SSD tier: session KV in an LMDB environment under the data directory.

    db "meta"    digest                -> JSON {tenant, session_id, chunks, footprint, saved_at}
    db "chunks"  digest + u32 index    -> one chunk of the encoded value (codec.py)
    db "info"    b"fingerprint"        -> the model fingerprint every value here belongs to

A put replaces chunks and meta in one write transaction, so a reader sees the old value or the new
one, never half. Opening an environment written by another model (fingerprint) empties it: KV of
another model or dtype is never reused. Sessions found at open are served again (warm restart).

Threads: the hierarchy writes and deletes from one thread at a time (its I/O lock) while other
threads read, outside any lock of the hierarchy. LMDB itself allows that (MVCC readers, one
writer); the in-memory index is a FootprintIndex, so `used_bytes`, `keys` and `contains` are
cheap and safe from any thread.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import lmdb

from chatstore.store import codec
from chatstore.store.keys import key_digest
from chatstore.store.session_kv import SessionKey, SessionKV
from chatstore.store.tier import FootprintIndex, StorageTier, TierFull

_HEADER_SLACK = 512  # bytes of codec header counted per value


def encoded_footprint(value: SessionKV) -> int:
    """Upper bound of the encoded size: what the LMDB and Redis tiers count a value as."""
    return value.nbytes + 4 * value.num_tokens + _HEADER_SLACK


class LmdbTier(StorageTier):
    name = "ssd"

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        fingerprint: str,
        chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.chunk_bytes = chunk_bytes
        self._capacity = capacity_bytes
        # Room for LMDB's own pages and freed-but-not-yet-reusable pages beyond our accounting.
        map_size = max(capacity_bytes * 2, capacity_bytes + (64 << 20))
        self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=4, sync=False)
        self._meta = self.env.open_db(b"meta")
        self._chunks = self.env.open_db(b"chunks")
        self._info = self.env.open_db(b"info")
        self._index = FootprintIndex()
        self._open_for_model()

    def _open_for_model(self) -> None:
        with self.env.begin(write=True) as txn:
            stored = txn.get(b"fingerprint", db=self._info)
            if stored is not None and stored.decode() != self.fingerprint:
                txn.drop(self._meta, delete=False)
                txn.drop(self._chunks, delete=False)
            txn.put(b"fingerprint", self.fingerprint.encode(), db=self._info)
            for raw in txn.cursor(db=self._meta).iternext(keys=False, values=True):
                meta = json.loads(raw)
                key = SessionKey(meta["tenant"], meta["session_id"])
                self._index.set(key, int(meta["footprint"]))

    @property
    def capacity(self) -> int:
        return self._capacity

    def footprint(self, value: SessionKV) -> int:
        return encoded_footprint(value)

    def put(self, key: SessionKey, value: SessionKV) -> None:
        need = self.check_fits(key, value)
        digest = _digest(key)
        chunks = codec.encode_chunks(value, self.fingerprint, self.chunk_bytes)
        meta = {
            "tenant": key.tenant,
            "session_id": key.session_id,
            "chunks": len(chunks),
            "footprint": need,
            "saved_at": time.time(),
        }
        try:
            with self.env.begin(write=True) as txn:
                self._delete_in(txn, digest)
                for i, chunk in enumerate(chunks):
                    txn.put(_chunk_key(digest, i), chunk, db=self._chunks)
                txn.put(digest, json.dumps(meta).encode(), db=self._meta)
        except lmdb.MapFullError as exc:
            raise TierFull(f"LMDB map full: {exc}") from exc
        self._index.set(key, need)

    def get(self, key: SessionKey) -> SessionKV | None:
        if key not in self._index:
            return None
        digest = _digest(key)
        with self.env.begin() as txn:
            raw = txn.get(digest, db=self._meta)
            if raw is None:
                self._index.pop(key)
                return None
            n = int(json.loads(raw)["chunks"])
            chunks = [txn.get(_chunk_key(digest, i), db=self._chunks) for i in range(n)]
        try:
            if any(c is None for c in chunks):
                raise codec.CorruptValueError("LMDB value is missing chunks")
            return codec.decode(codec.join_chunks(chunks), self.fingerprint)
        except (codec.CorruptValueError, codec.FingerprintMismatch):
            self.delete(key)
            raise

    def delete(self, key: SessionKey) -> bool:
        if not self._index.pop(key):
            return False
        with self.env.begin(write=True) as txn:
            self._delete_in(txn, _digest(key))
        return True

    def _delete_in(self, txn: lmdb.Transaction, digest: bytes) -> None:
        raw = txn.get(digest, db=self._meta)
        if raw is None:
            return
        for i in range(int(json.loads(raw)["chunks"])):
            txn.delete(_chunk_key(digest, i), db=self._chunks)
        txn.delete(digest, db=self._meta)

    def contains(self, key: SessionKey) -> bool:
        return key in self._index

    def used_bytes(self) -> int:
        return self._index.total

    def keys(self) -> list[SessionKey]:
        return self._index.keys()

    def size_of(self, key: SessionKey) -> int:
        return self._index.size_of(key)

    def raw_chunk(self, key: SessionKey, index: int = 0) -> bytes | None:
        """One stored chunk as bytes (tests and tools: inspect or damage a value)."""
        digest = _digest(key)
        with self.env.begin() as txn:
            value = txn.get(_chunk_key(digest, index), db=self._chunks)
        return bytes(value) if value is not None else None

    def write_raw_chunk(self, key: SessionKey, index: int, data: bytes) -> None:
        digest = _digest(key)
        with self.env.begin(write=True) as txn:
            txn.put(_chunk_key(digest, index), data, db=self._chunks)

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()


def _digest(key: SessionKey) -> bytes:
    return key_digest(key).encode()


def _chunk_key(digest: bytes, index: int) -> bytes:
    return digest + struct.pack(">I", index)
