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

Full storage. The map (`map_bytes`, by default twice the capacity or 64 MiB more) or the disk
under it may fill before the index says the tier is full (LMDB's own pages, a small map, a disk
shared with other files). A put it refuses raises StorageFull ("map_full" or "disk_full"; a
commit cut short by a full disk arrives as EIO) and changes nothing, and from then on the tier
counts as holding no more than it holds now: its `capacity` drops to its used bytes (or to just
under the refused value's size, if more), so the hierarchy evicts by its placement to make room
as for any full tier, and the next write goes into pages LMDB freed. A full map stays that size
for the process; after a full disk the capacity comes back once the file system has room again
(checked at most every second).

The files hold every tenant's KV: the directory is 0700 and its files 0600, whatever the umask.
With a `sealer` (encryption at rest, the default) every chunk is stored sealed under its
tenant's data key with (tenant, digest) as associated data (sealing/sealer.py); a value that
fails to open is a miss and stays where it is (never dropped: another key may still open it); a
value that opens but fails the codec's checks beneath the seal is dropped. `reseal` re-seals one
value under the tenant's newest data key (sealing/reseal.py).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb

from chatstore.store.sealing import KV_PURPOSE, OpenError, Sealer
from chatstore.store.sealing.sealer import is_sealed
from chatstore.store.session_kv import ChunkKey, SessionKV
from chatstore.store.tiers import codec
from chatstore.store.tiers.base import IndexedTier, StorageFull

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
DISK_RECHECK_S = 1.0  # after a full disk, the file system's free space is looked at this often
DISK_ROOM_MIN = 1 << 20  # free bytes below which an EIO from a commit counts as a full disk


def open_private(path: Path, **options: Any) -> lmdb.Environment:
    """An LMDB environment only this user can read: its data is every tenant's. mkdir's and
    lmdb's modes are masked by the umask (and mkdir's ignored for an existing dir): chmod."""
    path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)
    env = lmdb.open(str(path), mode=FILE_MODE, **options)
    for name in os.listdir(path):
        os.chmod(path / name, FILE_MODE)
    return env


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on path's file system (None: unknown)."""
    try:
        fs = os.statvfs(path)
    except OSError:
        return None
    return fs.f_bavail * fs.f_frsize


