"""Envelope keys (issue 33), proven on real LMDB and a real redis-server, without a model:

- the master key comes from the environment, a file, or $XDG_CONFIG_HOME, never the data
  directory; a replica is never given a generated one;
- master-key rotation rewraps data keys and touches no value; a data-key rotation re-seals
  every value (resumed after a crash) and retires the old keys;
- shredding deletes the tenant's data key: a pre-shred backup of the data, restored beside the
  current key store, opens nothing of the tenant (and its marker is nowhere in the clear),
  other tenants open; what no server can promise (an old key store plus the master key) holds;
- a clear value planted in LMDB or Redis is refused by reads, re-seals and the records'
  migration, and stays where it is; `encrypt-existing` alone seals it; a start whose records
  do not open (a wrong master key) deletes no stored chunk.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from chatstore.store.attention_store import AttentionStore
from chatstore.store.records.lmdb import LmdbRecordStore
from chatstore.store.records.record import SessionRecord
from chatstore.store.records.redis import RedisRecordStore
from chatstore.store.sealing import Keyring, KeyringError, OpenError, Sealer, load_master_secrets
from chatstore.store.sealing import reseal as reseal_module
from chatstore.store.sealing.key_store_lmdb import LmdbKeyStore
from chatstore.store.sealing.key_store_redis import RedisKeyStore
from chatstore.store.sealing.master_key import Secret, new_secret_line
from chatstore.store.sealing.reseal import Resealer
from chatstore.store.sealing.sealer import is_sealed, read_header
from chatstore.store.session_kv import ChunkKey, SessionKey, SessionKV
from chatstore.store.settings import StoreSettings
from chatstore.store.tiers import codec
from chatstore.store.tiers.lmdb import LmdbTier
from chatstore.store.tiers.redis import RedisTier
from tests.support.store import TINY_SPEC, lookup

pytestmark = pytest.mark.timeout(120)


def secret(key_id: str) -> Secret:
    return Secret(key_id, os.urandom(32))


def chunk(seed: int, tokens: int = 8) -> SessionKV:
    g = torch.Generator().manual_seed(seed)
    return SessionKV(list(range(seed, seed + tokens)), torch.randn(2, 2, tokens, 2, 4, generator=g))


def message(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def files_bytes(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())


class Data:
    """One server's sealed data directory: records, KV chunks, data keys (all LMDB)."""

    def __init__(self, root: Path, masters: list[Secret]) -> None:
        self.keys = LmdbKeyStore(root / "keys.lmdb")
        self.keyring = Keyring(masters, self.keys)
        sealer = Sealer(self.keyring)
        self.records = LmdbRecordStore(root / "records.lmdb", sealer=sealer)
        self.tier = LmdbTier(root / "kv.lmdb", 1 << 24, "fp", sealer=sealer)

    def close(self) -> None:
        self.records.close()
        self.tier.close()
        self.keys.close()


# -- the master key ---------------------------------------------------------------------------


def test_master_key_order_and_the_places_it_may_not_live(tmp_path, monkeypatch, caplog):
    data, config = tmp_path / "data", tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    with caplog.at_level("WARNING"):
        first = load_master_secrets(data)
    path = config / "chatstore" / "secret.key"
    assert (path.stat().st_mode & 0o777) == 0o600
    assert "generated a new master key" in caplog.text and str(path) in caplog.text
    assert load_master_secrets(data) == first  # read back, not generated again
    assert not data.exists() or not any(data.rglob("*"))  # nothing in the data directory
    env = new_secret_line("e1")
    assert [s.key_id for s in load_master_secrets(data, env)] == ["e1"]  # the env wins
    own = tmp_path / "own.key"
    own.write_text(new_secret_line("f1"))
    own.chmod(0o600)
    assert [s.key_id for s in load_master_secrets(data, "", str(own))] == ["f1"]
    os.chmod(path, 0o644)
    with pytest.raises(KeyringError, match="mode 644"):
        load_master_secrets(data)
    os.chmod(path, 0o600)

    # A key file inside the data directory: refused, and the error names both paths.
    data.mkdir(exist_ok=True)
    inside = data / "keys" / "master.key"
    inside.parent.mkdir()
    shutil.copy(own, inside)
    with pytest.raises(KeyringError, match="inside the data directory") as refused:
        load_master_secrets(data, "", str(inside))
    assert str(inside.resolve()) in str(refused.value) and str(data.resolve()) in str(refused.value)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(data / "cfg"))  # the default path, inside too
    with pytest.raises(KeyringError, match="inside the data directory"):
        load_master_secrets(data)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    (data / "secret.key").write_text(new_secret_line())  # where earlier versions made it
    with pytest.raises(KeyringError, match="inside the data directory"):
        load_master_secrets(data)
    (data / "secret.key").unlink()

    # With replicas (a Redis URL) a generated key is refused: each would make its own.
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "fresh"))
    with pytest.raises(KeyringError, match="every replica must be given the same one"):
        load_master_secrets(data, replicas=True)
    assert not (tmp_path / "fresh").exists()
    assert [s.key_id for s in load_master_secrets(data, env, replicas=True)] == ["e1"]


