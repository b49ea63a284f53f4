"""What a store's turn writes to each tier, counted where the bytes leave the process.

The store's own counter (`AttentionStore.bytes_written`) counts the chunk bytes its writer hands
to the tiers; it leaves out the write-back to LMDB, the copy to Redis and the session records.
This meter counts what goes out instead, in two streams:

  file_bytes   the process's `wchar` delta (/proc/self/io): every byte any thread passed to
               write/pwrite/writev-like system calls in the window. LMDB (opened without
               writemap) writes its dirty pages with pwrite(v) at commit, so this counts gross
               pages, rewritten ones included. (Socket send() is not in wchar.)
  redis_sent   every byte the process's Redis clients handed to their sockets (redis-py's
               `send_packed_command`, counted per thread): commands, keys and values
  redis_in     the check on redis_sent: the Redis server's own `INFO stats`
               total_net_input_bytes delta, every byte Redis received from any client (it
               also holds the ~25-byte INFO query that reads it)

Each is attributed to a tier by the calling thread's own delta of both (/proc/thread-self/io,
and the thread's Redis bytes) around the tier's writing calls:

  lmdb_kv      the LMDB KV tier's put, delete, ...
  redis_kv     the Redis KV tier's put_many and delete
  records      the record store's put, delete and _update (the store's upsert of a turn's
               token ids and chunk list, the API's append of the turn's messages): records.lmdb
               pages, or Redis commands when the records live in Redis
  other        file_bytes + redis_sent - the three above: writes outside those calls (session
               leases and read requests sent to Redis, a progress bar or log line printed in
               the window)
  dram         the DRAM tier: the KV rows its put and extend wrote into its block pool
               (tokens x bytes per token in the pool's dtype; memory writes show up in no
               system call). An extend (the store's re-keyed tail) writes only the new rows.
  all_tiers    dram + file_bytes + redis_sent (`other` included: nothing written is left out)

A bracket counts only the calling thread's bytes, so concurrent work on other threads is not
attributed to it; nested bracketed calls count once (the outer one).
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

CATEGORIES = ("lmdb_kv", "redis_kv", "records")


def _wchar(path: str) -> int:
    with open(path, "rb") as f:
        for line in f:
            if line.startswith(b"wchar:"):
                return int(line.split()[1])
    raise RuntimeError(f"no wchar in {path}")


def thread_wchar() -> int:
    return _wchar("/proc/thread-self/io")


def process_wchar() -> int:
    return _wchar("/proc/self/io")


@dataclass(frozen=True)
class Snapshot:
    file_bytes: int
    redis_sent: int
    brackets: dict[str, int]
    dram: int
    redis_in: int | None


class TierBytes:
    """Brackets the writing calls of `store`'s LMDB and Redis tiers and of `records` (the record
    store the API and the store share); `redis_url`: the Redis whose INFO is read, if any."""

    def __init__(self, store: Any, records: Any, redis_url: str = "") -> None:
        self._bytes: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._sent = 0  # bytes every Redis client of the process handed to its socket
        self._dram = 0  # KV bytes the DRAM tier wrote into its pool
        self._install_redis_count()
        self._redis = None
        if redis_url:
            import redis

            self._redis = redis.Redis.from_url(redis_url, socket_timeout=5)
        ssd, remote, dram = store.tier("ssd"), store.tier("remote"), store.tier("dram")
        if dram is not None:
            self._count_dram(dram)
        if ssd is not None:
            self._wrap(ssd, ("put", "delete", "write_raw_value", "_drop_unreadable"), "lmdb_kv")
        if remote is not None:
            self._wrap(remote, ("put_many", "delete"), "redis_kv")
        self._wrap(records, ("put", "delete", "_update"), "records")
        self.records_backend = "redis" if "Redis" in type(records).__name__ else "lmdb"

    def _install_redis_count(self) -> None:
        from redis.connection import AbstractConnection

        send = AbstractConnection.send_packed_command
        meter = self

        def counted(conn: Any, command: Any, *args: Any, **kwargs: Any) -> Any:
            items = [command] if isinstance(command, (str, bytes, memoryview)) else command
            n = sum(len(i.encode() if isinstance(i, str) else i) for i in items)
            meter._local.sent = meter._thread_sent() + n  # handed to the socket (sendall)
            with meter._lock:
                meter._sent += n
            return send(conn, command, *args, **kwargs)

        AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]
        self._restore = lambda: setattr(AbstractConnection, "send_packed_command", send)

    def _count_dram(self, tier: Any) -> None:
        per_token = tier.layout.bytes_per_token
        put, extend = tier.put, tier.extend

        def counted_put(key: Any, value: Any) -> None:
            put(key, value)
            self._add_dram(value.num_tokens * per_token)

        def counted_extend(base: Any, key: Any, keep: int, rows: Any) -> bool:
            done = extend(base, key, keep, rows)
            if done:
                self._add_dram(rows.num_tokens * per_token)
            return done

        tier.put, tier.extend = counted_put, counted_extend

    def _add_dram(self, n: int) -> None:
        with self._lock:
            self._dram += n

    def _thread_sent(self) -> int:
        return getattr(self._local, "sent", 0)

    def _thread_out(self) -> int:
        """Bytes this thread has written to files and sent to Redis."""
        return thread_wchar() + self._thread_sent()

    def _wrap(self, obj: Any, names: tuple[str, ...], category: str) -> None:
        for name in names:
            fn = getattr(obj, name, None)
            if fn is not None:
                setattr(obj, name, self._bracket(fn, category))

    def _bracket(self, fn: Any, category: str) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "inside", False):
                return fn(*args, **kwargs)
            self._local.inside = True
            before = self._thread_out()
            try:
                return fn(*args, **kwargs)
            finally:
                n = self._thread_out() - before
                self._local.inside = False
                with self._lock:
                    self._bytes[category] += n

        return call

    def _redis_in(self) -> int | None:
        if self._redis is None:
            return None
        return int(self._redis.info("stats")["total_net_input_bytes"])

    def snapshot(self, end: bool = False) -> Snapshot:
        """Take one before a turn and one (end=True) after its writes have landed. The INFO
        query is sent outside the syscall window (first at the start, last at the end)."""
        redis_in = None if end else self._redis_in()
        with self._lock:
            brackets, sent, dram = dict(self._bytes), self._sent, self._dram
        snap = Snapshot(process_wchar(), sent, brackets, dram, redis_in)
        if end:
            snap = Snapshot(snap.file_bytes, sent, brackets, snap.dram, self._redis_in())
        return snap

    @staticmethod
    def delta(a: Snapshot, b: Snapshot) -> dict[str, int]:
        out = {c: b.brackets.get(c, 0) - a.brackets.get(c, 0) for c in CATEGORIES}
        out["file_bytes"] = b.file_bytes - a.file_bytes
        out["redis_sent"] = b.redis_sent - a.redis_sent
        sent = out["file_bytes"] + out["redis_sent"]
        out["other"] = sent - sum(out[c] for c in CATEGORIES)
        out["dram"] = b.dram - a.dram
        out["all_tiers"] = out["dram"] + sent
        if a.redis_in is not None and b.redis_in is not None:
            out["redis_in"] = b.redis_in - a.redis_in
        return out

    def close(self) -> None:
        self._restore()
        if self._redis is not None:
            self._redis.close()
