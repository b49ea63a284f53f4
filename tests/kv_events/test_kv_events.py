"""KV events in vLLM's wire format: bytes equal to vLLM's msgspec encoding, read back by an
independent decoder (vLLM's structs copied here, and plain msgpack for tags and field order), a
real ZMQ subscriber that rebuilds the replica's cached device blocks and stored chunks exactly
from what it receives, store chunks published as device-sized blocks on the engine's hash chain,
llm-d's topic, and the replay protocol (buffered batches from a sequence number, then -1)."""

from __future__ import annotations

import socket
import time
from typing import Any

import msgpack
import msgspec
import pytest
import zmq

from chatstore.engine.block_manager import hash_block
from chatstore.engine.engine_config import EngineConfig
from chatstore.engine.llm_engine import LLMEngine
from chatstore.engine.request import Request
from chatstore.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineSource,
    KVEventPublisher,
    StoreSource,
    external_hash,
)
from chatstore.kv_events.topic import default_topic, pod_name, resolve_topic
from chatstore.kv_events.wire import encode_batch
from tests.support.chunk_store import CHUNK, make, turn
from tests.support.engine import greedy, prompt, run_all, tiny_runtime

# -- vLLM's structs, as vllm/distributed/kv_events.py (v0.26 / main, after #42892) declares them --