def is_disk_full(exc: BaseException, path: Path, min_free: int = DISK_ROOM_MIN) -> bool:
    """Whether a failed LMDB write was the disk filling up. py-lmdb reports a failed commit as
    lmdb.Error with the errno's text only, and a write cut short by a full disk as EIO: ENOSPC
    and EDQUOT say so; EIO (or an OSError) does when the file system has under min_free left."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    if os.strerror(errno.ENOSPC) in text or os.strerror(errno.EDQUOT) in text:
        return True
    if os.strerror(errno.EIO) in text or isinstance(exc, OSError):
        free = free_bytes(path)
        return free is not None and free < min_free
    return False


@dataclass
class _Refused:
    """The storage refused a write: the tier holds at most `limit` bytes for now."""

    reason: str  # map_full | disk_full
    limit: int
    room: int  # disk_full: free bytes on the file system that lift the limit
    recheck_at: float = 0.0


class LmdbTier(IndexedTier):
    name = "ssd"

    def __init__(
        self,
        path: str | Path,
        capacity_bytes: int,
        fingerprint: str,
        map_bytes: int | None = None,
        sealer: Sealer | None = None,
    ) -> None:
        self.path = Path(path)
        self.sealer = sealer
        super().__init__(capacity_bytes)
        self.fingerprint = fingerprint
        self._write_lock = threading.Lock()
        self._refused: _Refused | None = None  # set when the map or the disk refused a write
        # Room for LMDB's own pages and freed-but-not-yet-reusable pages beyond our accounting.
        self.map_bytes = map_bytes or max(capacity_bytes * 2, capacity_bytes + (64 << 20))
        self.env = open_private(self.path, map_size=self.map_bytes, max_dbs=4, sync=False)
        self._chunks = self.env.open_db(b"chunks")
        self._sizes = self.env.open_db(b"sizes")
        self._info = self.env.open_db(b"info")
        self._open_for_model()

    def _open_for_model(self) -> None:
        with self.env.begin(write=True) as txn:
            stored = txn.get(b"fingerprint", db=self._info)
            # Written only when it changes: a restart on a full disk then writes no page.
            if stored is None or stored.decode() != self.fingerprint:
                if stored is not None:  # another model's chunks
                    txn.drop(self._chunks, delete=False)
                    txn.drop(self._sizes, delete=False)
                txn.put(b"fingerprint", self.fingerprint.encode(), db=self._info)
            for digest, raw in txn.cursor(db=self._sizes):
                meta = json.loads(raw)
                self._index.set(ChunkKey(meta["tenant"], digest.decode()), int(meta["footprint"]))

    @property
    def capacity(self) -> int:
        """The configured capacity, or less while the map or the disk is full (module doc)."""
        refused = self._refused
        if refused is None:
            return self._capacity
        if refused.reason == "disk_full" and self._disk_has_room(refused):
            self._refused = None
            log.info("%s: the disk has room again (%d bytes of KV)", self.path, self._capacity)
            return self._capacity
        return min(self._capacity, refused.limit)

    def _disk_has_room(self, refused: _Refused) -> bool:
        now = time.monotonic()
        if now < refused.recheck_at:
            return False
        refused.recheck_at = now + DISK_RECHECK_S
        free = free_bytes(self.path)
        return free is not None and free >= refused.room

    def _storage_full(self, exc: Exception, need: int) -> StorageFull | None:
        """exc as StorageFull when it says the map or the disk is full (the tier then counts
        as full at what it holds now), else None. Under the write lock."""
        if isinstance(exc, lmdb.MapFullError):
            reason, where = "map_full", f"the LMDB map ({self.map_bytes} bytes)"
        elif is_disk_full(exc, self.path):
            reason, where = "disk_full", "the disk"
        else:
            return None
        # A value the empty tier could not take lowers the limit below its own size only.
        limit = min(self.capacity, max(self.used_bytes(), need - 1))
        room = 2 * need  # free bytes on the disk that lift a disk_full limit
        self._refused = _Refused(reason, limit, room, time.monotonic() + DISK_RECHECK_S)
        log.warning(
            "%s: %s is full (%s); the KV tier holds at most %d bytes from now on",
            self.path, where, exc, limit,
        )  # fmt: skip
        return StorageFull(reason, f"{self.name} tier: {where} is full: {exc}")

    def put(self, key: ChunkKey, value: SessionKV) -> None:
        if key in self._index:
            return  # immutable: the bytes here are the same
        blob = self._encoded(key, value)  # outside the lock
        with self._write_lock:
            if key in self._index:
                return
            need = self.check_fits(key, value)
            meta = json.dumps({"tenant": key.tenant, "footprint": need}).encode()
            try:
                with self.env.begin(write=True) as txn:
                    txn.put(key.digest.encode(), blob, db=self._chunks)
                    txn.put(key.digest.encode(), meta, db=self._sizes)
            except (lmdb.Error, OSError) as exc:  # the transaction was aborted: nothing changed
                full = self._storage_full(exc, need)
                if full is None:
                    raise
                raise full from exc
            self._index.set(key, need)

    def get(self, key: ChunkKey) -> SessionKV | None:
        """The chunk (None: not here). OpenError for a value that does not open (another,
        shredded or missing key; a clear value): a miss, and the value stays (an operator's
        mistake in the keys must not cost the data). CorruptValueError / FingerprintMismatch
        for a value that opened (or, unsealed, is read as stored) but is unusable: dropped."""
        if key not in self._index:
            return None
        error: ValueError | None = None
        with self.env.begin(buffers=True) as txn:
            raw = txn.get(key.digest.encode(), db=self._chunks)
            if raw is not None:
                try:
                    return self._decode(key, raw)  # copies out of the map once
                except OpenError:
                    raise
                except (codec.CorruptValueError, codec.FingerprintMismatch) as exc:
                    error = exc
        self._drop_unreadable(key)
        if error is not None:
            raise error
        return None

    def _drop_unreadable(self, key: ChunkKey) -> None:
        """A reader found key's value gone or unusable: under the write lock, look again (a
        writer may have replaced it meanwhile) and drop the value and its index entry if still
        so. A value that does not open is never dropped here."""
        with self._write_lock, self.env.begin(write=True, buffers=True) as txn:
            raw = txn.get(key.digest.encode(), db=self._chunks)
            if raw is not None and key in self._index:
                try:
                    self._decode(key, raw)
                    return  # rewritten meanwhile: keep it
                except OpenError:
                    return  # not ours to judge: a miss, left in place
                except (codec.CorruptValueError, codec.FingerprintMismatch):
                    pass
            self._delete(txn, key)

    def _encoded(self, key: ChunkKey, value: SessionKV) -> bytearray:
        """The value as stored: sealed straight from its KV's memory (the tag its checksum),
        or in the clear with its crc32."""
        if self.sealer is None:
            return codec.encode(value, self.fingerprint)
        parts = codec.sealable_parts(value, self.fingerprint)
        return self.sealer.seal_parts(*self._ad(key), parts)

    def _decode(self, key: ChunkKey, raw: Any) -> SessionKV:
        """The chunk in raw (sealed or not, as this tier stores); CorruptValueError (OpenError
        for a value that fails to open) or FingerprintMismatch when unusable."""
        if self.sealer is None:
            return codec.decode(raw, self.fingerprint)  # copied out of the map once
        # Opened into a buffer of its own, in which the chunk's KV stays (no second copy).
        plain = self.sealer.open_owned(KV_PURPOSE, key.tenant, key.digest.encode(), raw)
        return codec.decode_owned(plain, self.fingerprint, authenticated=True)

    def reseal(self, key: ChunkKey, adopt_clear: bool = False) -> bool:
        """Re-seal key's value under its tenant's sealing data key if it is under an older one
        (data-key rotation); whether it was rewritten. A value that does not open is left as
        it is (a miss for readers). A clear value is sealed only with adopt_clear
        (encrypt-existing), and only if it is a valid chunk of this model."""
        sealer = self.sealer
        if sealer is None:
            return False
        with self._write_lock:
            if key not in self._index:
                return False
            with self.env.begin(write=True) as txn:
                raw = txn.get(key.digest.encode(), db=self._chunks)
                plain = None if raw is None else self._resealable(key, raw, adopt_clear)
                if plain is None:
                    return False
                sealed = sealer.seal(KV_PURPOSE, key.tenant, key.digest.encode(), plain)
                txn.put(key.digest.encode(), sealed, db=self._chunks)
        return True

    def _resealable(self, key: ChunkKey, raw: bytes, adopt_clear: bool) -> bytes | None:
        """raw's codec bytes when `reseal` should rewrite it (module doc), else None."""
        assert self.sealer is not None
        if is_sealed(raw) == adopt_clear:  # adopting: clear ones only; rotating: sealed ones
            return None
        if not adopt_clear and not self.sealer.needs_reseal(key.tenant, raw):
            return None
        try:
            plain = raw if adopt_clear else self.sealer.open(*self._ad(key), raw)
            # Its checksum (a clear value being adopted) or tag (opened), and its model.
            codec.decode(plain, self.fingerprint, authenticated=not adopt_clear)
        except (codec.CorruptValueError, codec.FingerprintMismatch):
            return None
        return plain

    def _ad(self, key: ChunkKey) -> tuple[bytes, str, bytes]:
        return KV_PURPOSE, key.tenant, key.digest.encode()

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