# -- rotation ---------------------------------------------------------------------------------


def test_master_key_rotation_rewraps_data_keys_and_touches_no_value(tmp_path):
    k1, k2 = secret("k1"), secret("k2")
    data = Data(tmp_path, [k1])
    keys = [ChunkKey(f"t{i}", f"{i:032x}") for i in range(3)]
    for i, key in enumerate(keys):
        data.tier.put(key, chunk(i))
        data.records.put(SessionRecord(key.tenant, "s", message(f"m{i}")))
    raw_before = [data.tier.raw_value(k) for k in keys]
    data.close()

    rotated = Data(tmp_path, [k2, k1])  # k2 in front: it wraps, k1 still unwraps
    assert rotated.keyring.rewrap_all() == 3
    assert rotated.keyring.rewrap_all() == 0  # nothing left wrapped by k1
    assert [rotated.tier.raw_value(k) for k in keys] == raw_before  # no value re-sealed
    assert {w.master_id for t in rotated.keys.tenants() for w in rotated.keys.load(t).keys} == {
        "k2"
    }
    rotated.close()

    only_new = Data(tmp_path, [k2])  # k1 dropped: everything opens
    for i, key in enumerate(keys):
        assert torch.equal(only_new.tier.get(key).kv, chunk(i).kv)
        assert only_new.records.get(SessionKey(key.tenant, "s")).messages == message(f"m{i}")
    only_new.close()
    only_old = Data(tmp_path, [k1])  # the old master key alone: nothing opens any more
    with pytest.raises(OpenError):
        only_old.tier.get(keys[0])
    assert only_old.records.get(SessionKey("t0", "s")) is None
    only_old.close()


def test_data_key_rotation_reseals_resumably_and_retires_the_old_keys(tmp_path, monkeypatch):
    k1 = secret("k1")
    data = Data(tmp_path, [k1])
    keys = [ChunkKey(f"t{i % 3}", f"{i:032x}") for i in range(7)]
    for i, key in enumerate(keys):
        data.tier.put(key, chunk(i))
        data.records.put(SessionRecord(key.tenant, f"s{i}", message(f"m{i}")))
    assert {read_header(data.tier.raw_value(k)).dek_id for k in keys} == {"d1"}

    # The job dies after its third batch (as a crash would): its cursor is on disk.
    monkeypatch.setattr(reseal_module, "BATCH", 3)
    batches = []

    def crash_after_three() -> None:
        batches.append(1)
        if len(batches) == 3:
            raise RuntimeError("simulated crash")

    job = Resealer(data.keyring, data.records, [data.tier], tmp_path, on_batch=crash_after_three)
    job.start("data-keys")
    assert job.wait(30)
    assert job.progress.error and not job.progress.done
    assert job.progress.new_keys == 3  # every tenant has d2 in front now
    resumed = Resealer(data.keyring, data.records, [data.tier], tmp_path)  # a new process
    assert resumed.progress.cursor == job.progress.cursor
    resumed.start("data-keys")
    assert resumed.wait(30) and resumed.progress.done, resumed.progress
    assert resumed.progress.new_keys == 3  # none added twice
    # 7 records (a header and a log entry each) + 7 chunks: none twice, none missed
    assert resumed.progress.resealed == 21 and resumed.progress.unopened == 0
    for tenant in ("t0", "t1", "t2"):
        assert [w.dek_id for w in data.keys.load(tenant).keys] == ["d2"]  # d1 retired
    for i, key in enumerate(keys):
        assert read_header(data.tier.raw_value(key)).dek_id == "d2"
        assert torch.equal(data.tier.get(key).kv, chunk(i).kv)
        assert data.records.get(SessionKey(key.tenant, f"s{i}")).messages == message(f"m{i}")
    assert data.records.open_failures == 0
    data.close()


