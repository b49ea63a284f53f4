"""The KV tier's storage fills up mid-run (issue 21, item 7): an LMDB map smaller than the tier's
capacity, or the disk under it (a small tmpfs, where this process may mount one).

A write-back or write-through copy the storage refuses leaves the chunk in DRAM, served from
there byte for byte; the refusal is counted per tier and reason; the copy is tried again later,
with a backoff, and lands once there is room (the tier, now counting as full, evicts by its
placement; or the disk has room again). A chunk evicted from DRAM that no tier takes is a miss
later (the next turn recomputes it), never an error.

KV values are kv_of's (tests/support/chunk_store.py): a pure function of token id and position,
so the exact bytes every read must return are known."""

from __future__ import annotations

import contextlib
import functools
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import chatstore.store.store_parts as store_parts
import chatstore.store.tiers.lmdb as lmdb_tier
from chatstore.server.launcher import local_server
from chatstore.store.attention_store import AttentionStore
from chatstore.store.commit.persister import Persister
from chatstore.store.session_kv import ChunkKey
from chatstore.store.tiers.lmdb import LmdbTier
from tests.support.chunk_store import CHUNK, kv_of, make, turn
from tests.support.store import TOKEN_BYTES, lookup, push_down

SMALL_MAP = 64 << 10  # LMDB's own pages and three chunks of CHUNK tokens


@pytest.fixture
def kv_map(monkeypatch):
    """kv_map(n): stores made from now on open their KV tier's LMDB with an n-byte map."""

    def small(nbytes: int) -> None:
        small_tier = functools.partial(LmdbTier, map_bytes=nbytes)
        monkeypatch.setattr(store_parts, "LmdbTier", small_tier)

    return small


def grow(store: AttentionStore, sid: str, turns: int, first: int = 1) -> list[int]:
    """`turns` turns of session sid, each one chunk longer; the last history's ids."""
    ids: list[int] = []
    for t in range(turns):
        ids += list(range(first + 50 * t, first + 50 * t + CHUNK))
        turn(store, "t", sid, ids)
        assert store.flush_persist(10)
    return ids


def ssd_failures(store: AttentionStore) -> dict[str, int]:
    return store.stats().counters.tier("ssd").write_failures


def exact(store: AttentionStore, sid: str, ids: list[int]) -> None:
    got = lookup(store, "t", sid)
    assert got is not None and got.token_ids == ids
    assert torch.equal(got.kv, kv_of(ids)), f"{sid}: other bytes than its history's"


