"""SSD tier: KV chunks in an LMDB environment under the data directory.

    db "chunks"  digest                -> the encoded chunk (codec.py: header, token ids, then
                                          K, V layer-major, so one layer is a contiguous slice)
    db "sizes"   digest                -> JSON {tenant, footprint}: the index, read at open
    db "info"    b"fingerprint"        -> the model fingerprint every chunk here belongs to

A chunk is immutable (its key is a hash of its content), so a put of a key already here is a
no-op and a reader never sees a torn value: value and size are written in one transaction.
Opening an environment written by another model empties it. Chunks found at open are served
again (warm restart); the store deletes the ones no session references.

Threads: one writer at a time (the tiers' I/O lock), readers from any thread (LMDB's MVCC); the
in-memory index is a FootprintIndex, so occupancy questions cost no I/O.
"""

from __future__ import annotations

import json
from pathlib import Path

import lmdb

from chatstore.store.chunks import ChunkKey
from chatstore.store.session_kv import SessionKV
from chatstore.store.tiers import codec
from chatstore.store.tiers.base import IndexedTier, TierFull


class LmdbTier(IndexedTier):
    name = "ssd"

    def __init__(self, path: str | Path, capacity_bytes: int, fingerprint: str) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        super().__init__(capacity_bytes)
        self.fingerprint = fingerprint
        # Room for LMDB's own pages and freed-but-not-yet-reusable pages beyond our accounting.
        map_size = max(capacity_bytes * 2, capacity_bytes + (64 << 20))
        self.env = lmdb.open(str(self.path), map_size=map_size, max_dbs=4, sync=False)
        self._chunks = self.env.open_db(b"chunks")
        self._sizes = self.env.open_db(b"sizes")
        self._info = self.env.open_db(b"info")
        self._open_for_model()

    def _open_for_model(self) -> None:
        with self.env.begin(write=True) as txn:
            stored = txn.get(b"fingerprint", db=self._info)
            if stored is not None and stored.decode() != self.fingerprint:
                txn.drop(self._chunks, delete=False)
                txn.drop(self._sizes, delete=False)
            txn.put(b"fingerprint", self.fingerprint.encode(), db=self._info)
            for digest, raw in txn.cursor(db=self._sizes):
                meta = json.loads(raw)
                self._index.set(ChunkKey(meta["tenant"], digest.decode()), int(meta["footprint"]))

    def put(self, key: ChunkKey, value: SessionKV) -> None:
        if key in self._index:
            return  # immutable: the bytes here are the same
        need = self.check_fits(key, value)
        blob = codec.encode(value, self.fingerprint)
        meta = json.dumps({"tenant": key.tenant, "footprint": need}).encode()
        try:
            with self.env.begin(write=True) as txn:
                txn.put(key.digest.encode(), blob, db=self._chunks)
                txn.put(key.digest.encode(), meta, db=self._sizes)
        except lmdb.MapFullError as exc:
            raise TierFull(f"LMDB map full: {exc}") from exc
        self._index.set(key, need)

    def get(self, key: ChunkKey) -> SessionKV | None:
        if key not in self._index:
            return None
        with self.env.begin(buffers=True) as txn:
            raw = txn.get(key.digest.encode(), db=self._chunks)
            if raw is None:
                self._index.pop(key)
                return None
            try:
                return codec.decode(raw, self.fingerprint)  # copies out of the map once
            except (codec.CorruptValueError, codec.FingerprintMismatch) as exc:
                error = exc
        self.delete(key)
        raise error

    def delete(self, key: ChunkKey) -> bool:
        if not self._index.pop(key):
            return False
        with self.env.begin(write=True) as txn:
            txn.delete(key.digest.encode(), db=self._chunks)
            txn.delete(key.digest.encode(), db=self._sizes)
        return True

    def raw_value(self, key: ChunkKey) -> bytes | None:
        """The stored bytes of a chunk (tests and tools: inspect or damage a value)."""
        with self.env.begin() as txn:
            value = txn.get(key.digest.encode(), db=self._chunks)
        return bytes(value) if value is not None else None

    def write_raw_value(self, key: ChunkKey, data: bytes) -> None:
        with self.env.begin(write=True) as txn:
            txn.put(key.digest.encode(), data, db=self._chunks)

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()