def test_redis_values_rotate_keep_their_ttl_and_a_swap_stays_unopened(redis_client, tmp_path):
    master, keys = secret("k1"), RedisKeyStore(redis_client)
    keyring = Keyring([master], keys)
    tier = RedisTier(redis_client, 1 << 24, "fp", ttl_s=60, sealer=Sealer(keyring))
    records = RedisRecordStore(redis_client, sealer=Sealer(keyring))
    a, b = ChunkKey("alice", "aa" * 16), ChunkKey("bob", "bb" * 16)
    tier.put_many([(a, chunk(1)), (b, chunk(2))])
    records.put(SessionRecord("alice", "s", message("hi")))

    job = Resealer(keyring, records, [tier], tmp_path)
    job.start("data-keys")
    assert job.wait(30) and job.progress.done and job.progress.resealed == 3
    assert redis_client.ttl(tier._name(a)) > 0  # the TTL survived the rewrite
    for name in (tier._name(a), records._name(SessionKey("alice", "s"))):
        assert read_header(redis_client.get(name)).dek_id == "d2"
    other = Keyring([master], keys)  # another replica: the same data keys, through Redis
    replica = RedisTier(redis_client, 1 << 24, "fp", ttl_s=60, sealer=Sealer(other))
    assert replica.discover([a, b]) == 2
    assert torch.equal(replica.get(a).kv, chunk(1).kv)
    assert [w.dek_id for w in keys.load("alice").keys] == ["d2"]  # d1 retired
    bobs = redis_client.get(tier._name(b))
    redis_client.set(tier._name(a), bobs)  # bob's value under alice's name
    with pytest.raises(OpenError):
        replica.get(a)
    assert redis_client.get(tier._name(a)) == bobs  # a miss, and the value stays


# -- shredding --------------------------------------------------------------------------------


def test_a_shred_destroys_the_data_key_so_a_pre_shred_backup_opens_nothing(tmp_path):
    root, backup = tmp_path / "data", tmp_path / "backup"
    k1 = secret("k1")
    data = Data(root, [k1])
    marker = b"ZQX-alice-7e1f-MARKER"
    alice, bob = ChunkKey("alice", "aa" * 16), ChunkKey("bob", "bb" * 16)
    data.tier.put(alice, chunk(1))
    data.tier.put(bob, chunk(2))
    data.records.put(SessionRecord("alice", "s", message(marker.decode())))
    data.records.put(SessionRecord("bob", "s", message("bob's")))
    data.close()
    shutil.copytree(root, backup)  # a backup of everything, before the shred

    data = Data(root, [k1])
    assert data.keyring.shred("alice")
    assert data.keys.load("alice") is None
    data.close()
    for name in ("records.lmdb", "kv.lmdb"):  # the data restored; the key store is today's
        shutil.rmtree(root / name)
        shutil.copytree(backup / name, root / name)
    restored = Data(root, [k1])
    assert restored.records.get(SessionKey("alice", "s")) is None
    assert restored.records.open_failures == 1
    with pytest.raises(OpenError):
        restored.tier.get(alice)
    assert restored.tier.raw_value(alice) is not None  # a miss, not a delete
    assert restored.records.get(SessionKey("bob", "s")).messages == message("bob's")
    assert torch.equal(restored.tier.get(bob).kv, chunk(2).kv)
    restored.close()
    assert marker not in files_bytes(root) and marker not in files_bytes(backup)

    # What no server can promise (docs/security.md): the pre-shred key store with the master
    # key opens the pre-shred data. Hence: keep the master key out of every backup.
    old = Data(backup, [k1])
    assert old.records.get(SessionKey("alice", "s")).messages == message(marker.decode())
    old.close()


# -- clear values -----------------------------------------------------------------------------