class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(VKVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def test_bytes_equal_vllm_msgspec_encoding() -> None:
    big = (1 << 64) - 3  # above int64: vLLM's hashes are unsigned
    ours = [
        BlockStored([big, 7], None, [1, 300, 70000, 0], 2, None, "GPU", None),
        BlockStored([5], big, [-1, 2], 2, None, "CPU", None),
        BlockRemoved([big], "DISK"),
        AllBlocksCleared(),
    ]
    theirs = [
        VBlockStored([big, 7], None, [1, 300, 70000, 0], 2, None, "GPU", None),
        VBlockStored([5], big, [-1, 2], 2, None, "CPU", None),
        VBlockRemoved([big], "DISK"),
        VAllBlocksCleared(),
    ]
    ts = 1757500000.25
    expected = msgspec.msgpack.encode(VKVEventBatch(ts, theirs, data_parallel_rank=0))
    assert encode_batch(ts, ours, 0) == expected
    assert DECODER.decode(encode_batch(ts, ours)).events == theirs


def test_plain_msgpack_reads_vllms_tags_and_field_order() -> None:
    """A decoder with no struct definitions at all: the batch is a positional array and each
    event a map keyed by vLLM's field names in vLLM's order, the tag first under "type";
    fields without a default are written even when None, defaulted ones are left out."""
    events = [
        BlockStored([9], 3, [1, 2], 2, None, "CPU", None),
        BlockRemoved([9], "CPU"),
        AllBlocksCleared(),
    ]
    batch = msgpack.unpackb(encode_batch(1.5, events, 0))
    assert isinstance(batch, list) and len(batch) == 3 and batch[0] == 1.5 and batch[2] == 0
    stored, removed, cleared = batch[1]
    assert list(stored.items()) == [
        ("type", "BlockStored"),
        ("block_hashes", [9]),
        ("parent_block_hash", 3),
        ("token_ids", [1, 2]),
        ("block_size", 2),
        ("lora_id", None),
        ("medium", "CPU"),
        ("lora_name", None),
    ]
    assert list(removed.items()) == [
        ("type", "BlockRemoved"),
        ("block_hashes", [9]),
        ("medium", "CPU"),
    ]
    assert cleared == {"type": "AllBlocksCleared"}


def test_external_hash_is_vllms_low_64_bits_big_endian() -> None:
    digest = bytes(range(16))
    assert external_hash(digest) == int.from_bytes(digest[8:], "big")
    assert external_hash(b"\xff" * 32) == (1 << 64) - 1


# -- a subscriber --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Subscriber:
    """SUB on the live stream and a DEALER for replays, as a router would use them."""

    def __init__(self, port: int, replay_port: int, topic: str = "kv") -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.replay_url = f"tcp://127.0.0.1:{replay_port}"
        self.live: list[tuple[int, bytes]] = []
        self.topic = topic.encode()

    def receive(self, quiet_s: float = 0.3) -> None:
        while self.sub.poll(int(quiet_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic
            self.live.append((int.from_bytes(seq, "big"), payload))

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_url)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        try:
            while True:
                assert dealer.poll(5000), "no replay answer"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                if seq == END_SEQ:
                    assert payload == b""
                    return out
                out.append((int.from_bytes(seq, "big"), payload))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)


def rebuild(batches: list[tuple[int, bytes]]) -> dict[str, set[int]]:
    """Each medium's cached block hashes after applying the batches in order."""
    seqs = [s for s, _ in batches]
    assert seqs == sorted(set(seqs)), "sequence numbers strictly increase"
    media: dict[str, set[int]] = {}
    for _, payload in batches:
        batch = DECODER.decode(payload)
        assert batch.data_parallel_rank == 0
        for e in batch.events:
            if isinstance(e, VAllBlocksCleared):
                media.clear()
            elif isinstance(e, VBlockStored):
                assert len(e.token_ids) == e.block_size * len(e.block_hashes)
                media.setdefault(e.medium, set()).update(e.block_hashes)
            else:
                held = media.get(e.medium, set())
                assert set(e.block_hashes) <= held, "removed only what was stored"
                held.difference_update(e.block_hashes)
    return {m: s for m, s in media.items() if s}


def check_stream(sub: Subscriber, publisher: KVEventPublisher) -> list[tuple[int, bytes]]:
    """Everything published, by replay from 0; the live stream is a gap-free tail of it."""
    sub.receive(0.3)  # until the stream has been quiet that long
    everything = sub.replay(0)
    assert [s for s, _ in everything] == list(range(publisher.next_seq))
    if sub.live:
        first = sub.live[0][0]
        assert sub.live == everything[first:]
    return everything


@pytest.fixture
def channel():
    port, replay_port = free_port(), free_port()
    publisher = KVEventPublisher(
        f"tcp://*:{port}", f"tcp://*:{replay_port}", topic="kv", interval_s=0.005
    )
    sub = Subscriber(port, replay_port)
    time.sleep(0.2)  # the subscription reaches the publisher (ZMQ's slow joiner)
    yield publisher, sub
    sub.close()
    publisher.close()


def test_replay_from_a_sequence_number_then_the_end_marker(channel) -> None:
    publisher, sub = channel
    for i in range(5):
        publisher.put(BlockStored([i], None, [i, i], 2, None, "GPU", None))
        time.sleep(0.03)  # one batch each
    everything = check_stream(sub, publisher)
    assert len(everything) == 5
    assert sub.replay(3) == everything[3:]
    assert sub.replay(99) == []
    assert sub.live == everything  # nothing lost after the subscription


# -- the device prefix cache ---------------------------------------------------------------


def test_subscriber_rebuilds_the_device_prefix_cache(channel) -> None:
    publisher, sub = channel
    engine = LLMEngine(tiny_runtime(num_blocks=24, block_size=4), EngineConfig())
    EngineSource(publisher, engine.blocks.block_size).attach(engine.blocks)
    shared = prompt(1, 12)
    for i in range(8):  # a shared prefix, then enough distinct prompts to evict cached blocks
        engine.add_request(Request(f"r{i}", shared + prompt(10 + i, 10), greedy(6)))
        run_all(engine)
    assert engine.blocks.evictions > 0
    media = rebuild(check_stream(sub, publisher))
    cached = {external_hash(h) for h in engine.blocks._block_of}
    assert media == {"GPU": cached}
    assert len(cached) == engine.stats().cached_blocks


def test_stored_blocks_carry_their_parent_and_tokens(channel) -> None:
    publisher, sub = channel
    engine = LLMEngine(tiny_runtime(num_blocks=64, block_size=4), EngineConfig())
    EngineSource(publisher, 4).attach(engine.blocks)
    tokens = prompt(3, 13)
    engine.add_request(Request("a", tokens, greedy(1)))
    run_all(engine)
    stored = [
        e for _, p in check_stream(sub, publisher) for e in DECODER.decode(p).events
    ]  # fmt: skip
    assert [e.token_ids for e in stored] == [tokens[0:4], tokens[4:8], tokens[8:12]]
    assert stored[0].parent_block_hash is None
    assert [e.parent_block_hash for e in stored[1:]] == [e.block_hashes[0] for e in stored[:-1]]


# -- store chunks --------------------------------------------------------------------------


def engine_chain(tenant: str, tokens: list[int], block_size: int) -> list[int]:
    """What the engine's prefix cache names the full blocks of `tokens` (routers' hashes)."""
    digests: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = digests[-1] if digests else None
        digests.append(hash_block(parent, tenant, tokens[start : start + block_size]))
    return [external_hash(d) for d in digests]


def full_chunks(store, tier_name: str, block_size: int = 4) -> set[int]:
    """The device-sized blocks of the full chunks a tier holds, on the engine's hash chain."""
    tier = next(t for t in store.tiers.tiers if t.name == tier_name)
    out, size, per_chunk = (
        set(),
        store.settings.chunk_tokens,
        store.settings.chunk_tokens // block_size,
    )
    for key in list(tier.keys()):
        pos = store.index.position_of(key)
        owner = next(iter(store.index.owners_of(key)))
        tokens = store.index.get(owner).token_ids
        if (pos + 1) * size <= len(tokens):
            chain = engine_chain(key.tenant, tokens[: (pos + 1) * size], block_size)
            out.update(chain[pos * per_chunk :])
    return out


def stored_events(batches: list[tuple[int, bytes]]) -> list[Any]:
    return [e for _, p in batches for e in DECODER.decode(p).events if isinstance(e, VBlockStored)]


def test_subscriber_rebuilds_the_store_tiers(channel, tmp_path) -> None:
    publisher, sub = channel
    store = make(tmp_path, async_save=False)
    try:
        source = StoreSource(publisher, store, 4)
        source.attach()
        history: dict[str, list[int]] = {}
        for step in range(14):  # more than DRAM holds: chunks go down to SSD
            sid = f"s{step % 5}"
            history[sid] = history.get(sid, []) + prompt(step, 11)
            turn(store, "t", sid, history[sid])
        turn(store, "t", "s0", history["s0"])  # a read back up (promotion) is no new event
        store.delete_session("t", "s1")
        store.flush_writes(10)
        store.tiers.drain_background(10)
        batches = check_stream(sub, publisher)
        events = [e for _, p in batches for e in DECODER.decode(p).events]
        kinds = {(type(e).__name__, getattr(e, "medium", None)) for e in events}
        assert {
            ("VBlockStored", "CPU"),
            ("VBlockStored", "DISK"),
            ("VBlockRemoved", "CPU"),
        } <= kinds
        media = rebuild(batches)
        expected = {"CPU": full_chunks(store, "dram"), "DISK": full_chunks(store, "ssd")}
        assert expected["DISK"], "the walk must push chunks down to SSD"
        assert media == {m: s for m, s in expected.items() if s}
    finally:
        store.close()


def test_a_restarted_store_announces_what_its_tiers_hold(channel, tmp_path) -> None:
    publisher, sub = channel
    first = make(tmp_path, async_save=False, dram_bytes=0)
    turn(first, "t", "a", prompt(1, 3 * CHUNK))
    first.close()
    store = make(tmp_path, async_save=False, dram_bytes=0)
    try:
        StoreSource(publisher, store, 4).attach()
        media = rebuild(check_stream(sub, publisher))
        assert media == {"DISK": full_chunks(store, "ssd")}
        assert len(media["DISK"]) == 3 * CHUNK // 4  # 3 chunks of CHUNK // 4 device blocks
    finally:
        store.close()


def test_store_chunks_go_out_as_device_blocks_on_one_parent_chain(channel, tmp_path) -> None:
    """Every store event is a device-sized block (routers drop other sizes) whose parent is
    the block before it: a session's chunks read, block by block, as the engine's chain."""
    publisher, sub = channel
    store = make(tmp_path, async_save=False)
    try:
        StoreSource(publisher, store, 4).attach()
        tokens = prompt(5, 3 * CHUNK + 3)  # three full chunks and a partial tail
        turn(store, "t", "a", tokens)
        store.flush_writes(10)
        stored = stored_events(check_stream(sub, publisher))
        assert {(e.block_size, len(e.block_hashes), len(e.token_ids)) for e in stored} == {
            (4, 1, 4)
        }
        assert [e.token_ids for e in stored] == [tokens[i : i + 4] for i in range(0, 3 * CHUNK, 4)]
        assert stored[0].parent_block_hash is None
        assert [e.parent_block_hash for e in stored[1:]] == [e.block_hashes[0] for e in stored[:-1]]
        assert [e.block_hashes[0] for e in stored] == engine_chain("t", tokens, 4)[: 3 * CHUNK // 4]
    finally:
        store.close()


def test_device_and_store_publish_the_same_hashes_for_the_same_tokens(channel, tmp_path) -> None:
    """The engine's prefix cache and the store's DRAM tier, fed the same tenant's tokens,
    name each block alike: a router follows one chain across media. Another tenant's same
    tokens get other hashes (the tenant salts the chain)."""
    publisher, sub = channel
    engine = LLMEngine(tiny_runtime(num_blocks=64, block_size=4), EngineConfig())
    EngineSource(publisher, 4).attach(engine.blocks)
    store = make(tmp_path, async_save=False)
    try:
        StoreSource(publisher, store, 4).attach()
        tokens = prompt(7, 2 * CHUNK + 1)
        engine.add_request(Request("a", tokens, greedy(1), tenant="t"))
        run_all(engine)
        turn(store, "t", "s", tokens)
        turn(store, "u", "s", tokens)
        store.flush_writes(10)
        by_medium: dict[str, list[int]] = {}
        for e in stored_events(check_stream(sub, publisher)):
            by_medium.setdefault(e.medium, []).extend(e.block_hashes)
        tenant_t = engine_chain("t", tokens, 4)[: 2 * CHUNK // 4]
        assert by_medium["GPU"] == tenant_t
        assert by_medium["CPU"][: len(tenant_t)] == tenant_t
        assert set(by_medium["CPU"][len(tenant_t) :]).isdisjoint(tenant_t)
        assert len(by_medium["CPU"]) == 2 * len(tenant_t)
    finally:
        store.close()


def test_the_topic_is_llm_ds_kv_at_pod_at_model(tmp_path) -> None:
    assert pod_name("pod-a", 8000, env={"POD_IP": "10.0.0.5"}) == "pod-a"  # the config wins
    assert pod_name("", 8000, env={"POD_IP": "10.0.0.5", "POD_NAME": "p"}) == "10.0.0.5:8000"
    assert pod_name("", 8000, env={"POD_NAME": "p"}) == "p"
    assert pod_name("", 8000, env={}) == socket.gethostname()
    assert resolve_topic("", "10.0.0.5:8000", "m") == default_topic("10.0.0.5:8000", "m")
    assert resolve_topic("mine", "p", "m") == "mine"
    port = free_port()
    topic = resolve_topic("", pod_name("", 8000, env={"POD_IP": "10.0.0.5"}), "qwen")
    publisher = KVEventPublisher(f"tcp://*:{port}", topic=topic, interval_s=0.005)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")  # llm-d's subscriber filters on the prefix
    sub.connect(f"tcp://127.0.0.1:{port}")
    try:
        time.sleep(0.2)  # the subscription reaches the publisher
        publisher.put(AllBlocksCleared())
        assert sub.poll(5000)
        frame, seq, payload = sub.recv_multipart()
        assert frame == b"kv@10.0.0.5:8000@qwen"
        prefix, pod, model = frame.decode().split("@", 2)  # llm-d: kv@ then pod@model
        assert (prefix, pod, model) == ("kv", "10.0.0.5:8000", "qwen")
        assert seq == (0).to_bytes(8, "big")
        assert DECODER.decode(payload).events == [VAllBlocksCleared()]
    finally:
        sub.close(linger=0)
        publisher.close()


# -- the real app --------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.timeout(300)
def test_the_server_publishes_its_device_cache_and_store(default_model, tmp_path) -> None:
    import httpx

    from chatstore.model.default_model import DEFAULT_MODEL_NAME
    from chatstore.server.launcher import local_server

    port, replay_port = free_port(), free_port()
    srv = local_server(
        tmp_path,
        default_model,
        kv_cache_bytes=16 << 20,
        chunk_tokens=32,
        kv_events_endpoint=f"tcp://*:{port}",
        kv_events_replay_endpoint=f"tcp://*:{replay_port}",
        kv_events_pod="pod-a",  # the topic is left to its default, llm-d's kv@<pod>@<model>
    )
    sub = Subscriber(port, replay_port, topic=f"kv@pod-a@{DEFAULT_MODEL_NAME}")
    greedy_body = {"temperature": 0, "max_tokens": 4}
    try:
        with srv, httpx.Client(base_url=srv.url, timeout=120) as client:
            for i in range(2):
                sid = client.post("/v1/sessions", json={}).json()["id"]
                for text in ("Tell me about the sea, please. " * 8, "And rivers?"):
                    body = {"content": f"{i} {text}", **greedy_body}
                    r = client.post(f"/v1/sessions/{sid}/messages", json=body)
                    assert r.status_code == 200, r.text
            assert client.get("/v1/models").json()["data"][0]["id"] == DEFAULT_MODEL_NAME
            store = srv.app.state.service.store.kv
            store.flush_writes(10)
            blocks = srv.app.state.service.engine.engine.blocks
            publisher_seq = _wait_quiet(sub)
            media = rebuild(sub.replay(0))
            cached = {external_hash(h) for h in blocks._block_of}
            assert cached and media["GPU"] == cached
            bs = blocks.block_size
            assert media["CPU"] == full_chunks(store, "dram", bs) != set()
            assert {e.block_size for e in stored_events(sub.replay(0))} == {bs}
            admin = client.get("/admin/cache").json()
            assert admin["engine"]["cached_blocks"] == len(cached)
            dram = next(t for t in admin["tiers"] if t["name"] == "dram")
            assert dram["sessions"] >= len(media["CPU"]) * bs // 32  # chunks of 32 tokens
            assert publisher_seq > 0
    finally:
        sub.close()


def _wait_quiet(sub: Subscriber) -> int:
    """Receive until quiet; the number of batches the live stream saw."""
    time.sleep(0.2)
    sub.receive(0.5)
    return len(sub.live)
