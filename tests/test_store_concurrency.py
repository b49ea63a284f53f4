"""The store under threads: slow-tier I/O outside the hierarchy lock, in-transit values, demotion
order, reads that do not wait for queued commits, and session versions. Real DRAM, LMDB and
Redis tiers throughout; "slow" tiers are subclasses that sleep in put (a test of timing)."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable

import pytest
import redis as redis_lib
import torch

from chatstore.store import AttentionStore, StoreSettings
from chatstore.store.dram_tier import DramTier, KVLayout
from chatstore.store.hierarchy import TierHierarchy
from chatstore.store.lmdb_tier import LmdbTier, encoded_footprint
from chatstore.store.redis_tier import RedisTier
from chatstore.store.session_kv import SessionKey, SessionKV
from chatstore.store.writer import WriteBuffer
from tests.test_store_attention_store import SPEC, TOKEN_BYTES
from tests.test_store_attention_store import value as store_value

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
BLOCK = 4
BLOCK_BYTES = LAYOUT.bytes_per_token * BLOCK  # 512
SLOW_S = 0.8  # one slowed LMDB write


def value(num_tokens: int, seed: int) -> SessionKV:
    """A value that names its seed in its first token id (the stress test decodes it)."""
    g = torch.Generator().manual_seed(seed)
    ids = [seed] + [7] * (num_tokens - 1)
    return SessionKV(ids, torch.randn((2, 2, num_tokens, 2, 4), generator=g))


def K(name: str) -> SessionKey:
    return SessionKey("t", name)


class SlowLmdbTier(LmdbTier):
    """An LMDB tier whose writes (reads) take `delay_s` (`read_delay_s`) longer; says which key
    it is writing."""

    def __init__(
        self, *args, delay_s: float = 0.0, read_delay_s: float = 0.0, after_s: float = 0.0, **kw
    ) -> None:
        super().__init__(*args, **kw)
        self.delay_s = delay_s
        self.read_delay_s = read_delay_s
        self.after_s = after_s  # a pause after the write landed, before put returns
        self.writing = threading.Event()
        self.wrote = threading.Event()
        self.written: list[SessionKey] = []

    def put(self, key: SessionKey, value: SessionKV) -> None:
        self.written.append(key)
        self.writing.set()
        time.sleep(self.delay_s)
        super().put(key, value)
        self.wrote.set()
        time.sleep(self.after_s)

    def get(self, key: SessionKey) -> SessionKV | None:
        time.sleep(self.read_delay_s)
        return super().get(key)


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def in_thread(fn: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def slow_pair(tmp_path):
    """DRAM for three 8-token sessions over an LMDB tier whose writes take SLOW_S."""
    dram = DramTier(6 * BLOCK_BYTES, LAYOUT, BLOCK)
    ssd = SlowLmdbTier(tmp_path / "kv.lmdb", 1 << 20, "fp", delay_s=SLOW_S)
    h = TierHierarchy([dram, ssd])
    yield h, dram, ssd
    ssd.close()


# -- task: slow-tier I/O outside the lock ---------------------------------------------------


def test_dram_lookup_does_not_wait_for_a_demotion_in_flight(slow_pair):
    """A put that evicts a session to LMDB used to hold the hierarchy lock for the whole LMDB
    write; a lookup of a DRAM-resident session from another thread waited that long."""
    h, dram, ssd = slow_pair
    vals = {n: value(8, seed=i) for i, n in enumerate("abcd")}
    for n in "abc":
        h.put(K(n), vals[n])
    writer = in_thread(lambda: h.put(K("d"), vals["d"]))  # evicts a: a slow LMDB write
    assert ssd.writing.wait(5) and ssd.written == [K("a")]
    got, took = timed(lambda: h.get(K("b")))
    assert got.equal(vals["b"])
    assert took < SLOW_S / 5, f"DRAM lookup waited {took:.3f}s for another session's write"
    tier, took = timed(lambda: h.tier_of(K("a")))
    assert tier == "dram" and took < SLOW_S / 5  # in transit: still served from memory
    writer.join(10)
    assert h.tier_of(K("a")) == "ssd" and h.get(K("a")).equal(vals["a"])
    h.check_capacity()
    dram.check_integrity()


def test_get_of_an_in_transit_session_is_a_memory_hit_that_stays_up(slow_pair):
    h, dram, ssd = slow_pair
    vals = {n: value(8, seed=i) for i, n in enumerate("abcd")}
    for n in "abc":
        h.put(K(n), vals[n])
    writer = in_thread(lambda: h.put(K("d"), vals["d"]))  # a is on its way to LMDB
    assert ssd.writing.wait(5)
    _, took = timed(lambda: h.delete(K("b")))  # DRAM only: no slow-tier work to wait for
    assert took < SLOW_S / 5
    got, took = timed(lambda: h.get(K("a")))  # served from memory, back into DRAM
    assert got.equal(vals["a"]) and took < SLOW_S / 5
    assert h.tier_of(K("a")) == "dram" and h.counters.tier("dram").hits == 1
    writer.join(10)
    # The finished write found itself stale: its LMDB copy is gone, the move up stands.
    assert h.tier_of(K("a")) == "dram" and not ssd.contains(K("a"))
    assert h.get(K("a")).equal(vals["a"]) and ssd.used_bytes() == 0
    assert h.in_transit() == 0
    h.check_capacity()
    dram.check_integrity()


def test_re_put_and_delete_during_a_demotion_beat_the_stale_copy(slow_pair):
    h, dram, ssd = slow_pair
    vals = {n: value(8, seed=i) for i, n in enumerate("abcde")}
    for n in "abc":
        h.put(K(n), vals[n])
    writer = in_thread(lambda: h.put(K("d"), vals["d"]))  # a -> LMDB, slowly
    assert ssd.writing.wait(5)
    h.delete(K("b"))
    newer = value(8, seed=99)  # fits the room b left: no eviction, so no slow-tier work
    _, took = timed(lambda: h.put(K("a"), newer))  # re-put while the old a is being written
    assert took < SLOW_S / 5
    assert h.get(K("a")).equal(newer)
    writer.join(10)
    assert h.get(K("a")).equal(newer) and not ssd.contains(K("a"))

    ssd.writing.clear()
    writer = in_thread(lambda: h.put(K("e"), vals["e"]))  # evicts the LRU session: c
    assert ssd.writing.wait(5) and ssd.written[-1] == K("c")
    assert h.delete(K("c"))  # returns once the stale copy is gone
    assert h.tier_of(K("c")) is None and not ssd.contains(K("c"))
    writer.join(10)
    assert h.get(K("c")) is None and not ssd.contains(K("c"))
    assert h.in_transit() == 0 and ssd.used_bytes() == 0
    h.check_capacity()
    dram.check_integrity()


def test_a_copy_written_after_its_session_was_deleted_is_never_read(tmp_path):
    """The demotion's LMDB write lands after the session was deleted, and the writer has not
    yet settled it: a read in that window must not find (and move up) the dead copy."""
    dram = DramTier(6 * BLOCK_BYTES, LAYOUT, BLOCK)
    ssd = SlowLmdbTier(tmp_path / "kv.lmdb", 1 << 20, "fp", after_s=SLOW_S)
    h = TierHierarchy([dram, ssd])
    vals = {n: value(8, seed=i) for i, n in enumerate("abcd")}
    for n in "abc":
        h.put(K(n), vals[n])
    writer = in_thread(lambda: h.put(K("d"), vals["d"]))  # evicts a
    assert ssd.wrote.wait(5) and ssd.contains(K("a"))  # a's copy is in LMDB, unsettled
    deleter = in_thread(lambda: h.delete(K("a")))  # waits for the write in flight
    deadline = time.monotonic() + 2
    while h.tier_of(K("a")) is not None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert ssd.contains(K("a"))  # still the window: written, not yet settled
    assert h.get(K("a")) is None and h.tier_of(K("a")) is None
    writer.join(10)
    deleter.join(10)
    assert not ssd.contains(K("a")) and h.get(K("a")) is None and not dram.contains(K("a"))
    assert h.in_transit() == 0
    ssd.close()


@pytest.mark.parametrize("with_redis", [False, True], ids=["dram+lmdb", "dram+lmdb+redis"])
def test_threaded_random_ops_never_serve_a_stale_value(tmp_path, request, with_redis):
    """Four threads put / delete their own sessions and get / prefetch / locate everyone's, over
    a DRAM tier that holds a few of them: every value read is the one a put wrote for that key,
    never older than the last put or delete finished before the read started; at the end every
    key holds its last value or nothing, in exactly one tier, within every capacity."""
    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # interleave the threads finely
    dram = DramTier(10 * BLOCK_BYTES, LAYOUT, BLOCK)
    ssd = SlowLmdbTier(  # slowed a little: more reads and writes overlap other threads' work
        tmp_path / "kv.lmdb",
        4 * encoded_footprint(value(12, 0)),
        "fp",
        delay_s=0.002,
        read_delay_s=0.002,
    )
    tiers = [dram, ssd]
    if with_redis:
        client = request.getfixturevalue("redis_client")
        tiers.append(RedisTier(client, 3 * encoded_footprint(value(12, 0)), "fp", ttl_s=60))
    h = TierHierarchy(tiers)
    threads, keys_per_thread, ops = 4, 4, 200
    keys = [K(f"{t}-{i}") for t in range(threads) for i in range(keys_per_thread)]
    floor = dict.fromkeys(keys, 0)  # seed of the last finished put/delete of each key
    last: dict[SessionKey, SessionKV | None] = dict.fromkeys(keys)
    errors: list[BaseException] = []

    def check(key: SessionKey, got: SessionKV | None, low: int) -> None:
        if got is None:
            return  # dropped off the last tier, deleted, or never stored
        seed = got.token_ids[0]
        assert seed // 1000 == keys.index(key), f"{key} holds another key's value"
        assert seed >= low, f"{key}: stale value {seed} after {low} finished"
        assert got.equal(value(got.num_tokens, seed)), f"{key}: torn value {seed}"

    def run(t: int) -> None:
        rng = random.Random(t)
        mine = keys[t * keys_per_thread : (t + 1) * keys_per_thread]
        seq = {k: 0 for k in mine}
        try:
            for _ in range(ops):
                op = rng.random()
                if op < 0.4:
                    key = rng.choice(mine)
                    seq[key] += 1
                    seed = keys.index(key) * 1000 + seq[key]
                    v = value(rng.randrange(1, 13), seed)
                    h.put(key, v)
                    last[key], floor[key] = v, seed
                elif op < 0.5:
                    key = rng.choice(mine)
                    seq[key] += 1
                    h.delete(key)
                    last[key], floor[key] = None, keys.index(key) * 1000 + seq[key]
                elif op < 0.85:
                    key = rng.choice(keys)
                    low = floor[key]
                    check(key, h.get(key), low)
                elif op < 0.95:
                    h.prefetch(rng.choice(keys), touch=rng.random() < 0.5)
                else:
                    h.tier_of(rng.choice(keys))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    try:
        workers = [threading.Thread(target=run, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(60)
    finally:
        sys.setswitchinterval(old_switch)
    assert not errors, errors[0]
    for key in keys:
        got = h.get(key)
        if last[key] is None:
            assert got is None, f"{key} was deleted but reads {got.token_ids[0]}"
        elif got is not None:
            assert got.equal(last[key]), f"{key}: {got.token_ids[0]} is not its last value"
        assert sum(t.contains(key) for t in h.tiers) == (got is not None)
    h.check_capacity()
    dram.check_integrity()
    assert h.in_transit() == 0
    assert h.counters.tier("dram").evictions > 0
    ssd.close()


# -- task: demotion order ------------------------------------------------------------------


class RecordingRedisTier(RedisTier):
    """Notes, at each write, whether the tier above still holds the key; fails `fail` writes."""

    def __init__(self, *args, upper: LmdbTier, fail: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.upper = upper
        self.fail = fail
        self.seen: list[tuple[SessionKey, bool]] = []

    def put(self, key: SessionKey, value: SessionKV) -> None:
        self.seen.append((key, self.upper.contains(key)))
        if self.fail:
            self.fail -= 1
            raise redis_lib.ConnectionError("connection reset (test)")
        super().put(key, value)


def lmdb_over_redis(tmp_path, client, fail: int = 0):
    one = encoded_footprint(value(8, 0))
    dram = DramTier(4 * BLOCK_BYTES, LAYOUT, BLOCK)  # two 8-token sessions
    ssd = LmdbTier(tmp_path / "kv.lmdb", 2 * one, "fp")
    remote = RecordingRedisTier(client, 4 * one, "fp", ttl_s=60, upper=ssd, fail=fail)
    return TierHierarchy([dram, ssd, remote]), ssd, remote


def test_lmdb_to_redis_writes_redis_before_deleting_from_lmdb(tmp_path, redis_client):
    h, ssd, remote = lmdb_over_redis(tmp_path, redis_client)
    vals = {n: value(8, seed=i) for i, n in enumerate("abcde")}
    for n in "abcde":
        h.put(K(n), vals[n])
    # a went DRAM -> LMDB -> Redis: when Redis was written, LMDB still held it.
    assert remote.seen == [(K("a"), True)]
    assert h.tier_of(K("a")) == "remote" and not ssd.contains(K("a"))
    for n in "abcde":
        assert h.get(K(n)).equal(vals[n])
    h.check_capacity()
    ssd.close()


def test_failed_redis_write_leaves_the_session_in_lmdb(tmp_path, redis_client):
    """The demotion used to delete from LMDB first: a Redis write that raised lost it."""
    h, ssd, remote = lmdb_over_redis(tmp_path, redis_client, fail=1)
    vals = {n: value(8, seed=i) for i, n in enumerate("abcde")}
    for n in "abcde":
        h.put(K(n), vals[n])  # the put of e makes LMDB demote a: its Redis write fails
    assert remote.seen[0] == (K("a"), True)
    assert h.tier_of(K("a")) == "ssd" and ssd.contains(K("a"))
    assert h.counters.tier("remote").errors == 1
    assert h.tier_of(K("c")) == "remote"  # no room made in LMDB: c went one tier further
    for n in "abcde":
        assert h.get(K(n)).equal(vals[n]), f"{n} lost"
    h.check_capacity()
    ssd.close()


# -- task: lookups do not wait for queued commits ------------------------------------------


def test_write_buffer_peek_builds_once_and_the_writer_commits_that_value():
    committed: list[tuple[str, object]] = []
    gate = threading.Event()
    buffer = WriteBuffer(lambda key, v: committed.append((key, v)))
    buffer.submit("first", lambda: gate.wait(10), 1)  # holds the writer
    builds: list[int] = []

    def build() -> object:
        builds.append(1)
        time.sleep(0.05)
        return object()

    buffer.submit("k", build, 1)
    assert buffer.peek("nothing") is None
    seen: list[object] = []
    readers = [in_thread(lambda: seen.append(buffer.peek("k"))) for _ in range(3)]
    for r in readers:
        r.join(5)
    assert len(seen) == 3 and seen[0] is seen[1] is seen[2] is not None
    gate.set()
    assert buffer.flush(5)
    assert committed[-1] == ("k", seen[0]) and builds == [1]
    assert buffer.peek("k") is None  # committed: nothing pending

    def broken() -> object:
        raise ValueError("no such rows")

    buffer.submit("bad", broken, 1)
    assert buffer.peek("bad") is None
    assert buffer.flush(5) and buffer.failures == 1
    buffer.close()


class SlowCommitStore(AttentionStore):
    """Commits (the writer thread's tier writes) take `commit_delay_s` longer."""

    commit_delay_s = 0.0

    def _commit(self, key, value):
        time.sleep(self.commit_delay_s)
        return super()._commit(key, value)


def slow_store(tmp_path, **kw) -> SlowCommitStore:
    kw.setdefault("dram_bytes", 0)  # LMDB only: every commit is a disk write
    settings = StoreSettings(data_dir=tmp_path, ssd_bytes=1 << 24, async_save=True, **kw)
    return SlowCommitStore(settings, SPEC, "fp")


def test_lookup_returns_the_queued_turn_without_waiting_for_commits(tmp_path):
    store = slow_store(tmp_path)
    old, new, other = store_value(16, 1), store_value(24, 2), store_value(20, 3)
    store.save("t", "s", old)
    store.commit_delay_s = 0.5
    store.save_later("t", "x", lambda: other, other.nbytes)  # queued ahead: 0.5 s
    store.save_later("t", "s", lambda: new, new.nbytes)  # then this one: another 0.5 s
    top = store.hierarchy.tiers[0].name
    hits = store.hierarchy.counters.tier(top).hits
    got, took = timed(lambda: store.lookup("t", "s"))
    assert got.equal(new) and took < 0.25, f"lookup waited {took:.3f}s"
    assert store.writer.is_pending(SessionKey("t", "s"))
    assert store.hierarchy.counters.tier(top).hits == hits + 1  # counted where it will land
    assert store.flush_writes(10)
    committed = store.lookup("t", "s")
    assert committed.equal(got) and store.saved_tokens("t", "s") == new.token_ids
    store.commit_delay_s = 0.0
    store.close()


def test_lookup_during_queued_turns_is_never_older_or_torn(tmp_path):
    store = slow_store(tmp_path)
    turns = [store_value(16 + i, seed=i) for i in range(12)]
    store.save("t", "s", turns[0])
    store.commit_delay_s = 0.02
    submitted = [0]  # index of the newest turn handed to save_later
    done = threading.Event()

    def submit() -> None:
        for i in range(1, len(turns)):
            v = turns[i]
            store.save_later("t", "s", lambda v=v: v, v.nbytes)
            submitted[0] = i
            time.sleep(0.01)
        done.set()

    thread = in_thread(submit)
    reads = 0
    while not done.is_set() or store.writer.is_pending(SessionKey("t", "s")):
        low = submitted[0]
        got = store.lookup("t", "s")
        index = next(i for i, v in enumerate(turns) if v.token_ids == got.token_ids)
        assert got.equal(turns[index]), "torn turn"
        assert index >= low, f"turn {index} read after turn {low} was submitted"
        reads += 1
    thread.join(10)
    assert reads > 5 and store.lookup("t", "s").equal(turns[-1])
    store.commit_delay_s = 0.0
    store.close()


# -- task: session versions ----------------------------------------------------------------


def test_version_changes_with_the_saved_kv_and_not_with_its_tier(tmp_path):
    store = AttentionStore(
        StoreSettings(
            data_dir=tmp_path,
            dram_bytes=2 * 16 * TOKEN_BYTES,
            ssd_bytes=1 << 20,
            max_context_tokens=40,
        ),
        SPEC,
        "fp",
    )
    seen: list[int] = []

    def changed(sid: str = "a") -> bool:
        v = store.version("t", sid)
        fresh = v not in seen
        seen.append(v)
        return fresh

    assert changed()  # never saved: some number
    store.save("t", "a", store_value(16, 1))
    assert changed()
    store.save("t", "b", store_value(16, 2))
    store.save("t", "c", store_value(16, 3))  # a moves DRAM -> LMDB
    assert store.tier_of("t", "a") == "ssd" and not changed()
    assert store.lookup("t", "a").equal(store_value(16, 1))  # LMDB -> DRAM
    store.hierarchy.demote_all(0)
    assert not changed()
    history = store_value(30, 4)
    store.save("t", "a", history)
    assert changed()
    prompt = history.token_ids + list(range(500, 515))  # over max_context_tokens: truncated
    store.fit_context("t", "a", prompt, head=4, tail=15)
    assert changed()
    assert store.delete_session("t", "a")
    assert changed()
    before_b = store.version("t", "b")
    store.invalidate_all()
    assert changed() and store.version("t", "b") != before_b
    assert store.version("t", "never") != 0 and not changed()
    store.close()


def test_version_changes_at_submit_and_on_purge(tmp_path):
    store = slow_store(tmp_path, session_ttl_s=50)
    gate = threading.Event()
    v1 = store_value(16, 1)
    before = store.version("t", "s")
    store.save_later("t", "s", lambda: (gate.wait(10), v1)[1], v1.nbytes)
    after = store.version("t", "s")
    assert after != before  # at submit, before the write lands
    gate.set()
    assert store.flush_writes(10) and store.version("t", "s") == after
    store.save("t", "keep", store_value(8, 2))
    keep = store.version("t", "keep")
    record = store.records.get(store.key("t", "s"))
    record.updated_at -= 100
    store.records.put(record)
    assert store.purge_expired() == [store.key("t", "s")]
    assert store.version("t", "s") not in (before, after)
    assert store.version("t", "keep") == keep
    store.close()


def test_version_is_thread_safe_and_only_grows(tmp_path):
    store = slow_store(tmp_path)
    seen: list[list[int]] = [[] for _ in range(3)]

    def bump(i: int) -> None:
        for n in range(40):
            store.save("t", f"s{i}", store_value(4, n))
            seen[i].append(store.version("t", f"s{i}"))

    workers = [in_thread(lambda i=i: bump(i)) for i in range(3)]
    for w in workers:
        w.join(30)
    for versions in seen:
        assert versions == sorted(set(versions)) and len(versions) == 40
    store.close()