def test_a_planted_clear_value_is_refused_everywhere_until_encrypt_existing(tmp_path, redis_client):
    data = Data(tmp_path / "data", [secret("k1")])
    remote = RedisTier(redis_client, 1 << 24, "fp", ttl_s=60, sealer=Sealer(data.keyring))
    local_key, remote_key = ChunkKey("mallory", "cc" * 16), ChunkKey("mallory", "dd" * 16)
    clear_chunk = bytes(codec.encode(chunk(5), "fp"))
    data.tier.put(local_key, chunk(4))  # indexed here; its value replaced by a clear one
    data.tier.write_raw_value(local_key, clear_chunk)
    remote.put(remote_key, chunk(6))
    redis_client.set(remote._name(remote_key), clear_chunk)
    planted = SessionRecord("mallory", "s", message("planted")).to_json()
    name = data.records._name(SessionKey("mallory", "s"))
    with data.records.env.begin(write=True) as txn:
        txn.put(name, planted)

    # Reads: a miss (KV) or absent (records), counted, and the value stays as it was.
    with pytest.raises(OpenError):
        data.tier.get(local_key)
    with pytest.raises(OpenError):
        remote.get(remote_key)
    assert data.records.get(SessionKey("mallory", "s")) is None
    assert data.records.open_failures == 1
    # Re-seal (a data-key rotation): not adopted.
    job = Resealer(data.keyring, data.records, [data.tier, remote], tmp_path)
    job.start("data-keys")
    assert job.wait(30) and job.progress.done
    assert data.tier.raw_value(local_key) == clear_chunk
    assert redis_client.get(remote._name(remote_key)) == clear_chunk
    with data.records.env.begin() as txn:
        assert bytes(txn.get(name)) == planted
    data.close()
    # The records' migration of the old clear layout (names without a tenant): not adopted.
    old_name = b"0123456789abcdef0123456789abcdef"
    records = LmdbRecordStore(tmp_path / "old.lmdb")
    with records.env.begin(write=True) as txn:
        txn.put(old_name, planted)
    records.close()
    data = Data(tmp_path / "data", [data.keyring.secrets["k1"]])
    migrated = LmdbRecordStore(tmp_path / "old.lmdb", sealer=Sealer(data.keyring))
    with migrated.env.begin() as txn:
        assert bytes(txn.get(old_name)) == planted
    assert migrated.list_sessions() == []
    migrated.close()

    # encrypt-existing: the operator's explicit conversion seals them, and they open.
    remote = RedisTier(redis_client, 1 << 24, "fp", ttl_s=60, sealer=Sealer(data.keyring))
    job = Resealer(data.keyring, data.records, [data.tier, remote], tmp_path)
    job.start("encrypt-existing")
    assert job.wait(30) and job.progress.done and job.progress.resealed == 3
    assert is_sealed(data.tier.raw_value(local_key))
    assert is_sealed(redis_client.get(remote._name(remote_key)))
    assert torch.equal(data.tier.get(local_key).kv, chunk(5).kv)
    assert torch.equal(remote.get(remote_key).kv, chunk(5).kv)
    assert data.records.get(SessionKey("mallory", "s")).messages == message("planted")
    data.close()


def test_a_start_whose_records_do_not_open_deletes_no_stored_chunk(tmp_path):
    """A restart given the wrong master key: the session records do not open (counted), and
    the start's sweep of unreferenced chunks deletes nothing (a value that fails to open is a
    miss, never a delete); with the right key again, the session's chunks are all there."""
    right, wrong = new_secret_line("k1"), new_secret_line("k1")
    ids = list(range(5, 5 + 2 * 64 + 9))
    kv = torch.randn(2, 2, len(ids), 2, 4, generator=torch.Generator().manual_seed(3))

    def store(secret: str) -> AttentionStore:
        settings = StoreSettings(
            data_dir=tmp_path, dram_bytes=0, ssd_bytes=1 << 24, block_size=4, chunk_tokens=64,
            persist="write_through", secret_key=secret,
        )  # fmt: skip
        return AttentionStore(settings, TINY_SPEC, "fp")

    first = store(right)
    first.save("alice", "s", SessionKV(ids, kv))
    assert first.flush_persist(30)
    chunks = set(first.tier("ssd").keys())
    assert len(chunks) == 3
    first.close()
    mistaken = store(wrong)
    assert mistaken.records.open_failures >= 1
    assert set(mistaken.tier("ssd").keys()) == chunks  # nothing swept
    mistaken.close()
    again = store(right)
    assert set(again.tier("ssd").keys()) == chunks
    assert lookup(again, "alice", "s").equal(SessionKV(ids, kv))
    again.close()


def test_a_store_refuses_to_start_on_a_key_in_its_data_dir_or_a_generated_one_with_redis(
    tmp_path, monkeypatch, redis_url
):
    data = tmp_path / "data"
    inside = data / "master.key"
    data.mkdir()
    inside.write_text(new_secret_line() + "\n")
    inside.chmod(0o600)

    def settings(**extra: object) -> StoreSettings:
        return StoreSettings(data_dir=data, dram_bytes=1 << 20, ssd_bytes=1 << 20, **extra)

    with pytest.raises(KeyringError, match="inside the data directory") as refused:
        AttentionStore(settings(secret_key_file=str(inside)), TINY_SPEC, "fp")
    assert str(inside) in str(refused.value) and str(data) in str(refused.value)
    assert not (data / "keys.lmdb").exists()  # refused before anything was opened
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "no-key-here"))
    with pytest.raises(KeyringError, match="every replica must be given the same one"):
        AttentionStore(settings(redis_url=redis_url), TINY_SPEC, "fp")
    assert not (tmp_path / "no-key-here").exists()  # none generated
