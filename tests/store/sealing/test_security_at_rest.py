"""Encryption at rest (issues 26, 33): what reaches LMDB and Redis is sealed per tenant, proven
on the bytes themselves. Real LMDB, a real redis-server, the real default model and server.
(Envelope keys without a server: test_envelope_keys.py; replicas: test_replica_keys.py; the
server and conversation: tests/support/tenant_server.py.)

- a marker planted in a conversation is found by a byte grep of the data dir and of a Redis dump
  with encryption off, and not with it on (and neither are the chunks' token ids); a copy of the
  data directory served without the master key opens nothing;
- a value swapped between two tenants' keys, or with one flipped bit, fails to open (a miss,
  counted, left in place), for KV chunks and records;
- a crypto-shredded tenant's sessions are absent after a restart, and a backup of the data taken
  before the shred, restored beside the current key store, opens nothing of the tenant;
- `rotate-keys` rewraps the data keys, `rotate-data-keys` re-seals every value;
- a later turn after a restart restores its KV from sealed LMDB chunks with the recompute's
  greedy tokens.
"""

from __future__ import annotations

import os
import shutil
import struct
import uuid
from pathlib import Path

import httpx
import lmdb
import pytest
import torch

from chatstore.store.attention_store import AttentionStore
from chatstore.store.records.lmdb import LmdbRecordStore
from chatstore.store.records.record import SessionRecord
from chatstore.store.sealing import Keyring, OpenError, Sealer, load_master_secrets
from chatstore.store.sealing.key_store_lmdb import LmdbKeyStore
from chatstore.store.sealing.master_key import Secret, new_secret_line, parse_secrets
from chatstore.store.sealing.sealer import read_header
from chatstore.store.session_kv import ChunkKey, SessionKey, SessionKV
from chatstore.store.tiers.lmdb import LmdbTier
from chatstore.transfer import StoreConnector
from tests.support.multiturn import CHUNK, MiniEngine, make_store
from tests.support.tenant_server import ADMIN, converse, tenant_server
from tests.support.tiny_models import chat_ids

pytestmark = pytest.mark.timeout(300)


def secret(key_id: str) -> Secret:
    return Secret(key_id, os.urandom(32))


def chunk(seed: int, tokens: int = 8) -> SessionKV:
    g = torch.Generator().manual_seed(seed)
    return SessionKV(list(range(seed, seed + tokens)), torch.randn(2, 2, tokens, 2, 4, generator=g))


# -- the seal itself: tenants, keys, bits ---------------------------------------------------------


