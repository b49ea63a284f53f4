"""Test helpers for the store: a tiny model's shapes, a store of it and random KV to save in it,
the sessions it evicts, and states only pressure would bring about."""

from __future__ import annotations

import threading

import torch

from chatstore.model.spec import ModelSpec
from chatstore.store.attention_store import AttentionStore
from chatstore.store.port_values import StoreEvent
from chatstore.store.session_kv import ChunkKey, SessionKey, SessionKV
from chatstore.store.settings import StoreSettings

# A two-layer model's shapes, for stores tested without a model (KV of random values).
TINY_SPEC = ModelSpec(
    architecture="LlamaForCausalLM",
    num_layers=2,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    num_kv_heads=2,
    head_dim=4,
    vocab_size=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_type="default",
    max_position_embeddings=256,
    qkv_bias=False,
    tie_word_embeddings=False,
    sliding_window=None,
    eos_token_ids=(1,),
)
TOKEN_BYTES = 2 * 2 * 2 * 4 * 4  # fp32 bytes of one token's K and V over all layers
BLOCK = 16 * TOKEN_BYTES  # one DRAM block = one 16-token session (the placement tests' unit)


def value(num_tokens: int, seed: int = 0) -> SessionKV:
    """A session's history of num_tokens: token ids from the seed, random KV of TINY_SPEC."""
    g = torch.Generator().manual_seed(seed)
    ids = [seed * 100 + i for i in range(num_tokens)]
    return SessionKV(ids, torch.randn((2, 2, num_tokens, 2, 4), generator=g))


def three_turns() -> list[SessionKV]:
    """Three turns of different sizes (2000, 3000 and 2500 tokens), so that a torn write would
    show in the token ids or the shape as well as in the values."""
    return [value(2000, 1), value(3000, 2), value(2500, 3)]


def make(tmp_path, fingerprint: str = "fp", **kw) -> AttentionStore:
    """A store of TINY_SPEC under tmp_path: 64 16-token sessions of DRAM, 1 MiB of SSD."""
    kw.setdefault("dram_bytes", 64 * 16 * TOKEN_BYTES)
    kw.setdefault("ssd_bytes", 1 << 20)
    return AttentionStore(StoreSettings(data_dir=tmp_path, **kw), TINY_SPEC, fingerprint)


def save_later(
    store: AttentionStore,
    tenant: str,
    session_id: str,
    v: SessionKV,
    gate: threading.Event | None = None,
) -> None:
    """v as the session's whole history through save_turn (the writer thread with async_save);
    its chunks are built only once `gate` is set."""
    plan = store.plan_turn(tenant, list(v.token_ids), None, 0)

    def build() -> dict:
        if gate is not None:
            gate.wait(10)
        spans = plan.new_spans()
        return {k: SessionKV(v.token_ids[a:b], v.kv[:, :, a:b].clone()) for _, k, a, b in spans}

    store.save_plan(tenant, session_id, plan, build, v.nbytes)


def session_of(store: AttentionStore, chunk: ChunkKey) -> SessionKey | None:
    """The session holding a chunk (every session here is one chunk of its own)."""
    owners = store.index.owners_of(chunk)
    return next(iter(owners)) if owners else None


def evictions(store: AttentionStore) -> list[SessionKey]:
    """The sessions the store evicts from DRAM from now on, in order (one chunk each)."""
    out: list[SessionKey] = []

    def listen(e: StoreEvent) -> None:
        if e.kind == "evicted" and e.tier == "dram":
            out.append(session_of(store, e.key))

    store.add_listener(listen)
    return out


def push_down(store: AttentionStore, tenant: str, session_id: str) -> None:
    """The session's chunks leave DRAM as an eviction would leave them: on SSD only."""
    store.wait_saved(tenant, session_id)
    chain = store.index.get(SessionKey(tenant, session_id))
    assert chain is not None, f"{tenant}/{session_id} holds no chunks"
    for chunk in chain.chunks:
        assert store.tiers.persist(chunk), f"chunk {chunk} did not reach SSD"
        with store.tiers.lock:
            store.tier("dram").delete(chunk)


def saved_tokens(store: AttentionStore, tenant: str, session_id: str) -> list[int]:
    """The session's recorded token ids, once its pending write has landed."""
    store.wait_saved(tenant, session_id)
    record = store.records.get(store.key(tenant, session_id))
    return list(record.token_ids) if record else []


def lookup(store: AttentionStore, tenant: str, session_id: str) -> SessionKV | None:
    """The session's whole stored KV, read from wherever its chunks are (None: not stored)."""
    return store.reader.whole(store.key(tenant, session_id))


def held_bytes(store: AttentionStore) -> int:
    """Bytes of the chunks opened turns hold beside DRAM (turn_opening.py)."""
    return store.opening.held_bytes
