"""SSD tier: KV chunks in an LMDB environment under the data directory.

    db "chunks"  digest                -> the encoded chunk (codec.py: header, token ids, then
                                          K, V layer-major, so one layer is a contiguous slice)
    db "sizes"   digest                -> JSON {tenant, footprint}: the index, read at open
    db "info"    b"fingerprint"        -> the model fingerprint every chunk here belongs to

A chunk is immutable (its key is a hash of its content), so a put of a key already here is a
no-op and a reader never sees a torn value: value and size are written in one transaction.
Opening an environment written by another model empties it. Chunks found at open are served
again (warm restart); the store deletes the ones no session references.

Threads: readers from any thread (LMDB's MVCC); the in-memory index is a FootprintIndex, so
occupancy questions cost no I/O. Every change (a put, a delete, and a reader dropping a value it
found gone or corrupt) holds the tier's `_write_lock` from its index check to its index update,
so the index and the database change together. That lock covers one LMDB transaction, never
the hierarchy's I/O lock's Redis calls, so a reader (maybe the engine thread) that drops a bad
value waits at most for one local write.

The files hold every tenant's KV: the directory is 0700 and its files 0600, whatever the umask.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import lmdb

from chatstore.store.chunks import ChunkKey
from chatstore.store.session_kv import SessionKV
from chatstore.store.tiers import codec
from chatstore.store.tiers.base import IndexedTier, TierFull

DIR_MODE = 0o700
FILE_MODE = 0o600


def open_private(path: Path, **options: Any) -> lmdb.Environment:
    """An LMDB environment only this user can read: its data is every tenant's. mkdir's and
    lmdb's modes are masked by the umask (and mkdir's ignored for an existing dir): chmod."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)
    env = lmdb.open(str(path), mode=FILE_MODE, **options)
    for name in os.listdir(path):
        os.chmod(path / name, FILE_MODE)
    return env


class LmdbTier(IndexedTier):
    name = "ssd"

    def __init__(self, path: str | Path, capacity_bytes: int, fingerprint: str) -> None:
        self.path = Path(path)
        super().__init__(capacity_bytes)
        self.fingerprint = fingerprint
        self._write_lock = threading.Lock()
        # Room for LMDB's own pages and freed-but-not-yet-reusable pages beyond our accounting.
        map_size = max(capacity_bytes * 2, capacity_bytes + (64 << 20))
        self.env = open_private(self.path, map_size=map_size, max_dbs=4, sync=False)
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
        blob = codec.encode(value, self.fingerprint)  # outside the lock: the slow part
        with self._write_lock:
            if key in self._index:
                return
            need = self.check_fits(key, value)
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
        error: ValueError | None = None
        with self.env.begin(buffers=True) as txn:
            raw = txn.get(key.digest.encode(), db=self._chunks)
            if raw is not None:
                try:
                    return codec.decode(raw, self.fingerprint)  # copies out of the map once
                except (codec.CorruptValueError, codec.FingerprintMismatch) as exc:
                    error = exc
        self._drop_unreadable(key)
        if error is not None:
            raise error
        return None

    def _drop_unreadable(self, key: ChunkKey) -> None:
        """A reader found key's value gone or bad: under the write lock, look again (a writer
        may have replaced it meanwhile) and drop the value and its index entry if still so."""
        with self._write_lock, self.env.begin(write=True, buffers=True) as txn:
            raw = txn.get(key.digest.encode(), db=self._chunks)
            if raw is not None and key in self._index:
                try:
                    codec.decode(raw, self.fingerprint)
                    return  # rewritten meanwhile: keep it
                except (codec.CorruptValueError, codec.FingerprintMismatch):
                    pass
            self._delete(txn, key)

    def delete(self, key: ChunkKey) -> bool:
        with self._write_lock:
            if key not in self._index:
                return False
            with self.env.begin(write=True) as txn:
                self._delete(txn, key)
            return True

    def _delete(self, txn: lmdb.Transaction, key: ChunkKey) -> None:
        txn.delete(key.digest.encode(), db=self._chunks)
        txn.delete(key.digest.encode(), db=self._sizes)
        self._index.pop(key)

    def raw_value(self, key: ChunkKey) -> bytes | None:
        """The stored bytes of a chunk (tests and tools: inspect or damage a value)."""
        with self.env.begin() as txn:
            value = txn.get(key.digest.encode(), db=self._chunks)
        return bytes(value) if value is not None else None

    def write_raw_value(self, key: ChunkKey, data: bytes) -> None:
        with self._write_lock, self.env.begin(write=True) as txn:
            txn.put(key.digest.encode(), data, db=self._chunks)

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()