def test_kv_value_swapped_between_tenants_or_flipped_is_a_miss_left_in_place(tmp_path):
    sealer = Sealer(Keyring([secret("k1")]))
    tier = LmdbTier(tmp_path / "kv.lmdb", 1 << 24, "fp", sealer=sealer)
    a, b = ChunkKey("alice", "aa" * 16), ChunkKey("bob", "bb" * 16)
    tier.put(a, chunk(1))
    tier.put(b, chunk(2))
    assert torch.equal(tier.get(a).kv, chunk(1).kv)  # opens under its own key
    raw_a, raw_b = tier.raw_value(a), tier.raw_value(b)
    tier.write_raw_value(a, raw_b)  # bob's value under alice's key
    with pytest.raises(OpenError):
        tier.get(a)
    assert tier.contains(a) and tier.raw_value(a) == raw_b  # a miss, never a delete
    flipped = bytearray(raw_b)
    flipped[len(flipped) // 2] ^= 0x01
    tier.write_raw_value(b, bytes(flipped))
    with pytest.raises(OpenError):  # never served, and left in place
        tier.get(b)
    assert tier.raw_value(b) == bytes(flipped)
    # Another tenant with the same digest (keys are per tenant): the seal says no as well.
    c = ChunkKey("bob", "aa" * 16)
    tier.put(c, chunk(3))
    tier.write_raw_value(c, raw_a)
    with pytest.raises(OpenError):
        tier.get(c)
    tier.close()


def test_seal_parts_is_seal_of_the_joined_parts_and_any_changed_bit_fails_to_open():
    """Chunks are sealed from their parts (header, KV memory) without joining them: the value
    opens to exactly the joined bytes under the same associated data, and, with no CRC
    beneath the seal, the tag alone refuses a flipped bit anywhere, header or KV."""
    sealer = Sealer(Keyring([secret("k1")]))
    head, body = os.urandom(301), memoryview(torch.randn(4096).numpy())
    sealed = sealer.seal_parts(b"kv", "alice", b"digest", [head, body])
    joined = head + body.tobytes()
    assert sealer.open(b"kv", "alice", b"digest", bytes(sealed)) == joined
    assert len(sealed) == len(sealer.seal(b"kv", "alice", b"digest", joined))
    with pytest.raises(OpenError):
        sealer.open(b"kv", "bob", b"digest", bytes(sealed))
    offset = read_header(sealed).body_offset + 12  # the ciphertext starts after the nonce
    for at in (offset, offset + 300, offset + 301, len(sealed) - 17, len(sealed) - 1):
        flipped = bytearray(sealed)
        flipped[at] ^= 0x80
        with pytest.raises(OpenError):
            sealer.open(b"kv", "alice", b"digest", bytes(flipped))


def test_record_swapped_between_tenants_or_flipped_reads_absent(tmp_path):
    store = LmdbRecordStore(tmp_path / "records.lmdb", sealer=Sealer(Keyring([secret("k1")])))
    store.put(SessionRecord("alice", "s", [{"role": "user", "content": "alice's"}]))
    store.put(SessionRecord("bob", "s", [{"role": "user", "content": "bob's"}]))
    a, b = SessionKey("alice", "s"), SessionKey("bob", "s")
    assert store.get(a).messages[0]["content"] == "alice's"
    with store.env.begin(write=True) as txn:
        raw_b = txn.get(store._name(b))
        txn.put(store._name(a), raw_b)
        flipped = bytearray(raw_b)
        flipped[-20] ^= 0x80
        txn.put(store._name(b), bytes(flipped))
    assert store.get(a) is None and store.get(b) is None  # absent, not an error
    assert store.open_failures == 2
    assert store.list_sessions() == []
    store.close()


# -- the bytes at rest, through the real server ---------------------------------------------------


def _files_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


def _head_token_ids(model) -> bytes:
    """The first token ids of every conversation (the chat template's opening), as the clear
    codec stores them in chunk 0: int32 little-endian."""
    ids = chat_ids(model.tokenizer, [{"role": "system", "content": "Be brief."}])[:8]
    return struct.pack(f"<{len(ids)}i", *ids)


@pytest.mark.model
@pytest.mark.parametrize("encrypt", [False, True], ids=["clear", "sealed"])
def test_marker_in_data_dir_and_redis_dump_only_in_the_clear(
    default_model, tmp_path, redis_url, redis_client, encrypt
):
    marker = f"ZQX-{uuid.uuid4().hex[:12]}-MARKER"
    head = _head_token_ids(default_model)
    local = tmp_path / "local"
    with tenant_server(
        local, default_model, encrypt_at_rest=encrypt, persist="write_through"
    ) as srv:
        sid = converse(srv.url, marker)
    on_disk = _files_bytes(local)
    assert (marker.encode() in on_disk) is not encrypt  # the records in records.lmdb
    assert (head in on_disk) is not encrypt  # the KV chunks' token ids in kv.lmdb
    if encrypt:  # everything the server wrote under its data dir, restored on a fresh machine
        assert not [p for p in local.rglob("*") if p.name.endswith(".key")]
        _served_without_the_master_key(local, tmp_path / "copy", default_model, sid)

    shared = tmp_path / "shared"
    with tenant_server(
        shared, default_model, encrypt_at_rest=encrypt, redis_url=redis_url, persist="write_through"
    ) as srv:
        converse(srv.url, marker)
    redis_client.config_set("rdbcompression", "no")  # DUMP payloads as stored, not LZF'd
    names = list(redis_client.scan_iter("chatstore:*"))
    assert any(n.startswith(b"chatstore:kv:") for n in names)
    assert any(n.startswith(b"chatstore:rec:") for n in names)
    dump = b"".join(redis_client.dump(n) or b"" for n in names)
    assert (marker.encode() in dump) is not encrypt
    assert (head in dump) is not encrypt
    assert (marker.encode() in _files_bytes(shared)) is False  # records went to Redis


def _served_without_the_master_key(data: Path, copy: Path, model, sid: str) -> None:
    """A copy of the data directory, served where the master key is not (another
    $XDG_CONFIG_HOME: the server generates a key of its own): nothing of it opens."""
    shutil.copytree(data, copy)
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CONFIG_HOME", str(copy.parent / "another-machine"))
    try:
        with (
            tenant_server(copy, model) as srv,
            httpx.Client(base_url=srv.url, trust_env=False) as c,
        ):
            alice = {"Authorization": "Bearer key-alice"}
            assert c.get(f"/v1/sessions/{sid}", headers=alice).status_code == 404
            assert c.get("/v1/sessions", headers=alice).json()["data"] == []
            admin = {"Authorization": f"Bearer {ADMIN}"}
            assert c.get("/admin/cache", headers=admin).json()["open_failures"]["records"] >= 1
    finally:
        mp.undo()


@pytest.mark.model
def test_shredded_tenant_is_absent_after_restart_and_a_pre_shred_backup_opens_nothing(
    default_model, tmp_path
):
    data, backup = tmp_path / "data", tmp_path / "backup"
    with tenant_server(data, default_model) as srv:
        alice_sid = converse(srv.url, "alice-secret")
        bob_sid = converse(srv.url, "bob-secret", key="key-bob")
        with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
            stored = c.post(
                "/v1/responses",
                json={"input": "Hello", "temperature": 0, "max_output_tokens": 4},
                headers={"Authorization": "Bearer key-alice"},
            )
            assert stored.status_code == 200, stored.text
            shutil.copytree(data, backup)  # a backup taken before the shred
            admin = {"Authorization": f"Bearer {ADMIN}"}
            assert c.delete("/admin/tenants/alice/data").status_code == 401
            gone = c.delete("/admin/tenants/alice/data", headers=admin)
            assert gone.status_code == 200, gone.text
            assert gone.json()["sessions"] >= 1 and gone.json()["responses"] == 1
            alice = {"Authorization": "Bearer key-alice"}
            assert c.get(f"/v1/sessions/{alice_sid}", headers=alice).status_code == 404
    restarted = tenant_server(data, default_model)  # a restart: nothing of alice comes back
    with restarted as srv, httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
        alice = {"Authorization": "Bearer key-alice"}
        assert c.get(f"/v1/sessions/{alice_sid}", headers=alice).status_code == 404
        assert c.get("/v1/sessions", headers=alice).json()["data"] == []
        assert c.get(f"/v1/responses/{stored.json()['id']}", headers=alice).status_code == 404
        bob = c.get(f"/v1/sessions/{bob_sid}", headers={"Authorization": "Bearer key-bob"})
        assert bob.status_code == 200  # another tenant is untouched
        reused = converse(srv.url, "after", key="key-alice")  # the tenant may start over
        assert c.get(f"/v1/sessions/{reused}", headers=alice).status_code == 200
    # The backup, read with the server's master key and its key store as it is now: alice's
    # records fail to open (her data key is gone), bob's still do; her marker is nowhere in the
    # clear.
    keys = LmdbKeyStore(data / "keys.lmdb")
    keyring = Keyring(load_master_secrets(data), keys)
    old = LmdbRecordStore(backup / "records.lmdb", sealer=Sealer(keyring))
    tenants = {r.tenant for r in old.list_sessions()}
    assert "bob" in tenants and "alice" not in tenants and old.open_failures >= 1
    old.close()
    keys.close()
    assert b"alice-secret" not in _files_bytes(backup) + _files_bytes(data)
    # The backup restored in place of the data (beside today's key store): alice's sessions
    # are still absent, bob's are back, and the records that failed to open are counted where
    # operators look.
    for name in ("records.lmdb", "kv.lmdb"):
        shutil.rmtree(data / name)
        shutil.copytree(backup / name, data / name)
    restored = tenant_server(data, default_model)
    with restored as srv, httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
        alice = {"Authorization": "Bearer key-alice"}
        assert c.get(f"/v1/sessions/{alice_sid}", headers=alice).status_code == 404
        bob = c.get(f"/v1/sessions/{bob_sid}", headers={"Authorization": "Bearer key-bob"})
        assert bob.status_code == 200
        admin = {"Authorization": f"Bearer {ADMIN}"}
        failures = c.get("/admin/cache", headers=admin).json()["open_failures"]
        assert failures["records"] >= 1 and "ssd" in failures
        metrics = c.get("/metrics", headers=admin).text
        assert 'chatstore_store_open_failures_total{tier="records"}' in metrics


@pytest.mark.model
def test_rotate_keys_rewraps_and_rotate_data_keys_reseals_a_live_servers_data(
    default_model, tmp_path, capsys
):
    """`chatstore admin rotate-keys` against a server restarted with a new master key in
    front rewraps the data keys (no value moves); `rotate-data-keys` re-seals every record and
    chunk on disk under a new data key and retires the old one."""
    from chatstore.cli import main

    data = tmp_path / "data"
    k1, k2 = new_secret_line("k1"), new_secret_line("k2")
    with tenant_server(data, default_model, secret_key=k1, persist="write_through") as srv:
        sid = converse(srv.url, "rotate-me")
    with tenant_server(data, default_model, secret_key=f"{k2},{k1}") as srv:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        idle = httpx.get(f"{srv.url}/admin/keys/rotation", headers=admin, trust_env=False)
        assert idle.json()["phase"] == "idle"
        assert main(["admin", "--url", srv.url, "rotate-keys"]) == 1  # no admin key: refused
        assert "HTTP 401" in capsys.readouterr().err
        assert main(["admin", "--url", srv.url, "--admin-key", ADMIN, "rotate-keys"]) == 0
        assert "rewrapped the data keys of 1 tenants" in capsys.readouterr().out
        assert main(["admin", "--url", srv.url, "--admin-key", ADMIN, "rotate-data-keys"]) == 0
        assert "done: data-keys" in capsys.readouterr().out
        with httpx.Client(base_url=srv.url, trust_env=False) as c:
            alice = {"Authorization": "Bearer key-alice"}
            assert c.get(f"/v1/sessions/{sid}", headers=alice).status_code == 200
            progress = c.get("/admin/keys/rotation", headers=admin).json()
            assert progress["done"] and progress["job"] == "data-keys"
            assert progress["resealed"] >= 2  # the session's record and its chunks
    keys = LmdbKeyStore(data / "keys.lmdb")
    keyring = Keyring(parse_secrets(k2, "test"), keys)  # k1 dropped
    assert [(w.dek_id, w.master_id) for w in keys.load("alice").keys] == [("d2", "k2")]
    records = LmdbRecordStore(data / "records.lmdb", sealer=Sealer(keyring))
    assert [r.session_id for r in records.list_sessions("alice")] == [sid]
    assert records.open_failures == 0
    records.close()
    tier = LmdbTier(data / "kv.lmdb", 1 << 30, default_model.fingerprint, sealer=Sealer(keyring))
    chunks = list(tier.keys())
    assert chunks and all(read_header(tier.raw_value(k)).dek_id == "d2" for k in chunks)
    tier.close()
    keys.close()


@pytest.mark.model
def test_encrypt_existing_command_seals_what_was_written_in_the_clear(
    default_model, tmp_path, capsys
):
    """Data written with encrypt_at_rest = false, served with encryption on: the clear records
    read as absent (never accepted) until `chatstore admin encrypt-existing` seals them."""
    from chatstore.cli import main

    data = tmp_path / "data"
    with tenant_server(data, default_model, encrypt_at_rest=False, persist="write_through") as srv:
        sid = converse(srv.url, "clear-then-sealed")
    assert b"clear-then-sealed" in _files_bytes(data)
    with (
        tenant_server(data, default_model) as srv,
        httpx.Client(base_url=srv.url, trust_env=False) as c,
    ):
        alice = {"Authorization": "Bearer key-alice"}
        assert c.get(f"/v1/sessions/{sid}", headers=alice).status_code == 404
        url = ["admin", "--url", srv.url, "--admin-key", ADMIN]
        assert main([*url, "encrypt-existing"]) == 0
        assert "done: encrypt-existing" in capsys.readouterr().out
        assert c.get(f"/v1/sessions/{sid}", headers=alice).status_code == 200
    # The live values are sealed; the clear ones may linger in pages LMDB freed (copy-on-write)
    # until reused: a compacting copy (docs/security.md) writes live pages only.
    compact = tmp_path / "compact"
    compact.mkdir()
    env = lmdb.open(str(data / "records.lmdb"), readonly=True, lock=False)
    env.copy(str(compact), compact=True)
    env.close()
    assert b"clear-then-sealed" not in _files_bytes(compact)


# -- KV restored from sealed LMDB gives the recompute's tokens ------------------------------------


@pytest.mark.model
@pytest.mark.slow
def test_later_turn_after_restart_restores_sealed_kv_with_identical_tokens(
    default_model,
    reference,
    tmp_path,
):
    engine = MiniEngine(default_model)
    store: AttentionStore = make_store(default_model, tmp_path, "restart")
    assert store.sealer is not None  # encryption at rest is the default
    for i, ref in enumerate(reference):
        if i > 0:
            store.close()  # a restart: only the sealed chunks on disk remain
            store = make_store(default_model, tmp_path, "restart")
            ssd = store.tier("ssd")
            for key in list(ssd.keys()):
                sealing = store.sealer.keyring.sealing_dek_id(key.tenant)
                assert read_header(ssd.raw_value(key)).dek_id == sealing
        engine.attach(StoreConnector(store, engine.cache, engine.runner.rope))
        got = engine.turn(ref.prompt)
        assert got.output == ref.output, f"turn {i + 1} differs when restored from sealed LMDB"
        if i > 0:
            prev = reference[i - 1]
            assert got.cached >= len(prev.prompt) + len(prev.output) - 2
            assert got.cached >= CHUNK
    counters = store.stats().counters.tier("ssd")
    assert counters.hits > 0 and counters.open_failures == 0
    store.close()