def wait_for(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("persist", ["write_back", "write_through"])
def test_a_full_kv_map_keeps_the_chunk_in_dram_counts_it_and_retries(tmp_path, kv_map, persist):
    kv_map(SMALL_MAP)
    dram = 64 * CHUNK * TOKEN_BYTES  # DRAM holds every chunk: only the map is short
    store = make(tmp_path, persist=persist, persist_lag_s=0.0, dram_bytes=dram)
    assert store.persister is not None
    store.persister.retry_s = 0.05
    ssd = store.tier("ssd")
    ids: list[int] = []
    for t in range(12):  # the map takes three chunks: the fourth is refused
        ids += list(range(1 + 50 * t, 1 + 50 * t + CHUNK))
        turn(store, "t", "s", ids)  # never raises
        assert store.flush_persist(10)
        exact(store, "s", ids)
    assert ssd_failures(store).get("map_full", 0) >= 1
    assert store.persister.refused >= 1, "no refused copy was handed over for a retry"
    counters = store.stats().counters
    assert counters.dropped == 0, "a chunk still in DRAM was counted as dropped"
    chain = store.index.get(store.key("t", "s"))
    assert all(store.tier("dram").contains(c) for c in chain.chunks)  # nothing left DRAM
    # The tier now counts as full at what its map holds: room is made by eviction (copies of
    # chunks DRAM still has), and the refused copies land on a retry.
    assert ssd.capacity < 1 << 22 and ssd.used_bytes() <= ssd.capacity
    assert counters.tier("ssd").evictions > 0
    wait_for(lambda: store.persister.retrying() == 0)
    assert ssd.contains(chain.chunks[-1])
    # What LMDB holds reads back exactly: the session with its chunks out of DRAM.
    for chunk in chain.chunks:
        with store.tiers.lock:
            if ssd.contains(chunk):
                store.tier("dram").delete(chunk)
    got = lookup(store, "t", "s")
    assert got is not None and got.token_ids == ids[: len(got.token_ids)]
    assert torch.equal(got.kv, kv_of(got.token_ids))
    store.close()


def test_when_dram_is_full_too_the_chunk_is_a_miss_later_not_an_error(tmp_path, kv_map):
    kv_map(SMALL_MAP)
    store = make(tmp_path, persist="write_back", persist_lag_s=0.0)  # DRAM: 6 chunks
    a = grow(store, "a", 6)
    b = grow(store, "b", 6, first=1000)  # pushes a's chunks out of DRAM: few fit on SSD
    assert store.tiers.drain_background(10)
    counters = store.stats().counters
    assert ssd_failures(store).get("map_full", 0) >= 1
    assert counters.dropped > 0  # kept nowhere
    for sid, ids in (("a", a), ("b", b)):  # what is found is exact; the rest is a miss
        got = lookup(store, "t", sid)
        if got is not None:
            assert got.token_ids == ids[: len(got.token_ids)]
            assert torch.equal(got.kv, kv_of(got.token_ids))
    found = store.find("t", "a")
    assert found is None or len(found.token_ids) < len(a)  # a's history is not all kept
    # Once DRAM has room again, the next turn recomputes what was dropped and stores it.
    assert store.delete_session("t", "b")
    turn(store, "t", "a", a)
    assert store.flush_persist(10)
    exact(store, "a", a)
    store.close()


def test_refused_copies_back_off_and_land_once_there_is_room():
    full = threading.Event()
    full.set()
    calls: list[ChunkKey] = []

    def persist(key: ChunkKey) -> bool:
        calls.append(key)
        return not full.is_set()

    persister = Persister(persist, lag_s=0.0, retry_s=0.02, max_retry_s=0.16)
    keys = [ChunkKey("t", f"{i:064x}") for i in range(5)]
    for key in keys:
        persister.add(key)
    wait_for(lambda: persister.retrying() == 5)
    time.sleep(0.6)
    # A hot loop would have tried thousands of times; the backoff tries one chunk per retry
    # (0.02, 0.04, 0.08, then every 0.16 s) and keeps the others waiting with it.
    assert 2 <= len(calls) <= 10, f"{len(calls)} tries in 0.6 s"
    assert persister.retrying() == 5 and persister.persisted == 0
    late = ChunkKey("t", "f" * 64)
    persister.add(late)  # due while the tier refuses: it waits with the others, untried
    wait_for(lambda: persister.retrying() == 6)
    time.sleep(0.2)  # a retry or two: each tries the first chunk waiting only
    assert late not in calls
    full.clear()  # room is made
    wait_for(lambda: persister.persisted == 6)
    assert persister.retrying() == 0 and persister.pending() == 0
    persister.close()


@contextlib.contextmanager
def small_disk(where: Path, nbytes: int) -> Iterator[Path]:
    """A tmpfs of nbytes mounted at where (skip where this process may not mount one)."""
    where.mkdir()
    cmd = ["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(where)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(disk: Path) -> Path:
    """A file taking every free byte of disk."""
    filler = disk / "filler"
    with filler.open("wb", buffering=0) as fh, contextlib.suppress(OSError):
        while fh.write(b"\0" * 4096):
            pass
    return filler


def test_a_full_disk_under_the_kv_tier_keeps_chunks_in_dram_until_it_has_room(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(lmdb_tier, "DISK_RECHECK_S", 0.0)
    with small_disk(tmp_path / "disk", 1 << 20) as disk:
        data = tmp_path / "data"
        data.mkdir()
        (data / "kv.lmdb").symlink_to(disk)  # only the KV tier on the small disk
        store = make(data, persist="write_back", persist_lag_s=0.0)
        try:
            filler = fill(disk)
            ids = list(range(1, 2 * CHUNK + 3))
            turn(store, "t", "s", ids)
            assert store.flush_persist(10)
            assert ssd_failures(store).get("disk_full", 0) >= 1
            assert store.persister.retrying() > 0
            assert store.stats().counters.dropped == 0
            exact(store, "s", ids)  # from DRAM
            filler.unlink()  # room again: the next try lands every chunk
            assert store.flush_persist(10)
            assert store.persister.retrying() == 0
            push_down(store, "t", "s")  # out of DRAM: read from the disk
            exact(store, "s", ids)
            store.close()
            fill(disk)  # a restart on the full disk opens and reads what it holds
            store = make(data, persist="write_back", persist_lag_s=0.0)
            exact(store, "s", ids)
        finally:
            store.close()


def metric(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


@pytest.mark.model
@pytest.mark.timeout(300)
def test_turns_succeed_on_a_full_kv_map_and_the_api_counts_the_refusals(
    default_model, tmp_path, kv_map
):
    """A real server whose KV tier's map holds two chunks of the default model (16 tokens,
    ~0.7 MB each in fp32): every turn succeeds and reuses its history, which stays in DRAM;
    /admin/cache and /metrics count the refused copies."""
    kv_map(2 << 20)
    srv = local_server(
        tmp_path,
        default_model,
        kv_cache_bytes=32 << 20,
        dram_bytes=128 << 20,
        ssd_bytes=256 << 20,
        chunk_tokens=16,
        persist_lag_s=0.0,
        max_context_tokens=512,
    )
    with srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        store = srv.app.state.service.store.kv
        sid = client.post("/v1/sessions", json={"system_prompt": "Be brief."}).json()["id"]
        cached = []
        for i in range(4):
            body = {"content": f"Say {i}, then a short sentence.", "max_tokens": 8}
            reply = client.post(f"/v1/sessions/{sid}/messages", json={**body, "temperature": 0})
            assert reply.status_code == 200, reply.text
            cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert store.flush_persist(30)

        def ssd_line() -> dict:
            tiers = client.get("/admin/cache").json()["tiers"]
            return next(t for t in tiers if t["name"] == "ssd")

        wait_for(lambda: ssd_line()["write_failures"] > 0, 30)
        ssd = ssd_line()
        assert ssd["write_failures_by_reason"].get("map_full", 0) >= 1
        assert ssd["write_failures"] == sum(ssd["write_failures_by_reason"].values())
        text = client.get("/metrics").text
        name = "chatstore_store_write_failures_total"
        counted = metric(text, name, tier="ssd", reason="map_full")
        assert counted is not None and counted >= 1
        assert all(n > 0 for n in cached[1:]), f"history not reused: {cached}"
        row = client.get("/admin/cache/sessions").json()["data"][0]
        assert row["id"] == sid and row["kv_tokens_by_tier"].get("dram", 0) > 0
        assert store.stats().counters.dropped == 0  # nothing left DRAM unkept
